"""Debezium 3.6.1's embedded engine with its outbox event router, configured exactly as the
Kafka guide says (its properties block is read from docs/guides/kafka.md), producing to Kafka as
a Connect worker would (support/debezium/OutboxRouter.java). The jars come from Maven Central
through scripts/kafka.sh fetch_debezium.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
LIBS = ROOT / "target/debezium/libs"
PROGRAM = Path(__file__).resolve().parent / "debezium/OutboxRouter.java"
KAFKA_SH = ROOT / "scripts/kafka.sh"


def guide_properties() -> dict[str, str]:
    """The connector's properties as the Kafka guide shows them (its first ```properties
    block), so that the configuration users copy is the one tested."""
    text = (ROOT / "docs/guides/kafka.md").read_text()
    block = re.search(r"```properties\n(.*?)```", text, re.S).group(1)
    pairs = (line.split("=", 1) for line in block.splitlines() if line.strip() and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


@contextlib.contextmanager
def guide_slot(conn):
    """The Kafka guide's publication, and its slot made now (Debezium, with snapshot.mode no_data,
    starts from the slot: it reads what is committed from here on); both dropped at the end,
    once Debezium has let go of the slot."""
    props = guide_properties()
    publication, slot = props["publication.name"], props["slot.name"]
    conn.execute(f"CREATE PUBLICATION {publication} FOR TABLE outbox.events "
                 "WITH (publish = 'insert', publish_via_partition_root = true)")
    conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    try:
        yield
    finally:
        deadline = time.monotonic() + 30
        while conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s",
                           (slot,)).fetchone()[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.execute(f"DROP PUBLICATION {publication}")


def run_outbox_router(pg_port: int, dbname: str, bootstrap: str, expect: int, topic_prefix: str = "",
                      timeout: float = 180.0) -> float:
    """Runs Debezium on the Kafka guide's configuration against dbname (its publication and slot,
    named there, must exist) until it has produced `expect` records to Kafka, each topic the
    router picks prefixed with topic_prefix. Returns the seconds from its first record to
    its last ack."""
    return wait_outbox_router(start_outbox_router(pg_port, dbname, bootstrap, expect, topic_prefix), timeout)


def start_outbox_router(pg_port: int, dbname: str, bootstrap: str, expect: int,
                        topic_prefix: str = "") -> subprocess.Popen:
    """run_outbox_router, started: wait for it with wait_outbox_router."""
    subprocess.run(["bash", str(KAFKA_SH), "fetch_debezium"], check=True, timeout=600)
    work = Path(tempfile.mkdtemp(prefix="outbox-debezium-"))
    settings = {
        **guide_properties(),
        # where the database is, and what the guide leaves to the deployment
        "name": "outbox-cdc",
        "topic.prefix": "outbox",
        "database.hostname": "127.0.0.1",
        "database.port": str(pg_port),
        "database.user": "postgres",
        "database.password": "unused",   # the test clusters trust local connections
        "database.dbname": dbname,
        "offset.storage": "org.apache.kafka.connect.storage.MemoryOffsetBackingStore",
        "offset.flush.interval.ms": "1000",
    }
    (work / "connector.properties").write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    process = subprocess.Popen(
        ["java", "-Xmx512m", "-XX:TieredStopAtLevel=1", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
         "-cp", f"{LIBS}/*", str(PROGRAM), str(work / "connector.properties"), bootstrap, topic_prefix,
         str(expect)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=work)
    process.work = work   # removed by wait_outbox_router
    return process


def wait_outbox_router(process: subprocess.Popen, timeout: float = 180.0) -> float:
    """Waits for a started router to produce what it expects; the seconds from its first
    record to its last ack."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"Debezium did not produce what it expected in {timeout} s:\n{out}\n{err[-4000:]}")
    finally:
        shutil.rmtree(process.work, ignore_errors=True)
    assert process.returncode == 0, f"Debezium failed ({process.returncode}):\n{out}\n{err[-4000:]}"
    seconds = re.search(r"produced \d+ in ([0-9.]+) s", out)
    assert seconds, out
    return float(seconds.group(1))
