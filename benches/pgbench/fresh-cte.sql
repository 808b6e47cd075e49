-- Tried and not adopted (docs/archive/benchmarks.md, 2026-12-02 morning): DO NOTHING, then an expired marker taken over by an UPDATE in a second CTE gated on the first (fresh: a new key every time).
\set k random(1, 1000000000000)
\set ttl 604800000
BEGIN;
WITH ins AS (INSERT INTO pgb_m (scope, message_id, processed_at, expires_at, fingerprint) SELECT 'handle', 'm' || :k, now(), now() + :ttl * interval '1 millisecond', NULL WHERE CASE current_setting('transaction_isolation') WHEN 'read committed' THEN true ELSE ('idempotent: claim not at read committed: ' || current_setting('transaction_isolation'))::boolean END ON CONFLICT (scope, message_id) DO NOTHING RETURNING true), upd AS (UPDATE pgb_m m SET processed_at = now(), expires_at = now() + :ttl * interval '1 millisecond', fingerprint = NULL, result = NULL WHERE m.scope = 'handle' AND m.message_id = 'm' || :k AND m.expires_at <= now() AND NOT EXISTS (SELECT FROM ins) RETURNING true) SELECT true FROM ins UNION ALL SELECT true FROM upd;
INSERT INTO pgb_p (message_id, amount) VALUES ('m' || :k, 100);
COMMIT;
