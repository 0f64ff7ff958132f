#!/usr/bin/env bash
# Apache Kafka for the tests' KafkaCluster (tests/support/kafka_cluster.py) and Debezium for
# tests/support/debezium.py: their jars from Maven Central, and the test CA and stores of the
# cluster's SASL_SSL listener. Everything lands under target/. Source it, or run it with a
# function's name and its arguments:
#   scripts/kafka.sh fetch_kafka
#   scripts/kafka.sh fetch_debezium
#   scripts/kafka.sh kafka_certs DIR [PASSWORD]
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

KAFKA_POM="$ROOT/scripts/kafka/pom.xml"
KAFKA_LIBS="$TARGET/kafka/libs"
DEBEZIUM_POM="$ROOT/scripts/debezium/pom.xml"
DEBEZIUM_LIBS="$TARGET/debezium/libs"

# The broker, its tools and a logging binding, with every runtime dependency, as jars in
# target/kafka/libs (run with `java -cp 'target/kafka/libs/*'`).
fetch_kafka() {
    fetch_jars "$KAFKA_POM" "$KAFKA_LIBS" "Apache Kafka"
}

# Debezium's embedded engine, PostgreSQL connector and outbox event router, with every runtime
# dependency, as jars in target/debezium/libs (tests/support/debezium.py runs them).
fetch_debezium() {
    fetch_jars "$DEBEZIUM_POM" "$DEBEZIUM_LIBS" "Debezium"
}

# fetch_jars POM DIR NAME: the jars POM lists, and their runtime dependencies, from Maven
# Central into DIR. The stamp holds the hash of the pom that made them: a changed pom fetches
# anew, an unchanged one does nothing. A cold fetch fills ~/.m2 too (Kafka about 55 MB,
# Debezium about 40 MB).
fetch_jars() {
    local pom=$1 libs=$2 name=$3 want
    want=$(sha256sum "$pom" | cut -d' ' -f1)
    [ "$(cat "$libs/.stamp" 2>/dev/null)" = "$want" ] && return 0
    log "$name jars from Maven Central into $libs"
    # jars of an older pom must not stay on the class path beside the new ones
    rm -rf "$libs"
    mvn -q -B -f "$pom" dependency:copy-dependencies -DoutputDirectory="$libs" -DincludeScope=runtime
    # written last, so an interrupted copy is fetched again
    echo "$want" > "$libs/.stamp"
}

# A test CA and, signed by it, a certificate for 127.0.0.1 and localhost (the address the
# brokers advertise, which clients check), in DIR: ca.pem (for clients), broker.p12 (the
# broker's key and certificate chain: its keystore) and truststore.p12 (the CA), both PKCS12
# under PASSWORD (keytool wants 6 characters at least). Valid 7 days: the stores are made for
# each cluster, never kept.
kafka_certs() {
    local dir=$1 password=${2:-outbox-test}
    mkdir -p "$dir"
    (
        cd "$dir"
        quietly openssl req -x509 -newkey rsa:2048 -nodes -days 7 -subj "/CN=outbox test Kafka CA" \
            -keyout ca.key -out ca.pem \
            -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
        printf '%s\n' "subjectAltName=IP:127.0.0.1,DNS:localhost" "basicConstraints=CA:FALSE" \
            "keyUsage=digitalSignature,keyEncipherment" "extendedKeyUsage=serverAuth" > broker.ext
        quietly openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout broker.key -out broker.csr
        quietly openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 7 \
            -extfile broker.ext -out broker.pem
        quietly openssl pkcs12 -export -name broker -inkey broker.key -in broker.pem -certfile ca.pem \
            -passout "pass:$password" -out broker.p12
        rm -f truststore.p12
        quietly keytool -importcert -noprompt -alias ca -file ca.pem -keystore truststore.p12 \
            -storetype PKCS12 -storepass "$password"
    )
}

# Run a command whose chatter (openssl's progress, keytool's "added") is shown only if it fails.
quietly() {
    local out
    out=$("$@" 2>&1) || { printf '%s\n' "$out" >&2; return 1; }
}

# run as a script: the function named by the first argument
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    "$@"
fi
