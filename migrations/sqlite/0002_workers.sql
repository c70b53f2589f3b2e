-- The workers' queue. One row per (run, step): the steps' idempotency keys
-- `provisioningRunId + plan` and `provisioningRunId + apply`. Times are epoch milliseconds
-- so that one SQL text serves both engines.
CREATE TABLE work_items
(
    item_id         text    NOT NULL,
    step            text    NOT NULL,
    tenant_id       text    NOT NULL,
    environment_key text    NOT NULL,
    status          text    NOT NULL DEFAULT 'pending',
    attempts        integer NOT NULL DEFAULT 0,
    not_before      integer  NOT NULL,
    lease_until     integer,
    claimed_by      text,
    last_error      text,
    correlation_id  text,
    causation_id    text,
    created_at      integer  NOT NULL,
    updated_at      integer  NOT NULL,
    PRIMARY KEY (item_id, step)
) STRICT;
CREATE INDEX work_items_due ON work_items (status, not_before);
-- At most one apply at a time per environment, whatever the number of instances.
CREATE UNIQUE INDEX work_items_one_apply_per_environment ON work_items (environment_key)
    WHERE step = 'apply' AND status = 'running';

-- When each environment last had a successful apply: a plan made before it is stale.
CREATE TABLE environment_applies
(
    environment_key text   PRIMARY KEY,
    run_id          text   NOT NULL,
    applied_at      integer NOT NULL
) STRICT;
