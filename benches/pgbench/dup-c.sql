-- A duplicate, hand-written: INSERT .. ON CONFLICT DO NOTHING finds the live marker; ROLLBACK.
\set k random(1, 200000)
BEGIN;
INSERT INTO pgb_m (scope, message_id, processed_at, expires_at) VALUES ('handle', 'm' || :k, now(), now() + interval '7 days') ON CONFLICT (scope, message_id) DO NOTHING RETURNING 1;
ROLLBACK;
