//! Threads of ours inside a PostgreSQL backend (the worker's delivery threads, librdkafka's,
//! the metrics server's) start with every signal blocked: PostgreSQL's handlers must only
//! ever run on the backend's main thread, and a new thread inherits its creator's mask.
//!
//! ```ignore
//! let handle = threads::with_signals_blocked(|| std::thread::spawn(work));
//! ```

/// Runs `f` (which starts a thread) with all signals blocked, so the thread inherits that mask.
pub fn with_signals_blocked<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: sigfillset and pthread_sigmask only write the sigset_t values we own, and the
    // old mask is put back on this thread before returning.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        let result = f();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        result
    }
}
