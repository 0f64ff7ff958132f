//! Native Kafka sink: the worker produces to the brokers itself, with librdkafka (the `rdkafka`
//! crate, built from its bundled source). The record rules (topic, key, headers) are
//! `records`', shared with the REST sinks.
//!
//! Per-key order with whole batches rests on four things:
//! - the idempotent producer (acks=all, gapless): per partition, the broker persists a
//!   producer's records in the order they were produced, so a record persisted means every
//!   earlier record of its partition from that producer was persisted first;
//! - no record is ever failed locally in the middle of a key: messages never time out inside
//!   the client (message.timeout.ms = 0), and when one cannot even be queued, or its report
//!   says it failed, the later records of its key in the batch are not queued (held back);
//! - another topic is another partition, which the producer does not order with the first: a
//!   key's record for a topic other than its previous record's waits for that one's report;
//! - a record is acked only on its delivery report. What has no report by the sink's
//!   request_timeout (or the batch's deadline) goes back unsent, its key waiting from the first
//!   such record, with no attempt counted. The record stays queued in the client: when its key
//!   comes again, the later batch waits for that record's report instead of queueing a copy,
//!   or takes it for delivered if it was since (Copies). So a partition away for minutes (no
//!   leader, not enough replicas) while the others deliver gets each record once, not once per
//!   retry, and the client's queue does not fill with copies. A copy can still arrive twice
//!   after the producer is replaced (Producer::retire), never ahead of an earlier record of
//!   its key.
//!
//! A record a broker refuses for its content (too large, not valid) is produced again alone,
//! through a second producer (`alone`, one record at a time) before it is judged: a broker
//! refuses a whole record batch for one record of it. That producer holds nothing once its
//! record is reported or its batch is over (torn down when no report came), so no copy of it
//! outlives its batch unseen by the next batch of its key.
//!
//! The producer lives on the delivery threads (created on first use, where every signal is
//! blocked, so its threads inherit that mask) and never calls into PostgreSQL.

use super::records::{kafka_topic, record_headers, record_value};
use super::{held_back, Config, Event, Outcome, Verdict};
use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{
    BaseRecord, DeliveryResult, Producer as _, ProducerContext, ThreadedProducer,
};
use rdkafka::types::RDKafkaErrorCode as Code;
use rdkafka::ClientContext;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The most bytes the client may hold queued (librdkafka's queue.buffering.max.kbytes).
const QUEUE_KBYTES: usize = 64 * 1024;
/// How long a full client queue is waited on, in steps of QUEUE_FULL_WAIT, before the
/// record's key is held back.
const QUEUE_FULL_PATIENCE: Duration = Duration::from_secs(1);
const QUEUE_FULL_WAIT: Duration = Duration::from_millis(10);

/// A Kafka sink's producer: built on first use, built anew after a fatal error (e.g. a broker
/// that lost the idempotent producer's state: its records are then sent again by a new one).
pub struct Producer {
    settings: ClientConfig,
    live: Mutex<Live>,
    /// A producer of its own for records sent alone (send_refused_alone), one at a time under
    /// this lock: the live producer would put them in a record batch with other batches' records.
    alone: Mutex<Option<Arc<ThreadedProducer<Reports>>>>,
    /// Per topic, when it last took a record of ours; per record refused alone, when it first
    /// was (blame_only_where_the_topic_takes_records).
    evidence: Mutex<super::evidence::TopicEvidence>,
}

#[derive(Default)]
struct Live {
    producer: Option<Arc<ThreadedProducer<Reports>>>,
    /// A broker said it has no idempotent producer (Kafka before 0.11).
    without_idempotence: bool,
}

impl Producer {
    /// Checks the settings as librdkafka will take them, without starting a client.
    pub fn new(config: &Config) -> Result<Producer, String> {
        let settings = client_config(config)?;
        settings
            .create_native_config()
            .map_err(|e| format!("Kafka producer settings: {e}"))?;
        Ok(Producer {
            settings,
            live: Mutex::default(),
            alone: Mutex::default(),
            evidence: Mutex::default(),
        })
    }

    fn live(&self) -> Result<Arc<ThreadedProducer<Reports>>, String> {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = &live.producer {
            match p.client().fatal_error() {
                None => return Ok(Arc::clone(p)),
                Some((Code::UnsupportedFeature, _)) => live.without_idempotence = true,
                Some(_) => {}
            }
        }
        let mut settings = self.settings.clone();
        if live.without_idempotence {
            // one request in flight per connection keeps each partition in order on retries
            settings
                .set("enable.idempotence", "false")
                .set("enable.gapless.guarantee", "false")
                .set("max.in.flight.requests.per.connection", "1");
        }
        let producer = Arc::new(
            settings
                .create_with_context(Reports::default())
                .map_err(|e| format!("Kafka producer: {e}"))?,
        );
        let old = live.producer.replace(Arc::clone(&producer));
        drop(live);
        if let Some(old) = old {
            tear_down(old);
        }
        Ok(producer)
    }

    /// Produces the batch, in order, and waits for each record's delivery report until the
    /// sink's request_timeout.
    pub fn send(&self, config: &Config, events: &[&Event], deadline: Instant) -> Outcome {
        let live = match self.live() {
            Ok(live) => live,
            Err(error) => {
                let unsent = Verdict::Unsent {
                    error,
                    retry_after: None,
                };
                return Outcome::all(events.len(), unsent);
            }
        };
        let started = Instant::now();
        let deadline = deadline.min(started + config.request_timeout);
        let batch = Arc::new(Batch::new(events.len()));
        let topics: Vec<String> = events.iter().map(|e| kafka_topic(config, e)).collect();
        // per key, the index of its last record queued in this batch
        let mut last: HashMap<&str, usize> = HashMap::new();
        // records an earlier batch's copy delivered, and when (not during this batch)
        let mut delivered_before: Vec<Option<Instant>> = vec![None; events.len()];
        for (i, event) in events.iter().enumerate() {
            let key = event.aggregate_id.as_str();
            let topic = &topics[i];
            let go_on = match last.get(key) {
                None => true,
                Some(&j) => {
                    // another topic is another partition, which the producer does not order
                    // with this one: the earlier record must be in before this one goes
                    let same_topic = topics[j] == *topic;
                    let earlier = match same_topic {
                        true => batch.verdict(j),
                        false => batch.wait_for(j, deadline),
                    };
                    // any failure holds the key's later events back (outbox.settle keeps
                    // them back whatever is reported: sent now, they would go twice)
                    match earlier {
                        None => same_topic,
                        Some(v) => v == Verdict::Delivered,
                    }
                }
            };
            let verdict = match go_on {
                false => Some(held_back()),
                true => match earlier_copy(&live, &event.id, &batch, i) {
                    EarlierCopy::Queued => None,
                    EarlierCopy::Delivered(at) => {
                        delivered_before[i] = Some(at);
                        Some(Verdict::Delivered)
                    }
                    EarlierCopy::NotQueued => {
                        produce(&live, config, event, topic, &batch, i, deadline).err()
                    }
                },
            };
            if let Some(verdict) = verdict {
                batch.report(i, verdict);
            }
            last.insert(key, i);
        }
        batch.wait(deadline);
        let refused_alone = self.send_refused_alone(config, events, &topics, &batch, deadline);
        self.blame_only_where_the_topic_takes_records(
            &topics,
            events,
            &batch,
            &refused_alone,
            &delivered_before,
            started,
        );
        if batch.nothing_through() {
            self.retire(&live);
        }
        // from here, a report is remembered for the next batch of its key, not lost on this one
        batch.over.store(true, Ordering::Relaxed);
        batch.outcome(live.context().last_error())
    }

    /// A broker refuses a whole record batch when one record of it is too large or not valid,
    /// so the records it refused so are produced again one at a time, in batch order, each
    /// alone in its record batch (a producer of their own, `alone`): only a record refused on
    /// its own is then judged (else its batch-mates, other keys' events, were dead-lettered
    /// with it). A key whose record is refused alone holds its later records
    /// back. What the deadline leaves unsent this way goes back unsent, never blamed. (The
    /// refusal may have ended the live producer, gapless: the next batch builds a new one.)
    fn send_refused_alone(
        &self,
        config: &Config,
        events: &[&Event],
        topics: &[String],
        batch: &Arc<Batch>,
        deadline: Instant,
    ) -> Vec<usize> {
        let mut refused_alone = Vec::new();
        for i in batch.refused_for_content() {
            let key = events[i].aggregate_id.as_str();
            let earlier_failed = (0..i).any(|j| {
                events[j].aggregate_id == key && batch.verdict(j) != Some(Verdict::Delivered)
            });
            if earlier_failed {
                batch.replace(i, held_back());
                continue;
            }
            let Some(mut alone) = lock_until(&self.alone, deadline) else {
                batch.replace(i, not_sent_alone("no time left"));
                continue;
            };
            if alone
                .as_ref()
                .is_none_or(|p| p.client().fatal_error().is_some())
            {
                if let Some(old) = std::mem::replace(&mut *alone, self.alone_producer()) {
                    tear_down(old); // a fatal error ended it
                }
            }
            let Some(producer) = alone.as_ref() else {
                batch.replace(i, not_sent_alone("no producer to send it alone"));
                continue;
            };
            batch.replace_later(i);
            match produce(producer, config, events[i], &topics[i], batch, i, deadline) {
                Err(verdict) => batch.report(i, verdict),
                Ok(()) => drop(batch.wait_for(i, deadline)),
            }
            match batch.verdict(i) {
                Some(Verdict::Reject { .. }) => refused_alone.push(i),
                // no report by the deadline: the copy it holds would go unseen by the next
                // batch of its key (the live producer's Copies), so it holds none
                None => {
                    if let Some(old) = alone.take() {
                        tear_down(old);
                    }
                }
                Some(_) => {}
            }
        }
        refused_alone
    }

    /// A producer for records sent alone: its reports are about its one record
    /// (Reports::sends_alone), and it is not gapless, or a refusal would end it (a fatal
    /// error) each time; with one record out at a time no gap can open behind one.
    fn alone_producer(&self) -> Option<Arc<ThreadedProducer<Reports>>> {
        let mut settings = self.settings.clone();
        settings.set("enable.gapless.guarantee", "false");
        let reports = Reports {
            sends_alone: true,
            ..Reports::default()
        };
        settings.create_with_context(reports).ok().map(Arc::new)
    }

    /// A record a broker refused on its own is the record's only once its topic has taken
    /// another record of ours since (src/sinks/evidence.rs); until then it goes back unsent.
    fn blame_only_where_the_topic_takes_records(
        &self,
        topics: &[String],
        events: &[&Event],
        batch: &Batch,
        refused_alone: &[usize],
        delivered_before: &[Option<Instant>],
        started: Instant,
    ) {
        let mut evidence = self.evidence.lock().unwrap_or_else(|e| e.into_inner());
        if refused_alone.is_empty() && evidence.waiting_on_nothing() {
            return; // no refusal to judge, now or later: the clean path does no more
        }
        let now = Instant::now();
        for (j, topic) in topics.iter().enumerate() {
            if batch.verdict(j) == Some(Verdict::Delivered) {
                // (a copy delivered before this batch proves nothing of a refusal in it)
                evidence.took(topic, delivered_before[j].unwrap_or(now));
            }
        }
        for &i in refused_alone {
            let topic = &topics[i];
            if evidence.blames(topic, &events[i].id, started) {
                continue;
            }
            if let Some(Verdict::Reject { error }) = batch.verdict(i) {
                batch.replace(i, super::evidence::not_yet_blamed(&error, topic));
            }
        }
    }

    /// Nothing got through by the deadline: the next batch gets a new producer, and this one,
    /// once the batches that use it are over, drops what it still holds (a broker back from a
    /// restart may not know it; its copies would only arrive twice).
    fn retire(&self, producer: &Arc<ThreadedProducer<Reports>>) {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        if live
            .producer
            .as_ref()
            .is_some_and(|p| Arc::ptr_eq(p, producer))
        {
            let old = live.producer.take();
            drop(live);
            if let Some(old) = old {
                tear_down(old);
            }
        }
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        let live = self.live.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(producer) = live.producer.take() {
            tear_down(producer);
        }
        let alone = self.alone.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(producer) = alone.take() {
            tear_down(producer);
        }
    }
}

/// Lets go of a producer on a thread of its own (signals blocked): librdkafka's teardown joins
/// its threads and flushes for up to half a second, which must not stall the worker's loop
/// (a sink changed or dropped) or the sink's other batches.
fn tear_down(producer: Arc<ThreadedProducer<Reports>>) {
    let spawned = crate::threads::with_signals_blocked(|| {
        std::thread::Builder::new()
            .name("outbox_ext kafka teardown".into())
            .spawn(move || drop(producer))
    });
    drop(spawned); // if no thread could start, the producer went with the closure, here
}

/// What became of the copy of event `id` an earlier batch queued (Copies::earlier). A function
/// of its own so that the lock is let go before the match on its answer queues the record.
fn earlier_copy(
    producer: &ThreadedProducer<Reports>,
    id: &str,
    batch: &Arc<Batch>,
    i: usize,
) -> EarlierCopy {
    producer
        .context()
        .copies()
        .earlier(id, (Arc::clone(batch), i))
}

/// Queues one record; Err(verdict) when it cannot be queued (a full queue is waited on for at
/// most QUEUE_FULL_PATIENCE).
fn produce(
    producer: &ThreadedProducer<Reports>,
    config: &Config,
    event: &Event,
    topic: &str,
    batch: &Arc<Batch>,
    i: usize,
    deadline: Instant,
) -> Result<(), Verdict> {
    if crate::emit::check_topic(topic).is_err() {
        return Err(Verdict::Invalid {
            error: format!("Kafka: \"{topic}\" is not a valid Kafka topic name"),
        });
    }
    let headers =
        record_headers(config, event)
            .iter()
            .fold(OwnedHeaders::new(), |h, (key, value)| {
                h.insert(Header {
                    key,
                    value: value.as_deref().map(str::as_bytes),
                })
            });
    let value = record_value(config, event);
    let id: Arc<str> = Arc::from(event.id.as_str());
    let opaque = Box::new((Arc::clone(batch), i, Arc::clone(&id)));
    let mut record = BaseRecord::with_opaque_to(topic, opaque)
        .key(event.aggregate_id.as_bytes())
        .headers(headers);
    if let Some(value) = &value {
        record = record.payload(value.as_bytes());
    }
    let patience = deadline.min(Instant::now() + QUEUE_FULL_PATIENCE);
    // queued from before the send: its report may come before send returns
    producer.context().copies().queueing(&id);
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((KafkaError::MessageProduction(Code::QueueFull), back))
                if Instant::now() < patience =>
            {
                record = back;
                std::thread::sleep(QUEUE_FULL_WAIT);
            }
            Err((error, _)) => {
                producer.context().copies().not_queued(&id);
                return Err(judge(&error, Side::Client));
            }
        }
    }
}

/// The lock, waited for until `deadline` at most (another batch may hold it while its record
/// sent alone awaits its report).
fn lock_until<T>(lock: &Mutex<T>, deadline: Instant) -> Option<std::sync::MutexGuard<'_, T>> {
    loop {
        match lock.try_lock() {
            Ok(guard) => return Some(guard),
            Err(std::sync::TryLockError::Poisoned(e)) => return Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(QUEUE_FULL_WAIT)
            }
            Err(std::sync::TryLockError::WouldBlock) => return None,
        }
    }
}

/// A record a broker refused with others that could not be sent alone: never blamed.
fn not_sent_alone(why: &str) -> Verdict {
    Verdict::Unsent {
        error: format!("Kafka: refused with other records, not sent alone ({why})"),
        retry_after: None,
    }
}

/// A broker's refusal of a record batch for its content: too large, or not a valid record
/// (it refuses the whole batch for one record of it).
fn refused_for_content(error: &KafkaError) -> bool {
    matches!(
        error.rdkafka_error_code(),
        Some(
            Code::MessageSizeTooLarge
                | Code::InvalidMessageSize
                | Code::MessageBatchTooLarge
                | Code::InvalidMessage
                | Code::InvalidRecord
        )
    )
}

/// Who refused a record: the client as it queued it, or a broker in its delivery report.
#[derive(Clone, Copy, PartialEq)]
enum Side {
    Client,
    Broker,
}

/// The verdict on a record librdkafka could not deliver (or queue). A topic name Kafka
/// refuses: dead-lettered at once. Refused for its own content (too large, not a valid
/// record): dead-lettered at once when our client refuses it (over its own
/// message.max.bytes), and as far as a broker says when a broker does (a topic's
/// max.message.bytes lowered by mistake refuses every record: src/worker/health.rs suspends
/// the sink instead). Anything else is the cluster's (a topic not made yet or denied to us,
/// credentials, leaders away, not enough replicas, timeouts) and never counted against the
/// record: its key waits, in order, and the sink is suspended when nothing gets through.
fn judge(error: &KafkaError, side: Side) -> Verdict {
    let text = format!("Kafka: {error}");
    // a topic name (or an argument) no broker takes, whoever says so
    let never_sendable = matches!(
        error.rdkafka_error_code(),
        Some(Code::InvalidTopic | Code::InvalidArgument)
    );
    match side {
        _ if never_sendable => Verdict::Invalid { error: text },
        Side::Broker if refused_for_content(error) => Verdict::Reject { error: text },
        Side::Client if refused_for_content(error) => Verdict::Invalid { error: text },
        _ => Verdict::Unsent {
            error: text,
            retry_after: None,
        },
    }
}

/// The records of one batch awaiting their delivery reports.
struct Batch {
    verdicts: Mutex<Verdicts>,
    reported: Condvar,
    /// Its outcome was taken: reports that come later are for no one.
    over: AtomicBool,
}

struct Verdicts {
    of: Vec<Option<Verdict>>,
    /// Records a broker refused for their content (perhaps a batch-mate's: send_refused_alone).
    refused: Vec<bool>,
    missing: usize,
    /// The record wait_for waits for (woken by its report, not by every report).
    awaited: Option<usize>,
}

impl Batch {
    fn new(n: usize) -> Batch {
        Batch {
            verdicts: Mutex::new(Verdicts {
                of: vec![None; n],
                refused: vec![false; n],
                missing: n,
                awaited: None,
            }),
            reported: Condvar::new(),
            over: AtomicBool::new(false),
        }
    }

    fn report(&self, i: usize, verdict: Verdict) {
        let mut verdicts = self.verdicts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot @ None) = verdicts.of.get_mut(i) {
            *slot = Some(verdict);
            verdicts.missing -= 1;
            if verdicts.missing == 0 || verdicts.awaited == Some(i) {
                self.reported.notify_all();
            }
        }
    }

    /// A broker refused record i for its content (refused_for_content): reported, and marked
    /// to be resent alone, unless it has its verdict already.
    fn report_refused(&self, i: usize, verdict: Verdict) {
        let mut verdicts = self.verdicts.lock().unwrap_or_else(|e| e.into_inner());
        if verdicts.of.get(i).is_some_and(Option::is_none) {
            verdicts.refused[i] = true;
        }
        drop(verdicts);
        self.report(i, verdict);
    }

    /// The records a broker refused for their content, in batch order.
    fn refused_for_content(&self) -> Vec<usize> {
        let verdicts = self.verdicts.lock().unwrap_or_else(|e| e.into_inner());
        (verdicts.refused.iter().enumerate())
            .filter(|(_, &refused)| refused)
            .map(|(i, _)| i)
            .collect()
    }

    /// Record i's verdict is `verdict` instead of the one reported (and a refusal for its
    /// content is judged by it).
    fn replace(&self, i: usize, verdict: Verdict) {
        let mut verdicts = self.verdicts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = verdicts.of.get_mut(i) {
            *slot = Some(verdict);
            verdicts.refused[i] = false;
        }
    }

    /// Record i is sent again: its verdict is the next report's.
    fn replace_later(&self, i: usize) {
        let mut verdicts = self.verdicts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot @ Some(_)) = verdicts.of.get_mut(i) {
            *slot = None;
            verdicts.missing += 1;
        }
        if let Some(flag) = verdicts.refused.get_mut(i) {
            *flag = false;
        }
    }

    /// Some record has no report by the deadline and none was delivered: the cluster is out
    /// of reach.
    fn nothing_through(&self) -> bool {
        let verdicts = &self.verdicts.lock().unwrap_or_else(|e| e.into_inner()).of;
        verdicts.iter().any(Option::is_none) && !verdicts.contains(&Some(Verdict::Delivered))
    }

    /// Record i's verdict, if it has one yet.
    fn verdict(&self, i: usize) -> Option<Verdict> {
        let verdicts = self.verdicts.lock().unwrap_or_else(|e| e.into_inner());
        verdicts.of.get(i).cloned().flatten()
    }

    /// Record i's verdict, waited for until `deadline`.
    fn wait_for(&self, i: usize, deadline: Instant) -> Option<Verdict> {
        let mut verdicts = self.wait_until(deadline, |v| {
            let reported = v.of.get(i).is_some_and(Option::is_some);
            v.awaited = (!reported).then_some(i); // the report of i is to wake us
            reported
        });
        verdicts.awaited = None;
        verdicts.of.get(i).cloned().flatten()
    }

    /// Waits until every record has its report, or `deadline`.
    fn wait(&self, deadline: Instant) {
        drop(self.wait_until(deadline, |v| v.missing == 0));
    }

    /// Waits until `done` (asked under the lock) or `deadline`; returns the lock.
    fn wait_until(
        &self,
        deadline: Instant,
        mut done: impl FnMut(&mut Verdicts) -> bool,
    ) -> std::sync::MutexGuard<'_, Verdicts> {
        let mut verdicts = self.verdicts.lock().unwrap_or_else(|e| e.into_inner());
        while !done(&mut verdicts) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            verdicts = match self.reported.wait_timeout(verdicts, left) {
                Ok((v, _)) => v,
                Err(e) => e.into_inner().0,
            };
        }
        verdicts
    }

    /// The verdicts; records with no report by the deadline go back unsent (librdkafka retries
    /// on its own until then: what it could not deliver is the cluster's doing).
    /// `client_said`: the producer's last error, if any (e.g. a failed TLS handshake).
    fn outcome(&self, client_said: Option<String>) -> Outcome {
        let verdicts = self.verdicts.lock().unwrap_or_else(|e| e.into_inner());
        let error = match client_said {
            Some(said) => format!("Kafka: no delivery report within request_timeout: {said}"),
            None => "Kafka: no delivery report within request_timeout (broker unreachable?)".into(),
        };
        Outcome::Events(
            (verdicts.of.iter().zip(&verdicts.refused))
                .map(|(v, &refused)| match (refused, v) {
                    // refused for its content after the batch's resends alone, up to the
                    // moment its outcome is taken: it proves nothing of its record
                    (true, _) => not_sent_alone("refused after its batch's resends"),
                    (false, Some(v)) => v.clone(),
                    (false, None) => Verdict::Unsent {
                        error: error.clone(),
                        retry_after: None,
                    },
                })
                .collect(),
        )
    }
}

/// Routes delivery reports to their batch, and keeps the client's last error (a broker it
/// cannot reach, a TLS handshake or a login that fails) for the sink's status. (After a fatal
/// error, the reports of what the producer held say they failed, and the next batch builds a
/// new producer.)
#[derive(Default)]
struct Reports {
    /// The client's last error, until a record is delivered.
    last_error: Mutex<Option<String>>,
    has_error: AtomicBool,
    /// The records this producer queued, while what became of them matters.
    copies: Mutex<Copies>,
    /// The producer of records sent alone (Producer::alone_producer).
    sends_alone: bool,
}

/// The records a producer queued, by event id, while what became of them matters (see the
/// top): queued and not yet reported, or delivered after their batch went back unsent.
#[derive(Default)]
struct Copies {
    by_id: HashMap<Arc<str>, Copy>,
    /// The records delivered late, oldest first, to be forgotten after DELIVERED_LATE_KEPT.
    late: VecDeque<(Instant, Arc<str>)>,
}

enum Copy {
    /// Queued and not yet reported; the places of later batches that wait for its report.
    Queued(Vec<Place>),
    /// Delivered (at this time) when no batch waited for it, its own having gone back unsent:
    /// the next batch of its key takes it for delivered.
    DeliveredLate(Instant),
}

/// How long a record delivered late is remembered: its key is tried again within its backoff
/// (backoff_max, 10 minutes by default). Forgotten, it is only sent again.
const DELIVERED_LATE_KEPT: Duration = Duration::from_secs(3600);

/// What became of a record an earlier batch of its key queued (that batch went back unsent).
enum EarlierCopy {
    /// There is none: queue this one.
    NotQueued,
    /// Still queued: its report is this record's.
    Queued,
    /// Delivered since, at this time: so is this record.
    Delivered(Instant),
}

/// A record's place in a batch: the batch and the record's index in it.
type Place = (Arc<Batch>, usize);

impl Copies {
    /// Event `id`'s copy queued by an earlier batch, if any; one still queued will report to
    /// `place` too. One event is in one batch out at a time (its shard's), so nothing queues
    /// it meanwhile.
    fn earlier(&mut self, id: &str, place: Place) -> EarlierCopy {
        match self.by_id.get_mut(id) {
            Some(Copy::Queued(waiting)) => {
                // only live batches wait: a record away for hours is tried again many times
                waiting.retain(|(earlier, _)| !earlier.over.load(Ordering::Relaxed));
                waiting.push(place);
                EarlierCopy::Queued
            }
            Some(&mut Copy::DeliveredLate(at)) => {
                self.by_id.remove(id);
                EarlierCopy::Delivered(at)
            }
            None => EarlierCopy::NotQueued,
        }
    }

    fn queueing(&mut self, id: &Arc<str>) {
        self.by_id.insert(Arc::clone(id), Copy::Queued(Vec::new()));
    }

    fn not_queued(&mut self, id: &str) {
        self.by_id.remove(id);
    }

    /// Record `id` was reported: the places still waiting for it, its own batch's first.
    /// Delivered with none, it is remembered for the next batch of its key. (A report that
    /// comes as its own batch's outcome is taken goes to neither: one more copy, no loss.)
    fn reported(&mut self, id: &Arc<str>, own: Place, delivered: bool) -> Vec<Place> {
        let mut waiting = match self.by_id.remove(id) {
            Some(Copy::Queued(waiting)) => waiting,
            _ => Vec::new(),
        };
        waiting.insert(0, own);
        waiting.retain(|(batch, _)| !batch.over.load(Ordering::Relaxed));
        if waiting.is_empty() && delivered {
            let now = Instant::now();
            self.forget_outlived(now);
            self.by_id.insert(Arc::clone(id), Copy::DeliveredLate(now));
            self.late.push_back((now, Arc::clone(id)));
        }
        waiting
    }

    fn forget_outlived(&mut self, now: Instant) {
        while let Some((at, id)) = self
            .late
            .front()
            .filter(|(at, _)| now.duration_since(*at) > DELIVERED_LATE_KEPT)
            .cloned()
        {
            self.late.pop_front();
            if matches!(self.by_id.get(&id), Some(Copy::DeliveredLate(t)) if *t == at) {
                self.by_id.remove(&id);
            }
        }
    }
}

impl Reports {
    fn copies(&self) -> std::sync::MutexGuard<'_, Copies> {
        self.copies.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl ClientContext for Reports {
    // librdkafka's own log lines stay out of the server log (errors reach status instead)
    fn log(&self, _level: rdkafka::config::RDKafkaLogLevel, _fac: &str, _log_message: &str) {}

    fn error(&self, error: KafkaError, reason: &str) {
        let mut last = self.last_error.lock().unwrap_or_else(|e| e.into_inner());
        // "all brokers are down" follows the error that says why: keep that one
        if error.rdkafka_error_code() == Some(Code::AllBrokersDown) && last.is_some() {
            return;
        }
        *last = Some(format!("{reason} ({error})"));
        self.has_error.store(true, Ordering::Relaxed);
    }
}

impl ProducerContext for Reports {
    type DeliveryOpaque = Box<(Arc<Batch>, usize, Arc<str>)>;

    fn delivery(&self, result: &DeliveryResult<'_>, opaque: Self::DeliveryOpaque) {
        let (batch, i, id) = *opaque;
        // a refusal of a record sent alone is about it; else perhaps about a batch-mate
        let refused =
            !self.sends_alone && result.as_ref().is_err_and(|(e, _)| refused_for_content(e));
        let verdict = match result {
            Ok(_) => {
                if self.has_error.swap(false, Ordering::Relaxed) {
                    *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = None;
                }
                Verdict::Delivered
            }
            Err((error, _)) => judge(error, Side::Broker),
        };
        let waiting = self
            .copies()
            .reported(&id, (batch, i), verdict == Verdict::Delivered);
        for (waiting, j) in waiting {
            match refused {
                // any batch waiting for it resends it alone before judging (send_refused_alone)
                true => waiting.report_refused(j, verdict.clone()),
                false => waiting.report(j, verdict.clone()),
            }
        }
    }
}

/// librdkafka's settings for a sink. The URL is kafka://host:port[,host:port...] (plaintext) or
/// kafkas://... (TLS, verified against tls_ca or the system's roots).
fn client_config(config: &Config) -> Result<ClientConfig, String> {
    let (tls, brokers) = bootstrap(&config.url)?;
    // librdkafka takes a connection setup timeout of at least 1 s, a request timeout of at
    // most 900 s
    let millis =
        |d: Duration, least: u128, most: u128| d.as_millis().clamp(least, most).to_string();
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("client.id", format!("outbox_ext/{}", config.name))
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("enable.gapless.guarantee", "true")
        .set("partitioner", "murmur2_random") // where a Java producer puts the same key
        .set("allow.auto.create.topics", "false") // a mistyped topic shows, it is not made
        .set("message.timeout.ms", "0") // never fail a record in the client (see the top)
        .set(
            "request.timeout.ms",
            millis(config.request_timeout, 1, 900_000),
        )
        .set(
            "socket.connection.setup.timeout.ms",
            millis(config.connect_timeout, 1000, 2_147_483_647),
        )
        .set(
            "topic.metadata.propagation.max.ms",
            millis(config.request_timeout / 3, 1, 3_600_000),
        )
        .set("linger.ms", millis(config.linger, 0, 900_000))
        .set(
            "compression.type",
            config.compression.as_deref().unwrap_or("none"),
        )
        .set("queue.buffering.max.kbytes", QUEUE_KBYTES.to_string())
        .set(
            "queue.buffering.max.messages",
            queue_messages(config).to_string(),
        );
    let sasl = config.sasl_mechanism.as_deref();
    c.set(
        "security.protocol",
        match (tls, sasl.is_some()) {
            (false, false) => "plaintext",
            (true, false) => "ssl",
            (false, true) => "sasl_plaintext",
            (true, true) => "sasl_ssl",
        },
    );
    if let Some(mechanism) = sasl {
        c.set("sasl.mechanism", mechanism)
            .set(
                "sasl.username",
                config.sasl_username.as_deref().unwrap_or(""),
            )
            .set("sasl.password", config.secret.as_deref().unwrap_or(""));
    }
    if let Some(pem) = &config.tls_ca {
        c.set("ssl.ca.pem", pem);
    }
    Ok(c)
}

/// Room for every batch in flight twice over (a copy left from a timed-out batch, the next).
fn queue_messages(config: &Config) -> usize {
    (config.batch_size.max(1) as usize * config.concurrency * 2).max(1000)
}

/// (TLS?, "host:port,...") of a kafka:// or kafkas:// URL.
pub fn bootstrap(url: &str) -> Result<(bool, String), String> {
    let (tls, rest) = if let Some(rest) = url.strip_prefix("kafka://") {
        (false, rest)
    } else if let Some(rest) = url.strip_prefix("kafkas://") {
        (true, rest)
    } else {
        return Err(format!("\"{url}\" is not a kafka:// or kafkas:// URL"));
    };
    let rest = rest.trim_end_matches('/');
    let ok = |b: &str| match b.rsplit_once(':') {
        Some((host, port)) => {
            !host.is_empty()
                && port.parse::<u16>().is_ok_and(|p| p > 0)
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-.[]:_".contains(c))
        }
        None => false,
    };
    if rest.split(',').all(ok) {
        Ok((tls, rest.to_string()))
    } else {
        Err(format!(
            "\"{url}\" lists a broker that is not host:port (kafka://host1:9092,host2:9092)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_config;
    use super::*;
    use crate::sinks::Kind;

    #[test]
    fn a_refusal_for_content_is_certain_only_when_the_client_makes_it() {
        let too_large = KafkaError::MessageProduction(Code::MessageSizeTooLarge);
        assert!(matches!(
            judge(&too_large, Side::Client),
            Verdict::Invalid { .. }
        ));
        assert!(matches!(
            judge(&too_large, Side::Broker),
            Verdict::Reject { .. }
        ));
        let invalid = KafkaError::MessageProduction(Code::InvalidRecord);
        assert!(matches!(
            judge(&invalid, Side::Broker),
            Verdict::Reject { .. }
        ));
        let bad_topic = KafkaError::MessageProduction(Code::InvalidTopic);
        assert!(matches!(
            judge(&bad_topic, Side::Broker),
            Verdict::Invalid { .. }
        ));
        let away = KafkaError::MessageProduction(Code::NotEnoughReplicas);
        assert!(matches!(judge(&away, Side::Broker), Verdict::Unsent { .. }));
    }

    #[test]
    fn sasl_over_tls_settings() {
        let config = Config {
            sasl_mechanism: Some("SCRAM-SHA-512".into()),
            sasl_username: Some("svc".into()),
            secret: Some("pw".into()),
            tls_ca: Some("-----BEGIN CERTIFICATE-----".into()),
            compression: Some("zstd".into()),
            ..test_config(Kind::Kafka, "kafkas://b1:9093,b2:9093")
        };
        let c = client_config(&config).unwrap();
        for (key, value) in [
            ("bootstrap.servers", "b1:9093,b2:9093"),
            ("security.protocol", "sasl_ssl"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "svc"),
            ("sasl.password", "pw"),
            ("ssl.ca.pem", "-----BEGIN CERTIFICATE-----"),
            ("compression.type", "zstd"),
            ("enable.idempotence", "true"),
            ("acks", "all"),
            ("message.timeout.ms", "0"),
        ] {
            assert_eq!(c.get(key), Some(value), "{key}");
        }
        let plain = client_config(&test_config(Kind::Kafka, "kafka://b:9092")).unwrap();
        assert_eq!(plain.get("security.protocol"), Some("plaintext"));
        assert_eq!(plain.get("sasl.mechanism"), None);
    }

    #[test]
    fn bootstrap_urls() {
        assert_eq!(
            bootstrap("kafka://a:9092,b.example:9093"),
            Ok((false, "a:9092,b.example:9093".into()))
        );
        assert_eq!(
            bootstrap("kafkas://[::1]:9092/"),
            Ok((true, "[::1]:9092".into()))
        );
        for bad in [
            "http://a:1",
            "kafka://",
            "kafka://a",
            "kafka://a:0",
            "kafka://a:1,,b:2",
            "kafka://a b:1",
        ] {
            assert!(bootstrap(bad).is_err(), "{bad}");
        }
    }

    /// A record queued by a batch that went back unsent at its deadline.
    fn queued_by_a_batch_gone_back(copies: &mut Copies, id: &Arc<str>) -> Arc<Batch> {
        let first = Arc::new(Batch::new(1));
        copies.queueing(id);
        first.over.store(true, Ordering::Relaxed);
        first
    }

    #[test]
    fn a_record_still_queued_reports_to_the_next_batch_of_its_key_not_sent_again() {
        let (mut copies, id) = (Copies::default(), Arc::from("e1"));
        let first = queued_by_a_batch_gone_back(&mut copies, &id);
        let second = Arc::new(Batch::new(2));
        let earlier = copies.earlier("e1", (Arc::clone(&second), 1));
        assert!(matches!(earlier, EarlierCopy::Queued));
        for (batch, j) in copies.reported(&id, (Arc::clone(&first), 0), true) {
            batch.report(j, Verdict::Delivered);
        }
        assert_eq!(second.verdict(1), Some(Verdict::Delivered));
        assert_eq!(first.verdict(0), None, "a batch gone back takes no report");
    }

    #[test]
    fn a_record_delivered_after_its_batch_went_back_is_taken_for_delivered_once() {
        let (mut copies, id) = (Copies::default(), Arc::from("e1"));
        let first = queued_by_a_batch_gone_back(&mut copies, &id);
        let before = Instant::now();
        assert!(copies.reported(&id, (first, 0), true).is_empty());
        let next = Arc::new(Batch::new(1));
        std::thread::sleep(Duration::from_millis(5));
        let earlier = copies.earlier("e1", (Arc::clone(&next), 0));
        // with the time it was delivered: not taken as its topic's taking a record now
        assert!(
            matches!(earlier, EarlierCopy::Delivered(at) if at >= before && at.elapsed() >= Duration::from_millis(5))
        );
        let again = copies.earlier("e1", (next, 0));
        assert!(matches!(again, EarlierCopy::NotQueued));
    }

    #[test]
    fn a_record_failed_after_its_batch_went_back_is_sent_again() {
        let (mut copies, id) = (Copies::default(), Arc::from("e1"));
        let first = queued_by_a_batch_gone_back(&mut copies, &id);
        assert!(copies.reported(&id, (first, 0), false).is_empty());
        let earlier = copies.earlier("e1", (Arc::new(Batch::new(1)), 0));
        assert!(matches!(earlier, EarlierCopy::NotQueued));
    }

    #[test]
    fn a_refusal_for_content_reported_after_the_resends_alone_is_never_judged() {
        let batch = Batch::new(2);
        batch.report(0, Verdict::Delivered);
        let refused = || Verdict::Reject {
            error: "Kafka: Broker: Message size too large".into(),
        };
        // its batch's resends done (send_refused_alone), the refusal comes in
        batch.report_refused(1, refused());
        let Outcome::Events(verdicts) = batch.outcome(None) else {
            panic!("a batch's outcome is its events' verdicts")
        };
        assert_eq!(verdicts[0], Verdict::Delivered);
        assert!(
            matches!(&verdicts[1], Verdict::Unsent { error, .. } if error.contains("not sent alone"))
        );
        // a verdict of ours on a refused record (held back behind its key) stands
        let held = Batch::new(1);
        held.report_refused(0, refused());
        held.replace(0, held_back());
        let Outcome::Events(verdicts) = held.outcome(None) else {
            panic!("a batch's outcome is its events' verdicts")
        };
        assert_eq!(verdicts[0], Verdict::HeldBack);
    }

    #[test]
    fn records_delivered_late_are_forgotten_after_a_while() {
        let (mut copies, id) = (Copies::default(), Arc::from("e1"));
        let first = queued_by_a_batch_gone_back(&mut copies, &id);
        copies.reported(&id, (first, 0), true);
        copies.forget_outlived(Instant::now() + DELIVERED_LATE_KEPT + Duration::from_secs(1));
        assert!(copies.by_id.is_empty() && copies.late.is_empty());
    }
}
