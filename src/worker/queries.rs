//! The worker's statements: its side of delivery that talks to PostgreSQL, all on its main thread and each in a
//! short transaction of its own: read the sinks, claim a batch, settle a finished batch (ack,
//! nack, reject or release), record delivery figures. No network I/O happens in here.
//!
//! Every statement here runs in the worker's session (search_path `pg_catalog, pg_temp`, see
//! `session`), and names what it uses by schema besides: our functions and tables as
//! `outbox.*`, PostgreSQL's functions and operators as `pg_catalog.*` /
//! `OPERATOR(pg_catalog.*)`, so that not even a changed search_path could make one resolve to
//! another role's object. Values that would need an operator (intervals, NULLs for "none")
//! are computed here and bound as parameters instead.

use super::health::{Health, Judgement, State};
use super::pool::Batch;
use super::session::in_transaction;
use crate::sinks::{Config, Event, Kind, Verdict};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiResult, SpiTupleTable};
use serde::Deserialize;
use serde_json::Value;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Who the worker's leases belong to: on start it takes back every lease of this name (only
/// one worker serves a database, so any such lease is a dead worker's).
pub const OWNER: &str = "outbox_ext worker";

thread_local! {
    /// The statements of a batch's way (claim, settle), prepared on their first run and kept
    /// for the session: parsed and planned at every run, they cost the main thread, which
    /// claims and settles every batch, about a fifth of each batch's time.
    static PREPARED: RefCell<HashMap<String, OwnedPreparedStatement>> = RefCell::new(HashMap::new());
}

/// Runs a statement of a batch's way with its arguments (whose types it is prepared with),
/// prepared once per session. As `client.select`: read-only until the transaction writes.
fn run_kept<'conn>(
    client: &SpiClient<'conn>,
    sql: &str,
    args: &[DatumWithOid],
) -> SpiResult<SpiTupleTable<'conn>> {
    PREPARED.with(|prepared| {
        let mut prepared = prepared.borrow_mut();
        if !prepared.contains_key(sql) {
            let types: Vec<PgOid> = args.iter().map(|a| PgOid::from(a.oid())).collect();
            prepared.insert(sql.to_owned(), client.prepare(sql, &types)?.keep());
        }
        client.select(&prepared[sql], None, args)
    })
}

/// A sink as read, and a stamp that changes whenever its row does.
pub struct SinkRow {
    pub config: Config,
    pub stamp: String,
}

pub fn load_sinks() -> Result<Vec<SinkRow>, String> {
    let columns: Vec<SinkColumns> = select_rows(
        "sink",
        "SELECT s.name, s.kind, s.url, s.format, s.topics, s.aggregate_types,
                s.batch_size, s.concurrency,
                pg_catalog.date_part('epoch', s.connect_timeout) AS connect_timeout,
                pg_catalog.date_part('epoch', s.request_timeout) AS request_timeout,
                s.secret, s.http_headers, s.tls_ca, s.topic_map, s.cluster_id,
                s.compression, pg_catalog.date_part('epoch', s.linger) AS linger,
                s.sasl_mechanism, s.sasl_username, s.updated_at::text AS stamp,
                c.id AS consumer_id
           FROM outbox.sinks s
           JOIN outbox.consumers c ON c.name OPERATOR(pg_catalog.=) s.name
          WHERE s.enabled ORDER BY s.name",
    )?;
    Ok(columns
        .into_iter()
        .filter_map(SinkColumns::into_row)
        .collect())
}

/// The rows of `query`, each read by column name into a T (through row_to_json), in a
/// transaction of its own; a row that does not fit is left out with a WARNING naming `what`.
fn select_rows<T: serde::de::DeserializeOwned>(what: &str, query: &str) -> Result<Vec<T>, String> {
    in_transaction(|| {
        Spi::connect(|client| {
            let json_rows = format!("SELECT pg_catalog.row_to_json(r)::text FROM ({query}) AS r");
            let mut rows = Vec::new();
            for row in client.select(&json_rows, None, &[])? {
                let json = row.get::<String>(1)?.unwrap_or_default();
                match serde_json::from_str(&json) {
                    Ok(t) => rows.push(t),
                    Err(e) => warning!("outbox_ext worker: unreadable {what} row: {e}"),
                }
            }
            Ok::<_, pgrx::spi::Error>(rows)
        })
    })?
    .map_err(|e| e.to_string())
}

/// The columns of outbox.sinks the worker uses, by name (intervals in seconds).
#[derive(Deserialize)]
struct SinkColumns {
    name: String,
    kind: String,
    url: String,
    format: Option<String>,
    topics: Option<Vec<String>>,
    aggregate_types: Option<Vec<String>>,
    batch_size: i32,
    concurrency: i32,
    connect_timeout: f64,
    request_timeout: f64,
    secret: Option<String>,
    http_headers: Option<BTreeMap<String, String>>,
    tls_ca: Option<String>,
    topic_map: Option<HashMap<String, String>>,
    cluster_id: Option<String>,
    compression: Option<String>,
    linger: f64,
    sasl_mechanism: Option<String>,
    sasl_username: Option<String>,
    stamp: String,
    consumer_id: i32,
}

impl SinkColumns {
    /// None for a kind the worker does not know (the table's trigger allows no other).
    fn into_row(self) -> Option<SinkRow> {
        let seconds = |s: f64| Duration::from_secs_f64(s.clamp(0.001, 86_400.0));
        let config = Config {
            kind: Kind::parse(&self.kind)?,
            name: self.name,
            consumer_id: self.consumer_id,
            url: self.url,
            format: self.format.unwrap_or_default(),
            topics: self.topics,
            aggregate_types: self.aggregate_types,
            batch_size: self.batch_size,
            concurrency: self.concurrency.max(1) as usize,
            connect_timeout: seconds(self.connect_timeout),
            request_timeout: seconds(self.request_timeout),
            secret: self.secret,
            http_headers: self.http_headers.unwrap_or_default().into_iter().collect(),
            tls_ca: self.tls_ca,
            topic_map: self.topic_map.unwrap_or_default(),
            cluster_id: self.cluster_id,
            compression: self.compression,
            linger: Duration::from_secs_f64(self.linger.clamp(0.0, 60.0)),
            sasl_mechanism: self.sasl_mechanism,
            sasl_username: self.sasl_username,
        };
        Some(SinkRow {
            config,
            stamp: self.stamp,
        })
    }
}

/// Every consumer's row of outbox.status, for the metrics (ages and times in seconds).
pub fn consumer_status() -> Result<Vec<super::metrics::ConsumerStatus>, String> {
    select_rows(
        "outbox.status",
        "SELECT s.consumer, s.pending, s.parked_keys, s.parked_events, s.dead_letters,
                pg_catalog.date_part('epoch', s.lag) AS lag,
                pg_catalog.date_part('epoch', s.oldest_pending_at) AS oldest_pending_at,
                s.delivered_total, s.failed_total
           FROM outbox.status s",
    )
}

/// Takes back the leases a dead worker left on this sink's shards.
pub fn take_back_leases(sink: &str) -> Result<i32, String> {
    in_transaction(|| {
        Spi::get_one_with_args::<i32>(
            "SELECT outbox.release_owner($1, $2)",
            &[sink.into(), OWNER.into()],
        )
    })?
    .map(|n| n.unwrap_or(0))
    .map_err(|e| e.to_string())
}

/// The columns of a claimed event the worker reads (`read_batch` takes them in this order).
/// created_at as to_json writes it (ISO 8601 whatever DateStyle), its quotes trimmed: no
/// JSON is parsed back per event.
const CLAIMED: &str = "c.shard, c.epoch, c.id::text, c.topic, c.aggregate_type, c.aggregate_id,
     c.event_type, c.payload::text, c.headers::text,
     pg_catalog.btrim(pg_catalog.to_json(c.created_at)::text, '\"'), c.attempt";

/// The sink row as the worker last read it: still enabled, its `updated_at` (the stamp, bound
/// as `$stamp`) unchanged. A claim joins it, so that once a pause or a change commits no claim
/// made after hands out a batch for the old settings; the worker rereads the row at once (the
/// commit wakes it), and only a claim already running as the change commits goes ahead. The
/// condition on `outbox.sinks s`: the sink's name is parameter $1, the stamp parameter number `stamp`.
fn sink_as_read(stamp: usize) -> String {
    format!(
        "s.name OPERATOR(pg_catalog.=) $1 AND s.enabled
            AND s.updated_at::text OPERATOR(pg_catalog.=) ${stamp}"
    )
}

/// Claims the next batch (at most batch_size events) of at most `shards` shards of the sink,
/// in one transaction; none when no shard has work or the sink's row is no longer as read
/// (`stamp`).
pub fn claim(
    config: &Config,
    stamp: &str,
    batch_size: i32,
    lease: Duration,
    shards: i32,
) -> Result<Vec<Batch>, String> {
    let began = Instant::now(); // the lease runs from the call (see read_batches)
    in_transaction(|| {
        // select, not update: pgrx's update takes an xid first, and a claim must come before
        // its transaction's first write (see sql/claim.sql). Lateral on the sink's row, the
        // claim runs only if the row is as read; never filter its rows after it instead (an
        // outer join, a condition on c): a claim whose rows are dropped keeps its shard leased
        // until the lease ends
        Spi::connect(|client| {
            let rows = run_kept(
                client,
                &format!(
                    "SELECT {CLAIMED}
                       FROM outbox.sinks s
                      CROSS JOIN LATERAL outbox.claim(s.name, $2, pg_catalog.make_interval(secs => $3), $4, $6) AS c
                      WHERE {}",
                    sink_as_read(5)
                ),
                &[
                    config.name.as_str().into(),
                    batch_size.into(),
                    lease.as_secs_f64().into(),
                    OWNER.into(),
                    stamp.into(),
                    shards.into(),
                ],
            )?;
            Ok::<_, pgrx::spi::Error>(read_batches(config, began + lease, rows))
        })
    })?
    .map_err(|e| e.to_string())
}

/// Settles a finished batch and claims the sink's next ones (of at most `shards` shards), in
/// one call and one transaction (outbox.settle_and_claim): half the worker's transactions
/// while a sink keeps up. Settled alone when the sink's row is no longer as read (`stamp`).
pub fn settle_and_claim(
    batch: &Batch,
    verdicts: &[Verdict],
    config: &Config,
    stamp: &str,
    batch_size: i32,
    lease: Duration,
    shards: i32,
) -> Result<(Settled, Vec<Batch>), String> {
    let began = Instant::now(); // the lease runs from the call (see read_batches)
    in_transaction(|| {
        Spi::connect_mut(|client| {
            // both questions in one statement: one round through SPI per settle fewer
            let row = run_kept(
                client,
                &format!(
                    "SELECT EXISTS ({CLAIMED_FOR}), EXISTS (SELECT FROM outbox.sinks s WHERE {})",
                    sink_as_read(3)
                ),
                &[
                    batch.sink.as_str().into(),
                    batch.consumer_id.into(),
                    stamp.into(),
                ],
            )?
            .first();
            let (claimed, as_read) = (row.get::<bool>(1)?, row.get::<bool>(2)?);
            if claimed != Some(true) {
                return Ok((Settled::default(), Vec::new()));
            }
            let (failures, settled) = failures(batch, verdicts);
            if as_read != Some(true) {
                settle_only(client, batch, failures)?;
                return Ok((settled, Vec::new()));
            }
            let rows = run_kept(
                client,
                &format!(
                    "SELECT {CLAIMED}
                       FROM outbox.settle_and_claim($1, $2, $3, $4::jsonb, $5,
                                                    pg_catalog.make_interval(secs => $6), $7, $8) AS c"
                ),
                &[
                    batch.sink.as_str().into(),
                    batch.shard.into(),
                    batch.epoch.into(),
                    failures.into(),
                    batch_size.into(),
                    lease.as_secs_f64().into(),
                    OWNER.into(),
                    shards.into(),
                ],
            )?;
            Ok::<_, pgrx::spi::Error>((settled, read_batches(config, began + lease, rows)))
        })
    })?
    .map_err(|e| e.to_string())
}

/// CLAIMED's column types, in its order.
const CLAIMED_TYPES: [pg_sys::Oid; 11] = {
    use pg_sys::{INT4OID, INT8OID, TEXTOID};
    [
        INT4OID, INT8OID, TEXTOID, TEXTOID, TEXTOID, TEXTOID, TEXTOID, TEXTOID, TEXTOID, TEXTOID,
        INT4OID,
    ]
};

/// The claimed rows (columns as CLAIMED) as batches, one per shard (a claim returns each
/// shard's rows together); their deadline leaves a tenth of the lease for settling. The lease
/// ends at `lease_ends`, counted from before the call, as the database counts it (from the
/// statement's start): a call that waited on a lock (a replay or drop_consumer left open in a
/// transaction) returns batches whose lease has partly run, and counted from the return,
/// their requests could still go out once another claim had taken the shard again. `rows`
/// must be the last result of SPI: each row is read straight from SPI's result with one deform, as
/// pgrx's reads column by column (two guarded calls into PostgreSQL each, every column found
/// from the row's start) took a fifth of the worker's time at batches of 1,000.
fn read_batches(
    config: &Config,
    lease_ends: Instant,
    rows: pgrx::spi::SpiTupleTable,
) -> Vec<Batch> {
    let now = Instant::now();
    let deadline = now + lease_ends.saturating_duration_since(now).mul_f64(0.9);
    // SAFETY: SPI_tuptable and SPI_processed describe `rows`, the last statement's result
    // (nothing ran since); its columns are checked against CLAIMED_TYPES before any is read,
    // and every datum read is of the type checked.
    unsafe {
        let table = pg_sys::SPI_tuptable;
        if rows.is_empty() || table.is_null() || pg_sys::SPI_processed as usize != rows.len() {
            return Vec::new();
        }
        let desc = (*table).tupdesc;
        let types_match = (*desc).natts as usize == CLAIMED_TYPES.len()
            && (1..)
                .zip(CLAIMED_TYPES)
                .all(|(i, t)| pg_sys::SPI_gettypeid(desc, i) == t);
        assert!(
            types_match,
            "outbox_ext worker: CLAIMED's columns changed type"
        );
        let mut values = [pg_sys::Datum::from(0); CLAIMED_TYPES.len()];
        let mut nulls = [false; CLAIMED_TYPES.len()];
        let mut batches: Vec<Batch> = Vec::new();
        for i in 0..rows.len() {
            pg_sys::heap_deform_tuple(
                *(*table).vals.add(i),
                desc,
                values.as_mut_ptr(),
                nulls.as_mut_ptr(),
            );
            let text = |c: usize| String::from_datum(values[c], nulls[c]);
            let shard = i32::from_datum(values[0], nulls[0]).unwrap_or(-1);
            let epoch = i64::from_datum(values[1], nulls[1]).unwrap_or(-1);
            if batches
                .last()
                .is_none_or(|b| (b.shard, b.epoch) != (shard, epoch))
            {
                batches.push(Batch {
                    sink: config.name.clone(),
                    consumer_id: config.consumer_id,
                    shard,
                    epoch,
                    deadline,
                    events: Vec::new(),
                });
            }
            let batch = batches.last_mut().expect("pushed above");
            batch.events.push(Event {
                id: text(2).unwrap_or_default(),
                topic: text(3),
                aggregate_type: text(4).unwrap_or_default(),
                aggregate_id: text(5).unwrap_or_default(),
                event_type: text(6).unwrap_or_default(),
                payload: text(7),
                headers: text(8),
                created_at: text(9).unwrap_or_default(),
                attempt: i32::from_datum(values[10], nulls[10]).unwrap_or(1),
            });
        }
        batches
    }
}

/// What settling a batch did, for the sink's figures.
#[derive(Default)]
pub struct Settled {
    pub delivered: usize,
    pub failed: usize,
    pub error: Option<String>,
}

/// Applies a finished batch's judgement in one transaction: given back unattempted
/// (outbox.release), or settled (outbox.settle).
pub fn settle(batch: &Batch, judgement: &Judgement) -> Result<Settled, String> {
    in_transaction(|| {
        Spi::connect_mut(|client| match judgement {
            Judgement::GiveBack { error } => {
                let given_back = give_back(client, batch)?;
                Ok(Settled {
                    delivered: 0,
                    failed: 0,
                    error: given_back.then(|| error.clone()),
                })
            }
            Judgement::Settle(verdicts) => {
                let (failures, settled) = failures(batch, verdicts);
                match settle_only(client, batch, failures)? {
                    true => Ok(settled),
                    false => Ok(Settled::default()),
                }
            }
        })
    })?
    .map_err(|e: pgrx::spi::Error| e.to_string())
}

/// Whether the batch's sink (parameter $1) is still the consumer (id $2) it was claimed for.
/// One dropped and made again under its name is another, with leases and epochs of its own: a
/// late settle of the old one's batch could take the new one's batch at the same shard and
/// epoch for settled (its events then lost). The old one's batch is nobody's now: nothing to
/// settle or give back. Asked in the statement that settles or gives back: one statement, not
/// two.
const CLAIMED_FOR: &str = "SELECT FROM outbox.consumers k
     WHERE k.name OPERATOR(pg_catalog.=) $1 AND k.id OPERATOR(pg_catalog.=) $2";

/// Gives a batch back unattempted (outbox.release), unless its consumer is gone (CLAIMED_FOR):
/// whether it was given back.
fn give_back(client: &SpiClient, batch: &Batch) -> SpiResult<bool> {
    let released = run_kept(
        client,
        &format!("SELECT outbox.release($1, $3, $4) WHERE EXISTS ({CLAIMED_FOR})"),
        &[
            batch.sink.as_str().into(),
            batch.consumer_id.into(),
            batch.shard.into(),
            batch.epoch.into(),
        ],
    )?;
    Ok(released.len() == 1)
}

/// Settles a batch (outbox.settle), unless its consumer is gone (CLAIMED_FOR): whether it was
/// settled.
fn settle_only(client: &SpiClient, batch: &Batch, failures: String) -> SpiResult<bool> {
    let settled = run_kept(
        client,
        &format!("SELECT outbox.settle($1, $3, $4, $5::jsonb) WHERE EXISTS ({CLAIMED_FOR})"),
        &[
            batch.sink.as_str().into(),
            batch.consumer_id.into(),
            batch.shard.into(),
            batch.epoch.into(),
            failures.into(),
        ],
    )?;
    Ok(settled.len() == 1)
}

/// settle's failures (as JSON) from a batch's verdicts, with the figures they make. A sink
/// sends no event of a key after one of it failed: its later events have failed verdicts too,
/// which settle would keep back anyway. An unsent event is reported `"attempted": false`: its
/// key waits, in order, with no attempt counted.
fn failures(batch: &Batch, verdicts: &[Verdict]) -> (String, Settled) {
    let mut failures = Vec::new();
    let mut settled = Settled::default();
    let held_back = "held back behind an earlier event of its key".to_string();
    for (event, verdict) in batch.events.iter().zip(verdicts) {
        let (message, retry_after, last, attempted) = match verdict {
            Verdict::Delivered => {
                settled.delivered += 1;
                continue;
            }
            Verdict::Skipped => continue, // not this sink's: settled as delivered, not counted
            Verdict::Retry { error, retry_after } => (error, *retry_after, false, true),
            Verdict::Reject { error } | Verdict::Invalid { error } => (error, None, true, true),
            // (a Down verdict is judged before settling: blamed as Retry, or Unsent when not
            // blameable; one left Down is not counted)
            Verdict::Unsent { error, retry_after }
            | Verdict::Down {
                error, retry_after, ..
            } => (error, *retry_after, false, false),
            Verdict::HeldBack => (&held_back, None, false, false),
        };
        let message = crate::sinks::without_nul(message); // whatever made it, jsonb takes it
        let mut failure = serde_json::json!({
            "id": event.id,
            "error": message,
            "retry_after": retry_after.map(|d| d.as_secs_f64()),
            "final": last,
        });
        if !attempted {
            failure["attempted"] = Value::Bool(false);
        } else {
            settled.failed += 1;
        }
        failures.push(failure);
        settled.error.get_or_insert_with(|| message.clone());
    }
    (Value::Array(failures).to_string(), settled)
}

/// A sink's figures since the last flush.
#[derive(Default)]
pub struct Figures {
    pub delivered: u64,
    pub failed: u64,
    pub per_second: f64,
    pub error: Option<String>,
    pub health: Option<HealthRow>,
}

/// A sink's state as outbox._sink_stats keeps it (times as Unix seconds).
pub struct HealthRow {
    state: &'static str,
    reason: Option<String>,
    since: Option<f64>,
    next_probe_at: Option<f64>,
    /// Suspensions since the last write.
    pub suspensions: i64,
}

impl HealthRow {
    pub fn of(health: &Health) -> HealthRow {
        let unix = |t: SystemTime| {
            t.duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64())
        };
        match &health.state {
            State::Healthy => HealthRow {
                state: "healthy",
                reason: None,
                since: None,
                next_probe_at: None,
                suspensions: 0,
            },
            State::Suspended(s) => HealthRow {
                state: "suspended",
                reason: Some(s.reason.clone()),
                since: Some(unix(s.since)),
                next_probe_at: Some(unix(s.next_probe_at())),
                suspensions: 0,
            },
        }
    }
}

/// The transaction's start, as now() would give it.
fn now() -> pgrx::datum::TimestampWithTimeZone {
    // SAFETY: reads the current transaction's start timestamp.
    let at = unsafe { pg_sys::GetCurrentTransactionStartTimestamp() };
    pgrx::datum::TimestampWithTimeZone::try_from(at).unwrap_or_else(|_| {
        pgrx::datum::TimestampWithTimeZone::try_from(0i64).expect("the epoch is a timestamp")
    })
}

/// Adds the figures to outbox._sink_stats (one small row per sink), with the sink's state.
/// A suspension's times are bound as Unix seconds (to_timestamp) and NULL when healthy; the
/// state's `since` is kept while it lasts.
pub fn record_figures(figures: &HashMap<String, Figures>) -> Result<(), String> {
    in_transaction(|| {
        Spi::connect_mut(|client| {
            for (sink, f) in figures {
                let health = f.health.as_ref();
                client.update(
                    "INSERT INTO outbox._sink_stats AS s
                         (sink, delivered, failed, per_second, last_delivered_at, last_error, last_error_at,
                          state, state_reason, state_since, next_probe_at, suspensions)
                     SELECT $1, $2, $3, $4, $5, $6, $7, coalesce($8, 'healthy'), $9,
                            pg_catalog.to_timestamp($10), pg_catalog.to_timestamp($11), coalesce($12, 0)
                      WHERE EXISTS (SELECT FROM outbox.sinks k WHERE k.name OPERATOR(pg_catalog.=) $1)
                     ON CONFLICT (sink) DO UPDATE
                        SET delivered = s.delivered OPERATOR(pg_catalog.+) EXCLUDED.delivered,
                            failed = s.failed OPERATOR(pg_catalog.+) EXCLUDED.failed,
                            per_second = EXCLUDED.per_second,
                            last_delivered_at = coalesce(EXCLUDED.last_delivered_at, s.last_delivered_at),
                            last_error = coalesce(EXCLUDED.last_error, s.last_error),
                            last_error_at = coalesce(EXCLUDED.last_error_at, s.last_error_at),
                            state = EXCLUDED.state,
                            state_reason = EXCLUDED.state_reason,
                            state_since = EXCLUDED.state_since,
                            next_probe_at = EXCLUDED.next_probe_at,
                            suspensions = s.suspensions OPERATOR(pg_catalog.+) EXCLUDED.suspensions,
                            updated_at = pg_catalog.now()",
                    None,
                    &[
                        sink.as_str().into(),
                        (f.delivered as i64).into(),
                        (f.failed as i64).into(),
                        f.per_second.into(),
                        (f.delivered > 0).then(now).into(),
                        f.error.clone().into(),
                        f.error.as_ref().map(|_| now()).into(),
                        health.map(|h| h.state).into(),
                        health.and_then(|h| h.reason.clone()).into(),
                        health.and_then(|h| h.since).into(),
                        health.and_then(|h| h.next_probe_at).into(),
                        health.map(|h| h.suspensions).into(),
                    ],
                )?;
            }
            Ok::<_, pgrx::spi::Error>(())
        })
    })?
    .map_err(|e| e.to_string())
}
