//! Sinks: where the background worker delivers events. A sink is a row of outbox.sinks
//! (sql/sinks.sql); here it becomes a `Client` that turns a batch of events into HTTP requests
//! or Kafka records, and the replies into one verdict per event.
//!
//! The delivery code in this module runs on the worker's delivery threads: no call into
//! PostgreSQL, no pgrx, no panics on input (a panic is caught by the pool and counted as a
//! failed batch).

mod check;
pub mod evidence;
pub mod http;
pub mod kafka;
pub mod kafka_rest;
pub mod records;
pub mod webhook;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

thread_local! {
    /// Set when the worker gave up on the batch this delivery thread sends (Pool::abandon):
    /// its shard was given back and may be out again under the sink's new settings, so no
    /// further request of it starts (each would be a duplicate beyond the batches in flight).
    static GIVEN_UP: RefCell<Option<Arc<AtomicBool>>> = const { RefCell::new(None) };
}

/// The flag that says the current thread's batch was given up on (see GIVEN_UP).
pub fn delivering(given_up: Arc<AtomicBool>) {
    GIVEN_UP.with(|g| *g.borrow_mut() = Some(given_up));
}

fn given_up() -> bool {
    GIVEN_UP.with(|g| {
        g.borrow()
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Relaxed))
    })
}

/// One claimed event, as the worker read it (JSON fields kept as the text PostgreSQL gave).
#[derive(Debug, Clone)]
pub struct Event {
    pub id: String,
    pub topic: Option<String>,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    /// The jsonb payload as JSON text; None for a NULL payload (a Kafka tombstone).
    pub payload: Option<String>,
    /// The jsonb headers (an object of strings) as JSON text.
    pub headers: Option<String>,
    /// ISO 8601, with offset.
    pub created_at: String,
    /// 1 for a first delivery; more for the retried head of a parked key.
    pub attempt: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Webhook,
    Kafka,
    KafkaRestV2,
    KafkaRestV3,
}

impl Kind {
    pub fn parse(kind: &str) -> Option<Kind> {
        match kind {
            "webhook" => Some(Kind::Webhook),
            "kafka" => Some(Kind::Kafka),
            "kafka_rest_v2" => Some(Kind::KafkaRestV2),
            "kafka_rest_v3" => Some(Kind::KafkaRestV3),
            _ => None,
        }
    }
}

/// A sink's configuration, read from outbox.sinks (validated there by a trigger).
#[derive(Debug, Clone)]
pub struct Config {
    pub name: String,
    /// The sink's consumer (outbox.consumers.id): a sink dropped and made again under its name
    /// is another consumer.
    pub consumer_id: i32,
    pub kind: Kind,
    /// webhook and Kafka REST: http(s)://...; kafka: kafka(s)://host:port,...
    pub url: String,
    /// webhook: "batch" or "single"; kafka: "outbox" or "debezium"; Kafka REST: "json",
    /// "binary" (or "string" in v3).
    pub format: String,
    pub topics: Option<Vec<String>>,
    pub aggregate_types: Option<Vec<String>>,
    pub batch_size: i32,
    pub concurrency: usize,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    /// webhook: Standard Webhooks signing secret ("whsec_" + base64); kafka: SASL password.
    pub secret: Option<String>,
    pub http_headers: Vec<(String, String)>,
    /// PEM certificates trusted instead of the public roots.
    pub tls_ca: Option<String>,
    pub topic_map: HashMap<String, String>,
    pub cluster_id: Option<String>,
    /// kafka: the producer's compression codec (kafka::COMPRESSIONS; None: none).
    pub compression: Option<String>,
    /// kafka: how long the producer waits to fill a request.
    pub linger: Duration,
    /// kafka: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (None: no SASL).
    pub sasl_mechanism: Option<String>,
    pub sasl_username: Option<String>,
}

impl Config {
    /// Events outside the sink's routing are skipped (acknowledged without a request).
    /// `topics` matches the event's topic: the one it was emitted with, else its aggregate
    /// type (the topic it is sent to, before `topic_map` renames it); as outbox_internal._routes.
    pub fn routes(&self, event: &Event) -> bool {
        let topic = event.topic.as_deref().unwrap_or(&event.aggregate_type);
        let topic_ok =
            (self.topics.as_ref()).is_none_or(|topics| topics.iter().any(|x| x == topic));
        let type_ok = self
            .aggregate_types
            .as_ref()
            .is_none_or(|types| types.contains(&event.aggregate_type));
        topic_ok && type_ok
    }
}

/// What became of one event.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Delivered,
    /// Not for this sink (its routing): acknowledged without a request, and not counted.
    Skipped,
    /// Failed, may succeed later: the key is parked and retried with backoff.
    Retry {
        error: String,
        retry_after: Option<Duration>,
    },
    /// Refused for good, as far as the sink says (a 4xx; a 413 for one event; a record a broker
    /// refuses as too large or not valid): dead-lettered once the sink is shown to take other
    /// events (src/worker/health.rs). A limit lowered by mistake (a proxy's body size) refuses
    /// every event: the sink is then suspended, not its events dead-lettered. (A topic's
    /// max.message.bytes lowered refuses only that topic's records: the Kafka sinks hold such
    /// a refusal back until the topic is shown to take records, src/sinks/evidence.rs.)
    Reject {
        error: String,
    },
    /// The event itself can never be sent, decided here before it reaches the sink: a topic
    /// name Kafka refuses, a record over the client's own size limit. Dead-lettered whatever
    /// the sink's health.
    Invalid {
        error: String,
    },
    /// Not sent because an earlier event of its key in the batch failed (settle keeps a failed
    /// key's later events back whatever is said of them).
    HeldBack,
    /// Carried by a request that found the sink down (Outcome::SinkDown) while nothing of its
    /// batch had gone through (else it is Unsent: Tally::record): the worker judges it
    /// (src/worker/health.rs), as a retry when the sink is shown healthy for other events and
    /// the failure is `blameable`, else by giving the batch back. The batch's events no
    /// request carried are Unsent: nothing can be said of them.
    Down {
        error: String,
        retry_after: Option<Duration>,
        blameable: bool,
    },
    /// Not attempted, or refused for a reason of the sink's own (throttled, a topic it lacks,
    /// no report by the deadline, the batch out of time): never blamed on the event. Its key
    /// waits, in order, with no attempt counted (settle's `"attempted": false`).
    Unsent {
        error: String,
        retry_after: Option<Duration>,
    },
}

impl Verdict {
    pub fn is_failure(&self) -> bool {
        !matches!(self, Verdict::Delivered | Verdict::Skipped)
    }

    /// A failure the sink answered (a retry, a refusal, found down) as not sent: nothing is
    /// counted, its key waits, the error stays its own. Any other verdict as it is.
    pub fn uncounted(self) -> Verdict {
        match self {
            Verdict::Retry { error, retry_after } => Verdict::Unsent { error, retry_after },
            Verdict::Reject { error } => Verdict::Unsent {
                error,
                retry_after: None,
            },
            other => other.unsent_if_down().unwrap_or(other),
        }
    }

    /// For a Down verdict, the same failure as not sent.
    pub fn unsent_if_down(&self) -> Option<Verdict> {
        match self {
            Verdict::Down {
                error, retry_after, ..
            } => Some(Verdict::Unsent {
                error: error.clone(),
                retry_after: *retry_after,
            }),
            _ => None,
        }
    }
}

/// What became of a request, or of a batch (Client::deliver: always Events).
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The whole request failed in a way that points at the sink (unreachable, TLS, 401, 404,
    /// 5xx from a gateway). Its events become Down (Tally::record): the worker blames them only
    /// when the sink is shown healthy for other events (src/worker/health.rs), and only if the
    /// failure is `blameable`; otherwise the batch goes back unattempted.
    SinkDown {
        error: String,
        retry_after: Option<Duration>,
        /// false when what the request carried cannot have caused it: the request never
        /// reached the receiver (no connection, DNS, TLS), the receiver refused our credentials
        /// or connection settings, or a Kafka REST proxy failed (it waits on the brokers). A
        /// sink that fails so for some requests while delivering others (one bad address or
        /// pod of several, a secret rotated on some pods) is failing, not its events.
        blameable: bool,
    },
    /// One verdict per event, in batch order.
    Events(Vec<Verdict>),
}

impl Outcome {
    /// The same verdict for all `n` events of a request.
    pub fn all(n: usize, verdict: Verdict) -> Outcome {
        Outcome::Events(vec![verdict; n])
    }

    /// The verdicts of the `n` events of a request: Down for each, when it found the sink down.
    pub fn into_verdicts(self, n: usize) -> Vec<Verdict> {
        match self {
            Outcome::Events(verdicts) => verdicts,
            Outcome::SinkDown {
                error,
                retry_after,
                blameable,
            } => {
                let down = Verdict::Down {
                    error,
                    retry_after,
                    blameable,
                };
                vec![down; n]
            }
        }
    }

    /// The sink's ask to wait, if it made one: a verdict unsent with a Retry-After (a 429, a
    /// 503 shedding load). The batch then sends nothing more: what is left waits as asked.
    pub fn asks_to_wait(&self) -> Option<Verdict> {
        let waits = |v: &&Verdict| {
            matches!(
                v,
                Verdict::Unsent {
                    retry_after: Some(_),
                    ..
                }
            )
        };
        match self {
            Outcome::Events(verdicts) => verdicts.iter().find(waits).cloned(),
            Outcome::SinkDown { .. } => None,
        }
    }
}

/// A sink ready to deliver: its configuration and how it reaches the sink.
pub struct Client {
    pub config: Config,
    transport: Transport,
    /// Which Kafka topics take records, for the Kafka REST sinks (the native sink keeps its
    /// own, with its producer).
    topics: std::sync::Mutex<evidence::TopicEvidence>,
}

enum Transport {
    /// An HTTP agent (connection pool), and the webhook signer if the sink has a secret.
    Http {
        agent: ureq::Agent,
        signer: Option<webhook::Signer>,
    },
    Kafka(kafka::Producer),
}

impl Client {
    /// Fails on a configuration the worker cannot use (rows saved before 0.6.0 checked them).
    pub fn new(config: Config) -> Result<Client, String> {
        let transport = match config.kind {
            Kind::Kafka => Transport::Kafka(kafka::Producer::new(&config)?),
            _ => Transport::Http {
                agent: http::agent(&config)?,
                signer: match &config.secret {
                    Some(secret) => Some(webhook::Signer::new(secret)?),
                    None => None,
                },
            },
        };
        for (name, value) in &config.http_headers {
            http::check_header(name, value)?; // a row saved before the check existed
        }
        Ok(Client {
            config,
            transport,
            topics: Default::default(),
        })
    }

    /// Delivers a batch: the events of the shard in one go, then (over HTTP) the retried heads
    /// of parked keys one request each, so that a poisoned event fails alone. A probe of a
    /// suspended sink sends every event alone, for the same reason. A Kafka producer reports
    /// on each record by itself: its whole batch goes in one go. No request starts that could
    /// outlast `deadline` (the batch's lease): what is left then goes back unsent.
    pub fn deliver(&self, events: &[Event], deadline: Instant, probe: bool) -> Outcome {
        let started = Instant::now();
        let alone = |e: &Event| (e.attempt > 1 || probe) && self.config.kind != Kind::Kafka;
        let mut tally = match probe {
            true => Tally::probing(events.len()),
            false => Tally::new(events.len()),
        };
        // routed away first: skipped whether or not the batch stops before their group
        let (routed, skipped): (Vec<usize>, Vec<usize>) =
            (0..events.len()).partition(|&i| self.config.routes(&events[i]));
        for i in skipped {
            tally.set(i, Verdict::Skipped);
        }
        let (retried, first): (Vec<usize>, Vec<usize>) =
            routed.into_iter().partition(|&i| alone(&events[i]));
        let mut failed_keys: Vec<&str> = Vec::new();
        let groups = std::iter::once(first).chain(retried.into_iter().map(|i| vec![i]));
        for group in groups {
            let (held, routed): (Vec<usize>, Vec<usize>) = group
                .into_iter()
                .partition(|&i| failed_keys.contains(&events[i].aggregate_id.as_str()));
            for i in held {
                tally.set(i, held_back());
            }
            if routed.is_empty() {
                continue;
            }
            if out_of_time(&self.config, deadline) {
                break; // finish() gives the rest back unsent
            }
            let part: Vec<&Event> = routed.iter().map(|&i| &events[i]).collect();
            let outcome = self.send(&part, (started, deadline));
            let failed: Vec<usize> = match &outcome {
                Outcome::Events(verdicts) => (routed.iter().zip(verdicts))
                    .filter(|(_, v)| v.is_failure())
                    .map(|(&i, _)| i)
                    .collect(),
                Outcome::SinkDown { .. } => routed.clone(), // (a probe goes on past it)
            };
            failed_keys.extend(failed.iter().map(|&i| events[i].aggregate_id.as_str()));
            if let Some(stop) = tally.record(&routed, outcome) {
                return stop; // (its retried heads too)
            }
        }
        tally.finish()
    }

    /// Sends a group of a batch begun at `started`.
    fn send(&self, events: &[&Event], (started, deadline): (Instant, Instant)) -> Outcome {
        match (&self.transport, self.config.kind) {
            (Transport::Kafka(producer), _) => producer.send(&self.config, events, deadline),
            (Transport::Http { agent, signer }, Kind::Webhook) => {
                webhook::send(agent, &self.config, signer.as_ref(), events, deadline)
            }
            (Transport::Http { agent, .. }, _) => kafka_rest::send(
                agent,
                &self.config,
                &self.topics,
                events,
                (started, deadline),
            ),
        }
    }
}

/// Whether a request started now could still be going at `deadline` (the batch's lease, less
/// a margin for settling): a batch must never be re-claimed while part of it is still out, or
/// the later copy could overtake newer events of its keys. Or the batch was given up on.
pub fn out_of_time(config: &Config, deadline: Instant) -> bool {
    Instant::now() + config.request_timeout >= deadline || given_up()
}

/// The verdicts of a batch sent in several requests. When the sink goes down after part of the
/// batch got through, giving the whole batch back would send that part again: instead the part
/// that got through is acked and the rest goes back unsent (its keys wait, no attempt
/// counted). A batch that finds the sink down before anything of it went through has only the
/// events that request carried marked Down (Verdict::Down), for the worker to judge; later
/// batches find the sink down at their first request too, and are given back whole unless
/// the sink is shown healthy.
///
/// A probe of a suspended sink (`probing`) sends each event alone and goes on past one event
/// that finds the sink down in a way it may have caused (a 502 from a receiver that crashes on
/// it, a timeout): stopped there, every probe would test that event first and nothing behind
/// it, and a sink whose only work lies behind a poisoned event would stay suspended for good.
/// A second such event stops it: the sink is down, as far as two requests can tell.
///
/// A request the sink answers with a Retry-After (Outcome::asks_to_wait) ends the batch: what
/// is left waits as asked.
pub struct Tally {
    verdicts: Vec<Option<Verdict>>,
    any_sent: bool,
    probing: bool,
    passed_down: bool,
}

impl Tally {
    pub fn new(n: usize) -> Tally {
        Tally {
            verdicts: vec![None; n],
            any_sent: false,
            probing: false,
            passed_down: false,
        }
    }

    pub fn probing(n: usize) -> Tally {
        Tally {
            probing: true,
            ..Tally::new(n)
        }
    }

    pub fn set(&mut self, i: usize, verdict: Verdict) {
        self.verdicts[i] = Some(verdict);
    }

    /// Takes a request's outcome for the events `indexes`; Some(outcome of the whole batch)
    /// when the sink is down and the batch must stop. Only the events the request carried are
    /// Down, and only while nothing of the batch has gone through; the rest go back unsent.
    pub fn record(&mut self, indexes: &[usize], outcome: Outcome) -> Option<Outcome> {
        let wait = outcome.asks_to_wait();
        let verdicts = outcome.into_verdicts(indexes.len());
        let blameable_alone = |v: &[Verdict]| {
            matches!(
                v,
                [Verdict::Down {
                    blameable: true,
                    ..
                }]
            )
        };
        if self.probing && !self.any_sent && !self.passed_down && blameable_alone(&verdicts) {
            // (a probe goes on: health.rs judges the Down with what came after it)
            self.passed_down = true;
            self.verdicts[indexes[0]] = verdicts.into_iter().next();
            return None;
        }
        let unsent = verdicts.iter().find_map(Verdict::unsent_if_down);
        for (&i, v) in indexes.iter().zip(verdicts) {
            self.any_sent |= v == Verdict::Delivered;
            self.verdicts[i] = Some(v);
        }
        if let (None, Some(wait)) = (&unsent, wait) {
            return Some(self.finish_with(wait));
        }
        let unsent = unsent?;
        if self.any_sent {
            // part of the batch got through: sending it again would duplicate it, so the part
            // the sink did not take waits, uncounted
            for v in self.verdicts.iter_mut().flatten() {
                if let Some(not_sent) = v.unsent_if_down() {
                    *v = not_sent;
                }
            }
        }
        Some(self.finish_with(unsent))
    }

    /// The verdicts; an event no request carried (the batch ran out of time) goes back unsent:
    /// an event without a verdict from the sink is never acked.
    pub fn finish(mut self) -> Outcome {
        self.finish_with(Verdict::Unsent {
            error: "not sent: the batch ran out of time within its lease".into(),
            retry_after: None,
        })
    }

    fn finish_with(&mut self, unsent: Verdict) -> Outcome {
        Outcome::Events(
            std::mem::take(&mut self.verdicts)
                .into_iter()
                .map(|v| v.unwrap_or_else(|| unsent.clone()))
                .collect(),
        )
    }
}

/// A request the sink refused for good (too large, or a 4xx: http::refuses_for_good), sent
/// again as two halves, in order (and so on, down to single events: only an event refused
/// alone is judged, not its batch-mates). Events of the second half whose key failed in the
/// first are held back. No half is sent once `out_of_time()` (sinks::out_of_time, for the
/// batch's deadline): what is left then goes back unsent.
pub fn split(
    events: &[&Event],
    out_of_time: impl Fn() -> bool,
    send: impl Fn(&[&Event]) -> Outcome,
) -> Outcome {
    let first = &events[..events.len() / 2];
    let mut tally = Tally::new(events.len());
    if out_of_time() {
        return tally.finish();
    }
    let outcome = send(first);
    let failed: Vec<&str> = match &outcome {
        Outcome::Events(verdicts) => first
            .iter()
            .zip(verdicts)
            .filter(|(_, v)| **v != Verdict::Delivered)
            .map(|(e, _)| e.aggregate_id.as_str())
            .collect(),
        Outcome::SinkDown { .. } => Vec::new(),
    };
    let first_indexes: Vec<usize> = (0..first.len()).collect();
    if let Some(stop) = tally.record(&first_indexes, outcome) {
        return stop;
    }
    let (held, sent): (Vec<usize>, Vec<usize>) = (first.len()..events.len())
        .partition(|&i| failed.contains(&events[i].aggregate_id.as_str()));
    for i in held {
        tally.set(i, held_back());
    }
    if !sent.is_empty() && !out_of_time() {
        let part: Vec<&Event> = sent.iter().map(|&i| events[i]).collect();
        if let Some(stop) = tally.record(&sent, send(&part)) {
            return stop;
        }
    }
    tally.finish()
}

/// The verdict of an event not sent because an earlier event of its key failed.
pub fn held_back() -> Verdict {
    Verdict::HeldBack
}

/// A sink's text (an error reply's body, a proxy's message) as PostgreSQL can take it: a NUL
/// (U+0000) becomes U+FFFD. PostgreSQL's text and jsonb hold no NUL: one in a failure's error
/// made every settle of its batch fail (jsonb refuses `\u0000`), so its shard never moved on
/// and the batch went out again at every lease.
pub fn without_nul(text: &str) -> String {
    text.replace('\0', "\u{FFFD}")
}

/// Appends `s` as a JSON string.
pub fn push_json_str(out: &mut String, s: &str) {
    match serde_json::to_string(s) {
        Ok(quoted) => out.push_str(&quoted),
        Err(_) => out.push_str("null"), // cannot happen for a &str
    }
}

/// A sink of `kind` at `url` with the defaults of outbox.create_sink, for unit tests.
#[cfg(test)]
pub fn test_config(kind: Kind, url: &str) -> Config {
    Config {
        name: "test".into(),
        consumer_id: 1,
        kind,
        url: url.into(),
        format: String::new(),
        topics: None,
        aggregate_types: None,
        batch_size: 100,
        concurrency: 8,
        connect_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(30),
        secret: None,
        http_headers: vec![],
        tls_ca: None,
        topic_map: HashMap::new(),
        cluster_id: None,
        compression: None,
        linger: Duration::from_millis(5),
        sasl_mechanism: None,
        sasl_username: None,
    }
}

/// An event of key `key` with empty fields, for unit tests.
#[cfg(test)]
pub fn test_event(key: &str) -> Event {
    Event {
        id: String::new(),
        topic: None,
        aggregate_type: String::new(),
        aggregate_id: key.into(),
        event_type: String::new(),
        payload: Some("{}".into()),
        headers: None,
        created_at: String::new(),
        attempt: 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_out_of_time_sends_nothing_and_goes_back_unsent() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        listener.set_nonblocking(true).expect("nonblocking");
        let url = format!("http://{}/", listener.local_addr().expect("bound"));
        let client = Client::new(test_config(Kind::Webhook, &url)).expect("a client");
        let events: Vec<Event> = ["a", "b"].map(test_event).to_vec();
        // request_timeout is 30 s: a lease ending sooner leaves no time for a request
        let deadline = Instant::now() + Duration::from_secs(10);
        let Outcome::Events(verdicts) = client.deliver(&events, deadline, false) else {
            panic!("expected verdicts");
        };
        assert!(
            verdicts.iter().all(|v| matches!(v, Verdict::Unsent { .. })),
            "{verdicts:?}"
        );
        assert!(listener.accept().is_err(), "no request was started");
    }

    fn down() -> Outcome {
        Outcome::SinkDown {
            error: "refused".into(),
            retry_after: None,
            blameable: true,
        }
    }

    #[test]
    fn a_split_sends_no_half_past_its_deadline() {
        let events: Vec<Event> = ["a", "b", "c", "d"].map(test_event).to_vec();
        let refs: Vec<&Event> = events.iter().collect();
        let sent = std::cell::Cell::new(0);
        let outcome = split(
            &refs,
            || sent.get() > 0,
            |part| {
                sent.set(sent.get() + 1);
                Outcome::all(part.len(), Verdict::Delivered)
            },
        );
        assert_eq!(sent.get(), 1, "the second half is not sent late");
        let Outcome::Events(v) = outcome else {
            panic!("expected verdicts")
        };
        assert_eq!(v[..2], [Verdict::Delivered, Verdict::Delivered]);
        assert!(v[2..].iter().all(|v| matches!(v, Verdict::Unsent { .. })));
    }

    #[test]
    fn a_split_request_holds_back_the_second_half_of_a_failed_key() {
        let events: Vec<Event> = ["a", "bad", "b", "bad"].map(test_event).to_vec();
        let refs: Vec<&Event> = events.iter().collect();
        let sent = std::cell::RefCell::new(Vec::new());
        let outcome = split(
            &refs,
            || false,
            |part| {
                sent.borrow_mut().push(part.len());
                Outcome::Events(
                    part.iter()
                        .map(|e| match e.aggregate_id.as_str() {
                            "bad" => Verdict::Retry {
                                error: "500".into(),
                                retry_after: None,
                            },
                            _ => Verdict::Delivered,
                        })
                        .collect(),
                )
            },
        );
        assert_eq!(
            *sent.borrow(),
            vec![2, 1],
            "the second bad event was not sent"
        );
        let Outcome::Events(v) = outcome else {
            panic!("expected verdicts")
        };
        assert_eq!(
            (v[0].clone(), v[2].clone()),
            (Verdict::Delivered, Verdict::Delivered)
        );
        assert!(matches!(&v[1], Verdict::Retry { error, .. } if error == "500"));
        assert_eq!(v[3], held_back());
    }

    #[test]
    fn a_sink_found_down_before_anything_went_through_marks_down_only_what_it_carried() {
        let mut tally = Tally::new(4);
        tally.set(2, Verdict::Skipped); // skipped by routing: not a delivery
        let Some(Outcome::Events(v)) = tally.record(&[0, 1], down()) else {
            panic!("expected verdicts");
        };
        let was_down = Verdict::Down {
            error: "refused".into(),
            retry_after: None,
            blameable: true,
        };
        assert_eq!(v[..3], [was_down.clone(), was_down, Verdict::Skipped]);
        assert!(
            matches!(&v[3], Verdict::Unsent { .. }),
            "not carried: unsent"
        );
    }

    #[test]
    fn a_batch_whose_first_request_finds_the_sink_down_sends_no_retried_head() {
        // a sink that closes each connection unanswered: down, as a restarting receiver is
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        let url = format!("http://{}/", listener.local_addr().expect("bound"));
        let requests = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = requests.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                drop(conn);
            }
        });
        let mut config = test_config(Kind::Webhook, &url);
        config.topics = Some(vec!["mine".into()]);
        let client = Client::new(config).expect("a client");
        let mut events: Vec<Event> = ["a", "b", "head", "away"].map(test_event).to_vec();
        for e in &mut events[..3] {
            e.topic = Some("mine".into());
        }
        events[2].attempt = 3; // a parked key's head: it would go alone, after the rest
        let deadline = Instant::now() + Duration::from_secs(60);
        let Outcome::Events(v) = client.deliver(&events, deadline, false) else {
            panic!("expected verdicts");
        };
        assert!(matches!(v[0], Verdict::Down { .. }), "{v:?}");
        assert!(matches!(v[1], Verdict::Down { .. }), "{v:?}");
        assert!(
            matches!(v[2], Verdict::Unsent { .. }),
            "the head was not sent: {v:?}"
        );
        assert_eq!(v[3], Verdict::Skipped, "routed away");
        let requests = requests.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(requests, 1, "only the first request was made");
    }

    #[test]
    fn a_probe_goes_on_past_an_event_that_found_the_sink_down_as_it_may_have_made_it() {
        let mut tally = Tally::probing(3);
        assert_eq!(tally.record(&[0], down()), None, "a 502, a timeout: go on");
        assert_eq!(
            tally.record(&[1], Outcome::all(1, Verdict::Delivered)),
            None
        );
        let unreached = Outcome::SinkDown {
            error: "connection refused".into(),
            retry_after: None,
            blameable: false,
        };
        let Some(Outcome::Events(v)) = tally.record(&[2], unreached) else {
            panic!("nothing it carried made it: stop");
        };
        assert!(matches!(&v[0], Verdict::Unsent { .. }), "{v:?}");
        assert_eq!(v[1], Verdict::Delivered);
        assert!(matches!(&v[2], Verdict::Unsent { .. }), "{v:?}");
        let mut tally = Tally::probing(2);
        assert_eq!(tally.record(&[0], down()), None);
        let Outcome::Events(v) = tally.finish() else {
            panic!("verdicts")
        };
        assert!(matches!(&v[0], Verdict::Down { .. }), "{v:?}");
        assert!(matches!(&v[1], Verdict::Unsent { .. }), "{v:?}");
        // a second event finding the sink so: down, as far as two requests can tell
        let mut tally = Tally::probing(3);
        assert_eq!(tally.record(&[0], down()), None);
        let Some(Outcome::Events(v)) = tally.record(&[1], down()) else {
            panic!("stopped at the second")
        };
        assert!(matches!(
            (&v[0], &v[1]),
            (Verdict::Down { .. }, Verdict::Down { .. })
        ));
        assert!(matches!(&v[2], Verdict::Unsent { .. }), "{v:?}");
    }

    #[test]
    fn a_request_answered_with_a_retry_after_ends_the_batch() {
        let mut tally = Tally::new(3);
        let asked = Verdict::Unsent {
            error: "HTTP 429".into(),
            retry_after: Some(Duration::from_secs(2)),
        };
        let Some(Outcome::Events(v)) = tally.record(&[0], Outcome::all(1, asked.clone())) else {
            panic!("the batch ends")
        };
        assert_eq!(v, vec![asked.clone(), asked.clone(), asked]);
        let mut tally = Tally::new(2);
        let throttled = Verdict::Unsent {
            error: "HTTP 429".into(),
            retry_after: None,
        };
        assert_eq!(
            tally.record(&[0], Outcome::all(1, throttled)),
            None,
            "no time said"
        );
    }

    #[test]
    fn a_sink_down_after_part_got_through_keeps_that_part() {
        let mut tally = Tally::new(3);
        assert_eq!(
            tally.record(&[0], Outcome::all(1, Verdict::Delivered)),
            None
        );
        let Some(Outcome::Events(v)) = tally.record(&[1], down()) else {
            panic!("expected verdicts");
        };
        assert_eq!(v[0], Verdict::Delivered);
        assert!(matches!(&v[1], Verdict::Unsent { error, .. } if error == "refused"));
        assert!(matches!(&v[2], Verdict::Unsent { .. }), "not sent: unsent");
    }
}
