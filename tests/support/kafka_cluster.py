"""A real Apache Kafka 4.4 cluster for the tests: three KRaft nodes on loopback, each broker and
controller at once (combined mode, static quorum), from the jars scripts/kafka.sh fetch_kafka
copies into target/kafka/libs.

Every node listens on PLAINTEXT, SASL_PLAINTEXT and SASL_SSL (SCRAM-SHA-256, SCRAM-SHA-512 and
PLAIN, one user for all), plus its CONTROLLER listener. Topics are never created on use; they
are replicated 3 times with min.insync.replicas 2, so acks=all survives one node down. ACLs
are enforced (StandardAuthorizer), open unless one says otherwise. A node
can be killed (SIGKILL), stopped (SIGTERM), paused (SIGSTOP) and started again on its log on
disk, at the same ports. Each node's data and log (server.log, appended to over restarts) are under `directory`.
"""

from __future__ import annotations

import base64
import signal
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import (AclBinding, AclBindingFilter, AclOperation, AclPermissionType, AdminClient,
                                    AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic, ResourcePatternType,
                                    ResourceType)

from .pgcluster import free_port

ROOT = Path(__file__).resolve().parent.parent.parent
KAFKA_SH = ROOT / "scripts/kafka.sh"
LIBS = ROOT / "target/kafka/libs"
LISTENERS = ("PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN")
# Small heaps (three JVMs beside PostgreSQL on 2 cores); the C1 compiler alone starts faster and
# costs less CPU, and the serial collector one thread, which is all short tests need. setpriv
# (util-linux) has the kernel SIGKILL the JVM when the thread that started it ends, so that a
# test process killed, or ended without close(), leaves no broker behind on its ports.
JVM = ["setpriv", "--pdeathsig", "KILL", "java", "-Xms64m", "-Xmx384m", "-XX:+UseSerialGC",
       "-XX:TieredStopAtLevel=1", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true"]
# The broker logs through log4j2 (scripts/kafka/pom.xml adds the SLF4J binding) to stdout, which
# goes with the JVM's own stderr (a crash, an OOM) to the node's server.log.
LOG4J2 = """\
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.out.ref = out
"""


class KafkaCluster:
    """Three KRaft nodes, ids 1, 2 and 3, started and ready (every node in the metadata) when
    the constructor returns; close() kills them and removes their directory."""

    user = "outbox"
    password = "outbox-secret"
    store_password = "outbox-store"   # of the SASL_SSL listener's PKCS12 keystore and truststore
    nodes = (1, 2, 3)

    def __init__(self, start_timeout: float = 90.0):
        subprocess.run(["bash", str(KAFKA_SH), "fetch_kafka"], check=True, timeout=600)
        self.directory = Path(tempfile.mkdtemp(prefix="outbox-kafka-"))
        self.processes: dict[int, subprocess.Popen | None] = dict.fromkeys(self.nodes)
        try:
            certs = self.directory / "certs"
            subprocess.run(["bash", str(KAFKA_SH), "kafka_certs", str(certs), self.store_password],
                           check=True, timeout=60)
            self.ca_pem = certs / "ca.pem"
            # ports fixed for the cluster's life: the quorum is static, a restarted node comes
            # back where its peers and the clients expect it
            self.ports = {n: {name: free_port() for name in (*LISTENERS, "CONTROLLER")} for n in self.nodes}
            (self.directory / "log4j2.properties").write_text(LOG4J2)
            for n in self.nodes:
                (self.directory / f"node{n}").mkdir()
                self._properties(n).write_text(
                    "".join(f"{k}={v}\n" for k, v in self._settings(n, certs).items()))
            self._format()
            self._admin = AdminClient({**self.client_config(), "log_level": 2})
            for n in self.nodes:
                self._launch(n)
            self.wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise

    # --- what clients need -------------------------------------------------------------------

    def bootstrap(self, listener: str = "PLAINTEXT") -> str:
        """host:port of every node on that listener (PLAINTEXT, SASL_PLAINTEXT or SASL_SSL)."""
        return ",".join(f"127.0.0.1:{self.ports[n][listener]}" for n in self.nodes)

    def client_config(self, listener: str = "PLAINTEXT", mechanism: str | None = None,
                      password: str | None = None) -> dict[str, str]:
        """librdkafka settings to reach the cluster on that listener; on a SASL one as the
        cluster's user, with mechanism (SCRAM-SHA-512 unless told) and password (another one,
        to be refused)."""
        config = {"bootstrap.servers": self.bootstrap(listener), "security.protocol": listener}
        if listener != "PLAINTEXT":
            config |= {"sasl.mechanism": mechanism or "SCRAM-SHA-512", "sasl.username": self.user,
                       "sasl.password": password or self.password}
        if listener == "SASL_SSL":
            config["ssl.ca.location"] = str(self.ca_pem)
        return config

    def admin(self):
        """The cluster's admin client (PLAINTEXT). One for the cluster's life: a client dropped
        while a request is under way fails it (_DESTROY). It logs only critical errors, not the
        refused connections of every wait for a node to start."""
        return self._admin

    def create_topic(self, name: str, partitions: int, rf: int = 3, timeout: float = 30.0,
                     config: dict[str, str] | None = None) -> None:
        """Create the topic (with topic-level config, if given) and wait until every partition
        has a leader."""
        self.admin().create_topics([NewTopic(name, partitions, rf, config=config or {})])[name].result(timeout)
        self._wait(lambda: self._leaders(name) == partitions, timeout, f"leaders of topic {name}")

    def set_topic_config(self, name: str, key: str, value: str, timeout: float = 30.0) -> None:
        """Sets one topic-level setting (an incremental alter, as kafka-configs.sh does)."""
        entry = ConfigEntry(key, value, incremental_operation=AlterConfigOpType.SET)
        resource = ConfigResource(ConfigResource.Type.TOPIC, name, incremental_configs=[entry])
        self.admin().incremental_alter_configs([resource])[resource].result(timeout)

    def delete_topic(self, name: str, timeout: float = 30.0) -> None:
        """Delete the topic and wait until the metadata no longer shows it."""
        self.admin().delete_topics([name])[name].result(timeout)
        self._wait(lambda: name not in self.admin().list_topics(timeout=5).topics, timeout,
                   f"deletion of topic {name}")

    def deny_write(self, topic: str) -> AclBinding:
        """An ACL that denies the cluster's SASL user writes to the topic; see allow."""
        acl = AclBinding(ResourceType.TOPIC, topic, ResourcePatternType.LITERAL, f"User:{self.user}",
                         "*", AclOperation.WRITE, AclPermissionType.DENY)
        self.admin().create_acls([acl])[acl].result(30)
        return acl

    def allow(self, acl: AclBinding) -> None:
        """Drop an ACL deny_write made."""
        match = AclBindingFilter(acl.restype, acl.name, acl.resource_pattern_type, acl.principal, acl.host,
                                 acl.operation, acl.permission_type)
        self.admin().delete_acls([match])[match].result(30)

    def wait_in_sync(self, topic: str, timeout: float = 30.0) -> None:
        """Wait until every replica of every partition of the topic is in its ISR: a restarted
        node has caught up, another may be killed without leaving a partition short."""
        def in_sync():
            partitions = self.admin().list_topics(topic, timeout=5).topics[topic].partitions
            return all(sorted(p.isrs) == sorted(p.replicas) for p in partitions.values())
        self._wait(in_sync, timeout, f"every replica of topic {topic} in sync")

    def leader(self, topic: str, partition: int) -> int:
        """The node that leads the partition now (waited for: a topic just made may not be in
        the metadata the broker answers with yet, or have no leader yet)."""
        found: list[int] = []

        def led():
            partitions = self.admin().list_topics(topic, timeout=10).topics[topic].partitions
            found[:] = [partitions[partition].leader] if partition in partitions else []
            return bool(found) and found[0] >= 0
        self._wait(led, 30, f"a leader of partition {partition} of topic {topic}")
        return found[0]

    def read(self, topic: str, expect: int, timeout: float = 30.0) -> list[dict]:
        """Every record of the topic, in (partition, offset) order, each as partition, offset,
        key, value (bytes), headers (a dict) and header_list (name, value pairs in order):
        read from the beginning of every partition until at least `expect` were read and every
        partition is read to its end, or until timeout (what was read is returned, for the
        caller to assert on)."""
        partitions = self.admin().list_topics(topic, timeout=10).topics[topic].partitions
        # the end of each partition shows as an EOF event; a broker answers a fetch at the end
        # after fetch.wait.max.ms (500 ms by default): 50 ms makes that end show sooner
        consumer = Consumer({**self.client_config(), "group.id": f"read-{uuid.uuid4()}",
                             "enable.auto.commit": False, "enable.partition.eof": True,
                             "fetch.wait.max.ms": 50})
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        records, at_end, deadline = [], set(), time.monotonic() + timeout
        try:
            while (len(records) < expect or at_end != set(partitions)) and time.monotonic() < deadline:
                m = consumer.poll(0.2)
                if m is None:
                    continue
                if m.error():
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        at_end.add(m.partition())
                    continue
                at_end.discard(m.partition())
                records.append({"partition": m.partition(), "offset": m.offset(), "key": m.key(),
                                "value": m.value(), "headers": dict(m.headers() or []),
                                "header_list": list(m.headers() or [])})
        finally:
            consumer.close()
        return sorted(records, key=lambda r: (r["partition"], r["offset"]))

    # --- nodes -------------------------------------------------------------------------------

    def kill(self, node: int) -> None:
        """SIGKILL: a crash, nothing flushed, no controlled shutdown."""
        process = self.processes[node]
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        self.processes[node] = None

    def stop(self, node: int, timeout: float = 30.0) -> None:
        """SIGTERM: a controlled shutdown (leaders moved away first); SIGKILL if it takes longer
        than timeout, and TimeoutExpired raised."""
        process = self.processes[node]
        process.terminate()
        try:
            process.wait(timeout)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
            self.processes[node] = None

    def start(self, *nodes: int, timeout: float = 60.0) -> None:
        """Start killed or stopped nodes on their logs on disk, together (a quorum of
        controllers must be up before any of them is ready), and wait until they are ready."""
        for node in nodes:
            assert self.processes[node] is None, f"node {node} is running"
            self._launch(node)
        self.wait_ready(timeout)

    def pause(self, *nodes: int) -> None:
        """SIGSTOP: the nodes hold every request they took, as a stalled machine does."""
        for node in nodes:
            self.processes[node].send_signal(signal.SIGSTOP)

    def resume(self, *nodes: int) -> None:
        for node in nodes:
            self.processes[node].send_signal(signal.SIGCONT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until every running node answers on its PLAINTEXT listener with metadata that
        shows exactly the running nodes as brokers. A Kafka 4.4 broker opens its listeners only
        once the controller has unfenced it (it has caught up with the metadata log), so a node
        that answers is ready; each node is asked itself because after a kill the others go on
        showing the dead node's registration until its session times out (3 s). A node whose
        process exits fails at once."""
        def ready():
            for n, process in self.processes.items():
                if process is not None and process.poll() is not None:
                    raise AssertionError(f"Kafka node {n} exited with {process.returncode}\n{self._tail(n)}")
            running = {n for n, p in self.processes.items() if p is not None}
            return all(self._brokers(n) == running for n in running)
        self._wait(ready, timeout, "Kafka nodes ready")

    def log_file(self, node: int) -> Path:
        return self.directory / f"node{node}/server.log"

    def close(self) -> None:
        for process in self.processes.values():
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)
        self.processes = dict.fromkeys(self.nodes)
        shutil.rmtree(self.directory, ignore_errors=True)

    # --- inside ------------------------------------------------------------------------------

    def _properties(self, node: int) -> Path:
        return self.directory / f"node{node}/server.properties"

    def _settings(self, node: int, certs: Path) -> dict[str, object]:
        ports = self.ports[node]
        plain_users = f'user_{self.user}="{self.password}"'
        settings = {
            "process.roles": "broker,controller",
            "node.id": node,
            "controller.quorum.voters": ",".join(
                f"{n}@127.0.0.1:{self.ports[n]['CONTROLLER']}" for n in self.nodes),
            "controller.listener.names": "CONTROLLER",
            "listeners": ",".join(f"{name}://127.0.0.1:{port}" for name, port in ports.items()),
            "advertised.listeners": ",".join(f"{name}://127.0.0.1:{ports[name]}" for name in LISTENERS),
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,"
                                              "SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": self.directory / f"node{node}/data",
            "sasl.enabled.mechanisms": ",".join(MECHANISMS),
            # a cluster of 3 that keeps taking acks=all writes with one node down, as in production
            "default.replication.factor": 3,
            "min.insync.replicas": 2,
            "auto.create.topics.enable": "false",
            # ACLs as in production, open by default: what no ACL names is allowed to all,
            # and the brokers and the tests' own clients (PLAINTEXT: User:ANONYMOUS) may do
            # anything, so a test can deny the sink's user one topic (deny_write)
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found": "true",
            "super.users": "User:ANONYMOUS",
            "offsets.topic.replication.factor": 3,
            "transaction.state.log.replication.factor": 3,
            "transaction.state.log.min.isr": 2,
            # fewer internal partitions: created on a client's first use, each one costs time
            "offsets.topic.num.partitions": 3,
            "transaction.state.log.num.partitions": 3,
            "group.initial.rebalance.delay.ms": 0,
            # a dead node is fenced (and dropped from every ISR, so acks=all goes on without it)
            # after 3 s instead of 9; a SIGTERM's controlled shutdown is bounded by it too
            "broker.heartbeat.interval.ms": 500,
            "broker.session.timeout.ms": 3000,
            # threads and memory for 2 cores and a 384 MB heap (the cleaner's default is 128 MB)
            "num.network.threads": 2,
            "num.io.threads": 2,
            "background.threads": 2,
            "log.cleaner.dedupe.buffer.size": 8 * 1024 * 1024,
        }
        for listener in ("sasl_plaintext", "sasl_ssl"):
            prefix = f"listener.name.{listener}"
            for mechanism in ("scram-sha-256", "scram-sha-512"):
                settings[f"{prefix}.{mechanism}.sasl.jaas.config"] = \
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            settings[f"{prefix}.plain.sasl.jaas.config"] = \
                f"org.apache.kafka.common.security.plain.PlainLoginModule required {plain_users};"
        for store in ("keystore", "truststore"):
            settings[f"listener.name.sasl_ssl.ssl.{store}.type"] = "PKCS12"
            settings[f"listener.name.sasl_ssl.ssl.{store}.password"] = self.store_password
        settings["listener.name.sasl_ssl.ssl.keystore.location"] = certs / "broker.p12"
        settings["listener.name.sasl_ssl.ssl.truststore.location"] = certs / "truststore.p12"
        return settings

    def _format(self) -> None:
        """Format every node's log directory with the cluster's id and the SCRAM credentials
        (SCRAM users live in the metadata log; PLAIN's are in the JAAS settings), in parallel:
        each is a JVM start."""
        # Kafka's Uuid.randomUuid: base64url of 16 random bytes, never starting with '-'
        cluster_id = "-"
        while cluster_id.startswith("-"):
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        scram = [arg for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512") for arg in
                 ("--add-scram", f"{mechanism}=[name={self.user},password={self.password}]")]
        formats = [subprocess.Popen([*JVM, "-cp", f"{LIBS}/*", "kafka.tools.StorageTool", "format",
                                     "-t", cluster_id, "-c", str(self._properties(n)), *scram],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for n in self.nodes]
        try:
            for n, f in zip(self.nodes, formats):
                out, _ = f.communicate(timeout=60)
                assert f.returncode == 0, f"formatting Kafka node {n} failed:\n{out}"
        finally:
            for f in formats:
                if f.poll() is None:
                    f.kill()
                    f.wait()

    def _launch(self, node: int) -> None:
        with open(self.log_file(node), "ab") as log:
            self.processes[node] = subprocess.Popen(
                [*JVM, f"-Dlog4j2.configurationFile={self.directory / 'log4j2.properties'}",
                 "-cp", f"{LIBS}/*", "kafka.Kafka", str(self._properties(node))],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def _brokers(self, node: int) -> set[int]:
        """Ids of the brokers that node's metadata shows; none while it does not answer. A
        client of its own, that knows no other node, asks it and no other."""
        admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{self.ports[node]['PLAINTEXT']}",
                             "log_level": 2})
        try:
            return set(admin.list_topics(timeout=2).brokers)
        except KafkaException:
            return set()

    def _leaders(self, topic: str) -> int:
        """How many partitions of the topic have a leader (0 while the topic is not known)."""
        t = self.admin().list_topics(topic, timeout=5).topics.get(topic)
        if t is None or t.error is not None:
            return 0
        return sum(p.leader >= 0 for p in t.partitions.values())

    def _tail(self, node: int, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file(node).read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def _wait(self, what, timeout: float, name: str) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- node {n}:\n{self._tail(n)}" for n in self.nodes)
                raise TimeoutError(f"timed out after {timeout} s waiting for {name}\n{tails}")
            time.sleep(0.2)
