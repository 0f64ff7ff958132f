//! The worker's delivery threads. They take a claimed batch, do the HTTP work and hand back an
//! outcome; they never call into PostgreSQL (no pgrx, no palloc, no ereport) and run with every
//! signal blocked, so PostgreSQL's handlers only ever run on the worker's main thread. Each
//! finished batch writes a byte to a socket the main thread waits on next to its latch.
//!
//! Each sink has threads of its own, as many as it has batches in flight (at most its
//! `concurrency`): a sink that hangs holds only its own threads, never another sink's.

use crate::sinks::{Client, Event, Outcome, Verdict};
use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A claimed batch: the events of one shard under one lease epoch.
pub struct Batch {
    pub sink: String,
    /// The consumer it was claimed for (see Config::consumer_id).
    pub consumer_id: i32,
    pub shard: i32,
    pub epoch: i64,
    /// No request of the batch may start that could outlast this (its lease, less a margin
    /// for settling): a batch still out when its lease runs out could be overtaken.
    pub deadline: Instant,
    pub events: Vec<Event>,
}

pub struct Done {
    pub batch: Batch,
    pub outcome: Outcome,
    pub started: Instant,
    pub took: Duration,
    /// The submission's number (see Pool::abandon).
    ticket: u64,
}

struct Job {
    ticket: u64,
    client: Arc<Client>,
    batch: Batch,
    probe: bool,
    /// Set by Pool::abandon: the thread starts no further request of the batch.
    given_up: Arc<AtomicBool>,
}

/// A batch out: what giving its lease back needs (its consumer: the sink may be another one
/// by then), and its job's given_up.
struct Out {
    consumer_id: i32,
    shard: i32,
    epoch: i64,
    deadline: Instant,
    given_up: Arc<AtomicBool>,
}

pub struct Pool {
    sinks: HashMap<String, SinkThreads>,
    /// Numbers the submissions: a batch is known by its ticket, whatever its sink's name
    /// comes to mean later (a sink dropped and made again starts its epochs afresh).
    next_ticket: u64,
    /// The tickets of batches given up on while out: their outcome is dropped.
    abandoned: HashSet<u64>,
    done_tx: Sender<Done>,
    done: Receiver<Done>,
    wake_tx: Arc<UnixStream>,
    wake_rx: UnixStream,
}

/// One sink's job queue, its threads and its batches out.
struct SinkThreads {
    jobs: Sender<Job>,
    queue: Arc<Mutex<Receiver<Job>>>,
    threads: usize,
    in_flight: usize,
    /// The batches out by ticket, abandoned ones aside.
    out: HashMap<u64, Out>,
    /// Abandoned batches still being delivered: they hold threads.
    abandoned: usize,
}

impl Pool {
    pub fn new() -> std::io::Result<Pool> {
        let (wake_tx, wake_rx) = UnixStream::pair()?;
        wake_rx.set_nonblocking(true)?;
        wake_tx.set_nonblocking(true)?; // a full socket already means "wake up"
        let (done_tx, done) = channel();
        Ok(Pool {
            sinks: HashMap::new(),
            next_ticket: 0,
            abandoned: HashSet::new(),
            done_tx,
            done,
            wake_tx: Arc::new(wake_tx),
            wake_rx,
        })
    }

    /// Readable when a batch is done.
    pub fn wake_fd(&self) -> RawFd {
        self.wake_rx.as_raw_fd()
    }

    /// The sink's batches out: being delivered, or back and not yet settled. A batch back from
    /// its thread keeps its slot until its settle is written (Pool::settling): a crash before
    /// that commits sends it again, so a claim taking its slot earlier would put more than
    /// `concurrency` batches at risk of being sent twice.
    pub fn in_flight(&self, sink: &str) -> usize {
        self.sinks.get(sink).map_or(0, |s| s.in_flight)
    }

    pub fn total_in_flight(&self) -> usize {
        self.sinks.values().map(|s| s.in_flight).sum()
    }

    /// Hands the batch to one of its sink's threads, starting one if all are busy. A probe
    /// (of a suspended sink) sends each event in a request of its own.
    pub fn submit(&mut self, client: Arc<Client>, batch: Batch, probe: bool) {
        let sink = threads(&mut self.sinks, &batch.sink);
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        sink.in_flight += 1;
        let given_up = Arc::new(AtomicBool::new(false));
        let out = Out {
            consumer_id: batch.consumer_id,
            shard: batch.shard,
            epoch: batch.epoch,
            deadline: batch.deadline,
            given_up: Arc::clone(&given_up),
        };
        sink.out.insert(ticket, out);
        if sink.threads < sink.in_flight + sink.abandoned
            && spawn(&sink.queue, &self.done_tx, &self.wake_tx)
        {
            sink.threads += 1;
        }
        // the receiving end lives in sink.queue: sending cannot fail while it lives
        let _ = sink.jobs.send(Job {
            ticket,
            client,
            batch,
            probe,
            given_up,
        });
    }

    /// A sink that is gone: its threads end once their batches are done (a hung request ends
    /// at the sink's request_timeout).
    pub fn forget(&mut self, sink: &str) {
        if self.in_flight(sink) == 0 {
            self.sinks.remove(sink); // dropping its sender ends its idle threads
        }
    }

    /// Gives up on a sink's batches out: their outcome, whenever it comes, is dropped, they
    /// no longer count against its concurrency (new batches get threads of their own while
    /// they hold theirs), and their threads start no further request of them (a batch sent in
    /// several requests stops after the one out). Returns them, without their events, for
    /// their leases to be given back.
    pub fn abandon(&mut self, sink: &str) -> Vec<Batch> {
        let Some(threads) = self.sinks.get_mut(sink) else {
            return Vec::new();
        };
        let out: Vec<(u64, Out)> = threads.out.drain().collect();
        threads.in_flight = threads.in_flight.saturating_sub(out.len());
        threads.abandoned += out.len();
        self.abandoned.extend(out.iter().map(|(ticket, _)| *ticket));
        out.into_iter()
            .map(|(_, out)| {
                out.given_up.store(true, Ordering::Relaxed);
                Batch {
                    sink: sink.to_owned(),
                    consumer_id: out.consumer_id,
                    shard: out.shard,
                    epoch: out.epoch,
                    deadline: out.deadline,
                    events: Vec::new(),
                }
            })
            .collect()
    }

    /// The batches finished since the last call (abandoned ones left out). Each still counts
    /// as in flight until Pool::settling is called for it.
    pub fn take_done(&mut self) -> Vec<Done> {
        let mut buf = [0u8; 256];
        while matches!((&self.wake_rx).read(&mut buf), Ok(n) if n > 0) {}
        let mut done: Vec<Done> = self.done.try_iter().collect();
        for d in &done {
            if let Some(sink) = self.sinks.get_mut(&d.batch.sink) {
                if self.abandoned.contains(&d.ticket) {
                    sink.abandoned = sink.abandoned.saturating_sub(1);
                } else {
                    sink.out.remove(&d.ticket);
                }
            }
        }
        done.retain(|d| !self.abandoned.remove(&d.ticket));
        done
    }

    /// The settle written after Pool::settling failed (or a sink back whose batch is still to
    /// settle): the batch holds a slot until a retry commits (or is given up).
    pub fn settle_failed(&mut self, sink: &str) {
        threads(&mut self.sinks, sink).in_flight += 1;
    }

    /// A finished batch's settle is being written: its slot is free to a claim in the same
    /// transaction (both commit, or neither does).
    pub fn settling(&mut self, sink: &str) {
        if let Some(sink) = self.sinks.get_mut(sink) {
            sink.in_flight = sink.in_flight.saturating_sub(1);
        }
    }
}

/// A sink's threads, queue and counts, made empty at first use.
fn threads<'a>(sinks: &'a mut HashMap<String, SinkThreads>, sink: &str) -> &'a mut SinkThreads {
    sinks.entry(sink.to_owned()).or_insert_with(|| {
        let (jobs, queue) = channel();
        SinkThreads {
            jobs,
            queue: Arc::new(Mutex::new(queue)),
            threads: 0,
            in_flight: 0,
            out: HashMap::new(),
            abandoned: 0,
        }
    })
}

/// Starts a delivery thread on `queue`; false if none could be started (the batch then waits
/// for one of the sink's threads).
fn spawn(queue: &Arc<Mutex<Receiver<Job>>>, done: &Sender<Done>, wake: &Arc<UnixStream>) -> bool {
    let (queue, done, wake) = (Arc::clone(queue), done.clone(), Arc::clone(wake));
    crate::threads::with_signals_blocked(|| {
        std::thread::Builder::new()
            .name("outbox_ext delivery".into())
            .spawn(move || deliver_loop(&queue, &done, &wake))
    })
    .is_ok()
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
        crate::sinks::delivering(Arc::clone(&job.given_up));
        let (batch, probe) = (&job.batch, job.probe);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            job.client.deliver(&batch.events, batch.deadline, probe)
        }))
        .unwrap_or_else(|_| {
            let unsent = Verdict::Unsent {
                error: "internal error: a delivery thread panicked".into(),
                retry_after: None,
            };
            Outcome::all(job.batch.events.len(), unsent)
        });
        let finished = Done {
            batch: job.batch,
            outcome,
            started,
            took: started.elapsed(),
            ticket: job.ticket,
        };
        if done.send(finished).is_err() {
            return;
        }
        let _ = (&*wake).write(&[1]);
    }
}
