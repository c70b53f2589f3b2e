-- Inbound messages (NATS or POST /factory/events), keyed by tenant and CloudEvent id, so that
-- a redelivered message has no second effect. `processing` rows carry a lease: a worker
-- that died mid-way leaves a row another delivery may take over once the lease expired.
CREATE TABLE inbound_messages
(
    tenant_id        text    NOT NULL,
    message_id       text    NOT NULL,
    source           text    NOT NULL,
    event_type       text    NOT NULL,
    status           text    NOT NULL CHECK (status IN ('processing', 'done', 'rejected')),
    attempts         integer NOT NULL DEFAULT 1,
    claimed_until_ms integer NOT NULL,
    outcome          text,
    first_seen_at    text    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    processed_at     text,
    PRIMARY KEY (tenant_id, message_id)
) STRICT;

-- Inbound messages that were malformed, unknown or refused: terminated, never redelivered.
CREATE TABLE inbound_dead_letters
(
    id          INTEGER PRIMARY KEY,
    via         text    NOT NULL,
    subject     text    NOT NULL,
    message_id  text,
    tenant_id   text,
    reason      text    NOT NULL,
    payload     text    NOT NULL,
    received_at text    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
) STRICT;
CREATE INDEX inbound_dead_letters_received ON inbound_dead_letters (received_at);
