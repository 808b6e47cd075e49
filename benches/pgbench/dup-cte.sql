-- Tried and not adopted: the DO NOTHING + UPDATE-expired CTE on a live marker (no lock taken); ROLLBACK.
\set k random(1, 200000)
\set ttl 604800000
BEGIN;
WITH ins AS (INSERT INTO pgb_m (scope, message_id, processed_at, expires_at, fingerprint) SELECT 'handle', 'm' || :k, now(), now() + :ttl * interval '1 millisecond', NULL WHERE CASE current_setting('transaction_isolation') WHEN 'read committed' THEN true ELSE ('idempotent: claim not at read committed: ' || current_setting('transaction_isolation'))::boolean END ON CONFLICT (scope, message_id) DO NOTHING RETURNING true), upd AS (UPDATE pgb_m m SET processed_at = now(), expires_at = now() + :ttl * interval '1 millisecond', fingerprint = NULL, result = NULL WHERE m.scope = 'handle' AND m.message_id = 'm' || :k AND m.expires_at <= now() AND NOT EXISTS (SELECT FROM ins) RETURNING true) SELECT true FROM ins UNION ALL SELECT true FROM upd;
ROLLBACK;
