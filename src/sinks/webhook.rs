//! HTTP webhook sink. A request carries one event (format "single") or the batch as a JSON
//! array ("batch"). Every request carries `webhook-id` = `Idempotency-Key` (see message_id:
//! stable across retries of the same events) and, with a secret, is signed the Standard
//! Webhooks way: `webhook-signature: v1,base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}"))`.

use super::http::{self, judge_failure};
use super::{held_back, out_of_time, push_json_str, split, Config, Event, Outcome, Tally, Verdict};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use std::time::{SystemTime, UNIX_EPOCH};

/// Signs requests with a Standard Webhooks secret ("whsec_" + base64 of the key).
pub struct Signer(ring::hmac::Key);

/// Key lengths Standard Webhooks allows, in bytes.
pub const KEY_BYTES: std::ops::RangeInclusive<usize> = 24..=64;

impl Signer {
    /// Fails unless the secret is `whsec_` (optional) and the base64 of a key of KEY_BYTES.
    pub fn new(secret: &str) -> Result<Signer, String> {
        let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
        let key = BASE64
            .decode(encoded)
            .map_err(|_| "the secret is not base64 (expected whsec_<base64>)".to_string())?;
        if !KEY_BYTES.contains(&key.len()) {
            return Err(format!(
                "the secret's key is {} bytes; Standard Webhooks keys are {} to {}",
                key.len(),
                KEY_BYTES.start(),
                KEY_BYTES.end()
            ));
        }
        Ok(Signer(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key)))
    }

    pub fn sign(&self, id: &str, timestamp: u64, body: &[u8]) -> String {
        let mut ctx = ring::hmac::Context::with_key(&self.0);
        ctx.update(format!("{id}.{timestamp}.").as_bytes());
        ctx.update(body);
        format!("v1,{}", BASE64.encode(ctx.sign().as_ref()))
    }
}

pub fn send(
    agent: &ureq::Agent,
    config: &Config,
    signer: Option<&Signer>,
    events: &[&Event],
    deadline: std::time::Instant,
) -> Outcome {
    if config.format == "single" {
        // once an event of a key fails, the key's later events are not sent ahead of it
        let mut tally = Tally::new(events.len());
        let mut failed: Vec<&str> = Vec::new();
        for (i, event) in events.iter().enumerate() {
            if failed.contains(&event.aggregate_id.as_str()) {
                tally.set(i, held_back());
                continue;
            }
            if out_of_time(config, deadline) {
                break; // the rest goes back unsent
            }
            let outcome = post(agent, config, signer, &[event], deadline);
            if matches!(&outcome, Outcome::Events(v) if v.iter().any(|v| *v != Verdict::Delivered))
            {
                failed.push(&event.aggregate_id);
            }
            if let Some(stop) = tally.record(&[i], outcome) {
                return stop;
            }
        }
        tally.finish()
    } else {
        post(agent, config, signer, events, deadline)
    }
}

fn post(
    agent: &ureq::Agent,
    config: &Config,
    signer: Option<&Signer>,
    events: &[&Event],
    deadline: std::time::Instant,
) -> Outcome {
    let Some(first) = events.first() else {
        return Outcome::Events(Vec::new());
    };
    let body = if config.format == "single" {
        event_json(first)
    } else {
        batch_json(events)
    };
    let id = message_id(events);
    let mut headers = request_headers(config, signer, &id, body.as_bytes(), events.len());
    for (name, value) in event_headers(events) {
        if !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case(&name)) {
            headers.push((name, value));
        }
    }
    // a 2xx delivers: of its body only what an error message could show is read
    let keep = 4096;
    match http::post(
        agent,
        &config.url,
        &headers,
        body.as_bytes(),
        config.request_timeout,
        keep,
    ) {
        Err(failure) => Outcome::SinkDown {
            error: format!("webhook: {failure}"),
            retry_after: None,
            blameable: !failure.unreached,
        },
        Ok(reply) if (200..300).contains(&reply.status) => {
            Outcome::all(events.len(), Verdict::Delivered)
        }
        Ok(reply) if http::refuses_for_good(reply.status) && events.len() > 1 => {
            let late = || out_of_time(config, deadline);
            split(events, late, |half| {
                post(agent, config, signer, half, deadline)
            })
        }
        Ok(reply) => judge_failure(&reply, "webhook", events.len()),
    }
}

/// The request's `webhook-id`: the event's id, or for a batch a digest of its events' ids. It
/// is the same whenever the same events are sent again, and differs for a batch of other
/// events, even one that starts with the same event (a receiver that dedups by it would
/// otherwise drop events that were not in the first request).
pub fn message_id(events: &[&Event]) -> String {
    match events {
        [one] => one.id.clone(),
        _ => {
            let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
            for (i, e) in events.iter().enumerate() {
                if i > 0 {
                    ctx.update(b",");
                }
                ctx.update(e.id.as_bytes());
            }
            let hex: String = ctx.finish().as_ref()[..16]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            format!("batch_{hex}")
        }
    }
}

fn request_headers(
    config: &Config,
    signer: Option<&Signer>,
    id: &str,
    body: &[u8],
    count: usize,
) -> Vec<(String, String)> {
    let timestamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut headers = vec![
        ("content-type".to_string(), "application/json".to_string()),
        ("webhook-id".to_string(), id.to_string()),
        ("idempotency-key".to_string(), id.to_string()),
        ("webhook-timestamp".to_string(), timestamp.to_string()),
        ("outbox-event-count".to_string(), count.to_string()),
    ];
    if let Some(signer) = signer {
        headers.push((
            "webhook-signature".to_string(),
            signer.sign(id, timestamp, body),
        ));
    }
    headers.extend(config.http_headers.iter().cloned());
    headers
}

/// Emit headers that also travel as HTTP headers: trace context (W3C Trace Context and
/// Baggage). Only these: a producer may emit any header, and must not set a receiver's
/// Authorization, Cookie or transport headers that way.
const TRACE_HEADERS: [&str; 3] = ["traceparent", "tracestate", "baggage"];

/// The emit headers a request carries as HTTP headers (all of them are in the body too): the
/// TRACE_HEADERS every event of the request has, with the same value (so those of the one
/// event, when it goes alone), that are valid HTTP header values. The sink's own headers and
/// http_headers come first and win.
fn event_headers(events: &[&Event]) -> Vec<(String, String)> {
    let parse = |e: &Event| -> Vec<(String, String)> {
        (e.headers.as_deref())
            .and_then(|h| {
                serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(h).ok()
            })
            .map(|m| {
                m.into_iter()
                    .filter_map(|(k, v)| Some((k, v.as_str()?.to_string())))
                    .collect()
            })
            .unwrap_or_default()
    };
    let Some((first, rest)) = events.split_first() else {
        return Vec::new();
    };
    let others: Vec<Vec<(String, String)>> = rest.iter().map(|e| parse(e)).collect();
    parse(first)
        .into_iter()
        .filter(|header| others.iter().all(|o| o.contains(header)))
        .filter(|(name, _)| TRACE_HEADERS.contains(&name.to_ascii_lowercase().as_str()))
        .filter(|(name, value)| http::check_header(name, value).is_ok())
        .collect()
}

fn batch_json(events: &[&Event]) -> String {
    let mut out = String::from("[");
    for (i, event) in events.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_event(&mut out, event);
    }
    out.push(']');
    out
}

fn event_json(event: &Event) -> String {
    let mut out = String::new();
    push_event(&mut out, event);
    out
}

/// `{"id":..,"topic":..,"aggregate_type":..,"aggregate_id":..,"event_type":..,"payload":..,
/// "headers":..,"created_at":..,"attempt":..}`; payload and headers are already JSON.
fn push_event(out: &mut String, e: &Event) {
    out.push_str("{\"id\":");
    push_json_str(out, &e.id);
    out.push_str(",\"topic\":");
    match &e.topic {
        Some(topic) => push_json_str(out, topic),
        None => out.push_str("null"),
    }
    out.push_str(",\"aggregate_type\":");
    push_json_str(out, &e.aggregate_type);
    out.push_str(",\"aggregate_id\":");
    push_json_str(out, &e.aggregate_id);
    out.push_str(",\"event_type\":");
    push_json_str(out, &e.event_type);
    out.push_str(",\"payload\":");
    out.push_str(e.payload.as_deref().unwrap_or("null"));
    out.push_str(",\"headers\":");
    out.push_str(e.headers.as_deref().unwrap_or("null"));
    out.push_str(",\"created_at\":");
    push_json_str(out, &e.created_at);
    out.push_str(&format!(",\"attempt\":{}}}", e.attempt));
}

#[cfg(test)]
mod tests {
    use super::super::test_event;
    use super::*;

    fn event(id: &str) -> Event {
        Event {
            id: id.into(),
            aggregate_type: "order".into(),
            event_type: "created".into(),
            payload: Some("{\"a\": [1, 2]}".into()),
            headers: Some("{\"h\": \"v\"}".into()),
            created_at: "2026-11-29T12:00:00+00:00".into(),
            ..test_event("4\"2")
        }
    }

    #[test]
    fn batch_is_a_json_array_of_events() {
        let (a, b) = (event("a"), event("b"));
        let json: serde_json::Value = serde_json::from_str(&batch_json(&[&a, &b])).unwrap();
        assert_eq!(json[1]["id"], "b");
        assert_eq!(json[0]["aggregate_id"], "4\"2");
        assert_eq!(json[0]["payload"]["a"][1], 2);
        assert_eq!(json[0]["headers"]["h"], "v");
        assert_eq!(json[0]["topic"], serde_json::Value::Null);
    }

    #[test]
    fn signature_matches_the_standard_webhooks_example() {
        // the example of the Standard Webhooks specification
        let signer = Signer::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            signer.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
        assert!(Signer::new("whsec_not base64!").is_err());
    }

    #[test]
    fn keys_are_24_to_64_bytes() {
        let secret = |n: usize| format!("whsec_{}", BASE64.encode(vec![7u8; n]));
        assert!(Signer::new(&secret(23)).is_err());
        assert!(Signer::new(&secret(24)).is_ok());
        assert!(Signer::new(&secret(64)).is_ok());
        assert!(Signer::new(&secret(65)).is_err());
        assert!(Signer::new(&BASE64.encode([7u8; 32])).is_ok()); // whsec_ is optional
    }
}
