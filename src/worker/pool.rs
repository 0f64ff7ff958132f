//! The worker's delivery threads. They take a claimed batch, do the HTTP work and hand back an
//! outcome; they never call into PostgreSQL (no pgrx, no palloc, no ereport) and run with every
//! signal blocked, so PostgreSQL's handlers only ever run on the worker's main thread. Each
//! finished batch writes a byte to a socket the main thread waits on next to its latch.

use crate::sinks::{Client, Event, Outcome};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// More threads than this would only queue on the same sockets.
const MAX_THREADS: usize = 64;

/// A claimed batch: the events of one shard under one lease epoch.
pub struct Batch {
    pub sink: String,
    pub shard: i32,
    pub epoch: i64,
    pub events: Vec<Event>,
}

pub struct Done {
    pub batch: Batch,
    pub outcome: Outcome,
    pub took: Duration,
}

struct Job {
    client: Arc<Client>,
    batch: Batch,
}

pub struct Pool {
    jobs: Sender<Job>,
    queue: Arc<Mutex<Receiver<Job>>>,
    done_tx: Sender<Done>,
    done: Receiver<Done>,
    wake_tx: Arc<UnixStream>,
    wake_rx: UnixStream,
    threads: usize,
    in_flight: HashMap<String, usize>,
}

impl Pool {
    pub fn new() -> std::io::Result<Pool> {
        let (wake_tx, wake_rx) = UnixStream::pair()?;
        wake_rx.set_nonblocking(true)?;
        wake_tx.set_nonblocking(true)?; // a full socket already means "wake up"
        let (jobs, queue) = channel();
        let (done_tx, done) = channel();
        Ok(Pool {
            jobs,
            queue: Arc::new(Mutex::new(queue)),
            done_tx,
            done,
            wake_tx: Arc::new(wake_tx),
            wake_rx,
            threads: 0,
            in_flight: HashMap::new(),
        })
    }

    /// Readable when a batch is done.
    pub fn wake_fd(&self) -> RawFd {
        self.wake_rx.as_raw_fd()
    }

    pub fn in_flight(&self, sink: &str) -> usize {
        self.in_flight.get(sink).copied().unwrap_or(0)
    }

    pub fn total_in_flight(&self) -> usize {
        self.in_flight.values().sum()
    }

    pub fn submit(&mut self, client: Arc<Client>, batch: Batch) {
        *self.in_flight.entry(batch.sink.clone()).or_default() += 1;
        if self.threads < self.total_in_flight().min(MAX_THREADS) {
            self.spawn();
        }
        // the receiving end lives in self.queue: sending cannot fail while self lives
        let _ = self.jobs.send(Job { client, batch });
    }

    /// The batches finished since the last call.
    pub fn take_done(&mut self) -> Vec<Done> {
        let mut buf = [0u8; 256];
        while matches!((&self.wake_rx).read(&mut buf), Ok(n) if n > 0) {}
        let done: Vec<Done> = self.done.try_iter().collect();
        for d in &done {
            if let Some(n) = self.in_flight.get_mut(&d.batch.sink) {
                *n = n.saturating_sub(1);
            }
        }
        done
    }

    fn spawn(&mut self) {
        let queue = Arc::clone(&self.queue);
        let done = self.done_tx.clone();
        let wake = Arc::clone(&self.wake_tx);
        let spawned = with_signals_blocked(|| {
            std::thread::Builder::new()
                .name("outbox_ext delivery".into())
                .spawn(move || deliver_loop(&queue, &done, &wake))
        });
        if spawned.is_ok() {
            self.threads += 1;
        }
    }
}

fn deliver_loop(queue: &Mutex<Receiver<Job>>, done: &Sender<Done>, wake: &UnixStream) {
    loop {
        let job = {
            let queue = queue
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            match queue.recv() {
                Ok(job) => job,
                Err(_) => return, // the pool is gone
            }
        };
        let started = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| job.client.deliver(&job.batch.events)))
            .unwrap_or_else(|_| Outcome::SinkDown {
                error: "internal error: a delivery thread panicked".into(),
                retry_after: None,
            });
        let finished = Done {
            batch: job.batch,
            outcome,
            took: started.elapsed(),
        };
        if done.send(finished).is_err() {
            return;
        }
        let _ = (&*wake).write(&[1]);
    }
}

/// Runs `f` (which starts a thread) with all signals blocked, so the thread inherits that mask.
fn with_signals_blocked<T>(f: impl FnOnce() -> T) -> T {
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
