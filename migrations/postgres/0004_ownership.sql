-- An Idempotency-Key reservation belongs to the request that made it: only that request may
-- release it or record its response, so a concurrent retry can never free another's key.
ALTER TABLE idempotency_keys ADD COLUMN owner text;

-- CloudEvents are unique by source and id, not by id alone. Each claim of an inbound message
-- gets a token; marking the message handled is conditioned on it and committed in the same
-- transaction as the message's effect.
ALTER TABLE inbound_messages DROP CONSTRAINT inbound_messages_pkey;
ALTER TABLE inbound_messages ADD PRIMARY KEY (tenant_id, source, message_id);
ALTER TABLE inbound_messages ADD COLUMN claim_token text;
