"""Delivery under faults, with real processes: the sink down for a while and back; random 500,
429 and hangs from a fault-injecting proxy in front of a real receiver; kill -9 of the worker in
the middle of a batch; an immediate shutdown of PostgreSQL mid-stream; a poisoned key; a fast
shutdown with a batch out; a failover to a promoted standby. In each
case nothing is lost, nothing phantom arrives, per-key order holds at the sink, and duplicates
stay within the documented window (the batches in flight when the worker died)."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import defaultdict

import psycopg
import pytest

from conftest import MAJORS
from support.events import emit_keys
from support.peers import FaultProxy, Receiver, Request, check_delivery, create_sink, wait_for
from support.pgcluster import Cluster, as_postgres

DB = "faults"
_names = itertools.count()


@pytest.fixture(scope="module", params=MAJORS, ids=[f"pg{m}" for m in MAJORS])
def faulty(request):
    """A cluster of its own (these tests crash and restart it) whose worker serves DB."""
    c = Cluster(request.param, {"outbox_ext.databases": f"'{DB}'"}).init()
    c.start()
    with c.connect() as conn:
        conn.execute(f"CREATE DATABASE {DB}")
    with c.connect(DB) as conn:
        conn.execute("CREATE EXTENSION outbox_ext")
    yield c
    c.destroy()


def connect(cluster, timeout: float = 60.0) -> psycopg.Connection:
    """A connection, waiting for the server to be back after a crash or restart."""
    return wait_for(lambda: _try_connect(cluster), timeout=timeout, every=0.3)


def _try_connect(cluster):
    try:
        return cluster.connect(DB)
    except psycopg.OperationalError:
        return None


def webhook(conn, url: str, **options) -> str:
    return create_sink(conn, f"f{next(_names)}", "webhook", url, **options)


def test_sink_down_for_a_while_and_back(faulty):
    receiver = Receiver()
    port = receiver.port
    receiver.close()                               # the sink is down
    with connect(faulty) as conn:
        sink = webhook(conn, f"http://127.0.0.1:{port}", batch_size=20)
        emitted = emit_keys(conn, keys=10, per_key=10, prefix="down")
        error = wait_for(lambda: conn.execute("SELECT last_sink_error FROM outbox.status WHERE consumer = %s",
                                              (sink,)).fetchone()[0])
        assert "webhook" in error
        time.sleep(2)
        receiver = Receiver(port=port)             # and back
        try:
            wait_for(lambda: len(receiver.accepted_events()) >= 100, timeout=60)
            time.sleep(0.5)
            check_delivery(emitted, receiver.accepted_events())
            row = conn.execute("SELECT dead_letters, parked_keys, pending FROM outbox.status WHERE consumer = %s",
                               (sink,)).fetchone()
            assert row == (0, 0, 0), "an outage is not the events' fault"
        finally:
            receiver.close()


def test_random_500_429_and_hangs_from_a_proxy(faulty):
    receiver = Receiver()
    proxy = FaultProxy(receiver.url, p500=0.15, p429=0.1, p_hang=0.05, hang=2.0)
    try:
        with connect(faulty) as conn:
            sink = webhook(conn, proxy.url, batch_size=10, request_timeout="1 s", max_attempts=100)
            emitted = emit_keys(conn, keys=20, per_key=15, prefix="rnd")
            wait_for(lambda: len(receiver.accepted_events()) >= 300, timeout=120)
            time.sleep(0.5)
            # a forward slower than the sink's timeout (a busy machine) is sent again: the only
            # duplicates allowed
            check_delivery(emitted, receiver.accepted_events(), max_duplicates=proxy.faults["slow"])
            assert conn.execute("SELECT dead_letters FROM outbox.status WHERE consumer = %s",
                                (sink,)).fetchone()[0] == 0
        assert all(proxy.faults[k] > 0 for k in ("500", "429", "hang")), proxy.faults
    finally:
        proxy.close()
        receiver.close()


def test_kill_9_of_the_worker_mid_batch(faulty):
    receiver = Receiver(lambda r: (time.sleep(0.1), (200, {}, b""))[1])
    batch, concurrency = 10, 4
    try:
        with connect(faulty) as conn:
            webhook(conn, receiver.url, batch_size=batch, concurrency=concurrency)
            emitted = emit_keys(conn, keys=16, per_key=20, prefix="kill")
        wait_for(lambda: len(receiver.accepted_events()) >= 40)
        pid = faulty.worker_pid(DB)
        log_start = len(faulty.log())
        os.kill(pid, 9)
        wait_for(lambda: "terminated by signal 9" in faulty.log()[log_start:])
        wait_for(lambda: len({e["id"] for e in receiver.accepted_events()}) >= 320, timeout=90)
        time.sleep(0.5)
        # at most the batches in flight at the kill arrive twice
        check_delivery(emitted, receiver.accepted_events(), max_duplicates=batch * concurrency)
        assert faulty.worker_pid(DB) not in (None, pid)
    finally:
        receiver.close()


def test_immediate_shutdown_mid_stream(faulty):
    receiver = Receiver()
    committed: list[str] = []
    stop = threading.Event()

    def produce():
        try:
            with faulty.connect(DB) as conn:
                i = 0
                while not stop.is_set():
                    committed.append(conn.execute(
                        "SELECT outbox.emit('order', %s, 'e', jsonb_build_object('i', %s::int))::text",
                        (f"imm{i % 7}", i)).fetchone()[0])
                    i += 1
        except psycopg.Error:
            pass                                   # the server went away under us
    try:
        with connect(faulty) as conn:
            sink = webhook(conn, receiver.url, batch_size=25, concurrency=4)
        producer = threading.Thread(target=produce)
        producer.start()
        wait_for(lambda: len(receiver.accepted_events()) >= 50)
        faulty.stop("immediate")
        stop.set()
        producer.join()
        faulty.start()
        with connect(faulty) as conn:
            rows = conn.execute("SELECT e.id::text, e.aggregate_id FROM outbox.events e "
                                "WHERE e.aggregate_id LIKE 'imm%%' ORDER BY e.seq").fetchall()
            emitted = defaultdict(list)
            for event_id, key in rows:
                emitted[key].append(event_id)
            assert set(committed) <= {r[0] for r in rows}, "every acknowledged commit survived"
            wait_for(lambda: {e["id"] for e in receiver.accepted_events()} >= {r[0] for r in rows}, timeout=60)
            time.sleep(0.5)
            # a batch the receiver took just before the stop may be sent again
            check_delivery(emitted, receiver.accepted_events(), max_duplicates=4 * 25)
            assert conn.execute("SELECT pending FROM outbox.status WHERE consumer = %s",
                                (sink,)).fetchone()[0] == 0
    finally:
        stop.set()
        receiver.close()


class Gate:
    """A receiver's answers, held back until the test lets each through."""

    def __init__(self):
        self.arrived: list[tuple[Request, threading.Event]] = []
        self.cond = threading.Condition()
        self.holding = True

    def answer(self, request: Request):
        gate = threading.Event()
        with self.cond:
            if not self.holding:
                gate.set()
            self.arrived.append((request, gate))
            self.cond.notify_all()
        gate.wait(30)
        return getattr(gate, "status", 200), {}, b""

    def held(self, path: str, n: int) -> list[tuple[Request, threading.Event]]:
        """The first n requests to path, with their gates, once they have come."""
        def come():
            return [(r, g) for r, g in self.arrived if r.path == path][:n]
        with self.cond:
            assert self.cond.wait_for(lambda: len(come()) == n, 30), f"{n} requests to {path}"
            return come()

    def let_all_through(self):
        with self.cond:
            self.holding = False
            for _, gate in self.arrived:
                gate.set()


def keys_of_distinct_shards(conn, n: int, prefix: str) -> list[str]:
    keys, shards = [], set()
    for key in (f"{prefix}{i}" for i in range(1000)):
        shard = conn.execute("SELECT outbox.shard_of(%s)", (key,)).fetchone()[0]
        if shard not in shards:
            keys.append(key)
            shards.add(shard)
        if len(keys) == n:
            return keys
    raise AssertionError("not enough shards")


def lock_shard(faulty, sink: str, key: str) -> psycopg.Connection:
    """A transaction holding the row of key's shard of sink, which settling a batch of it locks."""
    conn = faulty.connect(DB, autocommit=False)
    conn.execute("SELECT FROM outbox._shards s JOIN outbox.consumers c ON c.id = s.consumer_id "
                 "WHERE c.name = %s AND s.shard = outbox.shard_of(%s) FOR UPDATE", (sink, key))
    return conn


def test_a_delivered_batch_holds_its_slot_until_its_settle_commits(faulty):
    """The duplicate bound, concurrency x batch_size, at its edge: a sink with 2 slots gets both
    its batches back at once. The first's settle claims on while the second's waits (here on
    a lock), and the server stops (immediate) before the second's commits. A delivered batch
    keeps its slot until its settle commits, so the first's settle takes one batch, not two:
    2 batches are sent again, not 3."""
    gate = Gate()
    receiver = Receiver(gate.answer)
    locks: list[psycopg.Connection] = []
    batch, concurrency = 5, 2
    try:
        with connect(faulty) as conn:
            def emit(kind, key):
                return conn.execute("SELECT outbox.emit(%s, %s, 'e', '{}')::text", (kind, key)).fetchone()[0]
            keys = keys_of_distinct_shards(conn, 3, "slot")
            emitted = {k: [emit("slot", k) for _ in range(2 * batch)] for k in keys}
            emit("blocker", "b")
            sink = webhook(conn, receiver.url + "/slots", batch_size=batch, concurrency=concurrency,
                           aggregate_types=["slot"], from_beginning=True)
            blocker = webhook(conn, receiver.url + "/blocker", aggregate_types=["blocker"],
                              from_beginning=True)
        (_, first), (second, second_gate) = gate.held("/slots", 2)
        [(_, blocker_gate)] = gate.held("/blocker", 1)
        # the worker waits in the blocker's settle while both batches of the sink come back
        locks.append(lock_shard(faulty, blocker, "b"))
        blocker_gate.set()
        time.sleep(0.3)
        first.set()
        time.sleep(0.1)
        locks.append(lock_shard(faulty, sink, second.events()[0]["aggregate_id"]))
        second_gate.set()
        time.sleep(0.3)
        gate.let_all_through()
        locks[0].rollback()        # the blocker settles; then the first batch, claiming on
        time.sleep(1.5)            # what that claimed goes out; the second still waits
        faulty.stop("immediate")
        faulty.start()
        with connect(faulty):
            def slots():
                return [e for e in receiver.accepted_events() if e["aggregate_type"] == "slot"]
            want = {i for ids in emitted.values() for i in ids}
            wait_for(lambda: {e["id"] for e in slots()} >= want, timeout=60)
            time.sleep(0.5)
            check_delivery(emitted, slots(), max_duplicates=concurrency * batch)
    finally:
        gate.let_all_through()
        for lock in locks:
            lock.close()
        receiver.close()


def test_a_late_batch_of_a_sink_dropped_and_made_again_settles_nothing_of_the_new_one(faulty):
    """A sink dropped and made again under its name is another consumer, whose epochs start
    afresh: its first batch of a shard has the epoch of the old one's first. The old one's batch,
    back late, must not be settled as the new one's: that took the new batch for delivered,
    and when the new one's request failed its events were never sent."""
    gate = Gate()
    receiver = Receiver(gate.answer)
    try:
        with connect(faulty) as conn:
            def emit(i):
                return conn.execute("SELECT outbox.emit('order', 'again', 'e', jsonb_build_object('i', %s::int))::text",
                                    (i,)).fetchone()[0]
            name = webhook(conn, receiver.url + "/old", batch_size=5, concurrency=2)
            for i in range(5):
                emit(i)
            [(_, old)] = gate.held("/old", 1)
            conn.execute("SELECT outbox.drop_sink(%s)", (name,))
            create_sink(conn, name, "webhook", receiver.url + "/new", batch_size=5, concurrency=2)
            new_events = [emit(i) for i in range(5, 10)]
            [(_, new)] = gate.held("/new", 1)
            old.set()                              # back late, after the new sink's claim
            time.sleep(1)
            new.status = 503                       # the new sink's first try fails
            new.set()
            gate.let_all_through()
            wait_for(lambda: {e["id"] for e in receiver.accepted_events()} >= set(new_events), timeout=30)
            wait_for(lambda: conn.execute("SELECT pending FROM outbox.status WHERE consumer = %s",
                                          (name,)).fetchone()[0] == 0)
    finally:
        gate.let_all_through()
        receiver.close()


SETTLES = ("outbox.settle(text, int, bigint, jsonb), "
           "outbox.settle_and_claim(text, int, bigint, jsonb, int, interval, text, int)")
RELEASE = "outbox.release(text, int, bigint, interval)"


def test_a_settle_that_fails_is_tried_again_not_left_to_its_lease(faulty):
    """A settle that fails (here EXECUTE on settle revoked for 3 s; in life a deadlock, a lock
    or statement timeout) is tried again each second, and its batch keeps its slot meanwhile:
    nothing more goes out while nothing can be settled, delivery resumes once settling works,
    and nothing is sent twice. Left to its lease, each shard would stall until the lease ran
    out (5 minutes) and its batch would go out again."""
    receiver = Receiver()
    batch, concurrency = 10, 2
    try:
        with connect(faulty) as conn:
            sink = webhook(conn, receiver.url, batch_size=batch, concurrency=concurrency)
            conn.execute(f"REVOKE EXECUTE ON FUNCTION {SETTLES} FROM outbox_relay")
            emitted = emit_keys(conn, keys=10, per_key=5, prefix="unsettled")
            wait_for(lambda: "settling a batch" in (conn.execute(
                "SELECT last_sink_error FROM outbox.status WHERE consumer = %s", (sink,)).fetchone()[0] or ""))
            time.sleep(2)
            assert len(receiver.accepted_events()) <= concurrency * batch, \
                "no more batches go out than there are slots while none can be settled"
            conn.execute(f"GRANT EXECUTE ON FUNCTION {SETTLES} TO outbox_relay")
            wait_for(lambda: conn.execute("SELECT pending FROM outbox.status WHERE consumer = %s",
                                          (sink,)).fetchone()[0] == 0, timeout=15)
            check_delivery(emitted, receiver.accepted_events())
    finally:
        with connect(faulty) as conn:
            conn.execute(f"GRANT EXECUTE ON FUNCTION {SETTLES} TO outbox_relay")
        receiver.close()


def test_a_batch_back_after_its_sink_was_paused_is_settled_though_settling_fails_a_while(faulty):
    """A batch comes back after its sink was paused (the worker no longer has the sink), while
    settling fails (EXECUTE on settle revoked for 2 s): its settle is tried again, so that the
    sink, resumed, does not send the batch again. Dropped, the batch stayed leased, and the
    resumed sink took its lease back and sent it again."""
    gate = Gate()
    receiver = Receiver(gate.answer)
    try:
        with connect(faulty) as conn:
            sink = webhook(conn, receiver.url + "/paused", batch_size=10, concurrency=1)
            with conn.transaction():
                emitted = {"paused": [conn.execute("SELECT outbox.emit('order', 'paused', 'e', '{}')::text")
                                      .fetchone()[0] for _ in range(5)]}
            [(_, out)] = gate.held("/paused", 1)
            conn.execute("SELECT outbox.pause_sink(%s)", (sink,))
            conn.execute(f"REVOKE EXECUTE ON FUNCTION {SETTLES} FROM outbox_relay")
            time.sleep(1.5)                        # the worker reads the pause
            gate.let_all_through()                 # the batch comes back: its settle fails
            time.sleep(2)
            conn.execute(f"GRANT EXECUTE ON FUNCTION {SETTLES} TO outbox_relay")
            time.sleep(1.5)                        # the retry settles it
            conn.execute("SELECT outbox.resume_sink(%s)", (sink,))
            time.sleep(2)
            check_delivery(emitted, receiver.accepted_events(), max_duplicates=0)
    finally:
        gate.let_all_through()
        with connect(faulty) as conn:
            conn.execute(f"GRANT EXECUTE ON FUNCTION {SETTLES} TO outbox_relay")
        receiver.close()


def test_a_probe_given_back_for_new_settings_is_given_back_though_that_fails_a_while(faulty):
    """A fix of a suspended sink's row gives its probe out back (outbox.release) while that
    fails (EXECUTE on release revoked for 2 s): the give-back is tried again, and the new
    settings deliver the events as soon as it commits. Dropped, the shard stayed leased until
    its lease ran out (5 minutes)."""
    phase = ["failing"]
    held, done = threading.Event(), threading.Event()

    def answer(request: Request):
        if phase[0] == "failing":
            return 503, {}, b"deploying"
        if phase[0] == "holding":
            phase[0] = "open"
            held.set()
            done.wait(30)
            return 503, {}, b"deploying"
        return 200, {}, b""
    receiver = Receiver(answer)
    try:
        with connect(faulty) as conn:
            sink = webhook(conn, receiver.url, batch_size=20, request_timeout="20 s")
            emitted = emit_keys(conn, keys=1, per_key=5, prefix="given-back")
            wait_for(lambda: conn.execute("SELECT sink_state FROM outbox.status WHERE consumer = %s",
                                          (sink,)).fetchone()[0] == "suspended", timeout=10)
            phase[0] = "holding"
            assert held.wait(10), "a probe is out"
            conn.execute(f"REVOKE EXECUTE ON FUNCTION {RELEASE} FROM outbox_relay")
            conn.execute("UPDATE outbox.sinks SET request_timeout = '19 s' WHERE name = %s", (sink,))
            time.sleep(2)
            assert receiver.accepted_events() == [], "the shard is held while it cannot be given back"
            conn.execute(f"GRANT EXECUTE ON FUNCTION {RELEASE} TO outbox_relay")
            wait_for(lambda: len(receiver.accepted_events()) >= 5, timeout=5)
            check_delivery(emitted, receiver.accepted_events())
    finally:
        done.set()
        with connect(faulty) as conn:
            conn.execute(f"GRANT EXECUTE ON FUNCTION {RELEASE} TO outbox_relay")
        receiver.close()


def test_a_shard_claimed_only_to_look_is_given_back_though_that_fails_a_while(faulty):
    """A suspended sink's probe holding one key's events makes the worker claim another shard,
    only to see whether there is more to send, and give it back at once. That give-back
    failing (EXECUTE on release revoked for 2 s) is tried again: once the sink is back, both
    keys are delivered at once. Dropped, the other shard stayed leased (5 minutes)."""
    healed = threading.Event()
    receiver = Receiver(lambda r: (200, {}, b"") if healed.is_set() else (503, {}, b"deploying"))
    try:
        with connect(faulty) as conn:
            sink = webhook(conn, receiver.url, batch_size=20)
            first = conn.execute("SELECT outbox.shard_of('look-a')").fetchone()[0]
            other = next(k for k in (f"look-b{i}" for i in range(100))
                         if conn.execute("SELECT outbox.shard_of(%s)", (k,)).fetchone()[0] != first)
            with conn.transaction():
                emitted = {k: [conn.execute("SELECT outbox.emit('order', %s, 'e', '{}')::text", (k,)).fetchone()[0]]
                           for k in ("look-a", other)}
            wait_for(lambda: conn.execute("SELECT sink_state FROM outbox.status WHERE consumer = %s",
                                          (sink,)).fetchone()[0] == "suspended", timeout=10)
            conn.execute(f"REVOKE EXECUTE ON FUNCTION {RELEASE} FROM outbox_relay")
            time.sleep(2.5)                        # a probe, and a look at the other shard
            conn.execute(f"GRANT EXECUTE ON FUNCTION {RELEASE} TO outbox_relay")
            healed.set()
            wait_for(lambda: len(receiver.accepted_events()) >= 2, timeout=8)
            check_delivery(emitted, receiver.accepted_events())
    finally:
        with connect(faulty) as conn:
            conn.execute(f"GRANT EXECUTE ON FUNCTION {RELEASE} TO outbox_relay")
        receiver.close()


def test_a_database_set_to_serializable_still_delivers(faulty):
    """Some teams make SERIALIZABLE the default of a whole database. Claims and settles refuse
    it (25000: their reads after a lock need READ COMMITTED), so the worker pins its own
    session to READ COMMITTED and delivers as before."""
    receiver = Receiver()
    try:
        with connect(faulty) as conn:
            conn.execute(f"ALTER DATABASE {DB} SET default_transaction_isolation = 'serializable'")
        faulty.restart_worker(DB)                  # a new session, with the database's default
        with connect(faulty) as conn:
            assert conn.execute("SHOW default_transaction_isolation").fetchone()[0] == "serializable"
            conn.execute("SET default_transaction_isolation = 'read committed'")
            webhook(conn, receiver.url, batch_size=10)
            emitted = emit_keys(conn, keys=5, per_key=3, prefix="serializable")
            wait_for(lambda: len(receiver.accepted_events()) >= 15, timeout=15)
            check_delivery(emitted, receiver.accepted_events())
    finally:
        with connect(faulty) as conn:
            conn.execute(f"ALTER DATABASE {DB} RESET default_transaction_isolation")
        faulty.restart_worker(DB)
        receiver.close()


def refusing(key: str, body: bytes = b"cannot handle this one") -> Receiver:
    """A receiver that answers 500 to any request holding an event of `key`."""
    return Receiver(lambda r: (500, {}, body)
                    if any(e["aggregate_id"] == key for e in r.events()) else (200, {}, b""))


def poisoned_sink(conn, receiver: Receiver, key: str) -> tuple[str, list[str]]:
    """A webhook sink that dead-letters after 3 attempts, 1 s apart; and five innocent keys of
    `key`'s own shard."""
    sink = webhook(conn, receiver.url, batch_size=50, max_attempts=3, backoff_base="1 s", backoff_max="1 s")
    shard = conn.execute("SELECT outbox.shard_of(%s)", (key,)).fetchone()[0]
    neighbours = [k for k in (f"{key}-n{i}" for i in range(400))
                  if conn.execute("SELECT outbox.shard_of(%s)", (k,)).fetchone()[0] == shard][:5]
    return sink, neighbours


def emit_one(conn, key: str) -> str:
    return conn.execute("SELECT outbox.emit('order', %s, 'e', '{}')::text", (key,)).fetchone()[0]


def dead_lettered(conn, sink: str, n: int) -> list[str]:
    """The ids of the sink's dead letters in order, once there are n."""
    rows = wait_for(lambda: (rows := conn.execute(
        "SELECT event_id::text FROM outbox.dead_letters WHERE consumer = %s ORDER BY id",
        (sink,)).fetchall()) and len(rows) == n and rows, timeout=60)
    return [r[0] for r in rows]


def sink_state(conn, sink: str) -> str:
    return conn.execute("SELECT sink_state FROM outbox.status WHERE consumer = %s", (sink,)).fetchone()[0]


# a binary error body: a NUL in the error text made every settle of the batch fail (jsonb takes
# no \u0000), so the shard never moved on and the batch went out again at every lease
@pytest.mark.parametrize("body", [b"cannot handle this one", b"bad\x00thing"], ids=["text", "nul"])
def test_a_poisoned_key_blocks_only_itself(faulty, body):
    receiver = refusing("poison", body)
    try:
        with connect(faulty) as conn:
            sink, neighbours = poisoned_sink(conn, receiver, "poison")
            with conn.transaction():   # one commit: the first batch holds innocent events too, so
                poison = [emit_one(conn, "poison") for _ in range(3)]   # the sink is seen healthy
                emitted = {k: [emit_one(conn, k)] for k in neighbours}
            wait_for(lambda: conn.execute("SELECT parked_keys FROM outbox.status WHERE consumer = %s",
                                          (sink,)).fetchone()[0] == 1)
            t0 = time.time()
            for k in neighbours:                   # while the poisoned key is parked
                emitted[k].append(emit_one(conn, k))
            wait_for(lambda: len(receiver.accepted_events()) >= 2 * len(neighbours), timeout=10)
            assert time.time() - t0 < 1.0, "the shard went on without the poisoned key"
            assert dead_lettered(conn, sink, 3) == poison, "dead-lettered one by one, in order"
            check_delivery(emitted, receiver.accepted_events())
    finally:
        receiver.close()


def test_a_poisoned_key_first_in_a_new_sinks_stream_blocks_only_itself(faulty):
    """No success yet to tell a poisoned key from a sink that is down: the sink is suspended,
    and its probe, finding that key's events all there is to send, lets the key wait
    uncounted, so that the next probe reaches the events behind it, in the same shard; then
    the key is the one blamed."""
    receiver = refusing("first")
    try:
        with connect(faulty) as conn:
            sink, neighbours = poisoned_sink(conn, receiver, "first")
            poison = [emit_one(conn, "first") for _ in range(3)]
            wait_for(lambda: sink_state(conn, sink) == "suspended")
            emitted = {k: [emit_one(conn, k)] for k in neighbours}
            wait_for(lambda: len(receiver.accepted_events()) >= len(neighbours), timeout=15)
            assert dead_lettered(conn, sink, 3) == poison, "dead-lettered one by one, in order"
            check_delivery(emitted, receiver.accepted_events())
            assert sink_state(conn, sink) == "healthy"
    finally:
        receiver.close()


def receiver_busy(cluster) -> bool:
    """the worker has a batch out"""
    with cluster.connect() as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'outbox_ext worker' "
                            "AND query LIKE 'delivering%%'").fetchone()[0] > 0


def test_a_fast_shutdown_settles_the_batch_in_flight(faulty):
    receiver = Receiver(lambda r: (time.sleep(1.5), (200, {}, b""))[1])
    try:
        with connect(faulty) as conn:
            webhook(conn, receiver.url, batch_size=50, concurrency=1)
            emitted = emit_keys(conn, keys=5, per_key=4, prefix="term")
        wait_for(lambda: receiver.requests or receiver_busy(faulty))
        time.sleep(0.5)                            # the batch is out, its answer 1 s away
        log_start = len(faulty.log())
        faulty.stop("fast")                        # SIGTERM to the worker
        assert f'outbox_ext worker for "{DB}" stopping' in faulty.log()[log_start:]
        faulty.start()
        wait_for(lambda: len({e["id"] for e in receiver.accepted_events()}) >= 20, timeout=30)
        time.sleep(1)
        check_delivery(emitted, receiver.accepted_events())   # nothing sent twice
    finally:
        receiver.close()


def test_a_standby_does_not_deliver_and_takes_over_when_promoted(faulty):
    receiver = Receiver()
    port = receiver.port
    standby = None
    try:
        with connect(faulty) as conn:
            webhook(conn, receiver.url, batch_size=10)
            emitted = emit_keys(conn, keys=3, per_key=2, prefix="fo")
        wait_for(lambda: len(receiver.accepted_events()) >= 6)
        standby = Cluster(faulty.major)
        os.chown(standby.datadir, *_postgres_ids()) if os.geteuid() == 0 else None
        as_postgres(str(faulty.bindir / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(faulty.port),
                    "-U", "postgres", "-D", str(standby.datadir), "-R", "-X", "stream", "-c", "fast")
        with open(standby.datadir / "postgresql.conf", "a") as conf:
            conf.write(f"port = {standby.port}\nunix_socket_directories = '{standby.datadir}'\n")
        standby.start()
        receiver.close()                                        # the sink goes away ...
        with connect(faulty) as conn:
            for key, ids in emit_keys(conn, keys=3, per_key=3, prefix="fo").items():
                emitted[key] += ids                             # ... so these stay pending
            lsn = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        with connect(standby) as conn:
            wait_for(lambda: conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,)).fetchone()[0])
            assert conn.execute("SELECT count(*) FROM pg_stat_activity "
                                "WHERE backend_type LIKE 'outbox_ext%%'").fetchone()[0] == 0, "idle on a standby"
            for call in ("SELECT outbox.emit('order', 'x', 'e', '{}')",
                         "SELECT outbox.emit_many('order', 'e', ARRAY['x'], ARRAY['{}'::jsonb])"):
                with pytest.raises(psycopg.errors.ReadOnlySqlTransaction) as err:   # not XX000
                    conn.execute(call)
                assert err.value.diag.message_hint, "ours, not PostgreSQL's own"
        faulty.stop("immediate")                                # the primary fails
        as_postgres(str(standby.bindir / "pg_ctl"), "-D", str(standby.datadir), "-w", "promote")
        receiver = Receiver(port=port)                          # the sink is back
        wait_for(lambda: len({e["id"] for e in receiver.accepted_events()}) >= 9, timeout=60)
        time.sleep(0.5)
        # the promoted standby's worker delivered what the primary could not, once, in order
        check_delivery({k: ids[2:] for k, ids in emitted.items()}, receiver.accepted_events())
    finally:
        if standby:
            standby.destroy()
        receiver.close()
        faulty.start()


def _postgres_ids() -> tuple[int, int]:
    import pwd
    entry = pwd.getpwnam("postgres")
    return entry.pw_uid, entry.pw_gid
