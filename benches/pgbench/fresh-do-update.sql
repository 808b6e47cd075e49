-- (c) with PgStore's ON CONFLICT DO UPDATE .. WHERE expired instead of DO NOTHING (plain BEGIN, two parameters).
\set k random(1, 1000000000000)
\set ttl 604800000
BEGIN;
INSERT INTO pgb_m AS m (scope, message_id, processed_at, expires_at) VALUES ('handle', 'm' || :k, now(), now() + interval '7 days') ON CONFLICT (scope, message_id) DO UPDATE SET processed_at = EXCLUDED.processed_at, expires_at = EXCLUDED.expires_at, fingerprint = EXCLUDED.fingerprint, result = NULL WHERE m.expires_at <= now() RETURNING true;
INSERT INTO pgb_p (message_id, amount) VALUES ('m' || :k, 100);
COMMIT;
