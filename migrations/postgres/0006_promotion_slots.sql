-- One promotion at a time per environment: a promotion takes its environment's row here in
-- the same transaction as the event that starts its gates, so a second start conflicts.
-- The row is let go once the promotion no longer holds the environment.
CREATE TABLE IF NOT EXISTS promotion_slots (
    tenant_id text NOT NULL,
    environment_id text NOT NULL,
    promotion_id text NOT NULL,
    PRIMARY KEY (tenant_id, environment_id)
);
