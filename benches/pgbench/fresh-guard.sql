-- (c) with PgStore's guard: INSERT .. SELECT .. WHERE NOT EXISTS (live marker) (DO NOTHING, plain BEGIN).
\set k random(1, 1000000000000)
\set ttl 604800000
BEGIN;
INSERT INTO pgb_m (scope, message_id, processed_at, expires_at) SELECT 'handle', 'm' || :k, now(), now() + interval '7 days' WHERE NOT EXISTS (SELECT 1 FROM pgb_m l WHERE l.scope = 'handle' AND l.message_id = 'm' || :k AND l.expires_at > now()) ON CONFLICT (scope, message_id) DO NOTHING RETURNING 1;
INSERT INTO pgb_p (message_id, amount) VALUES ('m' || :k, 100);
COMMIT;
