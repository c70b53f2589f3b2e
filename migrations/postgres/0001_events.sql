-- The event store: the postgres-es schema plus Ferry's global stream columns (ARCHITECTURE.md, The global stream).
-- postgres-es inserts with an explicit column list, so the extra columns take their defaults.
CREATE TABLE events
(
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    sequence        bigint      NOT NULL CHECK (sequence >= 0),
    event_type      text        NOT NULL,
    event_version   text        NOT NULL,
    payload         jsonb       NOT NULL,
    metadata        jsonb       NOT NULL,
    global_position bigint      GENERATED ALWAYS AS IDENTITY,
    -- The inserting transaction: readers only take rows below the oldest running
    -- transaction, so a slow transaction that got an earlier position is never skipped.
    transaction_id  xid8        NOT NULL DEFAULT pg_current_xact_id(),
    event_id        uuid        NOT NULL DEFAULT gen_random_uuid(),
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (aggregate_type, aggregate_id, sequence)
);
CREATE UNIQUE INDEX events_global_position ON events (global_position);
CREATE UNIQUE INDEX events_event_id ON events (event_id);
CREATE INDEX events_stream_order ON events (transaction_id, global_position);

-- Wake subscribers on every instance when events commit (NOTIFY is delivered at commit).
CREATE FUNCTION ferry_notify_events() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('ferry_events', '');
    RETURN NULL;
END $$;
CREATE TRIGGER events_notify AFTER INSERT ON events
    FOR EACH STATEMENT EXECUTE FUNCTION ferry_notify_events();

-- One row per subscription of the global stream (projections, relay, workers).
CREATE TABLE subscription_checkpoints
(
    name            text        PRIMARY KEY,
    transaction_id  bigint      NOT NULL DEFAULT 0,
    global_position bigint      NOT NULL DEFAULT 0,
    updated_at      timestamptz NOT NULL DEFAULT now()
);

-- Idempotency-Key of command POSTs: the first request's body hash and response.
CREATE TABLE idempotency_keys
(
    tenant_id       text        NOT NULL,
    idempotency_key text        NOT NULL,
    operation       text        NOT NULL,
    request_hash    text        NOT NULL,
    resource_id     text        NOT NULL,
    response_status integer,
    response_body   jsonb,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, idempotency_key)
);
