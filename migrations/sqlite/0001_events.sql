-- The event store: the sqlite-es schema plus Ferry's global stream columns (ARCHITECTURE.md, The global stream).
-- SQLite has one writer at a time, so position order is commit order.
CREATE TABLE events
(
    global_position INTEGER PRIMARY KEY,
    aggregate_type  text    NOT NULL,
    aggregate_id    text    NOT NULL,
    sequence        integer NOT NULL CHECK (sequence >= 0),
    event_type      text    NOT NULL,
    event_version   text    NOT NULL,
    payload         text    NOT NULL,
    metadata        text    NOT NULL,
    event_id        text    NOT NULL DEFAULT (lower(
        hex(randomblob(4)) || '-' || hex(randomblob(2)) || '-4' || substr(hex(randomblob(2)), 2) || '-' ||
        substr('89ab', 1 + (abs(random()) % 4), 1) || substr(hex(randomblob(2)), 2) || '-' || hex(randomblob(6)))),
    recorded_at     text    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    UNIQUE (aggregate_type, aggregate_id, sequence)
) STRICT;
CREATE UNIQUE INDEX events_event_id ON events (event_id);

CREATE TABLE subscription_checkpoints
(
    name            text    PRIMARY KEY,
    transaction_id  integer NOT NULL DEFAULT 0,
    global_position integer NOT NULL DEFAULT 0,
    updated_at      text    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
) STRICT;

CREATE TABLE idempotency_keys
(
    tenant_id       text    NOT NULL,
    idempotency_key text    NOT NULL,
    operation       text    NOT NULL,
    request_hash    text    NOT NULL,
    resource_id     text    NOT NULL,
    response_status integer,
    response_body   text,
    created_at      text    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (tenant_id, idempotency_key)
) STRICT;
