"""Security: no role reaches a superuser's power through the worker, the SECURITY DEFINER API or
the extension's tables.

- A role with CREATE on public plants operators and functions that would win over pg_catalog's
  for the argument types the worker and the API use; the worker delivers, retries,
  dead-letters and maintains, relays call every API function: the planted code never runs.
- outbox_admin, outbox_relay and outbox_producer cannot attach triggers, rules or policies to,
  truncate or reference any table of the extension, partitions made by maintain() included.
- The worker's session is not a superuser.
- Sink settings the worker could not use are refused when written.
"""

from __future__ import annotations

import base64
import json

import psycopg
import pytest

from conftest import SECURITY_DB, TEMPLATE
from support.peers import Receiver, certificates, create_sink, wait_for

# Operators and argument types the worker's and the API's SQL use (see the rules in
# src/worker/queries.rs and sql/grants.sql); a planted operator of exactly these types would
# beat pg_catalog's, which needs an implicit cast.
OPERATORS = ["=", "<>", "<", "<=", ">", ">=", "+", "-", "*", "/", "%", "#>>"]
TYPES = ["smallint", "integer", "bigint", "numeric", "double precision", "real", "text",
         "interval", "timestamptz", "xid8", "uuid", "jsonb", "text[]", "boolean"]
COMPARISONS = {"=", "<>", "<", "<=", ">", ">="}
# Functions they call, with argument types that would beat pg_catalog's (anyelement, anyarray,
# VARIADIC "any", implicit casts) or tie with them (won by whichever comes first in the path).
FUNCTIONS = [
    ("to_json", ["timestamptz"], "json"), ("array_to_json", ["text[]"], "json"),
    ("make_interval", ["double precision"], "interval"), ("date_part", ["text", "interval"], "double precision"),
    ("format", ["text", "text"], "text"), ("format", ["text", "regclass"], "text"),
    ("unnest", ["xid8[]"], "SETOF xid8"), ("unnest", ["text[]"], "SETOF text"),
    ("unnest", ["uuid[]"], "SETOF uuid"), ("cardinality", ["text[]"], "integer"),
    ("cardinality", ["uuid[]"], "integer"), ("power", ["integer", "integer"], "double precision"),
    ("jsonb_path_exists", ["jsonb", "text"], "boolean"), ("to_timestamp", ["numeric"], "timestamptz"),
    ("pg_try_advisory_xact_lock", ["integer"], "boolean"), ("pg_try_advisory_lock", ["integer"], "boolean"),
    ("now", [], "timestamptz"), ("random", [], "double precision"), ("hashtext", ["text"], "integer"),
    ("pg_current_xact_id", [], "xid8"), ("pg_current_snapshot", [], "pg_snapshot"),
    ("pg_sequence_last_value", ["regclass"], "bigint"), ("generate_series", ["integer", "integer"], "SETOF integer"),
    ("floor", ["double precision"], "double precision"), ("lpad", ["text", "integer", "text"], "text"),
    ("jsonb_typeof", ["jsonb"], "text"), ("quote_ident", ["text"], "text"),
    ("set_config", ["text", "text", "boolean"], "text"), ("current_setting", ["text"], "text"),
    ("pg_visible_in_snapshot", ["xid8", "pg_snapshot"], "boolean"), ("position", ["text", "text"], "integer"),
    ("replace", ["text", "text", "text"], "text"), ("to_char", ["timestamp", "text"], "text"),
    ("pg_is_in_recovery", [], "boolean"), ("pg_backend_pid", [], "integer"),
    ("row_to_json", ["record"], "json"),
]


def trap(name: str) -> str:
    """The body of a planted function: bump public.pwned (a sequence, whose bump survives the
    rollback of whatever statement ran the trap) and say so in the server log."""
    return ("PERFORM pg_catalog.nextval('public.pwned'); "
            "RAISE WARNING 'planted " + name.replace("'", "''").replace("%", "%%") + " ran as %', current_user;")


def plant(conn) -> None:
    """As a role with CREATE on public. Planted operators give the real answer too, so that
    whatever ran one carries on (and runs more of them)."""
    conn.execute("CREATE SEQUENCE public.pwned; GRANT USAGE, UPDATE, SELECT ON SEQUENCE public.pwned TO PUBLIC")
    n = 0
    for op in OPERATORS:
        for left in TYPES:
            for right in TYPES:
                n += 1
                returns = "boolean" if op in COMPARISONS else ("text" if op == "#>>" else left)
                answer = "NULL" if op == "#>>" else f"l OPERATOR(pg_catalog.{op}) r"
                conn.execute(f"""
                    CREATE FUNCTION public.trap_op{n}(l {left}, r {right}) RETURNS {returns}
                        LANGUAGE plpgsql AS $t$ BEGIN {trap(op)} RETURN {answer}; END $t$""")
                conn.execute(f"CREATE OPERATOR public.{op} (LEFTARG = {left}, RIGHTARG = {right}, "
                             f"FUNCTION = public.trap_op{n})")
    for name, args, returns in FUNCTIONS:
        params = ", ".join(f"a{i} {t}" for i, t in enumerate(args))
        body = "RETURN;" if returns.startswith("SETOF") else "RETURN NULL;"
        conn.execute(f"""
            CREATE FUNCTION public.{name}({params}) RETURNS {returns} LANGUAGE plpgsql AS $t$
            BEGIN {trap(name)} {body} END $t$""")


def pwned(conn) -> int:
    last, called = conn.execute("SELECT last_value, is_called FROM public.pwned").fetchone()
    return last if called else 0


@pytest.fixture
def security_db(cluster):
    """SECURITY_DB (the worker serves it) with a role that may create in public: mallory."""
    with cluster.connect() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {SECURITY_DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {SECURITY_DB} TEMPLATE {TEMPLATE}")
        conn.execute("DO $$ BEGIN CREATE ROLE mallory LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    with cluster.connect(SECURITY_DB) as conn:
        conn.execute("GRANT CREATE ON SCHEMA public TO mallory")
    yield SECURITY_DB
    with cluster.connect() as conn:
        conn.execute(f"DROP DATABASE {SECURITY_DB} WITH (FORCE)")


def test_planted_operators_and_functions_never_run(cluster, security_db):
    ok = Receiver()
    # one key fails while the others go through: the sink is shown healthy, so that key's
    # events are parked and dead-lettered (a sink failing everything would only be suspended)
    failing = Receiver(lambda r: (500, {}, b"down") if any(e["aggregate_id"] == "k1" for e in r.events())
                       else (200, {}, b""))
    refusing = Receiver(lambda r: (422, {}, b"no") if any(e["aggregate_id"] == "k2" for e in r.events())
                        else (200, {}, b""))
    unavailable = Receiver(lambda r: (503, {"Retry-After": "1"}, b"later"))
    try:
        with cluster.connect(security_db, "mallory") as mallory:
            plant(mallory)
        with cluster.connect(security_db) as db:
            assert pwned(db) == 0
            create_sink(db, "ok", "webhook", ok.url, secret="whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
            create_sink(db, "failing", "webhook", failing.url, max_attempts=2)
            create_sink(db, "refusing", "webhook", refusing.url, format="single")
            create_sink(db, "unavailable", "webhook", unavailable.url)
            for i in range(20):
                db.execute("SELECT outbox.emit('order', %s, 'e', %s::jsonb, '{\"traceparent\": \"x\"}'::jsonb)",
                           (f"k{i % 4}", json.dumps({"i": i})))
            wait_for(lambda: len(ok.accepted_events()) >= 20, timeout=30)
            wait_for(lambda: db.execute("SELECT count(*) FROM outbox.dead_letters WHERE consumer = 'failing'")
                     .fetchone()[0] > 0, timeout=30)
            wait_for(lambda: db.execute("SELECT count(*) FROM outbox.dead_letters WHERE consumer = 'refusing'")
                     .fetchone()[0] > 0, timeout=30)
            wait_for(lambda: len(unavailable.requests) == 0 and db.execute(
                "SELECT last_sink_error IS NOT NULL FROM outbox.status WHERE consumer = 'unavailable'").fetchone()[0])
            db.execute("SELECT outbox.replay('failing')")   # retried again, dead again
            # the worker's maintain() creates partitions ahead once there is something to do
            before = db.execute("SELECT count(*) FROM outbox.partitions").fetchone()[0]
            db.execute("UPDATE outbox.partition_config SET ahead = 4")
            wait_for(lambda: db.execute("SELECT count(*) FROM outbox.partitions").fetchone()[0] > before)
        relay_calls(cluster, security_db)
        with cluster.connect(security_db) as db:
            wait_for(lambda: db.execute("SELECT count(*) FROM outbox.dead_letters WHERE consumer = 'failing'")
                     .fetchone()[0] > 0, timeout=30)
            assert pwned(db) == 0, "planted code ran inside the worker or an API function"
    finally:
        for r in (ok, failing, refusing, unavailable):
            r.close()


def relay_calls(cluster, dbname: str) -> None:
    """Every API function, called by the roles meant to call it, from sessions whose
    search_path puts public first. Their own statements use no operator, so only code our
    functions run could reach a planted one."""
    def session(user):
        conn = cluster.connect(dbname, user)
        conn.execute("SET search_path = public, pg_catalog")
        return conn
    with session("producer_user") as p:
        p.execute("SELECT outbox.emit('relay'::text, 'r1'::text, 'e'::text, '{}'::jsonb, '{\"a\": \"b\"}'::jsonb, 't'::text)")
        p.execute("SELECT outbox.emit_many('relay'::text, 'e'::text, '{r1,r2,r3}'::text[], '{\"{}\",\"{}\",\"{}\"}'::jsonb[])")
        p.execute("SELECT outbox.shard_of('r1'::text), outbox.shard_count(), outbox.uuid_v7()")
        p.execute("SELECT inbox.claim('01890000-0000-7000-8000-000000000000'::uuid, 'c'::text)")
        p.execute("SELECT inbox.uuid_at('2026-01-01'::timestamptz), inbox.uuid_time('01890000-0000-7000-8000-000000000000'::uuid)")
    with session("admin_user") as a:
        a.execute("SELECT outbox.create_consumer('mine'::text, true, 2, '10 ms'::interval, '20 ms'::interval)")
        a.execute("SELECT outbox.create_sink('extra'::text, 'webhook'::text, 'http://127.0.0.1:9/'::text)")
        a.execute("SELECT outbox.drop_sink('extra'::text)")
        a.execute("SELECT * FROM outbox.maintain()")
        a.execute("SELECT * FROM outbox.partitions")
    with session("relay_user") as r:
        rows = r.execute("SELECT shard, epoch, id FROM outbox.claim('mine'::text, 2, '30 s'::interval, 'me'::text)").fetchall()
        assert rows
        shard, epoch = rows[0][0], rows[0][1]
        r.execute("SELECT outbox.nack('mine'::text, %s::int, %s::bigint, %s::uuid, 'x'::text, '10 ms'::interval)",
                  (shard, epoch, rows[0][2]))
        if len(rows) > 1:
            r.execute("SELECT outbox.reject('mine'::text, %s::int, %s::bigint, %s::uuid, 'y'::text)",
                      (shard, epoch, rows[1][2]))
        r.execute("SELECT outbox.ack('mine'::text, %s::int, %s::bigint)", (shard, epoch))
        for _ in range(20):   # retries of the parked key, until it is dead
            rows = r.execute("SELECT shard, epoch, id FROM outbox.claim('mine'::text, 100, '30 s'::interval, 'me'::text)").fetchall()
            if rows:
                r.execute("SELECT outbox.nack('mine'::text, %s::int, %s::bigint, %s::uuid, 'x'::text)",
                          (rows[0][0], rows[0][1], rows[0][2]))
                r.execute("SELECT outbox.ack('mine'::text, %s::int, %s::bigint)", (rows[0][0], rows[0][1]))
        rows = r.execute("SELECT shard, epoch FROM outbox.claim('mine'::text, 100, '30 s'::interval, 'me'::text)").fetchall()
        if rows:
            r.execute("SELECT outbox.release('mine'::text, %s::int, %s::bigint, '0 s'::interval)", (rows[0][0], rows[0][1]))
        r.execute("SELECT outbox.release_owner('mine'::text, 'me'::text)")
        r.execute("SELECT * FROM outbox.status")
        r.execute("SELECT * FROM outbox.shard_status")
    with session("admin_user") as a:
        a.execute("SELECT outbox.replay('mine'::text)")
        a.execute("SELECT outbox.replay('mine'::text, 'r1'::text)")
        a.execute("SELECT outbox.drop_consumer('mine'::text)")


def test_the_worker_is_not_a_superuser(cluster, deliver_db):
    row = wait_for(lambda: cluster.connect().execute(
        "SELECT a.usename, r.rolsuper, r.rolcanlogin FROM pg_stat_activity a JOIN pg_roles r ON r.oid = a.usesysid"
        " WHERE a.backend_type = 'outbox_ext worker' AND a.datname = %s", (deliver_db,)).fetchone())
    assert row == ("outbox_worker", False, False)


EXTENSION_TABLES = """
    SELECT c.oid::regclass::text FROM pg_depend d JOIN pg_class c ON c.oid = d.objid
     WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_extension'::regclass
       AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'outbox_ext')
       AND c.relkind IN ('r', 'p')
    UNION
    SELECT c.oid::regclass::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE n.nspname IN ('outbox', 'inbox') AND c.relkind IN ('r', 'p')
     ORDER BY 1"""

ATTACKS = {
    "trigger": "CREATE TRIGGER t BEFORE INSERT ON {t} FOR EACH ROW EXECUTE FUNCTION pg_temp.trap()",
    "rule": "CREATE RULE r AS ON INSERT TO {t} DO ALSO NOTIFY pwned",
    "policy": "CREATE POLICY p ON {t} USING (true)",
    "truncate": "TRUNCATE {t}",
    # only tables with a primary key can be referenced at all
    "references": "CREATE TABLE attacker.ref ({columns}, FOREIGN KEY ({names}) REFERENCES {t})",
}
PRIMARY_KEY = """
    SELECT string_agg(quote_ident(a.attname) || ' ' || format_type(a.atttypid, a.atttypmod), ', '),
           string_agg(quote_ident(a.attname), ', ')
      FROM pg_constraint k JOIN pg_attribute a ON a.attrelid = k.conrelid AND a.attnum = ANY (k.conkey)
     WHERE k.conrelid = %s::regclass AND k.contype = 'p'"""


@pytest.mark.parametrize("role", ["admin_user", "relay_user", "producer_user"])
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_roles_cannot_attach_code_to_or_truncate_extension_tables(db, connect, role, attack):
    db.execute("UPDATE outbox.partition_config SET ahead = 3")
    assert db.execute("SELECT count(*) FROM outbox.maintain() WHERE action = 'created'").fetchone()[0] > 0
    tables = [r[0] for r in db.execute(EXTENSION_TABLES).fetchall()]
    assert any("_p2" in t for t in tables), "a partition maintain() made is among them"
    db.execute(f"CREATE SCHEMA attacker; GRANT ALL ON SCHEMA attacker TO {role}")
    user = connect(role, autocommit=False)
    user.execute("CREATE FUNCTION pg_temp.trap() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NEW; END$$")
    user.commit()
    allowed = []
    for table in tables:
        columns, names = db.execute(PRIMARY_KEY, (table,)).fetchone()
        if attack == "references" and columns is None:
            continue
        try:
            user.execute(ATTACKS[attack].format(t=table, columns=columns, names=names))
            allowed.append(table)
        except psycopg.errors.InsufficientPrivilege:
            pass
        user.rollback()
    assert allowed == []


def test_no_role_holds_trigger_truncate_or_references_and_partitions_hold_no_grant(db):
    # a default privilege of the owner's must not reach partitions made later
    db.execute("ALTER DEFAULT PRIVILEGES IN SCHEMA outbox, inbox GRANT ALL ON TABLES TO admin_user, PUBLIC")
    db.execute("UPDATE outbox.partition_config SET ahead = 3")
    assert db.execute("SELECT count(*) FROM outbox.maintain() WHERE action = 'created'").fetchone()[0] > 0
    wrong = db.execute("""
        SELECT c.oid::regclass::text, a.grantee::regrole::text, a.privilege_type
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace, aclexplode(c.relacl) a
         WHERE n.nspname IN ('outbox', 'inbox') AND a.grantee <> c.relowner
           AND (a.privilege_type IN ('TRIGGER', 'TRUNCATE', 'REFERENCES') OR c.relispartition)""").fetchall()
    assert wrong == []
    db.execute("ALTER DEFAULT PRIVILEGES IN SCHEMA outbox, inbox REVOKE ALL ON TABLES FROM admin_user, PUBLIC")


STRANGERS_PRIVILEGES = """
    SELECT kind, name, CASE WHEN grantee = 0 THEN 'PUBLIC' ELSE grantee::regrole::text END FROM (
        SELECT 'relation' AS kind, c.oid::regclass::text AS name, c.relowner AS owner, a.grantee
          FROM pg_class c, aclexplode(c.relacl) a WHERE c.relnamespace::regnamespace::text = ANY (%(schemas)s)
        UNION ALL
        SELECT 'routine', p.oid::regprocedure::text, p.proowner, a.grantee
          FROM pg_proc p, aclexplode(p.proacl) a WHERE p.pronamespace::regnamespace::text = ANY (%(schemas)s)
        UNION ALL
        SELECT 'type', t.oid::regtype::text, t.typowner, a.grantee
          FROM pg_type t, aclexplode(t.typacl) a WHERE t.typnamespace::regnamespace::text = ANY (%(schemas)s)
        UNION ALL
        SELECT 'schema', n.nspname::text, n.nspowner, a.grantee
          FROM pg_namespace n, aclexplode(n.nspacl) a WHERE n.nspname::text = ANY (%(schemas)s)) x
     WHERE grantee <> owner AND NOT (kind = 'type' AND grantee = 0)
       AND (grantee = 0 OR grantee::regrole::text NOT IN ('outbox_producer', 'outbox_relay', 'outbox_admin', 'outbox_worker'))
     ORDER BY 1, 2, 3"""
SCHEMAS = {"schemas": ["outbox", "inbox", "outbox_internal"]}


def test_the_installers_default_privileges_reach_no_object_of_the_extension(cluster, new_database):
    """ALTER DEFAULT PRIVILEGES of the role that runs CREATE EXTENSION applies to the objects
    its script makes: with ALL on tables for an application role (a common set-up), that role
    held TRIGGER on outbox._cursor_log, whose trigger the next claim ran as the owner."""
    name = new_database()
    with cluster.connect(name) as db:
        for kind, grant in [("TABLES", "ALL"), ("SEQUENCES", "ALL"), ("FUNCTIONS", "EXECUTE"),
                            ("TYPES", "USAGE"), ("SCHEMAS", "USAGE, CREATE")]:
            db.execute(f"ALTER DEFAULT PRIVILEGES GRANT {grant} ON {kind} TO producer_user, PUBLIC")
        db.execute("CREATE EXTENSION outbox_ext")
        assert db.execute(STRANGERS_PRIVILEGES, SCHEMAS).fetchall() == []
        with cluster.connect(name, "producer_user") as user:     # a member of outbox_producer
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                user.execute("CREATE TRIGGER t BEFORE INSERT ON outbox._cursor_log "
                             "FOR EACH ROW EXECUTE FUNCTION suppress_redundant_updates_trigger()")


def test_an_update_takes_back_what_default_privileges_gave_and_keeps_later_grants(cluster, new_database):
    """Installed before 0.40.0 under such default privileges, then updated: what the objects
    were made with is taken back (with a warning); a grant an operator made since stays."""
    from support.versions import RELEASED
    name = new_database()
    with cluster.connect(name) as db:
        db.execute("ALTER DEFAULT PRIVILEGES GRANT ALL ON TABLES TO producer_user")
        db.execute(f"CREATE EXTENSION outbox_ext VERSION '{RELEASED[-1]}'")
        db.execute("GRANT SELECT ON outbox.status TO nobody_user")       # a dashboard's role
        db.execute("ALTER EXTENSION outbox_ext UPDATE")
        assert db.execute(STRANGERS_PRIVILEGES, SCHEMAS).fetchall() == [("relation", "outbox.status", "nobody_user")]


def test_upgrade_from_0_5_0_takes_back_the_grants(cluster, new_database):
    name = new_database()
    with cluster.connect(name) as db:
        db.execute("CREATE EXTENSION outbox_ext VERSION '0.5.0'")
        db.execute("UPDATE outbox.partition_config SET ahead = 3")
        db.execute("SELECT * FROM outbox.maintain()")
        db.execute("GRANT ALL ON ALL TABLES IN SCHEMA outbox TO outbox_admin")  # partitions too
        # a 12-byte key 0.5.0 took, and a header 0.6.0 refuses: the sink is disabled, cleared
        db.execute("""SELECT outbox.create_sink('old', 'webhook', 'http://127.0.0.1:9/',
                      secret => 'whsec_AAAAAAAAAAAAAAAA', http_headers => '{"Host": "x"}')""")
        trigger_holders = """SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace,
                                    aclexplode(c.relacl) a
                              WHERE n.nspname IN ('outbox', 'inbox') AND a.privilege_type = 'TRIGGER'
                                AND a.grantee <> c.relowner"""
        assert db.execute(trigger_holders).fetchone()[0] > 0
        db.execute("ALTER EXTENSION outbox_ext UPDATE")
        assert db.execute(trigger_holders).fetchone()[0] == 0
        assert db.execute("SELECT pg_has_role('outbox_worker', 'outbox_relay', 'MEMBER')").fetchone()[0]
        assert db.execute("SELECT has_table_privilege('outbox_worker', 'outbox.sinks', 'SELECT')").fetchone()[0]
        assert db.execute("SELECT enabled, secret, http_headers FROM outbox.sinks").fetchone() == (False, None, None)
        db.execute("UPDATE outbox.sinks SET enabled = true")   # the row passes the checks now


def b64(n: int) -> str:
    return base64.b64encode(bytes(i % 256 for i in range(n))).decode()


@pytest.fixture(scope="module")
def pems(tmp_path_factory):
    return certificates(tmp_path_factory.mktemp("certs"))


BAD_SETTINGS = {
    "secret not base64": {"secret": "whsec_not base64!"},
    "secret key too short": {"secret": "whsec_" + b64(8)},
    "secret key too long": {"secret": "whsec_" + b64(100)},
    "header name with a space": {"http_headers": json.dumps({"X Bad": "1"})},
    "header name with a colon": {"http_headers": json.dumps({"X-Bad:": "1"})},
    "header value with CR LF": {"http_headers": json.dumps({"X-Ok": "a\r\nInjected: 1"})},
    "header the sink sets": {"http_headers": json.dumps({"Content-Length": "5"})},
    "tls_ca not PEM": {"tls_ca": "not a certificate"},
    "tls_ca PEM of garbage": {"tls_ca": "-----BEGIN CERTIFICATE-----\n" + b64(300) + "\n-----END CERTIFICATE-----\n"},
    "tls_ca broken base64": {"tls_ca": "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n"},
}


@pytest.mark.parametrize("case", sorted(BAD_SETTINGS))
def test_bad_sink_settings_are_refused(db, case):
    with pytest.raises(psycopg.errors.InvalidParameterValue) as e:
        create_sink(db, "bad", "webhook", "http://127.0.0.1:9/", **BAD_SETTINGS[case])
    assert e.value.diag.message_hint
    assert db.execute("SELECT count(*) FROM outbox.sinks").fetchone()[0] == 0
    create_sink(db, "good", "webhook", "http://127.0.0.1:9/")
    column, value = next(iter(BAD_SETTINGS[case].items()))
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        db.execute(f"UPDATE outbox.sinks SET {column} = %s WHERE name = 'good'", (value,))


def test_good_sink_settings_are_taken(db, pems):
    create_sink(db, "good", "webhook", "https://127.0.0.1:9/", secret="whsec_" + b64(32),
                http_headers=json.dumps({"Authorization": "Bearer t0k\ten", "X-Api-Key": "k"}),
                tls_ca=pems["ca"].read_text() + pems["other_ca"].read_text())
    create_sink(db, "raw-key", "webhook", "https://127.0.0.1:9/", secret=b64(24))
    assert db.execute("SELECT count(*) FROM outbox.sinks").fetchone()[0] == 2


def test_an_admins_expression_index_runs_under_emits_pinned_search_path(cluster, security_db):
    """An index an admin put on outbox.events whose SQL function resolves an operator by
    search_path: an emit, which writes as the extension's owner, must not resolve it by the
    caller's (mallory's operator would run as the owner)."""
    with cluster.connect(security_db) as db:
        db.execute("CREATE FUNCTION public.order_of(jsonb) RETURNS text IMMUTABLE LANGUAGE sql"
                   " AS $f$ SELECT $1 ->> 'order' $f$")
        db.execute("CREATE INDEX events_order_of ON outbox.events (public.order_of(payload))")
        db.execute("GRANT outbox_producer TO mallory")
    with cluster.connect(security_db, "mallory") as mallory:
        mallory.execute("CREATE SEQUENCE public.pwned")
        mallory.execute(f"""CREATE FUNCTION public.trap_arrow(l jsonb, r text) RETURNS text LANGUAGE plpgsql
                              AS $t$ BEGIN {trap('->>')} RETURN l OPERATOR(pg_catalog.->>) r; END $t$""")
        mallory.execute("CREATE OPERATOR public.->> (LEFTARG = jsonb, RIGHTARG = text, FUNCTION = public.trap_arrow)")
        mallory.execute("SET search_path = public, pg_catalog")
        mallory.execute("SELECT outbox.emit('order', 'k', 'e', '{\"order\": \"1\"}')")
        mallory.execute("SELECT outbox.emit_many('order', 'e', ARRAY['k'], ARRAY['{\"order\": \"2\"}'::jsonb])")
        assert pwned(mallory) == 0, "mallory's operator ran inside an emit"


def test_an_admins_rule_on_the_events_is_applied_to_every_emit(db):
    """A rule on outbox.events (an audit copy, say) applies to an emit as to any INSERT."""
    db.execute("CREATE TABLE public.audit (id uuid)")
    db.execute("CREATE RULE audit AS ON INSERT TO outbox.events DO ALSO INSERT INTO public.audit VALUES (NEW.id)")
    one = db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')").fetchone()[0]
    db.execute("SELECT outbox.emit_many('order', 'e', ARRAY['a', 'b'], ARRAY['{}'::jsonb, '{}'::jsonb])")
    assert one in [r[0] for r in db.execute("SELECT id FROM public.audit").fetchall()]
    assert db.execute("SELECT count(*) FROM public.audit").fetchone()[0] == 3
