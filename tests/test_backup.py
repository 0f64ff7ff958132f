"""Backups, restores and major upgrades keep every event, cursor and secret; DROP EXTENSION does
not discard undelivered events.

- pg_dump in custom, directory and plain formats, restored with pg_restore / psql into a fresh
  database: no error, and everything the outbox held comes back; --schema-only too.
- After a restore each consumer resumes where the dump left it: nothing acknowledged comes
  again, everything else does, in per-key order with events emitted after the restore, also in
  clusters whose transaction ids are far below or far above the dumped ones.
- pg_upgrade from 15 to 18, and a base backup: the worker delivers what was pending, once, in
  order.
- DROP EXTENSION is refused while events are undelivered, with a hint; allowed when nothing is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import psycopg
import pytest

from conftest import MAJORS, TEMPLATE
from support.db import waits_for_a_lock
from support.events import emit_keys
from support.peers import Receiver, check_delivery, create_sink, wait_for
from support.pgcluster import Cluster, as_postgres
from support.relay import Relay, first_deliveries
from support.versions import NEW, RELEASED

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"

# What must come back, table by table (ordered so that two databases compare row by row).
CONTENTS = {
    "events": "SELECT id, topic, aggregate_type, aggregate_id, event_type, payload, headers, created_at,"
              " txid, seq, shard, tableoid::regclass::text FROM outbox.events ORDER BY seq",
    "consumers": "SELECT * FROM outbox.consumers ORDER BY id",
    "cursors": "SELECT DISTINCT ON (consumer_id, shard) * FROM outbox._cursor_log"
               " ORDER BY consumer_id, shard, pos DESC",
    # (nacked_pos, new in 0.23.0, is read only within the batch that set it)
    "parked": "SELECT consumer_id, aggregate_id, shard, attempts, next_attempt_at, last_error, nacked_epoch,"
              " parked_at FROM outbox._parked ORDER BY consumer_id, aggregate_id",
    "parked_events": "SELECT * FROM outbox._parked_events ORDER BY pos",
    "dead_letters": "SELECT * FROM outbox.dead_letters ORDER BY id",
    # (updated_at stamps the row's last write: the restore's)
    "sinks": "SELECT name, kind, url, enabled, topics, aggregate_types, format, batch_size, concurrency,"
             " connect_timeout, request_timeout, secret, http_headers, tls_ca, topic_map, cluster_id"
             " FROM outbox.sinks ORDER BY name",
    "sink_stats": "SELECT sink, delivered, failed, last_error FROM outbox._sink_stats ORDER BY sink",
    "partition_config": "SELECT parent::text, width, ahead, retention, detach FROM outbox.partition_config ORDER BY 1",
    "partitions": "SELECT partition::text, lower, upper, is_default FROM outbox.partitions ORDER BY 1",
    "inbox": "SELECT message_id, consumer, received_at, tableoid::regclass::text FROM inbox.messages ORDER BY 1, 2",
    "event_seq": "SELECT last_value FROM outbox.event_seq",
}


def contents(conn) -> dict[str, list]:
    return {name: conn.execute(sql).fetchall() for name, sql in CONTENTS.items()}


def busy_outbox(conn) -> dict:
    """An outbox with a bit of everything: three consumers (one a sink with a secret), acked and
    pending events over several partitions, a batch out, a parked key with its queue, a dead
    letter, inbox rows, a changed partition width. Returns what a test needs to check."""
    conn.execute("UPDATE outbox.partition_config SET width = '6 hours', ahead = 4")
    conn.execute("SELECT * FROM outbox.maintain()")
    # c1's failed keys are retried only when a test says so (see check_resumed)
    conn.execute("SELECT outbox.create_consumer('c1', backoff_base => '1 hour', backoff_max => '1 hour')")
    conn.execute("SELECT outbox.create_consumer('c2')")
    create_sink(conn, "hook", "webhook", "http://127.0.0.1:9/hook", secret=SECRET,
                http_headers='{"Authorization": "Bearer t0ken"}')
    emitted = emit_keys(conn, keys=80, per_key=25)
    conn.execute("INSERT INTO outbox._sink_stats (sink, delivered, failed) VALUES ('hook', 17, 3)")
    for i in range(5):
        conn.execute("SELECT inbox.claim(outbox.uuid_v7(), %s)", (f"svc{i}",))
    conn.execute("SELECT inbox.claim('00000000-0000-4000-8000-000000000000', 'svc')")  # not UUIDv7
    relay = Relay(conn, "c1", batch_size=50)
    # the first batch: one key fails (parked, its events queue), another's first event is
    # refused (a dead letter; its later events queue, and go out with its shard's next batch);
    # the rest is acked
    acked = []
    batch = relay.claim()
    while len({e.aggregate_id for e in batch}) < 2:    # a shard of one key: take the next
        relay.ack(batch[0].shard, batch[0].epoch)
        acked, batch = acked + batch, relay.claim()
    parked_key = batch[0].aggregate_id
    refused = next(e for e in batch if e.aggregate_id != parked_key)
    relay.nack(batch[0], "down")
    conn.execute("SELECT outbox.reject('c1', %s, %s, %s, 'refused')", (refused.shard, refused.epoch, refused.id))
    relay.ack(batch[0].shard, batch[0].epoch)
    acked += [e for e in batch if e.aggregate_id not in (parked_key, refused.aggregate_id)]
    for _ in range(7):                          # more acked (the two keys' events queue up)
        batch = relay.claim()
        relay.ack(batch[0].shard, batch[0].epoch)
        acked += batch
    out = relay.claim()                         # a batch out at dump time
    # (the refused key, its failure dead-lettered, catches up when its shard is claimed)
    assert out and conn.execute("SELECT count(*) FROM outbox._parked WHERE aggregate_id = %s",
                                (parked_key,)).fetchone()[0] == 1
    assert conn.execute("SELECT count(*) FROM outbox.dead_letters").fetchone()[0] == 1
    return {"emitted": emitted, "acked": {str(e.id) for e in acked}, "out": {str(e.id) for e in out},
            "dead": str(refused.id)}


def run(*cmd: str) -> subprocess.CompletedProcess:
    return as_postgres(*cmd, check=False)


def dump_and_restore(cluster, source: str, target: str, fmt: str, schema_only: bool = False) -> str:
    """pg_dump source in fmt, restore into target (an empty database); returns stderr of both."""
    work = Path(tempfile.mkdtemp(prefix="outbox-dump-"))
    shutil.chown(work, "postgres", "postgres") if os.geteuid() == 0 else None
    conn_args = ["-h", "127.0.0.1", "-p", str(cluster.port), "-U", "postgres"]
    extra = ["--schema-only"] if schema_only else []
    try:
        path = work / {"custom": "dump.custom", "directory": "dump.dir", "plain": "dump.sql"}[fmt]
        flag = {"custom": "-Fc", "directory": "-Fd", "plain": "-Fp"}[fmt]
        dumped = run(str(cluster.bindir / "pg_dump"), *conn_args, flag, *extra, "-f", str(path), source)
        assert dumped.returncode == 0, dumped.stderr
        if fmt == "plain":
            restored = run(str(cluster.bindir / "psql"), *conn_args, "-X", "-q", "-v", "ON_ERROR_STOP=1",
                           "--single-transaction", "-d", target, "-f", str(path))
        else:
            restored = run(str(cluster.bindir / "pg_restore"), *conn_args, "--exit-on-error",
                           "-d", target, str(path))
        assert restored.returncode == 0, restored.stderr
        return dumped.stderr + restored.stderr
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_resumed(conn, state: dict, after: dict[str, list[str]]) -> None:
    """Drain c1 in the restored database: nothing it had acked comes again, everything else it
    had not (but the dead letter) does, and each key keeps its order, with the events emitted
    after the restore last."""
    conn.execute("UPDATE outbox._parked SET next_attempt_at = now()")   # retry the failed keys now
    delivered = Relay(conn, "c1", batch_size=70).drain()
    got = [str(e.id) for e in delivered]
    assert not set(got) & state["acked"], "an acknowledged event came again"
    every = [i for ids in state["emitted"].values() for i in ids] + [i for ids in after.values() for i in ids]
    missing = set(every) - state["acked"] - {state["dead"]} - set(got)
    assert not missing, f"{len(missing)} events never came"
    assert len(got) - len(set(got)) <= len(state["out"]), "only the batch out at dump time comes twice"
    for key, ids in first_deliveries((e.id, e.aggregate_id) for e in delivered).items():
        ids = [str(i) for i in ids]
        expected = [i for i in state["emitted"].get(key, []) + after.get(key, []) if i in ids]
        assert ids == expected, f"key {key} out of order"


@pytest.mark.parametrize("fmt", ["custom", "directory", "plain"])
def test_dump_and_restore_bring_everything_back_and_delivery_resumes(cluster, new_database, fmt):
    source, target = new_database(TEMPLATE), new_database()
    with cluster.connect(source) as conn:
        state = busy_outbox(conn)
        before = contents(conn)
    stderr = dump_and_restore(cluster, source, target, fmt)
    assert "ERROR" not in stderr, stderr
    with cluster.connect(target) as conn:
        assert contents(conn) == before
        assert conn.execute("SELECT tgenabled::text FROM pg_trigger WHERE tgname = 'rebase_before_emit'"
                            " AND tgrelid = 'outbox.events'::regclass").fetchone()[0] == "A", \
            "the rebase comes first for an emit of a session in replica mode too"
        assert conn.execute("SELECT count(*) FROM outbox.partitions WHERE NOT is_default").fetchone()[0] >= 4
        # events emitted after the restore (before any claim) come after the dump's, per key
        after = emit_keys(conn, keys=45, per_key=2, prefix="k")
        check_resumed(conn, state, after)
        # the dead letter is there to replay, the inbox still dedups, maintain and emit work
        assert conn.execute("SELECT outbox.replay('c1')").fetchone()[0] == 1
        assert Relay(conn, "c1").drain()[0].id is not None
        assert conn.execute("SELECT inbox.claim(message_id, consumer) FROM inbox.messages LIMIT 1").fetchone()[0] is False
        assert "rebased" in [r[0] for r in conn.execute("SELECT * FROM outbox.maintain()").fetchall()]
        assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'outbox.events'::regclass"
                            " AND NOT tgisinternal AND tgname NOT IN ('outbox_reach', 'outbox_seal')").fetchone()[0] == 0, \
                "emits write natively again"   # (those two fire on partitions ahead or over only)
        assert conn.execute("""SELECT array_agg(t.tgname || ' ' || t.tgenabled::text) FROM outbox.partitions p
                                 JOIN pg_trigger t ON t.tgrelid = p.partition
                                WHERE p.parent = 'outbox.events'::regclass AND NOT p.is_default AND now() <@ tstzrange(p.lower, p.upper)
                                  AND t.tgenabled <> 'D'""").fetchone()[0] is None, "none is on where emits write"


@pytest.mark.parametrize("how", ["nack", "reject"])
def test_a_batch_out_at_dump_time_with_a_nack_comes_back_in_key_order(cluster, new_database, how):
    """The batch out at dump time had a key's second event nacked (the key parked from there,
    that event and its later ones queued) and was never settled: restored, the batch is given
    back as outbox.release gives it back, so the key's first event of the batch does not go out
    behind the nacked one. Rejected instead (dead-lettered at once), the event comes again with
    the batch and its dead letter goes with it."""
    source, target = new_database(TEMPLATE), new_database()
    with cluster.connect(source) as conn:
        state = busy_outbox(conn)
        shard, epoch = conn.execute(
            "SELECT l.shard, l.epoch FROM outbox._cursor_log l "
            "WHERE l.consumer_id = (SELECT c.id FROM outbox.consumers c WHERE c.name = 'c1') "
            "AND l.lease_until > now() ORDER BY l.pos DESC LIMIT 1").fetchone()
        row = conn.execute(   # the second event of a key not parked before, in the batch
            "SELECT (array_agg(e.id ORDER BY e.seq))[2] FROM outbox.events e WHERE e.id = ANY (%s::uuid[]) "
            "AND NOT EXISTS (SELECT FROM outbox._parked p WHERE p.aggregate_id = e.aggregate_id) "
            "GROUP BY e.aggregate_id HAVING count(*) >= 2 LIMIT 1", (list(state["out"]),)).fetchone()
        assert row, "the batch out holds two events of a key"
        second, = row
        if how == "nack":
            conn.execute("SELECT outbox.nack('c1', %s, %s, %s, 'down', '0')", (shard, epoch, second))
        else:
            conn.execute("SELECT outbox.reject('c1', %s, %s, %s, 'refused')", (shard, epoch, second))
    dump_and_restore(cluster, source, target, "custom")
    with cluster.connect(target) as conn:
        # its relay settles it first thing: given back by the restore, so "no longer held"
        # (claim again), not "must come before any write" for the rebase the call made
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
            conn.execute("SELECT * FROM outbox.settle_and_claim('c1', %s, %s)", (shard, epoch))
        check_resumed(conn, state, emit_keys(conn, keys=45, per_key=2, prefix="k"))
        assert [str(r[0]) for r in conn.execute("SELECT event_id FROM outbox.dead_letters WHERE consumer = 'c1'")] \
            == [state["dead"]], "only the dead letter of a settled batch stays"


# every release whose dumps hold the outbox's rows (0.6.0 on), restored table by table; the
# last release before 0.19.0's foreign keys and the latest, in one transaction too
EARLIER_DUMPS = ([(v, "custom") for v in RELEASED[RELEASED.index("0.6.0"):]]
                 + [("0.18.0", "plain"), (RELEASED[-1], "plain")])


@pytest.mark.every_release
@pytest.mark.parametrize("old, fmt", EARLIER_DUMPS)
def test_a_dump_of_an_earlier_release_restores_into_this_one(cluster, new_database, old, fmt):
    """Moving to a new server: a dump made at an earlier version restored where this one is
    installed. The dump's CREATE EXTENSION makes this version and the earlier version's rows
    load into its tables in the order that pg_dump chose for the earlier version's constraints
    (0.19.0's foreign keys made that fail for dumps of 0.18.0 and before)."""
    source, target = new_database(), new_database()
    with cluster.connect(source) as conn:
        conn.execute(f"CREATE EXTENSION outbox_ext VERSION '{old}'")
        state = busy_outbox(conn)
        before = contents(conn)
    stderr = dump_and_restore(cluster, source, target, fmt)
    assert "ERROR" not in stderr, stderr
    with cluster.connect(target) as conn:
        assert conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'outbox_ext'").fetchone()[0] == NEW
        assert contents(conn) == before
        check_resumed(conn, state, emit_keys(conn, keys=45, per_key=2, prefix="k"))


def test_a_schema_only_dump_restores_cleanly(cluster, new_database):
    source = new_database(TEMPLATE)
    with cluster.connect(source) as conn:
        busy_outbox(conn)
    for fmt in ("custom", "plain"):
        target = new_database()
        stderr = dump_and_restore(cluster, source, target, fmt, schema_only=True)
        assert "ERROR" not in stderr, stderr
        with cluster.connect(target) as conn:
            conn.execute("SELECT outbox.emit('a', '1', 'e', '{}')")
            assert conn.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 1


@pytest.mark.parametrize("where", ["far_below", "far_above"])
def test_restore_into_a_cluster_whose_transaction_ids_are_unrelated(cluster, where):
    """The dumped cluster counts transactions in epoch 3; the restoring one in epoch 0 (its
    txids far below every dumped one) or in epoch 9 (far above)."""
    source = Cluster(cluster.major).init()
    target = Cluster(cluster.major).init()
    try:
        as_postgres(str(source.bindir / "pg_resetwal"), "-e", "3", str(source.datadir))
        if where == "far_above":
            as_postgres(str(target.bindir / "pg_resetwal"), "-e", "9", str(target.datadir))
        source.start()
        target.start()
        with source.connect() as conn:
            conn.execute("CREATE DATABASE app")
        with source.connect("app") as conn:
            conn.execute("CREATE EXTENSION outbox_ext")
            state = busy_outbox(conn)
            assert conn.execute("SELECT min(txid)::text::bigint FROM outbox.events").fetchone()[0] > 3 << 32
        work = Path(tempfile.mkdtemp(prefix="outbox-dump-"))
        shutil.chown(work, "postgres", "postgres") if os.geteuid() == 0 else None
        dumped = run(str(source.bindir / "pg_dump"), "-h", "127.0.0.1", "-p", str(source.port), "-U", "postgres",
                     "-Fc", "-f", str(work / "app.dump"), "app")
        assert dumped.returncode == 0, dumped.stderr
        with target.connect() as conn:
            conn.execute("CREATE DATABASE app")
        restored = run(str(target.bindir / "pg_restore"), "-h", "127.0.0.1", "-p", str(target.port),
                       "-U", "postgres", "--exit-on-error", "-d", "app", str(work / "app.dump"))
        assert restored.returncode == 0, restored.stderr
        shutil.rmtree(work, ignore_errors=True)
        with target.connect("app") as conn:
            now = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]
            assert (now < 3 << 32) if where == "far_below" else (now > 9 << 32)
            after = emit_keys(conn, keys=45, per_key=2, prefix="k")
            check_resumed(conn, state, after)
            # a consumer made after the restore from the beginning reads the dump's events too
            conn.execute("SELECT outbox.create_consumer('late', true)")
            late = Relay(conn, "late", batch_size=500).drain()
            assert len(late) == sum(map(len, state["emitted"].values())) + sum(map(len, after.values()))
    finally:
        source.destroy()
        target.destroy()


@pytest.mark.parametrize("to", ["18", "same major"])
def test_pg_upgrade_keeps_delivering(cluster, to):
    """From each older major to 18 (where this machine's builds allow it), and from each major
    to itself: pg_upgrade's binary-upgrade path for outbox_ext, whatever the versions."""
    if to == "18" and (cluster.major == "18" or "18" not in MAJORS):
        pytest.skip("to 18 runs from the older majors, beside their clusters")
    receiver = Receiver()
    # checksums as 15's and 16's initdb make them (18's default is on; older ones have no such flag)
    no_checksums = lambda major: ["--no-data-checksums"] if int(major) >= 18 else []
    old = Cluster(cluster.major).init(no_checksums(cluster.major))
    new_major = cluster.major if to == "same major" else to
    new = Cluster(new_major).init(no_checksums(new_major))
    try:
        old.start()
        with old.connect() as conn:
            conn.execute("CREATE DATABASE app")
        with old.connect("app") as conn:
            conn.execute("CREATE EXTENSION outbox_ext")
            conn.execute("SELECT * FROM outbox.maintain()")
            create_sink(conn, "hook", "webhook", receiver.url, batch_size=20)
            conn.execute("SELECT outbox.create_consumer('relay', backoff_base => '1 hour', backoff_max => '1 hour')")
            emitted = emit_keys(conn, keys=20, per_key=10)
            relay = Relay(conn, "relay")
            acked, batch = set(), relay.claim()
            while len({e.aggregate_id for e in batch}) < 2:    # a shard of one key: take the next
                relay.ack(batch[0].shard, batch[0].epoch)
                acked, batch = acked | {str(e.id) for e in batch}, relay.claim()
            parked = batch[0].aggregate_id
            refused = next(e for e in reversed(batch) if e.aggregate_id != parked)
            relay.nack(batch[0], "down")                        # a parked key
            conn.execute("SELECT outbox.reject('relay', %s, %s, %s, 'no')",
                         (refused.shard, refused.epoch, refused.id))  # a dead letter
            relay.ack(batch[0].shard, batch[0].epoch)
            acked |= {str(e.id) for e in batch if e.aggregate_id != parked} - {str(refused.id)}
            stamped = conn.execute("SELECT EXISTS (SELECT FROM pg_attribute, unnest(attoptions) AS o"
                                   " WHERE o LIKE 'pg_attver=%%')").fetchone()[0]
        old.stop()
        if stamped and not accepts_pg_attver(new):
            pytest.skip("platform: this PostgreSQL 15 (Debian 15.20) stamps every column with the attribute "
                        "option pg_attver, which this PostgreSQL 18 (18.6) rejects: pg_upgrade between them "
                        "fails for any table, with or without outbox_ext")
        work = Path(tempfile.mkdtemp(prefix="outbox-upgrade-"))
        shutil.chown(work, "postgres", "postgres") if os.geteuid() == 0 else None
        upgraded = subprocess.run(
            ["runuser", "-u", "postgres", "--", str(new.bindir / "pg_upgrade"),
             "-b", str(old.bindir), "-B", str(new.bindir), "-d", str(old.datadir), "-D", str(new.datadir),
             "-U", "postgres", "-p", str(old.port), "-P", str(new.port)],
            cwd=work, capture_output=True, text=True)
        logs = "".join("\n".join(l for l in f.read_text(errors="replace").splitlines() if "error" in l.lower())[-3000:] for f in new.datadir.glob("pg_upgrade_output.d/*/log/*_163*"))
        assert upgraded.returncode == 0, upgraded.stdout[-2000:] + upgraded.stderr + logs
        with open(new.datadir / "postgresql.conf", "a") as conf:
            conf.write("outbox_ext.databases = 'app'\n")
        new.start()
        wait_for(lambda: len({e["id"] for e in receiver.accepted_events()}) >= 200, timeout=60)
        check_delivery(emitted, receiver.accepted_events())     # once each, in order per key
        with new.connect("app") as conn:
            assert conn.execute("SELECT count(*) FROM outbox.dead_letters").fetchone()[0] == 1
            assert conn.execute("SELECT parked_keys FROM outbox.status WHERE consumer = 'relay'").fetchone()[0] == 1
            assert not conn.execute("SELECT restore_pending FROM outbox._origin").fetchone()[0]
            conn.execute("UPDATE outbox._parked SET next_attempt_at = now()")
            delivered = {str(e.id) for e in Relay(conn, "relay").drain()}
            assert delivered == {i for ids in emitted.values() for i in ids} - acked - {str(refused.id)}
            more = emit_keys(conn, keys=3, per_key=2, prefix="after")
            wait_for(lambda: {i for ids in more.values() for i in ids} <= {e["id"] for e in receiver.accepted_events()})
            assert conn.execute("SELECT count(*) FROM outbox.maintain() WHERE action = 'skipped'").fetchone()[0] == 0
    finally:
        receiver.close()
        old.destroy()
        new.destroy()


def accepts_pg_attver(cluster: Cluster) -> bool:
    """Whether the (stopped) cluster's server takes the column option pg_attver."""
    cluster.start()
    try:
        with cluster.connect() as conn:
            conn.execute("CREATE TABLE probe (a int)")
            try:
                conn.execute("ALTER TABLE probe ALTER COLUMN a SET (pg_attver = 1)")
                return True
            except psycopg.errors.InvalidParameterValue:
                return False
            finally:
                conn.execute("DROP TABLE probe")
    finally:
        cluster.stop()


def test_a_base_backup_restored_delivers_what_was_pending(cluster):
    receiver = Receiver()
    source = Cluster(cluster.major).init()
    copy = Cluster(cluster.major)
    try:
        source.start()
        with source.connect() as conn:
            conn.execute("CREATE DATABASE app")
        with source.connect("app") as conn:
            conn.execute("CREATE EXTENSION outbox_ext")
            create_sink(conn, "hook", "webhook", receiver.url, batch_size=25)
            emitted = emit_keys(conn, keys=10, per_key=10)
        shutil.chown(copy.datadir, "postgres", "postgres") if os.geteuid() == 0 else None
        backed_up = run(str(source.bindir / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(source.port),
                        "-U", "postgres", "-D", str(copy.datadir), "-X", "stream", "-c", "fast")
        assert backed_up.returncode == 0, backed_up.stderr
        source.stop()
        with open(copy.datadir / "postgresql.conf", "a") as conf:
            conf.write(f"port = {copy.port}\nunix_socket_directories = '{copy.datadir}'\n"
                       "outbox_ext.databases = 'app'\n")
        copy.start()
        wait_for(lambda: len({e["id"] for e in receiver.accepted_events()}) >= 100, timeout=60)
        check_delivery(emitted, receiver.accepted_events())
    finally:
        receiver.close()
        source.destroy()
        copy.destroy()


def test_drop_extension_with_undelivered_events_is_refused(db):
    db.execute("SELECT outbox.create_consumer('c')")
    db.execute("SELECT outbox.emit('a', '1', 'e', '{}') FROM generate_series(1, 500)")
    with pytest.raises(psycopg.errors.DependentObjectsStillExist) as e:
        db.execute("DROP EXTENSION outbox_ext")
    assert "c: 500 pending" in e.value.diag.message_detail
    assert "outbox_ext.drop_undelivered" in e.value.diag.message_hint
    with pytest.raises(psycopg.errors.DependentObjectsStillExist):
        db.execute("DROP EXTENSION IF EXISTS pg_stat_statements, outbox_ext CASCADE")
    assert db.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 500
    # delivered: the DROP goes through
    Relay(db, "c", batch_size=1000).drain()
    db.execute("DROP EXTENSION outbox_ext")
    assert db.execute("SELECT count(*) FROM pg_extension WHERE extname = 'outbox_ext'").fetchone()[0] == 0


@pytest.mark.parametrize("what", ["parked key", "dead letter", "override"])
def test_drop_extension_with_a_parked_key_or_dead_letter_is_refused(db, what):
    db.execute("SELECT outbox.create_consumer('c', backoff_base => '1 hour', backoff_max => '1 hour')")
    db.execute("SELECT outbox.emit('a', '1', 'e', '{}')")
    relay = Relay(db, "c")
    batch = relay.claim()
    if what == "dead letter":
        db.execute("SELECT outbox.reject('c', %s, %s, %s, 'no')", (batch[0].shard, batch[0].epoch, batch[0].id))
    else:
        relay.nack(batch[0], "down")
    relay.ack(batch[0].shard, batch[0].epoch)
    if what == "override":
        db.execute("SET outbox_ext.drop_undelivered = on")
        db.execute("DROP EXTENSION outbox_ext")
        return
    with pytest.raises(psycopg.errors.DependentObjectsStillExist) as e:
        db.execute("DROP EXTENSION outbox_ext")
    assert ("1 parked keys" if what == "parked key" else "1 dead letters") in e.value.diag.message_detail


@pytest.mark.parametrize("drop", ["DROP EXTENSION plpgsql CASCADE", "DROP LANGUAGE plpgsql CASCADE",
                                  "SET session_replication_role = replica; DROP EXTENSION outbox_ext"])
def test_a_drop_that_takes_outbox_ext_along_is_refused_too(db, drop):
    """A cascade from the language its functions are written in, or a session that skips
    triggers enabled the usual way, is refused while events are pending, as DROP EXTENSION is."""
    db.execute("SELECT outbox.create_consumer('c')")
    db.execute("SELECT outbox.emit('a', '1', 'e', '{}')")
    with pytest.raises(psycopg.errors.DependentObjectsStillExist) as e:
        db.execute(drop)
    assert "c: 1 pending" in e.value.diag.message_detail
    assert db.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 1
    # other cascades are not held up
    db.execute("RESET session_replication_role")
    db.execute("DROP EXTENSION IF EXISTS pg_trgm CASCADE")
    db.execute("DROP LANGUAGE IF EXISTS plperl CASCADE")


def test_drop_owned_by_outbox_exts_owner_is_refused(cluster, new_database):
    """DROP OWNED BY the role that created outbox_ext drops it: refused while events are
    pending; DROP OWNED BY anyone else is not held up."""
    name = new_database()
    owner = f"{name}_owner"
    with cluster.connect(name) as db:
        db.execute(f"CREATE ROLE {owner} SUPERUSER")
        try:
            db.execute(f"SET ROLE {owner}")
            db.execute("CREATE EXTENSION outbox_ext")
            db.execute("SELECT outbox.create_consumer('c')")
            db.execute("SELECT outbox.emit('a', '1', 'e', '{}')")
            db.execute("RESET ROLE")
            db.execute(f"CREATE ROLE {name}_other")
            db.execute(f"DROP OWNED BY {name}_other")   # not outbox_ext's owner: not held up
            db.execute(f"DROP ROLE {name}_other")
            with pytest.raises(psycopg.errors.DependentObjectsStillExist):
                db.execute(f"DROP OWNED BY {owner}")
            assert db.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 1
            Relay(db, "c").drain()
            db.execute(f"DROP OWNED BY {owner}")
            assert db.execute("SELECT count(*) FROM pg_extension WHERE extname = 'outbox_ext'").fetchone()[0] == 0
        finally:
            db.execute("RESET ROLE")
            db.execute("SET outbox_ext.drop_undelivered = on")
            db.execute(f"DROP OWNED BY {owner}")
            db.execute(f"DROP ROLE {owner}")


def test_an_emit_in_progress_when_the_drop_comes_is_waited_for_and_counted(db, connect):
    """The guard read what was undelivered before DROP EXTENSION locked the events table: an
    emit still in progress then committed unseen while the drop waited for its lock, and went
    with the table. The guard now locks the table first and reads after: refused (2BP01)."""
    db.execute("SELECT outbox.create_consumer('c')")
    writer = connect(autocommit=False)
    writer.execute("SELECT outbox.emit('a', '1', 'e', '{}')")
    dropper = connect()
    outcome: dict[str, object] = {}

    def drop() -> None:
        try:
            dropper.execute("DROP EXTENSION outbox_ext")
            outcome["dropped"] = True
        except psycopg.Error as e:
            outcome["error"] = e

    thread = threading.Thread(target=drop)
    thread.start()
    waits_for_a_lock(db, dropper.info.backend_pid)
    writer.commit()
    thread.join(30)
    assert "dropped" not in outcome, "the emit committed while the drop waited went with the table"
    assert isinstance(outcome["error"], psycopg.errors.DependentObjectsStillExist), outcome
    assert "c: 1 pending" in outcome["error"].diag.message_detail
    assert db.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 1


def test_a_drop_refused_for_undelivered_events_waits_for_no_reader(db, connect):
    """Something undelivered is reported at once: the guard takes the events table's lock only
    when it found nothing, else a drop refused anyway would wait behind a long reader (a dump)
    and queue every emit and claim behind it meanwhile."""
    db.execute("SELECT outbox.create_consumer('c')")
    db.execute("SELECT outbox.emit('a', '1', 'e', '{}')")
    reader = connect(autocommit=False)
    reader.execute("SELECT count(*) FROM outbox.events")      # holds ACCESS SHARE, as pg_dump does
    db.execute("SET lock_timeout = '2s'")
    with pytest.raises(psycopg.errors.DependentObjectsStillExist):
        db.execute("DROP EXTENSION outbox_ext")
    reader.rollback()


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_drop_in_a_snapshot_older_than_its_lock_is_refused(db, connect, level):
    """In a REPEATABLE READ or SERIALIZABLE transaction the guard can read only what its
    snapshot shows: an event committed since was dropped with the table. Refused (25000)
    while drop_undelivered is off; at READ COMMITTED the drop goes on as before."""
    db.execute("SELECT outbox.create_consumer('c')")
    dropper = connect(autocommit=False)
    dropper.execute(f"BEGIN ISOLATION LEVEL {level}")
    dropper.execute("SELECT count(*) FROM outbox.events")     # its snapshot: nothing pending
    db.execute("SELECT outbox.emit('a', '1', 'e', '{}')")
    with pytest.raises(psycopg.errors.InvalidTransactionState, match="READ COMMITTED"):
        dropper.execute("DROP EXTENSION outbox_ext")
    dropper.rollback()
    assert db.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 1
    Relay(db, "c").drain()
    db.execute("DROP EXTENSION outbox_ext")


def test_drop_extension_with_nothing_pending_drops(db):
    db.execute("SELECT outbox.emit('a', '1', 'e', '{}')")   # no consumer: nobody waits for it
    db.execute("DROP EXTENSION outbox_ext")
    db.execute("CREATE EXTENSION outbox_ext")
