-- (c) hand-written claim-first: plain BEGIN, INSERT .. ON CONFLICT DO NOTHING, the effect, COMMIT (a new key every time).
\set k random(1, 1000000000000)
\set ttl 604800000
BEGIN;
INSERT INTO pgb_m (scope, message_id, processed_at, expires_at) VALUES ('handle', 'm' || :k, now(), now() + interval '7 days') ON CONFLICT (scope, message_id) DO NOTHING RETURNING 1;
INSERT INTO pgb_p (message_id, amount) VALUES ('m' || :k, 100);
COMMIT;
