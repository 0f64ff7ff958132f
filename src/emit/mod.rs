//! Emit: what an event must be, its time-ordered id and its shard. `outbox.emit` is native
//! (`single`); `outbox.emit_many` (sql/emit.sql) writes through `insert`, or a plain INSERT.

mod insert;
mod single;

use crate::errors::{OrRaise, OutboxError};
use crate::gucs;
use pgrx::prelude::*;
use pgrx::{JsonB, Uuid};
use serde_json::Value;

/// Shards events are spread over. Fixed: changing it would move keys between shards and break
/// per-key order.
pub const SHARD_COUNT: i32 = 16;

/// `outbox.shard_count()`: SHARD_COUNT, for SQL. IMMUTABLE, so the planner folds it into
/// `outbox.shard_of` (sql/events.sql) wherever that is inlined.
#[pg_extern(schema = "outbox", immutable, strict, parallel_safe)]
fn shard_count() -> i32 {
    SHARD_COUNT
}

/// A new version-7 UUID: 48 bits of Unix milliseconds, then a counter and random bits, so ids
/// sort by creation time and stay unique across backends. The random bits come from a
/// per-process generator (uuid's `fast-rng`: rand's thread RNG, seeded from the OS on first use)
/// rather than a getrandom call per id (about 0.4 µs each, measured); it is seeded in each
/// backend after the fork (the postmaster never makes an id), so no two processes share it.
#[pg_extern(schema = "outbox", volatile, parallel_safe)]
fn uuid_v7() -> Uuid {
    Uuid::from_bytes(*uuid::Uuid::now_v7().as_bytes())
}

/// Longest aggregate_id emit takes, in bytes: a key is part of the index entries of parked
/// keys and dead letters, which PostgreSQL caps at about 2.7 kB; a longer key could be
/// emitted but never parked, retried or dead-lettered.
pub const MAX_KEY_BYTES: usize = 1024;
/// Longest aggregate_type and event_type, in bytes.
pub const MAX_TYPE_BYTES: usize = 255;

/// Refuses an emit in a read-only transaction, as PostgreSQL refuses an INSERT there (25006),
/// before an xid is taken. Needed because emit writes the row itself, not through the executor
/// that checks: otherwise the sequence refused it only after the xid (no hint), and on a
/// standby the xid itself failed, with XX000.
fn writable() -> Result<(), OutboxError> {
    // SAFETY: reads backend globals, in a transaction. A standby's transactions are all read
    // only (PostgreSQL starts them so), so recovery is asked about only to word the error.
    if unsafe { pg_sys::XactReadOnly } {
        let standby = unsafe { pg_sys::RecoveryInProgress() };
        return Err(OutboxError::ReadOnly { standby });
    }
    Ok(())
}

/// Checks one event's fields, in argument order; a bad field raises, so nothing is written.
fn check_event(
    aggregate_type: Option<&str>,
    aggregate_id: Option<&str>,
    event_type: Option<&str>,
    payload_bytes: Option<i64>,
    headers: Option<&JsonB>,
    topic: Option<&str>,
) {
    writable().or_raise();
    required("aggregate_type", aggregate_type, MAX_TYPE_BYTES).or_raise();
    required("aggregate_id", aggregate_id, MAX_KEY_BYTES).or_raise();
    required("event_type", event_type, MAX_TYPE_BYTES).or_raise();
    check_payload_size(payload_bytes, gucs::max_payload_bytes()).or_raise();
    check_routing(headers, topic);
}

/// What `outbox._event_id` was up to 0.4.0: the PL/pgSQL emit of those versions calls it, so
/// the library keeps the symbol for databases not yet updated (ALTER EXTENSION outbox_ext
/// UPDATE drops the SQL function); new installs do not declare it.
#[pg_extern(sql = false)]
fn event_id(
    aggregate_type: Option<&str>,
    aggregate_id: Option<&str>,
    event_type: Option<&str>,
    payload_bytes: Option<i32>,
    headers: Option<JsonB>,
    topic: Option<&str>,
) -> Uuid {
    let size = payload_bytes.map(i64::from);
    check_event(
        aggregate_type,
        aggregate_id,
        event_type,
        size,
        headers.as_ref(),
        topic,
    );
    crate::wake::note_emit();
    uuid_v7()
}

/// Checks a whole `emit_many` batch (fields shared by the batch once, keys one by one, the
/// largest payload against the limit) and returns one id per event, in order: one call per
/// batch instead of one per event keeps bulk emit close to a plain INSERT.
#[pg_extern(
    schema = "outbox_internal",
    name = "_batch_ids",
    volatile,
    parallel_safe
)]
fn batch_ids(
    aggregate_type: Option<&str>,
    event_type: Option<&str>,
    headers: Option<JsonB>,
    topic: Option<&str>,
    aggregate_ids: Array<&str>,
    largest_payload_bytes: Option<i32>,
) -> Vec<Uuid> {
    check_batch_fields(aggregate_type, event_type, headers.as_ref(), topic);
    check_payload_size(
        largest_payload_bytes.map(i64::from),
        gucs::max_payload_bytes(),
    )
    .or_raise();
    crate::wake::note_emit();
    aggregate_ids
        .iter()
        .map(|key| {
            required("aggregate_id", key, MAX_KEY_BYTES).or_raise();
            uuid_v7()
        })
        .collect()
}

/// The fields an `emit_many` batch shares; raises the first that is wrong.
fn check_batch_fields(
    aggregate_type: Option<&str>,
    event_type: Option<&str>,
    headers: Option<&JsonB>,
    topic: Option<&str>,
) {
    writable().or_raise();
    required("aggregate_type", aggregate_type, MAX_TYPE_BYTES).or_raise();
    required("event_type", event_type, MAX_TYPE_BYTES).or_raise();
    check_routing(headers, topic);
}

/// The optional fields that travel with an event to its sink: headers, then topic.
fn check_routing(headers: Option<&JsonB>, topic: Option<&str>) {
    if let Some(JsonB(headers)) = headers {
        check_headers(headers).or_raise();
    }
    if let Some(topic) = topic {
        check_topic(topic).or_raise();
    }
}

/// A field that must be there, not empty, and at most `max` bytes.
pub fn required(name: &'static str, value: Option<&str>, max: usize) -> Result<(), OutboxError> {
    match value {
        None => Err(OutboxError::NullArgument(name)),
        Some(value) => check_size(name, value.len(), max),
    }
}

/// The size check of `required`, for a value known not to be NULL.
pub fn check_size(name: &'static str, bytes: usize, max: usize) -> Result<(), OutboxError> {
    match bytes {
        0 => Err(OutboxError::EmptyArgument(name)),
        n if n > max => Err(OutboxError::TooLong {
            arg: name,
            bytes: n,
            limit: max,
        }),
        _ => Ok(()),
    }
}

/// The size a payload datum has uncompressed, however it came (a literal, a parameter, a
/// column stored compressed or out of line): what the limit applies to.
///
/// # Safety
/// `payload` must be a jsonb datum (a varlena, possibly toasted).
pub unsafe fn payload_bytes(payload: pg_sys::Datum) -> i64 {
    pg_sys::toast_raw_datum_size(payload) as i64
}

pub fn check_payload_size(bytes: Option<i64>, limit: i64) -> Result<(), OutboxError> {
    match bytes {
        Some(bytes) if bytes > limit => Err(OutboxError::PayloadTooLarge { bytes, limit }),
        _ => Ok(()),
    }
}

/// Headers travel as Kafka record headers and HTTP headers: a flat object of strings.
pub fn check_headers(headers: &Value) -> Result<(), OutboxError> {
    let Value::Object(map) = headers else {
        return Err(OutboxError::InvalidHeaders("not a JSON object".into()));
    };
    for (name, value) in map {
        if name.is_empty() {
            return Err(OutboxError::InvalidHeaders("a header name is empty".into()));
        }
        if !value.is_string() {
            return Err(OutboxError::InvalidHeaders(format!(
                "the value of \"{name}\" is not a string"
            )));
        }
    }
    Ok(())
}

/// Kafka's rule for topic names, which also keeps them safe in URLs.
pub fn check_topic(topic: &str) -> Result<(), OutboxError> {
    let legal = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    let ok = !topic.is_empty()
        && topic.len() <= 249
        && topic != "."
        && topic != ".."
        && topic.chars().all(legal);
    if ok {
        Ok(())
    } else {
        Err(OutboxError::InvalidTopic(topic.into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn topics() {
        assert!(check_topic("orders.v1-eu_2").is_ok());
        for bad in ["", ".", "..", "a b", "a/b", "é", &"x".repeat(250)] {
            assert!(check_topic(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn headers() {
        assert!(check_headers(&json!({"a": "1", "b": ""})).is_ok());
        assert!(check_headers(&json!({})).is_ok());
        for bad in [
            json!([]),
            json!("x"),
            json!({"a": 1}),
            json!({"a": null}),
            json!({"": "x"}),
        ] {
            assert!(check_headers(&bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn payload_size() {
        assert!(check_payload_size(Some(10), 10).is_ok());
        assert!(check_payload_size(None, 0).is_ok());
        assert_eq!(
            check_payload_size(Some(11), 10),
            Err(OutboxError::PayloadTooLarge {
                bytes: 11,
                limit: 10
            })
        );
    }

    #[test]
    fn required_fields() {
        assert_eq!(required("k", None, 3), Err(OutboxError::NullArgument("k")));
        assert_eq!(
            required("k", Some(""), 3),
            Err(OutboxError::EmptyArgument("k"))
        );
        assert!(required("k", Some(" "), 3).is_ok());
        assert!(required("k", Some("abc"), 3).is_ok());
        assert_eq!(
            required("k", Some("abcd"), 3),
            Err(OutboxError::TooLong {
                arg: "k",
                bytes: 4,
                limit: 3
            })
        );
    }
}
