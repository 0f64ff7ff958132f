//! The record rules every Kafka sink shares, native and REST: which topic an event goes to,
//! and the headers it carries. The key is always the aggregate id's bytes, so Kafka keeps a
//! key's records in one partition, in order.
//!
//! ```text
//! event topic "orders" (or, without one, its aggregate type), renamed by topic_map
//!   -> headers: the event's own, then outbox-id and outbox-event-type
//!      (format debezium: id and eventType, topic outbox.event.<aggregate type>)
//! ```

use super::{Config, Event, Kind};
use serde_json::Value;

/// The Kafka topic of an event: its topic (or aggregate type; with the debezium format,
/// outbox.event.<aggregate type>, as Debezium's outbox event router names it), renamed by
/// `topic_map`.
pub fn kafka_topic(config: &Config, event: &Event) -> String {
    let name = if config.kind == Kind::Kafka && config.format == "debezium" {
        format!("outbox.event.{}", event.aggregate_type)
    } else {
        event
            .topic
            .clone()
            .unwrap_or_else(|| event.aggregate_type.clone())
    };
    config.topic_map.get(&name).cloned().unwrap_or(name)
}

/// The event's own headers, then its id and type: outbox-id and outbox-event-type, or with
/// the debezium format id and eventType (the names Debezium's router and its docs use).
pub fn record_headers(config: &Config, e: &Event) -> Vec<(String, String)> {
    let mut headers: Vec<(String, String)> = e
        .headers
        .as_deref()
        .and_then(|h| serde_json::from_str::<serde_json::Map<String, Value>>(h).ok())
        .map(|map| {
            map.into_iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k, v.to_string())))
                .collect()
        })
        .unwrap_or_default();
    let (id, event_type) = match config.format.as_str() {
        "debezium" if config.kind == Kind::Kafka => ("id", "eventType"),
        _ => ("outbox-id", "outbox-event-type"),
    };
    headers.push((id.into(), e.id.clone()));
    headers.push((event_type.into(), e.event_type.clone()));
    headers
}
