SET client_min_messages = warning;
DROP TABLE IF EXISTS pgb_m, pgb_p;
CREATE TABLE pgb_m (
    scope        TEXT        NOT NULL,
    message_id   TEXT        NOT NULL,
    processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at   TIMESTAMPTZ NOT NULL,
    fingerprint  TEXT,
    result       TEXT,
    PRIMARY KEY (scope, message_id)
);
CREATE INDEX pgb_m_exp ON pgb_m (expires_at);
CREATE TABLE pgb_p (id BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL, amount BIGINT NOT NULL);
