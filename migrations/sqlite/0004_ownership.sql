-- An Idempotency-Key reservation belongs to the request that made it: only that request may
-- release it or record its response, so a concurrent retry can never free another's key.
ALTER TABLE idempotency_keys ADD COLUMN owner text;

-- CloudEvents are unique by source and id, not by id alone. Each claim of an inbound message
-- gets a token; marking the message handled is conditioned on it and committed in the same
-- transaction as the message's effect. SQLite cannot change a primary key in place.
CREATE TABLE inbound_messages_v2
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
    claim_token      text,
    PRIMARY KEY (tenant_id, source, message_id)
) STRICT;
INSERT INTO inbound_messages_v2 (tenant_id, message_id, source, event_type, status, attempts,
                                 claimed_until_ms, outcome, first_seen_at, processed_at)
SELECT tenant_id, message_id, source, event_type, status, attempts, claimed_until_ms, outcome,
       first_seen_at, processed_at
  FROM inbound_messages;
DROP TABLE inbound_messages;
ALTER TABLE inbound_messages_v2 RENAME TO inbound_messages;
