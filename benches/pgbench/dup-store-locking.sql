-- A duplicate with PgStore's locking claim: ON CONFLICT DO UPDATE locks the live marker; ROLLBACK.
\set k random(1, 200000)
\set ttl 604800000
BEGIN ISOLATION LEVEL READ COMMITTED;
INSERT INTO pgb_m AS m (scope, message_id, processed_at, expires_at, fingerprint) VALUES ('handle', 'm' || :k, now(), now() + :ttl * interval '1 millisecond', NULL) ON CONFLICT (scope, message_id) DO UPDATE SET processed_at = EXCLUDED.processed_at, expires_at = EXCLUDED.expires_at, fingerprint = EXCLUDED.fingerprint, result = NULL WHERE m.expires_at <= now() RETURNING true;
ROLLBACK;
