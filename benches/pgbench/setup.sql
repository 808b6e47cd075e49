-- The tables of benches/pgbench/run.sh: the marker table pgb_m is made by
-- run.sh from PgStore's own migration (idempotent-runtime/sql/postgres.sql),
-- after this file; pgb_p is the effect's table.
SET client_min_messages = warning;
DROP TABLE IF EXISTS pgb_m, pgb_p;
CREATE TABLE pgb_p (id BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL, amount BIGINT NOT NULL);
