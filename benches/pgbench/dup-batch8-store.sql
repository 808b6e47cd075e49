-- A batch of 8 duplicates with PgStore's batch claim (requests that read nothing back: guarded, no row locks); ROLLBACK.
\set k random(1, 199992)
\set ttl 604800000
BEGIN ISOLATION LEVEL READ COMMITTED;
INSERT INTO pgb_m AS m (scope, message_id, processed_at, expires_at, fingerprint) SELECT u.scope, u.message_id, now(), now() + u.ttl * interval '1 millisecond', u.fingerprint FROM unnest(array_fill('handle'::text, ARRAY[8]), ARRAY['m' || :k, 'm' || (:k + 1), 'm' || (:k + 2), 'm' || (:k + 3), 'm' || (:k + 4), 'm' || (:k + 5), 'm' || (:k + 6), 'm' || (:k + 7)], array_fill(:ttl::bigint, ARRAY[8]), array_fill(NULL::text, ARRAY[8]), array_fill(false, ARRAY[8])) AS u(scope, message_id, ttl, fingerprint, reads) WHERE u.reads OR NOT EXISTS (SELECT FROM pgb_m l WHERE l.scope = u.scope AND l.message_id = u.message_id AND l.expires_at > now()) ORDER BY u.scope, u.message_id ON CONFLICT (scope, message_id) DO UPDATE SET processed_at = EXCLUDED.processed_at, expires_at = EXCLUDED.expires_at, fingerprint = EXCLUDED.fingerprint, result = NULL WHERE m.expires_at <= now() RETURNING m.scope, m.message_id;
ROLLBACK;
