//! The background worker.
//!
//! A launcher, started by the postmaster when outbox_ext is in shared_preload_libraries,
//! starts one worker per database named in `outbox_ext.databases` and starts it again
//! whenever it stops (killed, crashed, or its database appeared late). A worker waits quietly
//! until CREATE EXTENSION has run in its database (and, after a library upgrade, until ALTER
//! EXTENSION UPDATE has brought the SQL to the library's version), then delivers events to
//! the sinks of outbox.sinks (`dispatch`) and runs outbox.maintain() every
//! `outbox_ext.maintain_interval`.
//! It is woken at commit by emit (`wake`). Both reload their settings on SIGHUP and stop on
//! SIGTERM. A failed statement is logged and retried; anything worse ends the worker with an
//! ERROR in the log, and the launcher starts it again.

mod dispatch;
mod health;
mod metrics;
pub(crate) mod pool;
mod queries;
mod scrapes;
mod session;

use crate::{gucs, wake};
use dispatch::Delivery;
use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BackgroundWorkerStatus, DynamicBackgroundWorker,
    SignalWakeFlags,
};
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::{PgLogLevel, PgSqlErrorCode};
use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::time::{Duration, Instant};

/// How often the launcher looks at its workers (it is also woken when one stops).
const LAUNCHER_NAP: Duration = Duration::from_secs(5);
/// How often a worker looks for CREATE EXTENSION (or UPDATE) in its database.
const EXTENSION_CHECK: Duration = Duration::from_secs(1);
/// The extension version whose SQL this library's worker runs.
const LIBRARY_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Registers the launcher; a no-op unless loaded through shared_preload_libraries.
pub fn init() {
    // SAFETY: PostgreSQL globals, read in _PG_init on the process's only thread (and below).
    if !unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        return;
    }
    if unsafe { pg_sys::IsBinaryUpgrade } {
        return; // pg_upgrade runs this server: nothing may be delivered or written
    }
    BackgroundWorkerBuilder::new("outbox_ext launcher")
        .set_type("outbox_ext launcher")
        .set_library("outbox_ext")
        .set_function("outbox_ext_launcher_main")
        .enable_spi_access()
        .set_restart_time(Some(LAUNCHER_NAP))
        .load();
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn outbox_ext_launcher_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // No database: the launcher only looks databases up in the shared catalog.
    BackgroundWorker::connect_worker_to_spi(None, None);
    let mut workers: HashMap<String, DynamicBackgroundWorker> = HashMap::new();
    let mut reported_missing: HashSet<String> = HashSet::new();
    loop {
        report_activity("starting workers");
        let role = gucs::worker_role();
        let role_exists = role_exists(&role);
        if !role_exists && reported_missing.insert(format!("role {role}")) {
            log!("outbox_ext: role \"{role}\" (outbox_ext.worker_role) does not exist yet; workers start once it does (CREATE EXTENSION outbox_ext makes outbox_worker)");
        }
        for db in gucs::databases().into_iter().filter(|_| role_exists) {
            if workers.get(&db).is_some_and(is_running) {
                continue;
            }
            let Some(oid) = database_oid(&db) else {
                if reported_missing.insert(db.clone()) {
                    warning!("outbox_ext: database \"{db}\" in outbox_ext.databases does not exist; waiting for it");
                }
                continue;
            };
            reported_missing.remove(&db);
            if wake::is_served(oid) {
                continue; // by a worker an earlier launcher started: looked at again next round
            }
            match start_worker(&db) {
                Some(worker) => {
                    workers.insert(db, worker);
                }
                None => warning!(
                    "outbox_ext: could not start a worker for \"{db}\" (max_worker_processes?)"
                ),
            }
        }
        if role_exists {
            reported_missing.remove(&format!("role {role}"));
        }
        report_activity("idle");
        // waiting for the role (CREATE EXTENSION): look again soon
        let nap = if role_exists {
            LAUNCHER_NAP
        } else {
            EXTENSION_CHECK
        };
        if !BackgroundWorker::wait_latch(Some(nap)) {
            break;
        }
        reload_on_sighup();
    }
    log!("outbox_ext launcher stopping");
    // Status 1, as PostgreSQL's own launchers exit on SIGTERM: the postmaster starts it again
    // after its restart time unless the server is shutting down. With status 0 a launcher
    // stopped by pg_terminate_backend would stay away, and no worker would be restarted.
    // SAFETY: on the launcher's main thread, outside any transaction; proc_exit does not return,
    // and the Rust values above are only leaked.
    unsafe { pg_sys::proc_exit(1) };
}

fn is_running(worker: &DynamicBackgroundWorker) -> bool {
    !matches!(worker.pid(), Err(BackgroundWorkerStatus::Stopped))
}

/// The database's oid if it exists and accepts connections.
fn database_oid(db: &str) -> Option<u32> {
    // SAFETY: tuple is the scan's current pg_database row; datname (a NUL-terminated NameData),
    // datallowconn and oid are fixed-width columns of its struct.
    find_in_shared_catalog(pg_sys::DatabaseRelationId, |tuple| unsafe {
        let form = pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_database>(tuple);
        let name = std::ffi::CStr::from_ptr((*form).datname.data.as_ptr());
        (name.to_bytes() == db.as_bytes())
            .then_some((*form).datallowconn.then_some((*form).oid.to_u32()))
    })
    .flatten()
}

/// True if the role exists (a worker cannot connect as a role that does not).
fn role_exists(role: &str) -> bool {
    // SAFETY: tuple is the scan's current pg_authid row; rolname, a NUL-terminated NameData, is
    // a fixed-width column of its struct.
    find_in_shared_catalog(pg_sys::AuthIdRelationId, |tuple| unsafe {
        let form = pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_authid>(tuple);
        let name = std::ffi::CStr::from_ptr((*form).rolname.data.as_ptr());
        (name.to_bytes() == role.as_bytes()).then_some(())
    })
    .is_some()
}

/// The first answer `found` gives for a row of a shared catalog, by a heap scan, as the
/// autovacuum launcher reads pg_database: with no database selected, neither SQL nor an index
/// scan can run.
fn find_in_shared_catalog<T>(
    catalog: pg_sys::Oid,
    found: impl Fn(*mut pg_sys::HeapTupleData) -> Option<T>
        + std::panic::UnwindSafe
        + std::panic::RefUnwindSafe,
) -> Option<T> {
    // SAFETY: in the launcher's transaction; catalog is a shared heap catalog, readable with no
    // database; each tuple is used before the next heap_getnext, the scan ended before closing.
    BackgroundWorker::transaction(move || unsafe {
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let rel = pg_sys::table_open(catalog, lock);
        let scan = pg_sys::table_beginscan_catalog(rel, 0, std::ptr::null_mut());
        let mut answer = None;
        while answer.is_none() {
            let tuple = pg_sys::heap_getnext(scan, pg_sys::ScanDirection::ForwardScanDirection);
            if tuple.is_null() {
                break;
            }
            answer = found(tuple);
        }
        pg_sys::table_endscan(scan);
        pg_sys::table_close(rel, lock);
        answer
    })
}

fn start_worker(db: &str) -> Option<DynamicBackgroundWorker> {
    BackgroundWorkerBuilder::new(&format!("outbox_ext worker {db}"))
        .set_type("outbox_ext worker")
        .set_library("outbox_ext")
        .set_function("outbox_ext_worker_main")
        .set_extra(db)
        .enable_spi_access()
        .set_restart_time(None) // the launcher restarts it, after checking its database exists
        // SAFETY: MyProcPid is set at process start; read on the launcher's main thread.
        .set_notify_pid(unsafe { pg_sys::MyProcPid })
        .load_dynamic()
        .ok()
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn outbox_ext_worker_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let db = BackgroundWorker::get_extra().to_owned();
    session::connect(&db, &gucs::worker_role());
    if !wake::claim_database() {
        return; // another worker serves this database (a launcher restarted); leave it be
    }
    let mut delivery = match Delivery::new(metrics::Metrics::start(&db)) {
        Ok(delivery) => delivery,
        Err(e) => error!("outbox_ext worker: cannot start its delivery threads: {e}"),
    };
    log!("outbox_ext worker started for database \"{db}\"");
    report_activity("idle");
    let mut next_maintain = Instant::now();
    let mut ready = false;
    let mut said: Option<Extension> = None; // what it last said while waiting
    while delivery.wait(next_maintain) {
        if reload_on_sighup() || wake::take_sinks_changed() {
            delivery.reload_soon();
        }
        if !ready {
            let found = extension();
            ready = found == Extension::Ready;
            if !ready {
                if said.as_ref() != Some(&found) {
                    say_waiting(&db, &found);
                    said = Some(found);
                }
                next_maintain = Instant::now() + EXTENSION_CHECK; // also when to look again
                continue;
            }
            said = None;
            next_maintain = Instant::now(); // at once: CREATE EXTENSION makes no partitions
        }
        if Instant::now() >= next_maintain {
            // looked at again on maintain's schedule: an UPDATE run while the server still runs
            // the library of before it shows here
            if extension() != Extension::Ready {
                ready = false;
                continue;
            }
            next_maintain = Instant::now()
                + if maintain() == Upkeep::Deferred {
                    Duration::ZERO // the rest of a run's work, after a round of delivery
                } else {
                    gucs::maintain_interval()
                };
        }
        // last: it reports what the worker is doing in pg_stat_activity
        if let Err(e) = delivery.run() {
            ready = extension() == Extension::Ready;
            if ready {
                warning!("outbox_ext worker: {e}");
            }
        }
    }
    delivery.shut_down();
    log!("outbox_ext worker for \"{db}\" stopping");
}

/// What the worker's database holds of outbox_ext.
#[derive(PartialEq)]
enum Extension {
    /// no CREATE EXTENSION yet, or it was dropped
    Missing,
    /// another version than this library's: the worker's statements are written for the SQL
    /// of its own version, which ALTER EXTENSION UPDATE installs (a library upgrade comes
    /// first, and the server runs the new library from its restart on)
    OtherVersion(String),
    Ready,
}

fn extension() -> Extension {
    let version = session::in_transaction(|| {
        Spi::get_one::<String>(
            "SELECT extversion FROM pg_catalog.pg_extension \
             WHERE extname OPERATOR(pg_catalog.=) 'outbox_ext'",
        )
    });
    match version {
        Ok(Ok(Some(v))) if v == LIBRARY_VERSION => Extension::Ready,
        Ok(Ok(Some(v))) => Extension::OtherVersion(v),
        _ => Extension::Missing, // no answer is no extension, as before it is created
    }
}

/// Says, once per state, why the worker is not delivering, and shows it in pg_stat_activity.
fn say_waiting(db: &str, found: &Extension) {
    match found {
        Extension::OtherVersion(v) => {
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
                format!(
                    "outbox_ext worker: \"{db}\" has outbox_ext {v} and the library is \
                     {LIBRARY_VERSION}: nothing is delivered or maintained there until the \
                     extension is updated"
                ),
                "outbox_ext",
            )
            .set_hint(format!(
                "Run ALTER EXTENSION outbox_ext UPDATE in \"{db}\"."
            ))
            .report(PgLogLevel::WARNING);
            report_activity("waiting for ALTER EXTENSION outbox_ext UPDATE");
        }
        _ => {
            log!("outbox_ext worker: waiting for CREATE EXTENSION outbox_ext in \"{db}\"");
            report_activity("idle");
        }
    }
}

/// What a run of outbox.maintain() left.
#[derive(PartialEq)]
enum Upkeep {
    Done,
    /// It did as much as one run may and more is waiting (actions "deferred"): run it again
    /// soon. Not when it only looked (partitions past retention kept for their events): the
    /// next run would look at the same ones again.
    Deferred,
}

/// Runs outbox.maintain() in a transaction of its own and logs what it did.
fn maintain() -> Upkeep {
    // SAFETY: on the worker's main thread; RecoveryInProgress reads shared state, no
    // transaction needed.
    if unsafe { pg_sys::RecoveryInProgress() } {
        return Upkeep::Done; // a standby: partitions follow the primary's
    }
    report_activity("outbox.maintain()");
    let actions = session::in_transaction(|| {
        Spi::connect_mut(|client| {
            client
                .update(
                    "SELECT action, relation, detail FROM outbox.maintain()",
                    None,
                    &[],
                )
                .map(|rows| {
                    rows.map(|row| {
                        let part = |i| row.get::<String>(i).ok().flatten().unwrap_or_default();
                        format!("{} {} {}", part(1), part(2), part(3))
                            .trim()
                            .to_owned()
                    })
                    .collect()
                })
                .unwrap_or_default()
        })
    });
    let actions: Vec<String> = match actions {
        Ok(actions) => actions,
        Err(e) => {
            warning!("outbox_ext maintain failed: {e}");
            Vec::new()
        }
    };
    for action in actions.iter().filter(|a| !a.starts_with("skipped")) {
        log!("outbox_ext maintain: {action}");
    }
    let did = |verb: &str| actions.iter().any(|a| a.split(' ').next() == Some(verb));
    let progressed = ["created", "moved", "dropped", "detached"]
        .into_iter()
        .any(did);
    if did("deferred") && progressed {
        Upkeep::Deferred
    } else {
        Upkeep::Done
    }
}

/// Rereads postgresql.conf after a SIGHUP; true if there was one.
fn reload_on_sighup() -> bool {
    let hup = BackgroundWorker::sighup_received();
    if hup {
        // SAFETY: on the process's main thread, between transactions, as PostgreSQL's own processes
        // reread the configuration after SIGHUP.
        unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
    }
    hup
}

/// Whether SIGTERM came: PostgreSQL's ShutdownRequestPending, which the handler sets and
/// nothing resets. (pgrx's sigterm_received() clears its flag: of two places that ask, the
/// second would never hear of the signal, and the worker would not stop.)
pub fn stop_requested() -> bool {
    // SAFETY: a sig_atomic_t only the SIGTERM handler writes; handlers and callers run on the
    // main thread (our threads block signals). Read by address, volatile, with no reference.
    unsafe { std::ptr::read_volatile(&raw const pg_sys::ShutdownRequestPending) != 0 }
}

/// Shows what the process is doing in pg_stat_activity.query.
pub fn report_activity(what: &str) {
    let state = if what == "idle" {
        pg_sys::BackendState::STATE_IDLE
    } else {
        pg_sys::BackendState::STATE_RUNNING
    };
    if let Ok(text) = CString::new(what) {
        // SAFETY: on the process's main thread; the text is copied into shared memory during the
        // call, which it outlives.
        unsafe { pg_sys::pgstat_report_activity(state, text.as_ptr()) };
    }
}
