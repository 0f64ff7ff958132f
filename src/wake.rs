//! Wake-at-commit. emit marks its transaction; when that transaction commits, its backend sets
//! the latch of the worker serving the database, so delivery starts at once instead of on the
//! next poll. The worker publishes its PGPROC in a small shared table, one slot per database.
//!
//! Only active when outbox_ext is in shared_preload_libraries (the shared table needs it).
//! Prepared transactions are not woken for (their COMMIT PREPARED may run anywhere); the
//! worker's fallback poll picks them up.

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, pg_sys, PGRXSharedMemory, PgAtomic};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

/// Databases served by workers at once: more than any cluster has workers for.
const SLOTS: usize = 64;

struct Slot {
    database: AtomicU32,
    /// The worker's PGPROC (shared memory, same address in every process), or 0.
    proc: AtomicUsize,
}

pub struct Workers {
    slots: [Slot; SLOTS],
}

impl Default for Workers {
    fn default() -> Self {
        Workers {
            slots: std::array::from_fn(|_| Slot {
                database: AtomicU32::new(0),
                proc: AtomicUsize::new(0),
            }),
        }
    }
}

// Only atomics inside: valid in shared memory as is.
unsafe impl PGRXSharedMemory for Workers {}

static WORKERS: PgAtomic<Workers> = unsafe { PgAtomic::new(c"outbox_ext workers") };
/// Set in the postmaster when preloading; inherited by every backend it forks.
static SHARED: AtomicBool = AtomicBool::new(false);
/// This transaction emitted: wake the worker if it commits.
static EMITTED: AtomicBool = AtomicBool::new(false);

pub fn init() {
    if !unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        return;
    }
    pg_shmem_init!(WORKERS);
    SHARED.store(true, Ordering::Relaxed);
    unsafe { pg_sys::RegisterXactCallback(Some(at_transaction_end), std::ptr::null_mut()) };
}

/// Called by emit: the worker is to be woken when this transaction commits.
pub fn note_emit() {
    EMITTED.store(true, Ordering::Relaxed);
}

#[pg_guard]
unsafe extern "C-unwind" fn at_transaction_end(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    match event {
        pg_sys::XactEvent::XACT_EVENT_COMMIT | pg_sys::XactEvent::XACT_EVENT_PARALLEL_COMMIT
            if EMITTED.swap(false, Ordering::Relaxed) =>
        {
            wake_worker(unsafe { pg_sys::MyDatabaseId }.to_u32());
        }
        pg_sys::XactEvent::XACT_EVENT_ABORT
        | pg_sys::XactEvent::XACT_EVENT_PARALLEL_ABORT
        | pg_sys::XactEvent::XACT_EVENT_PREPARE => EMITTED.store(false, Ordering::Relaxed),
        _ => {}
    }
}

/// Sets the latch of the worker serving `database`, if there is one.
fn wake_worker(database: u32) {
    if !SHARED.load(Ordering::Relaxed) {
        return;
    }
    for slot in &WORKERS.get().slots {
        if slot.database.load(Ordering::Acquire) != database {
            continue;
        }
        let proc = slot.proc.load(Ordering::Acquire) as *mut pg_sys::PGPROC;
        if !proc.is_null() {
            // A stale slot (worker gone, PGPROC reused) costs a spurious wake-up, nothing more.
            unsafe { pg_sys::SetLatch(&raw mut (*proc).procLatch) };
        }
    }
}

/// Called by a worker: emits in its database wake it from now on.
pub fn register_worker() {
    if !SHARED.load(Ordering::Relaxed) {
        return;
    }
    let database = unsafe { pg_sys::MyDatabaseId }.to_u32();
    let me = unsafe { pg_sys::MyProc } as usize;
    let slots = &WORKERS.get().slots;
    let slot = slots
        .iter()
        .find(|s| s.database.load(Ordering::Acquire) == database)
        .or_else(|| {
            slots.iter().find(|s| {
                s.database
                    .compare_exchange(0, database, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            })
        });
    match slot {
        Some(slot) => slot.proc.store(me, Ordering::Release),
        None => warning!("outbox_ext: no free wake-up slot; this worker relies on polling"),
    }
}
