//! The worker's delivery loop: keeps up to `concurrency` batches in flight per sink, each a
//! shard claimed in a short transaction and handed to the delivery threads; settles what comes
//! back, also in short transactions, as the sink's health judges it (src/worker/health.rs:
//! a suspended sink gets one probe at a time); keeps each sink's figures.
//! Woken by its latch (emit's commit, signals), by a finished batch, or by the fallback poll
//! (prepared transactions, parked keys falling due, a suspended sink's next probe).

use super::health::{Claims, Health, Judgement, State, PROBE_EVENTS};
use super::metrics::Metrics;
use super::pool::{Batch, Done, Pool};
use super::queries::{self, Figures, Settled, SinkRow};
use super::{report_activity, stop_requested};
use crate::sinks::{Client, Config};
use pgrx::prelude::*;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest the worker sleeps with nothing to wake it.
const POLL: Duration = Duration::from_secs(1);
/// How often sink rows are reread (changes apply without a restart) and figures written.
const RELOAD: Duration = Duration::from_secs(1);
const FLUSH: Duration = Duration::from_secs(2);
/// The delivery rate is the average over this window.
const RATE_WINDOW: Duration = Duration::from_secs(10);
/// A settle that failed is tried again this often (see Unsettled).
const SETTLE_RETRY: Duration = Duration::from_secs(1);
/// On SIGTERM, batches in flight get this long to finish and be settled.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// Claims shrink below the sink's batch_size when events are big, to about this many bytes,
/// so memory stays bounded whatever the payload sizes.
const BATCH_BYTES: usize = 8 * 1024 * 1024;

struct Sink {
    client: Arc<Client>,
    stamp: String,
    /// Events per claim: batch_size, less when events are big (see BATCH_BYTES).
    batch_limit: i32,
    /// Shards one claim may take (one per free slot at most): as many batches as fit
    /// BATCH_BYTES together at the size of the events just seen; 1 until a batch was seen, so
    /// that no claim holds several batches of events of unknown size at once.
    claim_shards: i32,
    health: Health,
    /// Suspensions not yet written to outbox._sink_stats; the state changed since the last write.
    new_suspensions: i64,
    health_changed: bool,
    /// A claim failed: no claim before this.
    claim_retry_at: Option<Instant>,
    figures: Figures,
    recent: VecDeque<(Instant, usize)>,
    /// The last figures written said "nothing happening".
    flushed_idle: bool,
    logged_error: Option<(String, Instant)>,
}

/// A batch whose settle or give-back failed (a deadlock, a lock or statement timeout, a
/// privilege revoked by mistake): tried again every SETTLE_RETRY while its lease lasts, and it
/// keeps its slot meanwhile (unless `abandoned`). Left to its lease, its shard would stall
/// until the lease ran out (5 minutes by default) and then go out again, a duplicate of every
/// event in it.
struct Unsettled {
    batch: Batch,
    judgement: Judgement,
    next_try: Instant,
    /// Holds no slot and makes no figures: given up on while out (Pool::abandon), claimed only
    /// to look (nothing_else_to_claim), or of a sink gone (until it comes back).
    abandoned: bool,
}

pub struct Delivery {
    pool: Pool,
    sinks: HashMap<String, Sink>,
    unsettled: Vec<Unsettled>,
    next_reload: Instant,
    next_flush: Instant,
    /// Shutting down: batches in flight are settled, no more are claimed.
    stopping: bool,
    metrics: Option<Metrics>,
    /// The last failure to read outbox.status for the metrics (logged when it changes).
    logged_status_error: Option<String>,
}

impl Delivery {
    pub fn new(metrics: Option<Metrics>) -> std::io::Result<Delivery> {
        Ok(Delivery {
            pool: Pool::new()?,
            sinks: HashMap::new(),
            unsettled: Vec::new(),
            next_reload: Instant::now(),
            next_flush: Instant::now() + FLUSH,
            stopping: false,
            metrics,
            logged_status_error: None,
        })
    }

    pub fn reload_soon(&mut self) {
        self.next_reload = Instant::now();
    }

    /// Sleeps until there is something to do (or `deadline`); false once SIGTERM came.
    pub fn wait(&mut self, deadline: Instant) -> bool {
        let now = Instant::now();
        let mut until = deadline.min(now + POLL).min(self.next_flush);
        // a time already past was acted on by the last round (or waits for a batch out, whose
        // end wakes us): taken as a deadline, it made every wait 1 ms for as long as it lasted
        let sinks = self.sinks.values();
        let times = sinks.flat_map(|sink| [sink.health.wake_at(), sink.claim_retry_at]);
        let retries = self.unsettled.iter().map(|u| Some(u.next_try));
        for t in times.chain(retries).flatten().filter(|t| *t > now) {
            until = until.min(t);
        }
        let timeout = until.saturating_duration_since(now).as_millis().max(1);
        let events = pg_sys::WL_LATCH_SET
            | pg_sys::WL_SOCKET_READABLE
            | pg_sys::WL_TIMEOUT
            | pg_sys::WL_EXIT_ON_PM_DEATH;
        unsafe {
            pg_sys::WaitLatchOrSocket(
                pg_sys::MyLatch,
                events as i32,
                self.pool.wake_fd(),
                timeout as std::ffi::c_long,
                pg_sys::PG_WAIT_EXTENSION,
            );
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
        pg_sys::check_for_interrupts!();
        !stop_requested()
    }

    /// One round: settle what finished, reread sinks when due, claim more, write figures.
    pub fn run(&mut self) -> Result<(), String> {
        self.settle_finished();
        if unsafe { pg_sys::RecoveryInProgress() } {
            // a standby: its primary's worker delivers; claims cannot write here
            report_activity("standby: not delivering");
            return Ok(());
        }
        if Instant::now() >= self.next_reload {
            self.reload()?;
        }
        self.claim_more();
        if let Some(metrics) = &self.metrics {
            for name in self.sinks.keys() {
                metrics.set_in_flight(name, self.pool.in_flight(name));
            }
        }
        if Instant::now() >= self.next_flush {
            let flushed = self.flush_figures();
            self.refresh_metrics();
            flushed?;
        }
        match self.pool.total_in_flight() {
            0 => report_activity("idle"),
            1 => report_activity("delivering: 1 batch in flight"),
            n => report_activity(&format!("delivering: {n} batches in flight")),
        }
        Ok(())
    }

    /// Stops claiming; gives the batches in flight a grace period to finish and be settled.
    pub fn shut_down(&mut self) {
        report_activity("stopping: settling batches in flight");
        self.stopping = true;
        let end = Instant::now() + SHUTDOWN_GRACE;
        while self.pool.total_in_flight() > 0 && Instant::now() < end {
            unsafe {
                pg_sys::WaitLatchOrSocket(
                    pg_sys::MyLatch,
                    (pg_sys::WL_SOCKET_READABLE | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH)
                        as i32,
                    self.pool.wake_fd(),
                    100,
                    pg_sys::PG_WAIT_EXTENSION,
                );
            }
            self.settle_finished();
        }
        let _ = self.flush_figures();
    }

    fn reload(&mut self) -> Result<(), String> {
        self.next_reload = Instant::now() + RELOAD;
        let rows = queries::load_sinks()?;
        let gone: Vec<String> = (self.sinks.keys())
            .filter(|name| !rows.iter().any(|r| r.config.name == **name))
            .cloned()
            .collect();
        for name in gone {
            self.sinks.remove(&name);
            self.pool.forget(&name);
            if let Some(metrics) = &self.metrics {
                metrics.forget(&name);
            }
        }
        for row in rows {
            let unchanged = self
                .sinks
                .get(&row.config.name)
                .is_some_and(|s| s.stamp == row.stamp);
            if !unchanged {
                self.configure(row);
            }
        }
        Ok(())
    }

    /// A new or changed sink: a new client; a new one also takes back a dead worker's leases.
    fn configure(&mut self, row: SinkRow) {
        let name = row.config.name.clone();
        let client = match Client::new(row.config) {
            Ok(client) => Arc::new(client),
            Err(e) => {
                warning!("outbox_ext: sink \"{name}\" is misconfigured: {e}");
                self.sinks.remove(&name);
                if let Some(metrics) = &self.metrics {
                    metrics.forget(&name);
                }
                return;
            }
        };
        match self.sinks.get_mut(&name) {
            Some(sink) => {
                // keep what the last claim learned of event sizes (a reload must not send one
                // claim of batch_size big events); the next claim adapts to a new batch_size
                sink.batch_limit = sink.batch_limit.min(client.config.batch_size);
                sink.client = client;
                sink.stamp = row.stamp;
                sink.claim_retry_at = None;
                if sink.health.state != State::Healthy {
                    // its batches out are probes of the old settings, which may hang until
                    // their request timeout holding their shards: given back now, the new
                    // settings are tried on them at once (the old client's request out,
                    // delivered late, is a duplicate, after the new client's copy or before it;
                    // it starts no further request of them)
                    for batch in self.pool.abandon(&name) {
                        let back = Judgement::GiveBack {
                            error: "given back for the sink's new settings".into(),
                        };
                        if let Some(e) = settle_unheld(&mut self.unsettled, batch, back) {
                            warning!("outbox_ext: sink \"{name}\": giving back a probe: {e}");
                        }
                    }
                }
                sink.health.reset(); // a fixed credential or URL is tried at once
                if sink.health.take_changed() {
                    health_changed(&name, sink, self.metrics.as_ref());
                    self.next_flush = Instant::now(); // outbox.status shows it at once
                }
            }
            None => {
                // a dead worker's leases (at start); never those of batches this worker still
                // has out or has yet to settle (the sink was disabled and enabled again
                // meanwhile): taken back, they could be claimed again and overtake the copy
                // still out, or go out again though delivered
                let settling = self.unsettled.iter().any(|u| u.batch.sink == name);
                if self.pool.in_flight(&name) == 0 && !settling {
                    if let Err(e) = queries::take_back_leases(&name) {
                        warning!("outbox_ext: sink \"{name}\": taking back leases: {e}");
                    }
                }
                // the sink is back: a batch of it still to settle holds a slot of it again, so
                // that no more than `concurrency` batches are at risk of going out twice
                for u in (self.unsettled.iter_mut()).filter(|u| u.abandoned && u.batch.sink == name)
                {
                    u.abandoned = false;
                    self.pool.settle_failed(&name);
                }
                if let Some(metrics) = &self.metrics {
                    metrics.set_health(&name, &Health::default());
                }
                self.sinks.insert(
                    name,
                    Sink {
                        batch_limit: client.config.batch_size,
                        claim_shards: 1,
                        client,
                        stamp: row.stamp,
                        health: Health::default(),
                        new_suspensions: 0,
                        health_changed: true,
                        claim_retry_at: None,
                        figures: Figures::default(),
                        recent: VecDeque::new(),
                        flushed_idle: false,
                        logged_error: None,
                    },
                );
            }
        }
    }

    fn claim_more(&mut self) {
        let now = Instant::now();
        for (name, sink) in self.sinks.iter_mut() {
            if sink.claim_retry_at.is_some_and(|t| t > now) {
                continue;
            }
            sink.claim_retry_at = None;
            let config = &sink.client.config;
            let probe = match sink.health.claims(now, self.pool.in_flight(name)) {
                Claims::None => continue,
                Claims::Probe => true,
                Claims::Full => false,
            };
            while self.pool.in_flight(name) < config.concurrency {
                let (limit, shards) = match probe {
                    true => (PROBE_EVENTS.min(sink.batch_limit), 1),
                    // a batch for each free slot, in one transaction: when events come faster
                    // than one claim per event, fewer claims
                    false => (
                        sink.batch_limit,
                        free_slots(config.concurrency, self.pool.in_flight(name))
                            .min(sink.claim_shards),
                    ),
                };
                match queries::claim(config, &sink.stamp, limit, lease(config), shards) {
                    Ok(batches) if !batches.is_empty() => {
                        // fewer than asked for: no other shard has work now
                        let all_there_is = batches.len() < shards as usize;
                        for batch in batches {
                            if probe {
                                let lone = one_key(&batch)
                                    && nothing_else_to_claim(
                                        config,
                                        &sink.stamp,
                                        &mut self.unsettled,
                                    );
                                sink.health.probe_sent(&batch, lone);
                            } else {
                                (sink.batch_limit, sink.claim_shards) =
                                    claim_size(config.batch_size, &batch.events);
                            }
                            self.pool.submit(Arc::clone(&sink.client), batch, probe);
                        }
                        if probe || all_there_is {
                            break; // one probe at a time, or nothing more to claim
                        }
                    }
                    Ok(_) => {
                        if probe {
                            sink.health.probe_found_nothing(now);
                        }
                        break;
                    }
                    Err(e) => {
                        note_error(name, sink, &format!("claim failed: {e}"));
                        sink.claim_retry_at = Some(now + Duration::from_secs(1));
                        break;
                    }
                }
            }
        }
    }

    /// Settles the batches back from their threads. A sink's batches back together are settled
    /// alone but for the last, which claims for every slot then free: as many claims as
    /// before, and no batch claimed into the slot of one still waiting for its settle.
    fn settle_finished(&mut self) {
        self.retry_settles();
        let done = self.pool.take_done();
        let mut waiting: HashMap<String, usize> = HashMap::new();
        for d in &done {
            *waiting.entry(d.batch.sink.clone()).or_default() += 1;
        }
        for d in done {
            let left = waiting.get_mut(&d.batch.sink).map_or(0, |n| {
                *n -= 1;
                *n
            });
            self.settle(d, left == 0);
        }
    }

    /// Settles a batch; and claims the sink's next batches in the same transaction when `last`
    /// (no batch of the sink waits for its settle after it) and the sink is keeping up.
    fn settle(&mut self, done: Done, last: bool) {
        self.pool.settling(&done.batch.sink);
        let Some(sink) = self.sinks.get_mut(&done.batch.sink) else {
            // disabled (or dropped) while the batch was out: still record what became of it,
            // so that it is not sent again when the sink comes back (a dropped sink's
            // consumer is gone: nothing is settled, see queries::CLAIMED_FOR); its failures are
            // not judged (no sink to judge them by): given back, unless something went through
            let judgement = Health::default().judge(&done.batch, done.outcome, done.started);
            self.pool.forget(&done.batch.sink);
            settle_unheld(&mut self.unsettled, done.batch, judgement);
            return;
        };
        if let Some(metrics) = &self.metrics {
            metrics.observe_batch(&done.batch.sink, done.took);
        }
        let judgement = sink.health.judge(&done.batch, done.outcome, done.started);
        if sink.health.take_changed() {
            health_changed(&done.batch.sink, sink, self.metrics.as_ref());
            self.next_flush = Instant::now(); // outbox.status shows it at once
        }
        let mut combined_failed = None;
        let keeping_up = last
            && !self.stopping
            && !stop_requested()
            && sink.claim_retry_at.is_none()
            && sink.health.claims(Instant::now(), 0) == Claims::Full
            && self.pool.in_flight(&done.batch.sink) < sink.client.config.concurrency;
        let result = match &judgement {
            // keeping up: settle and claim the sink's next batch in one transaction
            Judgement::Settle(verdicts) if keeping_up => {
                let config = &sink.client.config;
                // the settled batch's slot and the others free
                let free = free_slots(config.concurrency, self.pool.in_flight(&done.batch.sink))
                    .min(sink.claim_shards);
                queries::settle_and_claim(
                    &done.batch,
                    verdicts,
                    config,
                    &sink.stamp,
                    sink.batch_limit,
                    lease(config),
                    free,
                )
                // its claim failing rolls its settle back: settle on its own then
                .or_else(|e| {
                    combined_failed = Some(e);
                    queries::settle(&done.batch, &judgement).map(|s| (s, Vec::new()))
                })
                .map(|(settled, next)| {
                    for next in next {
                        (sink.batch_limit, sink.claim_shards) =
                            claim_size(config.batch_size, &next.events);
                        self.pool.submit(Arc::clone(&sink.client), next, false);
                    }
                    settled
                })
            }
            _ => queries::settle(&done.batch, &judgement),
        };
        if let Some(e) = combined_failed {
            let error = format!("settle_and_claim failed, settled on its own: {e}");
            note_error(&done.batch.sink, sink, &error);
        }
        match result {
            Ok(settled) => record(&done.batch.sink, sink, settled),
            Err(e) => {
                let error = format!("settling a batch of shard {}: {e}", done.batch.shard);
                note_error(&done.batch.sink, sink, &error);
                self.pool.settle_failed(&done.batch.sink);
                self.unsettled.push(Unsettled {
                    batch: done.batch,
                    judgement,
                    next_try: Instant::now() + SETTLE_RETRY,
                    abandoned: false,
                });
            }
        }
    }

    /// Tries the failed settles that are due again. One failing past its batch's deadline is
    /// given up: the batch is left to its lease, and goes out again once that runs out.
    fn retry_settles(&mut self) {
        let now = Instant::now();
        let (due, later) = std::mem::take(&mut self.unsettled)
            .into_iter()
            .partition(|u| u.next_try <= now);
        self.unsettled = later;
        for mut u in due {
            let result = queries::settle(&u.batch, &u.judgement);
            if result.is_err() && now < u.batch.deadline {
                u.next_try = now + SETTLE_RETRY;
                self.unsettled.push(u);
                continue;
            }
            if u.abandoned {
                if let Err(e) = result {
                    warning!(
                        "outbox_ext: sink \"{}\": giving back a batch of shard {} failed until \
                         its lease nearly ran out; it goes out again once it has: {e}",
                        u.batch.sink,
                        u.batch.shard
                    );
                }
                if !self.sinks.contains_key(&u.batch.sink) {
                    self.pool.forget(&u.batch.sink); // disabled or dropped
                }
                continue;
            }
            self.pool.settling(&u.batch.sink);
            let Some(sink) = self.sinks.get_mut(&u.batch.sink) else {
                self.pool.forget(&u.batch.sink); // disabled or dropped meanwhile
                continue;
            };
            match result {
                Ok(settled) => record(&u.batch.sink, sink, settled),
                Err(e) => note_error(
                    &u.batch.sink,
                    sink,
                    &format!(
                        "settling a batch of shard {} failed until its lease nearly ran out; it \
                         goes out again once it has: {e}",
                        u.batch.shard
                    ),
                ),
            }
        }
    }

    fn flush_figures(&mut self) -> Result<(), String> {
        self.next_flush = Instant::now() + FLUSH;
        let now = Instant::now();
        let mut figures = HashMap::new();
        for (name, sink) in self.sinks.iter_mut() {
            while sink
                .recent
                .front()
                .is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW)
            {
                sink.recent.pop_front();
            }
            let mut f = std::mem::take(&mut sink.figures);
            let mut health = queries::HealthRow::of(&sink.health);
            health.suspensions = std::mem::take(&mut sink.new_suspensions);
            f.health = Some(health);
            let changed = std::mem::take(&mut sink.health_changed);
            f.per_second = sink.recent.iter().map(|(_, n)| *n).sum::<usize>() as f64
                / RATE_WINDOW.as_secs_f64();
            let idle = f.delivered == 0
                && f.failed == 0
                && f.error.is_none()
                && f.per_second == 0.0
                && !changed;
            if !(idle && sink.flushed_idle) {
                sink.flushed_idle = idle; // an idle sink's row is written once, not every 2 s
                figures.insert(name.clone(), f);
            }
        }
        queries::record_figures(&figures)
    }

    /// Gives the metrics what outbox.status says now, if someone scraped since the last time.
    fn refresh_metrics(&mut self) {
        let Some(metrics) = self.metrics.as_ref().filter(|m| m.wanted()) else {
            return;
        };
        match queries::consumer_status() {
            Ok(consumers) => metrics.refresh(consumers),
            Err(e) => {
                let error = format!("reading outbox.status for the metrics: {e}");
                if self.logged_status_error.as_ref() != Some(&error) {
                    log!("outbox_ext worker: {error}");
                }
                self.logged_status_error = Some(error);
            }
        }
    }
}

/// The next claim's size: batch_size events, or fewer of the size just seen to fit BATCH_BYTES;
/// and how many shards' batches of that size fit BATCH_BYTES together (at least one).
fn claim_size(batch_size: i32, events: &[crate::sinks::Event]) -> (i32, i32) {
    let bytes: usize = events
        .iter()
        .map(|e| {
            e.payload.as_ref().map_or(0, String::len)
                + e.headers.as_ref().map_or(0, String::len)
                + 200
        })
        .sum();
    let per_event = (bytes / events.len().max(1)).max(1);
    let limit = ((BATCH_BYTES / per_event).max(1) as i32).min(batch_size.max(1));
    let shards = (BATCH_BYTES / (per_event * limit as usize)).clamp(1, i32::MAX as usize);
    (limit, shards as i32)
}

/// A settled batch's figures.
fn record(name: &str, sink: &mut Sink, settled: Settled) {
    sink.figures.delivered += settled.delivered as u64;
    sink.figures.failed += settled.failed as u64;
    sink.recent.push_back((Instant::now(), settled.delivered));
    if let Some(error) = settled.error {
        note_error(name, sink, &error);
    }
}

/// Logs a sink's change of state once (not once per request) and tells the metrics.
fn health_changed(name: &str, sink: &mut Sink, metrics: Option<&Metrics>) {
    sink.health_changed = true;
    if matches!(sink.health.state, State::Suspended(_)) {
        sink.new_suspensions += 1;
    }
    match &sink.health.state {
        State::Suspended(s) => warning!(
            "outbox_ext: sink \"{name}\" suspended: {}; nothing is counted against its events \
             while it is, and it is probed with one small batch every {:.1} s or so",
            s.reason,
            s.next_probe
                .saturating_duration_since(Instant::now())
                .as_secs_f64()
        ),
        State::Healthy => log!("outbox_ext: sink \"{name}\" resumed at full concurrency"),
    }
    if let Some(metrics) = metrics {
        metrics.set_health(name, &sink.health);
    }
}

/// Keeps the error for the sink's figures; logs it when it changes, or once a minute.
fn note_error(name: &str, sink: &mut Sink, error: &str) {
    sink.figures.error = Some(error.to_string());
    let now = Instant::now();
    let fresh = match &sink.logged_error {
        Some((last, at)) => last != error || now.duration_since(*at) > Duration::from_secs(60),
        None => true,
    };
    if fresh {
        log!("outbox_ext: sink \"{name}\": {error}");
        sink.logged_error = Some((error.to_string(), now));
    }
}

/// A claim's lease: meant to outlast a batch's requests (a batch sent in many requests, e.g.
/// format single, may take longer); a dead worker's leases are taken back at its restart.
fn lease(config: &crate::sinks::Config) -> Duration {
    (config.request_timeout * 4).max(Duration::from_secs(300))
}

/// How many shards' batches a claim may take: one per delivery slot free (at least one).
fn free_slots(concurrency: usize, in_flight: usize) -> i32 {
    concurrency
        .saturating_sub(in_flight)
        .clamp(1, i32::MAX as usize) as i32
}

fn one_key(batch: &Batch) -> bool {
    let key = batch.events.first().map(|e| &e.aggregate_id);
    batch.events.iter().all(|e| Some(&e.aggregate_id) == key)
}

/// Whether the sink has nothing to claim but the probe it holds (a second claim cannot take
/// the probe's shard, leased, and finds nothing). What it finds is given back at once.
fn nothing_else_to_claim(config: &Config, stamp: &str, unsettled: &mut Vec<Unsettled>) -> bool {
    match queries::claim(config, stamp, 1, lease(config), 1).map(|mut b| b.pop()) {
        Ok(None) => true,
        Ok(Some(other)) => {
            let shard = other.shard;
            let back = Judgement::GiveBack {
                error: "claimed only to see that there is more than the probe".into(),
            };
            if let Some(e) = settle_unheld(unsettled, other, back) {
                let name = &config.name;
                warning!("outbox_ext: sink \"{name}\": giving back shard {shard}: {e}");
            }
            false
        }
        Err(_) => false,
    }
}

/// Settles (or gives back) a batch that holds no slot: one given up on while out, claimed only
/// to look, or of a sink gone. One that fails is tried again (Unsettled) rather than left to
/// its lease; the error is returned.
fn settle_unheld(
    unsettled: &mut Vec<Unsettled>,
    batch: Batch,
    judgement: Judgement,
) -> Option<String> {
    let error = queries::settle(&batch, &judgement).err()?;
    unsettled.push(Unsettled {
        batch,
        judgement,
        next_try: Instant::now() + SETTLE_RETRY,
        abandoned: true,
    });
    Some(error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sinks::test_event;

    fn events(n: usize, payload_bytes: usize) -> Vec<crate::sinks::Event> {
        (0..n)
            .map(|i| crate::sinks::Event {
                payload: Some("x".repeat(payload_bytes)),
                headers: None,
                ..test_event(&i.to_string())
            })
            .collect()
    }

    #[test]
    fn small_events_let_one_claim_take_several_shards() {
        let (limit, shards) = claim_size(100, &events(10, 100));
        assert_eq!(limit, 100);
        assert!(shards > 64, "{shards}");
    }

    #[test]
    fn big_events_keep_one_claim_within_batch_bytes() {
        // 1 MB events: 8 to a batch, and one batch per claim
        assert_eq!(claim_size(1000, &events(3, 1024 * 1024)), (7, 1));
        // 200 kB events, batches of 10: four shards' batches fit 8 MB together
        let (limit, shards) = claim_size(10, &events(3, 200 * 1024));
        assert_eq!(limit, 10);
        assert_eq!(shards, 4);
        assert!(limit as usize * shards as usize * 200 * 1024 <= BATCH_BYTES);
    }
}
