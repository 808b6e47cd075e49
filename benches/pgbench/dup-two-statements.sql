-- A duplicate with DO NOTHING then a separate UPDATE .. WHERE expired (the take-over as a second statement); ROLLBACK.
\set k random(1, 200000)
\set ttl 604800000
BEGIN ISOLATION LEVEL READ COMMITTED;
INSERT INTO pgb_m (scope, message_id, processed_at, expires_at, fingerprint) VALUES ('handle', 'm' || :k, now(), now() + :ttl * interval '1 millisecond', NULL) ON CONFLICT (scope, message_id) DO NOTHING RETURNING true;
UPDATE pgb_m SET processed_at = now(), expires_at = now() + :ttl * interval '1 millisecond', fingerprint = NULL, result = NULL WHERE scope = 'handle' AND message_id = 'm' || :k AND expires_at <= now() RETURNING true;
ROLLBACK;
