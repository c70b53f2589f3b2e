-- Instances tell each other of new events with a NOTIFY of their own after the append
-- (ARCHITECTURE.md, The global stream), not from the appending transaction: Postgres
-- serialises the commits of notifying transactions, WAL flush included, under one lock.
DROP TRIGGER IF EXISTS events_notify ON events;
DROP FUNCTION IF EXISTS ferry_notify_events();
