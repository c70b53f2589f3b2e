-- Fencing the work queue. Every claim gets a fresh `claim_token`; every write of a claimed
-- item (renew, done, failed, retry, storing a result) is conditioned on it and on
-- `status = 'running'`, so an owner that lost its claim can no longer change the row.
-- `result` keeps the runner's outcome of an apply (a JSON document) from the moment the
-- runner returns, so that recording it again after a store error never runs the runner
-- twice.
ALTER TABLE work_items ADD COLUMN claim_token text;
ALTER TABLE work_items ADD COLUMN result text;
-- Items running when this migration runs were claimed without a token: give them one so
-- that recovery can settle them with a fenced write.
UPDATE work_items SET claim_token = 'migrated:' || item_id || ':' || step
 WHERE status = 'running';
