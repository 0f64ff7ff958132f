//! Prometheus metrics, served over HTTP by the worker when `outbox_ext.metrics_address` is set
//! (`scrapes` answers the requests).
//!
//! The serving thread never calls into PostgreSQL: it only encodes figures the main thread
//! keeps up to date. Those are what the worker measures itself (how long each batch took to
//! deliver, batches in flight) and what it reads from outbox.status, at most every two seconds
//! and only while someone scrapes (pending events, lag, parked keys, dead letters, delivered
//! and failed totals). Labels are the database and the consumer (a sink's consumer has the
//! sink's name); no URL, secret or other sink setting appears in them.

use super::health::{Health, State};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Labels {
    database: String,
    consumer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    database: String,
    consumer: String,
    state: String,
}

/// The states outbox_sink_state has a series for (a disabled sink has none: it is gone).
const STATES: [&str; 2] = ["healthy", "suspended"];

/// One consumer's row of outbox.status, as the worker reads it (ages in seconds).
#[derive(Debug, Deserialize)]
pub struct ConsumerStatus {
    pub consumer: String,
    pub pending: i64,
    pub lag: Option<f64>,
    pub oldest_pending_at: Option<f64>,
    pub parked_keys: i64,
    pub parked_events: i64,
    pub dead_letters: i64,
    pub delivered_total: Option<i64>,
    pub failed_total: Option<i64>,
}

/// What outbox.status said at the last refresh.
#[derive(Debug, Default)]
struct Snapshot {
    consumers: Vec<ConsumerStatus>,
    refreshed_at: f64,
}

/// The main thread's handle: it records figures here; the serving thread reads them.
pub struct Metrics {
    database: String,
    delivery_seconds: Family<Labels, Histogram>,
    in_flight: Family<Labels, Gauge>,
    sink_state: Family<StateLabels, Gauge>,
    suspensions: Family<Labels, Counter>,
    status: Arc<Mutex<Snapshot>>,
    /// Set by each scrape: outbox.status is read again only for someone who looks.
    scraped: Arc<AtomicBool>,
}

impl Metrics {
    /// Serves the metrics of `database` where outbox_ext.metrics_address says; None when it
    /// says nowhere, or serving failed (with a WARNING saying why).
    pub fn start(database: &str) -> Option<Metrics> {
        let address = match crate::gucs::metrics_address(database) {
            Ok(address) => address?,
            Err(e) => {
                pgrx::warning!("outbox_ext worker: no metrics: {e}");
                return None;
            }
        };
        match Metrics::serve(address, database) {
            Ok(metrics) => {
                pgrx::log!("outbox_ext worker: serving metrics on http://{address}/metrics");
                Some(metrics)
            }
            Err(e) => {
                pgrx::warning!("outbox_ext worker: no metrics: {e}");
                None
            }
        }
    }

    /// Starts serving on `address`; the error says why it could not.
    fn serve(address: SocketAddr, database: &str) -> Result<Metrics, String> {
        let metrics = Metrics {
            database: database.to_owned(),
            delivery_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 16)) // 1 ms .. 33 s
            }),
            in_flight: Family::default(),
            sink_state: Family::default(),
            suspensions: Family::default(),
            status: Arc::default(),
            scraped: Arc::new(AtomicBool::new(true)),
        };
        let registry = metrics.registry();
        let scraped = Arc::clone(&metrics.scraped);
        super::scrapes::serve(address, move || {
            scraped.store(true, Ordering::Relaxed);
            let mut body = String::new();
            prometheus_client::encoding::text::encode(&mut body, &registry).ok()?;
            Some(body)
        })?;
        Ok(metrics)
    }

    fn registry(&self) -> Registry {
        let mut registry = Registry::default();
        let up: Family<[(&str, String); 1], Gauge> = Family::default();
        up.get_or_create(&[("database", self.database.clone())])
            .set(1);
        registry.register(
            "outbox_worker_up",
            "1 while the worker serving the database runs (it serves these metrics)",
            up,
        );
        registry.register(
            "outbox_delivery_duration_seconds",
            "Time to deliver one claimed batch to the sink: its HTTP requests, or its Kafka records until their reports",
            self.delivery_seconds.clone(),
        );
        registry.register(
            "outbox_batches_in_flight",
            "Claimed batches out at the sink, not yet settled",
            self.in_flight.clone(),
        );
        registry.register(
            "outbox_sink_state",
            "1 for the state the sink is in (healthy, or suspended: every request failed, nothing is counted against its events, it is probed), 0 for the other",
            self.sink_state.clone(),
        );
        registry.register(
            "outbox_sink_suspensions",
            "Times the worker suspended the sink since it started",
            self.suspensions.clone(),
        );
        registry.register_collector(Box::new(StatusCollector {
            database: self.database.clone(),
            status: Arc::clone(&self.status),
        }));
        registry
    }

    fn labels(&self, consumer: &str) -> Labels {
        Labels {
            database: self.database.clone(),
            consumer: consumer.to_owned(),
        }
    }

    pub fn observe_batch(&self, sink: &str, took: Duration) {
        self.delivery_seconds
            .get_or_create(&self.labels(sink))
            .observe(took.as_secs_f64());
    }

    pub fn set_in_flight(&self, sink: &str, batches: usize) {
        self.in_flight
            .get_or_create(&self.labels(sink))
            .set(batches as i64);
    }

    /// The sink's state now; a suspension is counted.
    pub fn set_health(&self, sink: &str, health: &Health) {
        let now = match health.state {
            State::Healthy => "healthy",
            State::Suspended(_) => "suspended",
        };
        for state in STATES {
            let labels = self.state_labels(sink, state);
            self.sink_state
                .get_or_create(&labels)
                .set(i64::from(state == now));
        }
        let counter = self.suspensions.get_or_create(&self.labels(sink));
        let counted = counter.get();
        if health.suspensions > counted {
            counter.inc_by(health.suspensions - counted);
        }
    }

    fn state_labels(&self, consumer: &str, state: &str) -> StateLabels {
        StateLabels {
            database: self.database.clone(),
            consumer: consumer.to_owned(),
            state: state.to_owned(),
        }
    }

    /// A sink that is gone: its series go too.
    pub fn forget(&self, sink: &str) {
        self.delivery_seconds.remove(&self.labels(sink));
        self.in_flight.remove(&self.labels(sink));
        self.suspensions.remove(&self.labels(sink));
        for state in STATES {
            self.sink_state.remove(&self.state_labels(sink, state));
        }
    }

    /// Whether outbox.status is to be read again: someone scraped since the last refresh.
    pub fn wanted(&self) -> bool {
        self.scraped.swap(false, Ordering::Relaxed)
    }

    pub fn refresh(&self, consumers: Vec<ConsumerStatus>) {
        let refreshed_at = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        *self.status.lock().unwrap_or_else(|p| p.into_inner()) = Snapshot {
            consumers,
            refreshed_at,
        };
    }
}

/// Encodes the last snapshot of outbox.status at each scrape.
#[derive(Debug)]
struct StatusCollector {
    database: String,
    status: Arc<Mutex<Snapshot>>,
}

type Value = fn(&ConsumerStatus) -> Option<f64>;

/// Each series of outbox.status: name, help, type, value (None: no sample for that consumer).
const STATUS_SERIES: [(&str, &str, MetricType, Value); 8] = [
    (
        "outbox_pending_events",
        "Events the consumer has not read yet (exact up to 500 per shard, estimated beyond)",
        MetricType::Gauge,
        |c| Some(c.pending as f64),
    ),
    (
        "outbox_lag_seconds",
        "Age of the consumer's oldest pending event at the last refresh; 0 when none is pending",
        MetricType::Gauge,
        |c| Some(c.lag.unwrap_or(0.0)),
    ),
    (
        "outbox_oldest_pending_timestamp_seconds",
        "When the oldest pending event was written (Unix time); absent when none is pending",
        MetricType::Gauge,
        |c| c.oldest_pending_at,
    ),
    (
        "outbox_parked_keys",
        "Keys held back after a failed delivery, waiting for their retry",
        MetricType::Gauge,
        |c| Some(c.parked_keys as f64),
    ),
    (
        "outbox_parked_events",
        "Events waiting behind parked keys",
        MetricType::Gauge,
        |c| Some(c.parked_events as f64),
    ),
    (
        "outbox_dead_letters",
        "Events given up on (outbox.dead_letters), until replayed or discarded",
        MetricType::Gauge,
        |c| Some(c.dead_letters as f64),
    ),
    (
        "outbox_delivered_events",
        "Events the worker delivered to this sink (kept across worker restarts)",
        MetricType::Counter,
        |c| c.delivered_total.map(|n| n as f64),
    ),
    (
        "outbox_failed_events",
        "Event deliveries to this sink that failed (retried or dead-lettered)",
        MetricType::Counter,
        |c| c.failed_total.map(|n| n as f64),
    ),
];

impl Collector for StatusCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snapshot = self.status.lock().unwrap_or_else(|p| p.into_inner());
        for (name, help, kind, value) in STATUS_SERIES {
            let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
            for c in &snapshot.consumers {
                let Some(v) = value(c) else { continue };
                let labels = Labels {
                    database: self.database.clone(),
                    consumer: c.consumer.clone(),
                };
                let sample = metric.encode_family(&labels)?;
                match kind {
                    MetricType::Counter => ConstCounter::new(v).encode(sample)?,
                    _ => ConstGauge::new(v).encode(sample)?,
                }
            }
        }
        let mut refreshed = encoder.encode_descriptor(
            "outbox_status_refreshed_timestamp_seconds",
            "When the worker last read outbox.status for the figures above (Unix time)",
            None,
            MetricType::Gauge,
        )?;
        let database = [("database", self.database.as_str())];
        ConstGauge::new(snapshot.refreshed_at).encode(refreshed.encode_family(&database)?)
    }
}
