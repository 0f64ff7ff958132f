//! The record rules every Kafka sink shares, native and REST: which topic an event goes to,
//! its value and the headers it carries. The key is always the aggregate id's bytes, so Kafka
//! keeps a key's records in one partition, in order.
//!
//! ```text
//! event topic "orders" (or, without one, its aggregate type), renamed by topic_map
//!   -> value: the payload's JSON text (NULL: a tombstone)
//!   -> headers: the event's own, then outbox-id and outbox-event-type
//! format debezium (native only), the records of Debezium's outbox event router as
//! docs/guides/kafka.md configures it (tests/test_debezium.py compares the two):
//!   topic outbox.event.<aggregate type>, value the payload as compact JSON,
//!   headers id, eventType and outbox-headers (the event's headers as one JSON text, or null)
//! ```

use super::{Config, Event, Kind};
use serde_json::Value;
use std::borrow::Cow;

/// The Kafka topic of an event: its topic (or aggregate type; with the debezium format,
/// outbox.event.<aggregate type>, as Debezium's outbox event router names it), renamed by
/// `topic_map`.
pub fn kafka_topic(config: &Config, event: &Event) -> String {
    let name = if debezium(config) {
        format!("outbox.event.{}", event.aggregate_type)
    } else {
        event
            .topic
            .clone()
            .unwrap_or_else(|| event.aggregate_type.clone())
    };
    config.topic_map.get(&name).cloned().unwrap_or(name)
}

/// The record's value: the payload's JSON text, compact with the debezium format (as Debezium's
/// JsonConverter writes the payload its router expanded); None, a tombstone, for NULL.
pub fn record_value<'a>(config: &Config, e: &'a Event) -> Option<Cow<'a, str>> {
    let payload = e.payload.as_deref()?;
    Some(match debezium(config) {
        true => Cow::Owned(compact_json(payload)),
        false => Cow::Borrowed(payload),
    })
}

/// The record's headers, each a name and a value (None: a header with a null value). The
/// event's own headers, then its id and type as outbox-id and outbox-event-type; with the
/// debezium format id, eventType and outbox-headers, the event's headers as one JSON text
/// (null when it has none), as the router places them.
pub fn record_headers(config: &Config, e: &Event) -> Vec<(String, Option<String>)> {
    if debezium(config) {
        return vec![
            ("id".into(), Some(e.id.clone())),
            ("eventType".into(), Some(e.event_type.clone())),
            ("outbox-headers".into(), e.headers.clone()),
        ];
    }
    let mut headers: Vec<(String, Option<String>)> = e
        .headers
        .as_deref()
        .and_then(|h| serde_json::from_str::<serde_json::Map<String, Value>>(h).ok())
        .map(|map| {
            map.into_iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k, Some(v.to_string()))))
                .collect()
        })
        .unwrap_or_default();
    headers.push(("outbox-id".into(), Some(e.id.clone())));
    headers.push(("outbox-event-type".into(), Some(e.event_type.clone())));
    headers
}

fn debezium(config: &Config) -> bool {
    config.kind == Kind::Kafka && config.format == "debezium"
}

/// jsonb's text as Jackson (Debezium's JsonConverter) writes the same JSON: no whitespace
/// between tokens (jsonb writes a space after every ':' and ','), `\u` escapes in upper case,
/// and a character beyond U+FFFF escaped as its UTF-16 surrogate pair. Keys keep their order;
/// numbers and the other characters of strings stay as jsonb wrote them.
fn compact_json(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let (mut in_string, mut escaped, mut hex_left) = (false, false, 0);
    for c in text.chars() {
        if hex_left > 0 {
            hex_left -= 1;
            out.push(c.to_ascii_uppercase());
            continue;
        }
        if in_string {
            if escaped {
                hex_left = if c == 'u' { 4 } else { 0 };
            } else if c == '"' {
                in_string = false;
            } else if c as u32 > 0xFFFF {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04X}"));
                }
                continue;
            }
            escaped = !escaped && c == '\\';
        } else if c == '"' {
            in_string = true;
        } else if c.is_ascii_whitespace() {
            continue;
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_json_writes_what_jackson_writes() {
        let jsonb = r#"{"a": 1, "b c": [1, 2.50, "x, y: \"z\" \\"], "d": {"e": null}}"#;
        assert_eq!(
            compact_json(jsonb),
            r#"{"a":1,"b c":[1,2.50,"x, y: \"z\" \\"],"d":{"e":null}}"#
        );
        assert_eq!(compact_json(r#""  spaced  ""#), r#""  spaced  ""#);
        assert_eq!(
            compact_json(r#"{"s": "ü 日 🎉 \u001f \n"}"#),
            r#"{"s":"ü 日 \uD83C\uDF89 \u001F \n"}"#
        );
    }
}
