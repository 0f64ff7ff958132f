-- outbox_ext: schemas and roles. Runs first (bootstrap); rerunnable.
--
-- Roles are cluster-wide, so they are created only where missing: CREATE EXTENSION in a
-- second database, or after DROP EXTENSION, must not fail on them.
--   outbox_producer  emits events, nothing else (cannot read events or configuration)
--   outbox_relay     claims, acks and nacks events; reads the event log
--   outbox_admin     sinks, consumers, maintenance, dead letters (member of both above);
--                    not a superuser's power: no trigger, rule, policy or TRUNCATE on our tables
--   outbox_worker    what the background worker runs as: relays (member of outbox_relay),
--                    reads sinks, writes their figures, runs maintenance

CREATE SCHEMA IF NOT EXISTS outbox;
CREATE SCHEMA IF NOT EXISTS inbox;
-- Internal helpers: usable by no role (sql/grants.sql), called only by the API's functions and
-- views, so that \df outbox.* lists the API alone.
CREATE SCHEMA IF NOT EXISTS outbox_internal;

DO $roles$
DECLARE
    r text;
    admin text;
BEGIN
    FOREACH r IN ARRAY ARRAY['outbox_producer', 'outbox_relay', 'outbox_admin', 'outbox_worker'] LOOP
        -- a role that is not a superuser and may grant r (on PostgreSQL 16 and later, whoever
        -- made r with CREATEROLE keeps that): it could take r's privileges whenever it liked
        SELECT g.rolname INTO admin
          FROM pg_catalog.pg_auth_members m
          JOIN pg_catalog.pg_roles g ON g.oid = m.member
         WHERE m.roleid = (SELECT x.oid FROM pg_catalog.pg_roles x WHERE x.rolname = r)
           AND m.admin_option AND NOT g.rolsuper
         LIMIT 1;
        IF admin IS NOT NULL THEN
            RAISE EXCEPTION 'role "%" already exists and role "%" may grant it', r, admin
                USING ERRCODE = 'insufficient_privilege',
                      HINT = pg_catalog.format('outbox_ext gives %I its privileges: REVOKE ADMIN OPTION FOR %I FROM %I CASCADE; (CASCADE also takes back the grants of it that role made; or drop the role) and try again.', r, r, admin);
        END IF;
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = r) THEN
            EXECUTE pg_catalog.format('CREATE ROLE %I NOLOGIN', r);
        ELSIF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = r AND (rolcanlogin OR rolsuper)) THEN
            -- made by someone else, before us: whoever can log in as it holds its privileges
            RAISE WARNING 'role "%" already exists and can log in or is a superuser', r
                USING HINT = pg_catalog.format('outbox_ext expects it NOLOGIN NOSUPERUSER: ALTER ROLE %I NOLOGIN NOSUPERUSER;', r);
        END IF;
    END LOOP;
END
$roles$;
