//! The worker's session: which role it runs as and what its SQL can resolve.
//!
//! The worker runs as `outbox_ext.worker_role` (`outbox_worker`, NOLOGIN, created by CREATE
//! EXTENSION), never as a superuser: it relays through the SECURITY DEFINER API, reads
//! outbox.sinks, writes outbox._sink_stats and runs outbox.maintain() (sql/grants.sql), and
//! nothing else. Its search_path is `pg_catalog, pg_temp` for the whole session, set after
//! connecting so that no `ALTER DATABASE/ROLE ... SET search_path` applies: its statements
//! resolve only pg_catalog and the schemas they name (operators and functions are never looked
//! up in pg_temp), so no role with CREATE on some schema can plant code for it to run. Its
//! transactions are READ COMMITTED the same way (PINNED).
//!
//! - PostgreSQL 17 and later connect as the role directly (`BGWORKER_BYPASS_ROLELOGINCHECK`:
//!   no LOGIN needed).
//! - PostgreSQL 15 and 16 cannot connect a worker as a NOLOGIN role. The worker connects as the
//!   bootstrap superuser, runs no statement, and becomes the role for good: it sets
//!   `session_authorization` (session_user, current_user and pg_stat_activity show the role).
//! - On every major, each of the worker's transactions then runs as a security-restricted
//!   operation (`restrict`, called by `in_transaction`), in which PostgreSQL refuses
//!   `SET ROLE` and `SET SESSION AUTHORIZATION`: nothing running in the session can switch
//!   back. (PostgreSQL allows that state only inside a transaction; no code of the worker's runs
//!   between them.)

use pgrx::prelude::*;
use std::ffi::CString;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once the worker is its role: from then on its transactions are restricted.
static RESTRICTED: AtomicBool = AtomicBool::new(false);

/// At the start of each transaction (once connected): a security-restricted operation, as the
/// worker's own user. The transaction's end (commit: `unrestrict`; abort: PostgreSQL) ends it.
pub fn restrict() {
    if RESTRICTED.load(Ordering::Relaxed) {
        let sro = pg_sys::SECURITY_RESTRICTED_OPERATION as i32;
        // SAFETY: only sets backend globals, once connected (RESTRICTED), on the main thread.
        unsafe { pg_sys::SetUserIdAndSecContext(pg_sys::GetUserId(), sro) };
    }
}

/// Before a commit: back to no security context, as PostgreSQL expects between transactions.
pub fn unrestrict() {
    if RESTRICTED.load(Ordering::Relaxed) {
        // SAFETY: only sets backend globals, once connected (RESTRICTED), on the main thread.
        unsafe { pg_sys::SetUserIdAndSecContext(pg_sys::GetUserId(), 0) };
    }
}

/// The settings the worker's session pins, whatever `ALTER DATABASE/ROLE ... SET` says: what
/// its statements resolve names in, and READ COMMITTED, at which alone claims and settles may
/// run (a database set to SERIALIZABLE would otherwise stop every delivery with 25000).
const PINNED: [(&std::ffi::CStr, &std::ffi::CStr); 2] = [
    (c"search_path", c"pg_catalog, pg_temp"),
    (c"default_transaction_isolation", c"read committed"),
];

/// Connects the worker to `db` as `role` and pins its settings (PINNED).
pub fn connect(db: &str, role: &str) {
    let db = CString::new(db).unwrap_or_default();
    let role = CString::new(role).unwrap_or_default();
    connect_as(&db, &role);
    for (name, value) in PINNED {
        // SAFETY: connected, on the worker's main thread, between transactions; the name and
        // value are static C strings (a value the setting refuses raises).
        unsafe {
            pg_sys::SetConfigOption(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_SUSET,
                pg_sys::GucSource::PGC_S_SESSION,
            );
        }
    }
    warn_if_superuser();
    RESTRICTED.store(true, Ordering::Relaxed);
}

#[cfg(any(feature = "pg17", feature = "pg18"))]
fn connect_as(db: &CString, role: &CString) {
    let flags = pg_sys::BGWORKER_BYPASS_ROLELOGINCHECK;
    // SAFETY: once, on the worker's main thread, before any transaction; the worker has
    // BGWORKER_BACKEND_DATABASE_CONNECTION, and the C strings outlive the call.
    unsafe { pg_sys::BackgroundWorkerInitializeConnection(db.as_ptr(), role.as_ptr(), flags) };
}

#[cfg(any(feature = "pg15", feature = "pg16"))]
fn connect_as(db: &CString, role: &CString) {
    // SAFETY: once, on the worker's main thread, before any transaction; the worker has
    // BGWORKER_BACKEND_DATABASE_CONNECTION (a NULL role: the bootstrap superuser).
    unsafe { pg_sys::BackgroundWorkerInitializeConnection(db.as_ptr(), std::ptr::null(), 0) };
    // In a transaction: the setting's check looks the role up in the catalog.
    // SAFETY: in in_transaction's transaction, on the main thread; role is a C string that
    // outlives the call.
    in_transaction(|| unsafe {
        pg_sys::SetConfigOption(
            c"session_authorization".as_ptr(),
            role.as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_SESSION,
        );
    })
    .unwrap_or_else(|e| error!("outbox_ext worker: cannot become {role:?}: {e}"));
    unsafe { pg_sys::pgstat_bestart() }; // pg_stat_activity shows the session user anew
}

fn warn_if_superuser() {
    // SAFETY: superuser() reads the catalog cache, in the transaction in_transaction opens.
    let superuser = in_transaction(|| unsafe { pg_sys::superuser() });
    if superuser.unwrap_or(false) {
        warning!(
            "outbox_ext worker: outbox_ext.worker_role is a superuser; \
             it needs only what outbox_worker is granted"
        );
    }
}

/// Runs `f` in a transaction of its own; an ERROR rolls it back and comes back as Err, so a
/// failed statement (a dropped sink, a lost lease) never takes the worker down.
pub fn in_transaction<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    // SAFETY: on the worker's main thread, between transactions (each of ours ends below); the
    // snapshot pushed here is popped below, or by the abort.
    unsafe {
        pg_sys::SetCurrentStatementStartTimestamp(); // now() is the transaction's start
        pg_sys::StartTransactionCommand();
        restrict();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
    }
    let f = AssertUnwindSafe(f);
    let result = PgTryBuilder::new(move || Ok(f()))
        .catch_others(|caught| {
            Err(match caught {
                pg_sys::panic::CaughtError::PostgresError(e)
                | pg_sys::panic::CaughtError::ErrorReport(e)
                | pg_sys::panic::CaughtError::RustPanic { ereport: e, .. } => {
                    e.message().to_string()
                }
            })
        })
        .execute();
    // SAFETY: ends the transaction started above: on success its snapshot is popped first; after
    // an ERROR (caught above), AbortCurrentTransaction cleans up what it left.
    unsafe {
        if result.is_ok() {
            pg_sys::PopActiveSnapshot();
            unrestrict();
            pg_sys::CommitTransactionCommand();
        } else {
            pg_sys::AbortCurrentTransaction();
        }
    }
    result
}
