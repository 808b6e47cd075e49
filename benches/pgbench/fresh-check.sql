-- (c) with PgStore's isolation check: INSERT .. SELECT .. WHERE <at read committed> (DO NOTHING, plain BEGIN).
\set k random(1, 1000000000000)
\set ttl 604800000
BEGIN;
INSERT INTO pgb_m (scope, message_id, processed_at, expires_at) SELECT 'handle', 'm' || :k, now(), now() + interval '7 days' WHERE CASE current_setting('transaction_isolation') WHEN 'read committed' THEN true ELSE ('idempotent: claim not at read committed: ' || current_setting('transaction_isolation'))::boolean END ON CONFLICT (scope, message_id) DO NOTHING RETURNING 1;
INSERT INTO pgb_p (message_id, amount) VALUES ('m' || :k, 100);
COMMIT;
