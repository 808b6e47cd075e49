-- (c) with PgStore's BEGIN ISOLATION LEVEL READ COMMITTED.
\set k random(1, 1000000000000)
\set ttl 604800000
BEGIN ISOLATION LEVEL READ COMMITTED;
INSERT INTO pgb_m (scope, message_id, processed_at, expires_at) VALUES ('handle', 'm' || :k, now(), now() + interval '7 days') ON CONFLICT (scope, message_id) DO NOTHING RETURNING 1;
INSERT INTO pgb_p (message_id, amount) VALUES ('m' || :k, 100);
COMMIT;
