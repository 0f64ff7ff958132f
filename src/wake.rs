//! Which worker serves each database, and wake-at-commit.
//!
//! A small shared table holds one slot per database: the worker that claims it serves that
//! database. A restarted launcher starts no worker for a database whose slot is held, and a
//! second worker started for it anyway (a race with the first's start) leaves.
//! Only workers write the table, so no session can keep workers out of a database (an
//! advisory lock, which any role may take, could). emit marks its transaction; when that
//! transaction commits, its backend sets the latch of the slot's worker, so delivery starts at
//! once instead of on the next poll. A change of outbox.sinks marks its transaction the same
//! way (`_reload_sinks_at_commit`, called by the sinks trigger), and its commit also asks the
//! worker to reread the sinks at once: a fixed credential is tried without waiting for the
//! worker's next reload.
//!
//! Only active when outbox_ext is in shared_preload_libraries (the shared table needs it).
//! Prepared transactions are not woken for (their COMMIT PREPARED may run anywhere); the
//! worker's fallback poll picks them up.

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, pg_sys, PGRXSharedMemory, PgAtomic};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicUsize, Ordering};

/// Databases served by workers at once: more than any cluster has workers for.
const SLOTS: usize = 64;

struct Slot {
    database: AtomicU32,
    /// The pid of the worker serving the database, or 0 when none does.
    pid: AtomicI32,
    /// The worker's PGPROC (shared memory, same address in every process), or 0.
    proc: AtomicUsize,
    /// A committed transaction changed outbox.sinks: the worker is to reread them.
    sinks_changed: AtomicBool,
}

pub struct Workers {
    /// Held while a worker claims or releases a slot (workers only, a few times a life).
    claiming: AtomicBool,
    slots: [Slot; SLOTS],
}

impl Default for Workers {
    fn default() -> Self {
        Workers {
            claiming: AtomicBool::new(false),
            slots: std::array::from_fn(|_| Slot {
                database: AtomicU32::new(0),
                pid: AtomicI32::new(0),
                proc: AtomicUsize::new(0),
                sinks_changed: AtomicBool::new(false),
            }),
        }
    }
}

// Only atomics inside: valid in shared memory as is.
// SAFETY: integers and flags behind atomics; proc is a PGPROC's address, shared memory at
// the same address in every process. Nothing points into one process's memory.
unsafe impl PGRXSharedMemory for Workers {}

// SAFETY: the name is unique in the server's shared memory (the extension's own prefix).
static WORKERS: PgAtomic<Workers> = unsafe { PgAtomic::new(c"outbox_ext workers") };
/// Set in the postmaster when preloading; inherited by every backend it forks.
static SHARED: AtomicBool = AtomicBool::new(false);
/// This transaction emitted: wake the worker if it commits.
static EMITTED: AtomicBool = AtomicBool::new(false);
/// This transaction changed outbox.sinks: have the worker reread them if it commits.
static SINKS_CHANGED: AtomicBool = AtomicBool::new(false);

pub fn init() {
    // SAFETY: a PostgreSQL global, read in _PG_init on the process's only thread.
    if !unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        return;
    }
    pg_shmem_init!(WORKERS);
    SHARED.store(true, Ordering::Relaxed);
    // SAFETY: in _PG_init; at_transaction_end is a static fn that ignores its (null) argument.
    unsafe { pg_sys::RegisterXactCallback(Some(at_transaction_end), std::ptr::null_mut()) };
}

/// Called by emit: the worker is to be woken when this transaction commits.
pub fn note_emit() {
    EMITTED.store(true, Ordering::Relaxed);
}

// SAFETY: called by PostgreSQL (RegisterXactCallback) at each transaction event, on the
// backend's thread, where MyDatabaseId is this backend's (and below).
#[pg_guard]
unsafe extern "C-unwind" fn at_transaction_end(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    match event {
        pg_sys::XactEvent::XACT_EVENT_COMMIT | pg_sys::XactEvent::XACT_EVENT_PARALLEL_COMMIT => {
            let emitted = EMITTED.swap(false, Ordering::Relaxed);
            let sinks_changed = SINKS_CHANGED.swap(false, Ordering::Relaxed);
            if emitted || sinks_changed {
                wake_worker(unsafe { pg_sys::MyDatabaseId }.to_u32(), sinks_changed);
            }
        }
        pg_sys::XactEvent::XACT_EVENT_ABORT
        | pg_sys::XactEvent::XACT_EVENT_PARALLEL_ABORT
        | pg_sys::XactEvent::XACT_EVENT_PREPARE => {
            EMITTED.store(false, Ordering::Relaxed);
            SINKS_CHANGED.store(false, Ordering::Relaxed);
        }
        _ => {}
    }
}

v1!(pg_finfo_outbox_reload_sinks_at_commit);

/// outbox_internal._reload_sinks_at_commit(), called by the trigger on outbox.sinks: when this
/// transaction commits, the database's worker rereads the sinks at once.
// SAFETY: called by fmgr as a LANGUAGE c function of no arguments (sql/sinks.sql); it reads
// nothing of fcinfo.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn outbox_reload_sinks_at_commit(
    _fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    SINKS_CHANGED.store(true, Ordering::Relaxed);
    pg_sys::Datum::from(0)
}

/// Called by a worker: true once after each commit that changed its database's sinks.
pub fn take_sinks_changed() -> bool {
    // SAFETY: a PostgreSQL global, set once the worker connected (and read on its thread).
    let database = unsafe { pg_sys::MyDatabaseId }.to_u32();
    SHARED.load(Ordering::Relaxed)
        && WORKERS.get().slots.iter().any(|slot| {
            slot.database.load(Ordering::Acquire) == database
                && slot.sinks_changed.swap(false, Ordering::AcqRel)
        })
}

/// Sets the latch of the worker serving `database`, if there is one; `sinks_changed`: it is to
/// reread the sinks too.
fn wake_worker(database: u32, sinks_changed: bool) {
    if !SHARED.load(Ordering::Relaxed) {
        return;
    }
    for slot in &WORKERS.get().slots {
        if slot.database.load(Ordering::Acquire) != database {
            continue;
        }
        if sinks_changed {
            slot.sinks_changed.store(true, Ordering::Release);
        }
        let proc = slot.proc.load(Ordering::Acquire) as *mut pg_sys::PGPROC;
        if !proc.is_null() {
            // A stale slot (worker gone, PGPROC reused) costs a spurious wake-up, nothing more.
            // SAFETY: proc was a worker's MyProc: a PGPROC in shared memory, which lasts as long
            // as the server, at the same address in every process.
            unsafe { pg_sys::SetLatch(&raw mut (*proc).procLatch) };
        }
    }
}

/// Called by a worker once connected: true if it now serves its database (and emits there wake
/// it), false if another worker already does. The slot is let go when the worker exits, however
/// it exits (a crash that skips this resets shared memory).
pub fn claim_database() -> bool {
    if !SHARED.load(Ordering::Relaxed) {
        return true; // not preloaded: no launcher either, so no second worker
    }
    // SAFETY: process globals of a connected worker, read on its main thread (and below).
    let database = unsafe { pg_sys::MyDatabaseId }.to_u32();
    let me = unsafe { pg_sys::MyProcPid };
    let claimed = while_claiming(|slots| {
        // this database's slot, else a slot no worker holds
        let slot = slots
            .iter()
            .find(|s| s.database.load(Ordering::Acquire) == database)
            .or_else(|| slots.iter().find(|s| s.pid.load(Ordering::Acquire) == 0))?;
        let holder = slot.pid.load(Ordering::Acquire);
        if holder != 0 {
            return Some(Err(holder));
        }
        slot.database.store(database, Ordering::Release);
        // SAFETY: MyProc, this connected worker's PGPROC, read on its main thread.
        slot.proc
            .store(unsafe { pg_sys::MyProc } as usize, Ordering::Release);
        slot.pid.store(me, Ordering::Release);
        Some(Ok(()))
    });
    match claimed {
        Some(Ok(())) => {
            // SAFETY: release_database is a static fn that ignores its argument; it runs at exit
            // with shared memory still attached.
            unsafe { pg_sys::before_shmem_exit(Some(release_database), pg_sys::Datum::from(0)) };
            true
        }
        Some(Err(holder)) => {
            log!("outbox_ext: worker {holder} serves this database already; this one leaves");
            false
        }
        None => {
            warning!(
                "outbox_ext: more than {SLOTS} databases have workers; this one is not served"
            );
            false
        }
    }
}

/// Whether a worker serves `database` (its slot is held). The launcher asks before starting
/// one: a worker an earlier launcher started may still be serving it.
pub fn is_served(database: u32) -> bool {
    SHARED.load(Ordering::Relaxed)
        && WORKERS.get().slots.iter().any(|s| {
            s.database.load(Ordering::Acquire) == database && s.pid.load(Ordering::Acquire) != 0
        })
}

/// Lets go of the slot this worker holds: another worker may serve its database now.
// SAFETY: called by PostgreSQL at the worker's exit (before_shmem_exit), on its main thread,
// with shared memory still attached; MyProcPid is this process's (and below).
#[pg_guard]
unsafe extern "C-unwind" fn release_database(_code: std::ffi::c_int, _arg: pg_sys::Datum) {
    let me = unsafe { pg_sys::MyProcPid };
    while_claiming(|slots| {
        for slot in slots.iter().filter(|s| s.pid.load(Ordering::Acquire) == me) {
            slot.proc.store(0, Ordering::Release);
            slot.pid.store(0, Ordering::Release);
        }
    });
}

/// Runs `f` on the slots with no other worker claiming or releasing at the same time. `f` only
/// reads and writes the atomics: nothing in it can raise an ERROR and leave the table held.
fn while_claiming<T>(f: impl FnOnce(&[Slot; SLOTS]) -> T) -> T {
    let workers = WORKERS.get();
    while workers
        .claiming
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        std::thread::yield_now();
    }
    let result = f(&workers.slots);
    workers.claiming.store(false, Ordering::Release);
    result
}
