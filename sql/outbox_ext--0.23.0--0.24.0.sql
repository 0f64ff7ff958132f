-- outbox_ext 0.23.0 -> 0.24.0
--
-- Why: the documentation moved out of the README into docs/ (a page per function in
-- docs/reference), so the hints of the NULL-argument errors point there instead of at the
-- README (or at the reference index, where the caller is not one function). emit and emit_many
-- now refuse a read-only transaction (and a standby) with 25006 and a hint before they take an
-- xid; that check is in the library, no SQL changes for it.
--
-- A delta: what changed from 0.23.0 to 0.24.0, rerunnable.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.24.0'" to load this file. \quit

CREATE OR REPLACE FUNCTION outbox_internal._not_null(is_null boolean, arg text, func text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF is_null THEN
        RAISE EXCEPTION '% must not be NULL', arg
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = format('Pass %s to %s; %s describes every argument.', arg, func,
                                CASE WHEN func ~ '^(outbox|inbox)\.[a-z_]+$' THEN 'docs/reference/' || func || '.md'
                                     ELSE 'docs/reference/README.md' END);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox.pause_sink(name text) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'name must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass name to outbox.pause_sink; docs/reference/outbox.pause_sink.md describes it.';
    END IF;
    UPDATE outbox.sinks s SET enabled = false WHERE s.name OPERATOR(pg_catalog.=) pause_sink.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'sink "%" does not exist', name
            USING ERRCODE = 'undefined_object', HINT = 'SELECT name FROM outbox.sinks lists them.';
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox.resume_sink(name text) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'name must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass name to outbox.resume_sink; docs/reference/outbox.resume_sink.md describes it.';
    END IF;
    -- always an update, enabled or not: a new updated_at makes the worker start afresh
    UPDATE outbox.sinks s SET enabled = true WHERE s.name OPERATOR(pg_catalog.=) resume_sink.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'sink "%" does not exist', name
            USING ERRCODE = 'undefined_object', HINT = 'SELECT name FROM outbox.sinks lists them.';
    END IF;
END
$$;
