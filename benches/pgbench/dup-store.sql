-- A duplicate with PgStore's guarded claim (handler reads nothing back): no row lock; ROLLBACK. Plain BEGIN: the statement checks the isolation level.
\set k random(1, 200000)
\set ttl 604800000
BEGIN;
INSERT INTO pgb_m AS m (scope, message_id, processed_at, expires_at, fingerprint) SELECT 'handle', 'm' || :k, now(), now() + :ttl * interval '1 millisecond', NULL WHERE CASE current_setting('transaction_isolation') WHEN 'read committed' THEN true ELSE ('idempotent: claim not at read committed: ' || current_setting('transaction_isolation'))::boolean END AND NOT EXISTS (SELECT 1 FROM pgb_m l WHERE l.scope = 'handle' AND l.message_id = 'm' || :k AND l.expires_at > now()) ON CONFLICT (scope, message_id) DO UPDATE SET processed_at = EXCLUDED.processed_at, expires_at = EXCLUDED.expires_at, fingerprint = EXCLUDED.fingerprint, result = NULL WHERE m.expires_at <= now() RETURNING true;
ROLLBACK;
