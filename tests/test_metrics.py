"""Prometheus metrics: the worker's endpoint, scraped by a real Prometheus (Debian's package),
whose HTTP API the tests then query. Known deliveries, failures, a parked key, a dead letter and
a batch held in flight must show up as the series docs/guides/monitoring.md documents, equal to what
outbox.status says."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import MAJORS
from support.peers import Receiver, create_sink, wait_for
from support.pgcluster import Cluster, free_port

DB = "metrics_db"
SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
ALERTS = Path(__file__).resolve().parent.parent / "monitoring/alerts.yml"  # the shipped rules


@pytest.fixture(scope="module", params=MAJORS, ids=[f"pg{m}" for m in MAJORS])
def served(request):
    """A cluster whose worker serves DB and its metrics; yields (cluster, metrics port)."""
    port = free_port()
    c = Cluster(request.param, {"outbox_ext.databases": f"'{DB}'",
                                "outbox_ext.metrics_address": f"'127.0.0.1:{port}'"}).init()
    c.start()
    with c.connect() as conn:
        conn.execute(f"CREATE DATABASE {DB}")
    with c.connect(DB) as conn:
        conn.execute("CREATE EXTENSION outbox_ext")
    wait_for(lambda: _get(f"http://127.0.0.1:{port}/metrics"), timeout=30)
    yield c, port
    c.destroy()


@pytest.fixture(scope="module")
def prometheus(served):
    """A real Prometheus scraping the worker every second; yields query(promql) -> {labels: value}."""
    _, target = served
    home = Path(tempfile.mkdtemp(prefix="outbox-prometheus-"))
    (home / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{ALERTS}']\n"
        "scrape_configs:\n"
        f"  - job_name: outbox\n    static_configs: [{{targets: ['127.0.0.1:{target}']}}]\n")
    port = free_port()
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={home / 'prometheus.yml'}",
                             f"--storage.tsdb.path={home / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(home / "log", "w"))
    api = f"http://127.0.0.1:{port}"
    wait_for(lambda: _get(f"{api}/-/ready"), timeout=60)

    def query(promql: str) -> dict[tuple, float]:
        body = json.loads(_get(f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": promql})))
        assert body["status"] == "success", body
        return {tuple(sorted((k, v) for k, v in r["metric"].items() if k not in ("__name__", "instance", "job"))):
                float(r["value"][1]) for r in body["data"]["result"]}

    query.api = api
    yield query
    proc.terminate()
    proc.wait(timeout=30)
    shutil.rmtree(home, ignore_errors=True)


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None


def _status(url: str, method: str = "GET") -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def series(query, name: str, consumer: str) -> float | None:
    return query(f'{name}{{database="{DB}", consumer="{consumer}"}}').get(
        (("consumer", consumer), ("database", DB)))


def emit(conn, aggregate_type: str, keys: list[str]) -> None:
    with conn.transaction():
        for key in keys:
            conn.execute("SELECT outbox.emit(%s, %s, 'e', '{}')", (aggregate_type, key))


def status_of(conn, consumer: str) -> dict:
    cur = conn.execute("SELECT pending, parked_keys, parked_events, dead_letters, delivered_total, "
                       "failed_total FROM outbox.status WHERE consumer = %s", (consumer,))
    return dict(zip([d.name for d in cur.description], cur.fetchone()))


def picky(request) -> tuple[int, dict, bytes]:
    """Refuses key 'bad' for good (400: a dead letter) and key 'poison' for now (500: parked)."""
    key = request.events()[0]["aggregate_id"]
    return {"bad": 400, "poison": 500}.get(key, 200), {}, b""


def test_prometheus_scrapes_deliveries_failures_parked_keys_and_dead_letters(served, prometheus):
    cluster, port = served
    good, choosy = Receiver(), Receiver(picky)
    with cluster.connect(DB) as conn:
        conn.execute("SELECT outbox.create_consumer('reader')")  # a relay that never claims
        create_sink(conn, "good", "webhook", good.url, aggregate_types=["good"], secret=SECRET)
        # one retry, then parked for an hour: the failure counts stay still while the test reads
        create_sink(conn, "choosy", "webhook", choosy.url, aggregate_types=["choosy"], format="single",
                    backoff_base="1 hour", backoff_max="1 hour")
        emit(conn, "good", [f"g{i}" for i in range(5)])
        # one at a time, each after a success: a failing key is then judged at fault on its own
        # (the lone-key rule), whatever order the shards' batches would have come back in
        # (a lone key's refusal counts, and is final once refused again after a success: bad
        # is made due again at once after ok2's delivery)
        for keys, then in [(["ok1"], ("delivered_total", 1)), (["bad"], ("failed_total", 1)),
                           (["ok2"], ("delivered_total", 2)), ([], ("dead_letters", 1)),
                           (["ok3"], ("delivered_total", 3)), (["poison", "poison"], ("failed_total", 3))]:
            if keys:
                emit(conn, "choosy", keys)
            else:
                conn.execute("UPDATE outbox._parked SET next_attempt_at = now() WHERE aggregate_id = 'bad'")
            wait_for(lambda: status_of(conn, "choosy")[then[0]] == then[1])
        wait_for(lambda: status_of(conn, "good")["delivered_total"] == 5
                 and status_of(conn, "choosy")["delivered_total"] == 3
                 and status_of(conn, "choosy")["dead_letters"] == 1
                 and status_of(conn, "choosy")["parked_keys"] == 1
                 and status_of(conn, "choosy")["failed_total"] == 3)
        expected = {c: status_of(conn, c) for c in ("good", "choosy", "reader")}
        oldest = conn.execute("SELECT extract(epoch FROM oldest_pending_at)::float8 FROM outbox.status "
                              "WHERE consumer = 'reader'").fetchone()[0]
    # bad failed twice, poison once (the poison event held back behind it was not attempted)
    assert expected["choosy"]["failed_total"] == 3 and expected["choosy"]["parked_events"] == 2

    names = {"pending": "outbox_pending_events", "parked_keys": "outbox_parked_keys",
             "parked_events": "outbox_parked_events", "dead_letters": "outbox_dead_letters",
             "delivered_total": "outbox_delivered_events_total", "failed_total": "outbox_failed_events_total"}

    def scraped(consumer):
        return {column: series(prometheus, name, consumer) for column, name in names.items()}
    for consumer in expected:
        wait_for(lambda: scraped(consumer) == expected[consumer], timeout=30)
    assert expected["reader"]["pending"] == 11 and expected["reader"]["delivered_total"] is None
    # the relay's oldest pending event, and its age: 0 and absent where nothing is pending
    assert series(prometheus, "outbox_oldest_pending_timestamp_seconds", "reader") == pytest.approx(oldest, abs=1e-3)
    assert 0 < series(prometheus, "outbox_lag_seconds", "reader") < 60
    assert series(prometheus, "outbox_lag_seconds", "good") == 0
    assert series(prometheus, "outbox_oldest_pending_timestamp_seconds", "good") is None

    # each batch's delivery time: 5 events in one or more batches; 5 batches of one event
    for consumer, at_least in [("good", 1), ("choosy", 5)]:
        count = series(prometheus, "outbox_delivery_duration_seconds_count", consumer)
        assert count is not None and count >= at_least
        buckets = prometheus(f'outbox_delivery_duration_seconds_bucket{{consumer="{consumer}", le="+Inf"}}')
        assert list(buckets.values()) == [count]
        assert series(prometheus, "outbox_delivery_duration_seconds_sum", consumer) > 0
    assert prometheus(f'outbox_worker_up{{database="{DB}"}}') == {(("database", DB),): 1.0}
    assert prometheus('up{job="outbox"}') == {(): 1.0}
    good.close()
    choosy.close()


def test_a_sink_down_shows_as_suspended_and_counts_one_suspension(served, prometheus):
    cluster, _ = served
    gone = Receiver()
    gone.close()                                    # nothing listens there: every request fails
    with cluster.connect(DB) as conn:
        create_sink(conn, "gone", "webhook", gone.url, aggregate_types=["gone"])
        emit(conn, "gone", ["x1", "x2"])

        def state(name: str) -> dict[str, float]:
            return {dict(k)["state"]: v for k, v in
                    prometheus(f'outbox_sink_state{{database="{DB}", consumer="{name}"}}').items()}
        wait_for(lambda: state("gone") == {"healthy": 0.0, "suspended": 1.0}, timeout=30)
        assert prometheus('outbox_sink_suspensions_total{consumer="gone"}') == {
            (("consumer", "gone"), ("database", DB)): 1.0}, "one suspension, however many probes failed"
        fine = Receiver()
        try:
            create_sink(conn, "fine", "webhook", fine.url, aggregate_types=["fine"])
            wait_for(lambda: state("fine") == {"healthy": 1.0, "suspended": 0.0}, timeout=30)
        finally:
            fine.close()
        conn.execute("SELECT outbox.drop_sink('gone'), outbox.drop_sink('fine')")


def test_a_batch_out_at_a_hung_sink_is_in_flight(served, prometheus):
    cluster, _ = served
    release = threading.Event()

    def hang(_request):
        release.wait(60)
        return 200, {}, b""

    slow = Receiver(hang)
    try:
        with cluster.connect(DB) as conn:
            create_sink(conn, "slow", "webhook", slow.url, aggregate_types=["slow"], request_timeout="60 s")
            emit(conn, "slow", ["s1"])
            wait_for(lambda: series(prometheus, "outbox_batches_in_flight", "slow") == 1, timeout=30)
            release.set()
            wait_for(lambda: series(prometheus, "outbox_batches_in_flight", "slow") == 0, timeout=30)
            wait_for(lambda: series(prometheus, "outbox_delivered_events_total", "slow") == 1, timeout=30)
    finally:
        release.set()
        slow.close()


def test_the_shipped_alerting_rules_load_and_a_dead_letter_fires_its_alert(served, prometheus):
    cluster, _ = served
    def rules():
        groups = json.loads(_get(f"{prometheus.api}/api/v1/rules"))["data"]["groups"]
        return {r["name"]: r for g in groups for r in g["rules"]}
    assert set(rules()) == {"OutboxConsumerLagging", "OutboxWorkerDown", "OutboxDeadLetters", "OutboxSinkSuspended"}
    with cluster.connect(DB) as conn:   # a relay gives up on an event: a dead letter
        conn.execute("SELECT outbox.create_consumer('giving_up')")
        emit(conn, "doomed", ["d1"])
        shard, epoch, event_id = conn.execute(
            "SELECT shard, epoch, id FROM outbox.claim('giving_up')").fetchone()
        conn.execute("SELECT outbox.reject('giving_up', %s, %s, %s, 'no')", (shard, epoch, event_id))
    wait_for(lambda: any(a["labels"].get("consumer") == "giving_up" and a["state"] == "firing"
                         for a in rules()["OutboxDeadLetters"]["alerts"]), timeout=30)
    assert all(r["health"] == "ok" for r in rules().values())
    assert rules()["OutboxWorkerDown"]["state"] == "inactive"


def test_the_endpoint_shows_no_url_or_secret_and_serves_only_metrics(served):
    cluster, port = served
    secret = "whsec_" + base64.b64encode(b"top-secret-key-that-must-not-leak").decode()
    with cluster.connect(DB) as conn:
        create_sink(conn, "hidden", "webhook", "http://127.0.0.1:9/private-path?token=t0p", secret=secret)
        wait_for(lambda: 'consumer="hidden"' in (_get(f"http://127.0.0.1:{port}/metrics") or ""), timeout=30)
    text = _get(f"http://127.0.0.1:{port}/metrics")
    assert text.endswith("# EOF\n")
    for leak in ("private-path", "t0p", secret, "127.0.0.1:9/"):
        assert leak not in text
    assert _status(f"http://127.0.0.1:{port}/other") == 404
    assert _status(f"http://127.0.0.1:{port}/metrics", "POST") == 405
    assert _status(f"http://127.0.0.1:{port}/metrics", "HEAD") == 405


def raw(port: int, data: bytes) -> bytes:
    """Sends data on a connection of its own; what came back until the server closed it."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(data)
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
        return reply


def test_hostile_clients_cannot_take_the_endpoint_or_the_worker(served):
    """A body announced as 70 TB, a head that never ends, clients that send nothing and a flood
    of connections: each is refused or cut off, the worker lives on, and scrapes go on."""
    cluster, port = served
    pid = cluster.worker_pid(DB)
    huge = raw(port, b"GET /metrics HTTP/1.1\r\nContent-Length: 70000000000000\r\n\r\n")
    assert huge.startswith(b"HTTP/1.1 400")
    endless = b"GET /metrics HTTP/1.1\r\nX-Filler: "
    endless = raw(port, endless + b"a" * (8192 - len(endless)))  # all of it read: a clean close
    assert endless.startswith(b"HTTP/1.1 431")
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10)]
    # a flood within the listen backlog (128): beyond it the kernel itself drops connections
    flood = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(100)]
    for s in flood:
        s.close()
    started = time.monotonic()
    assert _get(f"http://127.0.0.1:{port}/metrics").endswith("# EOF\n")  # once the silent ones time out
    assert time.monotonic() - started < 5 + 5
    for s in silent:
        s.close()
    assert cluster.worker_pid(DB) == pid
    assert "terminated by signal" not in cluster.log()  # no crash of the worker, no cluster restart


@pytest.mark.parametrize("major", MAJORS, ids=[f"pg{m}" for m in MAJORS])
@pytest.mark.parametrize("address", ["localhost-no-port", "taken"])
def test_a_bad_or_taken_address_is_a_warning_and_the_worker_delivers_on(major, address):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    if address == "taken":
        address = f"127.0.0.1:{taken.getsockname()[1]}"
    c = Cluster(major, {"outbox_ext.databases": f"'{DB}'",
                        "outbox_ext.metrics_address": f"'{address}'"}).init()
    c.start()
    receiver = Receiver()
    try:
        with c.connect() as conn:
            conn.execute(f"CREATE DATABASE {DB}")
        with c.connect(DB) as conn:
            conn.execute("CREATE EXTENSION outbox_ext")  # makes the worker's role: it starts
            wait_for(lambda: "outbox_ext worker: no metrics:" in c.log(), timeout=30)
            create_sink(conn, "hook", "webhook", receiver.url)
            emit(conn, "any", ["a1"])
            wait_for(lambda: len(receiver.accepted_events()) == 1, timeout=30)
        assert c.log().count("outbox_ext worker: no metrics:") == 1
    finally:
        receiver.close()
        taken.close()
        c.destroy()


def test_a_restarted_worker_serves_again_and_prometheus_sees_it_back(served, prometheus):
    cluster, port = served
    with cluster.connect(DB) as conn:
        conn.execute("SELECT outbox.create_consumer('watcher')")
    wait_for(lambda: series(prometheus, "outbox_pending_events", "watcher") == 0, timeout=30)
    old = cluster.worker_pid(DB)
    with cluster.connect() as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (old,))
    wait_for(lambda: cluster.worker_pid(DB) not in (None, old), timeout=60)
    with cluster.connect(DB) as conn:
        emit(conn, "watched", ["w1", "w2"])
    # the new worker listens on the same port, and its figures reach Prometheus
    wait_for(lambda: series(prometheus, "outbox_pending_events", "watcher") == 2, timeout=30)
    assert prometheus('up{job="outbox"}') == {(): 1.0}
