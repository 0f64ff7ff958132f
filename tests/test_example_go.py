"""examples/go end to end: the order service, its relay and its consumer, built with `go build`
(once per session) and run against a real PostgreSQL database and the real 3-node Kafka cluster
(the session's `kafka` fixture, shared with the other Kafka tests), each command as the role
its README names: setup as admin_user, the relays as relay_user, orders and the consumer as
producer_user.

Orders are placed 8 at a time (each created with its lines, then paid, then shipped: a
transaction each) while two relay processes run, before their topic exists: the records fail,
the relays report them to settle, the keys wait and nothing is dead-lettered; once the example
makes the topic, every event is settled. Then a lease is lost: with the brokers stalled, a
relay's lease runs out mid-publish, the test's own claim takes the batch and gives it back,
the relay's settle is refused (55000) and it publishes the batch again. Read back with
confluent-kafka: every event of the log, nothing else, each key in one partition, each order's
events (first arrivals) in the order they were emitted. The consumer then applies each event
once, dropping the lost lease's duplicates (order_views agrees with orders), and, run again
from the start of the topic under another group, finds every record a duplicate and changes
nothing."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from support.peers import wait_for

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples/go"
ORDERS, WORKERS = 50, 8
_topics = itertools.count()


@pytest.fixture(scope="session")
def orders_bin(tmp_path_factory) -> Path:
    """The example's binary, built once. Modules come from the Go module proxy into the
    default module cache (GOMODCACHE if set); go.sum must already hold them (-mod=readonly)."""
    go = shutil.which("go")
    assert go, "the Go toolchain (go 1.26 or later) is needed to build examples/go"
    binary = tmp_path_factory.mktemp("example_go") / "orders"
    build = subprocess.run([go, "build", "-mod=readonly", "-buildvcs=false", "-o", str(binary), "."],
                           cwd=EXAMPLE, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr
    return binary


def run(binary: Path, *args: str, env: dict, timeout: float = 60) -> str:
    """Runs a command of the example to its end; returns what it logged (stderr)."""
    done = subprocess.run([str(binary), *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"orders {' '.join(args)} exited {done.returncode}:\n{done.stderr}"
    return done.stderr


def consumed(log: str) -> tuple[int, int]:
    """(applied, duplicates) from the consumer's last line."""
    m = re.search(r"applied (\d+) events, dropped (\d+) duplicates", log)
    assert m, log
    return int(m[1]), int(m[2])


class Relays:
    """Relay processes of the example, stopped with SIGTERM (as a service manager would) on
    exit; `log` is what they logged, `codes` their exit codes."""

    def __init__(self, binary: Path, env: dict, logs: Path, processes: int, *args: str):
        self.files = [logs / f"relay{next(_topics)}.log" for _ in range(processes)]
        self.processes = []
        for file in self.files:
            with file.open("w") as out:
                self.processes.append(subprocess.Popen([str(binary), "relay", *args], env=env,
                                                       stdout=out, stderr=out))

    def __enter__(self) -> "Relays":
        return self

    def __exit__(self, *exc) -> None:
        for p in self.processes:
            p.terminate()
        self.codes = []
        for p in self.processes:
            try:
                self.codes.append(p.wait(30))
            except subprocess.TimeoutExpired:
                p.kill()
                self.codes.append(p.wait())
        self.log = "\n".join(f.read_text() for f in self.files)


def test_orders_reach_kafka_in_order_and_are_applied_once(cluster, dbname, kafka, orders_bin, tmp_path):
    topic = f"example_orders{next(_topics)}"
    base = {**os.environ, "KAFKA_BROKERS": kafka.bootstrap()}

    def env(user: str) -> dict:
        return {**base, "DATABASE_URL": cluster.dsn(dbname, user)}

    with cluster.connect(dbname) as db, cluster.connect(dbname, "relay_user") as relay_conn:
        db.execute("GRANT CREATE ON SCHEMA public TO admin_user")
        run(orders_bin, "setup", env=env("admin_user"))   # tables and the outbox consumer
        run(orders_bin, "setup", env=env("admin_user"))   # again: nothing to do
        db.execute("GRANT SELECT, INSERT, UPDATE ON orders, order_views TO producer_user")

        def status() -> dict:
            row = db.execute("SELECT undelivered, parked_keys, dead_letters FROM outbox.status "
                             "WHERE consumer = 'kafka-orders'").fetchone()
            return dict(zip(("undelivered", "parked_keys", "dead_letters"), row))

        def keys_waiting() -> bool:
            """keys parked: the relays reported the records Kafka failed to settle"""
            return status()["parked_keys"] > 0

        def all_delivered() -> bool:
            """every event settled as delivered, no key waiting"""
            s = status()
            return s["undelivered"] == 0 and s["parked_keys"] == 0

        # 1. Two relay processes (two loops each), as a role that may only relay, start before
        # the topic exists; orders are placed 8 at a time.
        with Relays(orders_bin, env("relay_user"), tmp_path, 2, "-topic", topic) as relays:
            run(orders_bin, "create-orders", "-n", str(ORDERS), "-workers", str(WORKERS), "-prefix", "order",
                env=env("producer_user"))
            wait_for(keys_waiting, timeout=30)
            assert status()["dead_letters"] == 0        # Kafka's trouble, not the events': no attempt counted
            run(orders_bin, "create-topic", "-topic", topic, "-partitions", "4", env=base)
            wait_for(all_delivered, timeout=60)
            assert status()["dead_letters"] == 0
        assert relays.codes == [0, 0], relays.log       # SIGTERM: a relay stops cleanly
        assert "not published" in relays.log, relays.log

        # 2. A lease lost: one relay loop, 1-second leases, the brokers stalled while it
        # publishes one order's events. Once its lease ran out, another claim (ours) takes the
        # batch and gives it back: the relay's settle is refused (55000), it claims the batch
        # again and publishes it again. Kafka holds those events twice.
        def relay_claimed() -> bool:
            """the relay claimed a batch (a claim row with its owner name in the cursor log)"""
            owner = f"orders-relay-{relays.processes[0].pid}-0"
            return db.execute("SELECT count(*) FROM outbox._cursor_log WHERE owner = %s", (owner,)).fetchone()[0] > 0

        def taken_over():
            """the relay's lease ran out and our claim took its batch"""
            return relay_conn.execute("SELECT shard, epoch FROM outbox.claim('kafka-orders', 100, '1 minute', "
                                      "'test')").fetchone()

        with Relays(orders_bin, env("relay_user"), tmp_path, 1, "-topic", topic, "-relays", "1",
                    "-lease", "1s") as relays:
            kafka.pause(*kafka.nodes)
            try:
                run(orders_bin, "create-orders", "-n", "1", "-prefix", "stalled", env=env("producer_user"))
                wait_for(relay_claimed, timeout=30)
                shard, epoch = wait_for(taken_over, timeout=30)
                relay_conn.execute("SELECT outbox.release('kafka-orders', %s, %s)", (shard, epoch))
            finally:
                kafka.resume(*kafka.nodes)
            wait_for(all_delivered, timeout=60)
        assert relays.codes == [0], relays.log
        assert "lost the lease" in relays.log, relays.log

        events = db.execute("SELECT id::text, aggregate_id, event_type, payload FROM outbox.events").fetchall()
        versions = dict(db.execute("SELECT id, version FROM orders").fetchall())
        assert len(versions) == ORDERS + 1 and len(events) == sum(versions.values())
        assert {e[1] for e in events} == set(versions)

        # --- Kafka: every event, each order in one partition, in order --------------------
        records = kafka.read(topic, expect=len(events), timeout=60)
        by_id = {e[0]: e for e in events}
        arrived, partitions, seen = defaultdict(list), defaultdict(set), set()
        for r in records:
            event_id = r["headers"]["outbox-id"].decode()
            assert event_id in by_id, r                                    # nothing but the log's events
            _, key, event_type, payload = by_id[event_id]
            assert r["key"] == key.encode() and json.loads(r["value"]) == payload
            assert r["headers"]["outbox-event-type"].decode() == event_type
            partitions[key].add(r["partition"])
            if event_id not in seen:                                       # first arrivals only
                seen.add(event_id)
                arrived[key].append(payload["version"])
        assert seen == set(by_id)                                          # every event, at least once
        assert all(len(p) == 1 for p in partitions.values()), partitions   # a key stays in one partition
        assert arrived == {key: list(range(1, v + 1)) for key, v in versions.items()}  # in order per order

        # --- the consumer: each event applied once ------------------------------------------
        applied, duplicates = consumed(run(orders_bin, "consume", "-topic", topic, "-group", f"{topic}-views",
                                           "-until-caught-up", env=env("producer_user")))
        assert (applied, duplicates) == (len(events), len(records) - len(events))
        assert duplicates > 0                                              # those of the lost lease
        views = db.execute("SELECT * FROM order_views ORDER BY order_id").fetchall()
        assert db.execute(
            "SELECT count(*) FROM orders o JOIN order_views v ON v.order_id = o.id "
            "WHERE v.status = o.status AND o.status = 'shipped' AND v.customer = o.customer "
            "  AND v.version = o.version AND v.events = o.version AND v.lines = o.version - 3 "
            "  AND v.total_cents = o.total_cents").fetchone()[0] == len(versions)
        assert db.execute("SELECT count(*) FROM inbox.messages WHERE consumer = 'order-views'"
                          ).fetchone()[0] == len(events)

        # Read again from the start of the topic (a new group): every record is a duplicate
        applied, duplicates = consumed(run(orders_bin, "consume", "-topic", topic, "-group", f"{topic}-replay",
                                           "-until-caught-up", env=env("producer_user")))
        assert (applied, duplicates) == (0, len(records))
        assert db.execute("SELECT * FROM order_views ORDER BY order_id").fetchall() == views
