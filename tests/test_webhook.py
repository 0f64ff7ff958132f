"""The background worker delivering to real HTTP(S) webhook receivers: batches and single
events, signatures checked with the Standard Webhooks reference library, verified TLS, wake at
commit, retries with Retry-After, dead letters for 4xx, routing, and changes without restart."""

from __future__ import annotations

import hashlib
import json
import statistics
import threading
import time
from collections import defaultdict

import pytest
from standardwebhooks.webhooks import Webhook

from support.events import emit
from support.peers import Receiver, certificates, check_delivery, wait_for

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def sink_status(conn, sink: str) -> dict:
    cur = conn.execute("SELECT * FROM outbox.status WHERE consumer = %s", (sink,))
    row = cur.fetchone()
    return dict(zip([d.name for d in cur.description], row))


def test_batches_arrive_signed_in_per_key_order_and_rolled_back_events_never(conn, new_sink, receiver):
    sink = new_sink("webhook", receiver.url + "/hooks", secret=SECRET, batch_size=20)
    emitted = defaultdict(list)
    with conn.transaction():                       # several keys in one transaction
        for k in range(5):
            emitted[f"a{k}"] += emit(conn, f"a{k}", 3)
    for k in range(5):                             # and one transaction per event
        emitted[f"a{k}"] += emit(conn, f"a{k}", 4)
    with pytest.raises(RuntimeError), conn.transaction():
        emit(conn, "a0", 2)
        raise RuntimeError("roll back")
    wait_for(lambda: len(receiver.accepted_events()) >= 35)
    time.sleep(0.3)
    check_delivery(emitted, receiver.accepted_events())
    verifier = Webhook(SECRET)
    for request in receiver.requests:
        verifier.verify(request.body, request.headers)   # raises if the signature is wrong
        assert request.path == "/hooks"
        ids = [e["id"] for e in request.events()]
        want = ids[0] if len(ids) == 1 else "batch_" + hashlib.sha256(",".join(ids).encode()).hexdigest()[:32]
        assert request.headers["webhook-id"] == request.headers["idempotency-key"] == want
        assert int(request.headers["outbox-event-count"]) == len(request.events())
    assert max(len(r.events()) for r in receiver.requests) > 1, "batched"
    status = wait_for(lambda: (s := sink_status(conn, sink))["delivered_total"] == 35 and s)
    assert status["pending"] == 0 and status["sink_kind"] == "webhook"


def test_a_wrong_secret_fails_verification(conn, new_sink, receiver):
    new_sink("webhook", receiver.url, secret="whsec_" + "A" * 32)
    emit(conn, "w1")
    wait_for(lambda: receiver.requests)
    with pytest.raises(Exception):
        Webhook(SECRET).verify(receiver.requests[0].body, receiver.requests[0].headers)


def test_single_events_carry_their_own_id(conn, new_sink, receiver):
    new_sink("webhook", receiver.url, format="single")
    ids = emit(conn, "s1", 5)
    wait_for(lambda: len(receiver.requests) >= 5)
    assert [r.headers["webhook-id"] for r in receiver.requests] == ids
    assert all(isinstance(json.loads(r.body), dict) for r in receiver.requests)


def test_the_worker_is_woken_at_commit(conn, new_sink, receiver):
    new_sink("webhook", receiver.url)
    time.sleep(1.5)                                # the worker is idle, in its long sleep
    latencies = []
    for i in range(8):
        before = len(receiver.requests)
        t0 = time.time()
        emit(conn, f"l{i}")
        wait_for(lambda: len(receiver.requests) > before, timeout=5, every=0.002)
        latencies.append(receiver.requests[-1].at - t0)
        time.sleep(0.37)                            # out of step with any poll timer
    # the fallback poll runs once a second: waiting for it would average about 0.5 s
    assert statistics.median(latencies) < 0.15, latencies


def test_tls_is_verified_against_the_configured_ca(conn, new_sink, tmp_path):
    certs = certificates(tmp_path)
    server = Receiver(tls=(certs["server"], certs["key"]))
    try:
        trusting = new_sink("webhook", server.url, tls_ca=certs["ca"].read_text())
        doubting = new_sink("webhook", server.url, tls_ca=certs["other_ca"].read_text())
        public = new_sink("webhook", server.url)   # the public roots do not know the test CA
        emit(conn, "tls1", 3)
        wait_for(lambda: len(server.accepted_events()) == 3)
        for sink in (doubting, public):
            status = wait_for(lambda: (s := sink_status(conn, sink))["last_sink_error"] and s)
            assert "certificate" in status["last_sink_error"].lower() or "tls" in status["last_sink_error"].lower()
            assert status["pending"] == 3 and status["dead_letters"] == 0, "an untrusted peer gets nothing, nothing is lost"
        wait_for(lambda: sink_status(conn, trusting)["pending"] == 0, timeout=5)
    finally:
        server.close()


def test_5xx_and_408_are_retried_honouring_retry_after_and_order_holds(conn, new_sink):
    answers = {"n": 0}

    def flaky(request):
        answers["n"] += 1
        if answers["n"] == 1:
            return 503, {"retry-after": "2"}, b"maintenance"
        if answers["n"] in (2, 3):
            return (500 if answers["n"] == 2 else 408), {}, b"oops"
        return 200, {}, b""
    receiver = Receiver(flaky)
    try:
        sink = new_sink("webhook", receiver.url, batch_size=10)
        t0 = time.time()
        emitted = {"r1": emit(conn, "r1", 4), "r2": emit(conn, "r2", 4)}
        wait_for(lambda: len(receiver.accepted_events()) >= 8, timeout=30)
        assert receiver.requests[0].at - t0 >= 1.9, "Retry-After: 2 was honoured"
        check_delivery(emitted, receiver.accepted_events())
        # every request failed while they lasted: the sink's fault, no attempt spent
        assert all(e["attempt"] == 1 for e in receiver.accepted_events()), "no attempt was counted"
        assert sink_status(conn, sink)["dead_letters"] == 0
    finally:
        receiver.close()


def test_4xx_is_dead_lettered_and_the_key_moves_on(conn, new_sink):
    receiver = Receiver(lambda r: (422, {}, b"bad event") if any(e["payload"].get("bad") for e in r.events())
                        else (200, {}, b""))
    try:
        sink = new_sink("webhook", receiver.url, format="single")
        good = emit(conn, "d1", payload={"n": 1})
        bad = emit(conn, "d1", payload={"bad": True})
        later = emit(conn, "d1", payload={"n": 3}) + emit(conn, "d2", 2)
        wait_for(lambda: len(receiver.accepted_events()) == 4)
        assert [e["id"] for e in receiver.accepted_events() if e["aggregate_id"] == "d1"] == good + later[:1]
        dead = conn.execute("SELECT event_id::text, last_error FROM outbox.dead_letters WHERE consumer = %s",
                            (sink,)).fetchall()
        assert [d[0] for d in dead] == bad and "422" in dead[0][1]
    finally:
        receiver.close()


def test_an_event_refused_in_a_batch_takes_no_batch_mate_with_it(conn, new_sink):
    """A receiver answers 422 to a whole batch for the one event of it that it will never take.
    Only that event is dead-lettered (the request is split until the event is alone), and every
    other key's events arrive in order. (Once a request started later had gone through, the
    first event of every key in that batch was dead-lettered with it.)"""
    def answer(r):
        if any(e["payload"].get("bad") for e in r.events()):
            time.sleep(0.3)        # requests started after it go through first: shown healthy
            return 422, {}, b"unknown field: bad"
        return 200, {}, b""
    receiver = Receiver(answer)
    try:
        sink = new_sink("webhook", receiver.url, batch_size=50)
        emitted = defaultdict(list)
        for wave in range(3):
            with conn.transaction():
                for k in range(40):
                    emitted[f"w{k}"] += emit(conn, f"w{k}", payload={"wave": wave})
                if wave == 0:
                    bad = emit(conn, "poison", payload={"bad": True})
                    emitted["poison"] += emit(conn, "poison", payload={"after": True})
            time.sleep(0.1)
        wait_for(lambda: len({e["id"] for e in receiver.accepted_events()}) >= 121, timeout=30)
        dead = conn.execute("SELECT event_id::text FROM outbox.dead_letters WHERE consumer = %s",
                            (sink,)).fetchall()
        assert [d[0] for d in dead] == bad
        check_delivery(emitted, receiver.accepted_events())
    finally:
        receiver.close()


def test_routing_by_topic_and_aggregate_type(conn, new_sink, receiver):
    new_sink("webhook", receiver.url, topics=["billing"])
    wanted = emit(conn, "t1", 2, topic="billing")
    emit(conn, "t1", 2, topic="shipping")
    emit(conn, "t2", 1)
    wanted += emit(conn, "t3", 1, topic="billing")
    time.sleep(1.5)
    assert sorted(e["id"] for e in receiver.accepted_events()) == sorted(wanted)


def test_sink_changes_apply_without_a_restart(conn, new_sink, receiver):
    sink = new_sink("webhook", receiver.url)
    emit(conn, "c1")
    wait_for(lambda: len(receiver.requests) == 1)
    other = Receiver()
    try:
        conn.execute("UPDATE outbox.sinks SET url = %s, format = 'single' WHERE name = %s", (other.url, sink))
        time.sleep(1.5)
        ids = emit(conn, "c1", 2)
        wait_for(lambda: len(other.requests) == 2)
        assert [r.headers["webhook-id"] for r in other.requests] == ids
        conn.execute("UPDATE outbox.sinks SET enabled = false WHERE name = %s", (sink,))
        time.sleep(1.5)
        emit(conn, "c1")
        time.sleep(1.5)
        assert len(other.requests) == 2 and len(receiver.requests) == 1, "a disabled sink gets nothing"
        assert sink_status(conn, sink)["pending"] == 1, "and keeps its events"
    finally:
        other.close()


def test_big_payloads_are_delivered_in_smaller_batches(conn, new_sink, receiver):
    new_sink("webhook", receiver.url, batch_size=100)
    big = "x" * 900_000
    ids = [conn.execute("SELECT outbox.emit('order', %s, 'big', jsonb_build_object('blob', %s::text))::text",
                        (f"big{i % 3}", big)).fetchone()[0] for i in range(40)]
    wait_for(lambda: len(receiver.accepted_events()) >= 40, timeout=60)
    assert sorted(e["id"] for e in receiver.accepted_events()) == sorted(ids)
    assert all(e["payload"]["blob"] == big for e in receiver.accepted_events())
    # once a claim has seen how big they are, claims take about 8 MB of events at a time: only
    # the first claim may be bigger (its request need not arrive first: several are in flight)
    assert sum(len(r.events()) > 10 for r in receiver.requests) <= 1, \
        [len(r.events()) for r in receiver.requests]


def test_a_changed_sink_keeps_the_claim_size_learned_from_big_events(conn, new_sink, receiver):
    """Changing a sink (any UPDATE of its row) gives the worker a new client, not a first claim
    of batch_size big events in one request."""
    sink = new_sink("webhook", receiver.url, batch_size=100, concurrency=1)
    big = "x" * 900_000

    def emit_big(n: int) -> None:   # one key (one shard), one transaction: one claim sees them all
        with conn.transaction():
            for _ in range(n):
                conn.execute("SELECT outbox.emit('order', 'big', 'big', jsonb_build_object('blob', %s::text))",
                             (big,))
    emit_big(12)
    wait_for(lambda: len(receiver.accepted_events()) >= 12, timeout=60)   # learned: ~9 at a time
    conn.execute("UPDATE outbox.sinks SET http_headers = '{\"x-gen\": \"2\"}', updated_at = now() "
                 "WHERE name = %s", (sink,))
    before = len(receiver.requests)
    time.sleep(2)                   # the worker rereads changed sinks within a second
    emit_big(30)
    wait_for(lambda: len(receiver.accepted_events()) >= 42, timeout=60)
    after = receiver.requests[before:]
    # every request of the 30 went out through the new client (else this proves nothing) ...
    assert all(r.headers.get("x-gen") == "2" for r in after), [r.headers.get("x-gen") for r in after]
    # ... and none carried a claim of batch_size big events
    assert max(len(r.events()) for r in after) <= 10, [len(r.events()) for r in after]


def test_no_transaction_is_open_while_a_request_is_out(conn, new_sink):
    in_request = threading.Event()

    def slow(request):
        in_request.set()
        time.sleep(1.5)
        return 200, {}, b""
    receiver = Receiver(slow)
    try:
        new_sink("webhook", receiver.url)
        emit(conn, "slow1")
        assert in_request.wait(10)
        time.sleep(0.2)
        worker = conn.execute(
            "SELECT a.pid, a.state, a.xact_start, a.backend_xid, a.query FROM pg_stat_activity a "
            "WHERE a.backend_type = 'outbox_ext worker' AND a.datname = current_database()").fetchone()
        assert worker[1] == "active" and worker[4].startswith("delivering: 1 batch"), worker
        assert worker[2] is None and worker[3] is None, "no transaction while the request is out"
        locks = conn.execute("SELECT locktype, relation::regclass::text, mode FROM pg_locks "
                             "WHERE pid = %s AND locktype <> 'virtualxid'", (worker[0],)).fetchall()
        assert locks == [], "no lock at all while the request is out"
    finally:
        receiver.close()


def test_an_unresolvable_host_is_reported_and_loses_nothing(conn, new_sink):
    sink = new_sink("webhook", "http://no-such-host.invalid/hooks", connect_timeout="1 s")
    emit(conn, "dns1", 2)
    status = wait_for(lambda: (s := sink_status(conn, sink))["last_sink_error"] and s)
    assert "no-such-host.invalid" in status["last_sink_error"], "the error names the host (not the path)"
    assert status["pending"] == 2 and status["dead_letters"] == 0


def test_a_request_too_large_is_split_not_dead_lettered(conn, new_sink):
    receiver = Receiver(lambda r: (413, {}, b"too large") if len(r.events()) > 3 else (200, {}, b""))
    try:
        sink = new_sink("webhook", receiver.url, batch_size=20)
        with conn.transaction():
            emitted = {f"big{k}": emit(conn, f"big{k}", 4) for k in range(4)}
        wait_for(lambda: len(receiver.accepted_events()) >= 16)
        check_delivery(emitted, receiver.accepted_events())
        assert max(len(r.events()) for r in receiver.requests) <= 3
        assert sink_status(conn, sink)["dead_letters"] == 0
    finally:
        receiver.close()
