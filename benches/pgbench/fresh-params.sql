-- (c) with PgStore's ttl parameter and fingerprint column (DO NOTHING).
\set k random(1, 1000000000000)
\set ttl 604800000
BEGIN;
INSERT INTO pgb_m (scope, message_id, processed_at, expires_at, fingerprint) VALUES ('handle', 'm' || :k, now(), now() + :ttl * interval '1 millisecond', NULL) ON CONFLICT (scope, message_id) DO NOTHING RETURNING 1;
INSERT INTO pgb_p (message_id, amount) VALUES ('m' || :k, 100);
COMMIT;
