//! A sink's settings are checked when its row is written: the trigger on outbox.sinks calls
//! `outbox_internal._check_sink_settings`, so that no sink is saved in a state the worker could never
//! deliver with. The rules are the ones the worker applies when it builds the sink's client
//! (`kafka::bootstrap`, `webhook::Signer::new`, `http::check_header`, `http::certificates`):
//! one definition each. Runs in a backend, never on the delivery threads.

use super::{http, kafka, webhook};
use crate::errors::{OrRaise, OutboxError};
use pgrx::prelude::*;
use pgrx::JsonB;

/// Raises 22023, with a hint, for a kafka sink's broker list, a webhook secret, an
/// http_headers entry or a tls_ca the worker could not use; NULLs are fine (no secret, no
/// extra headers, the public roots). A kafka sink's secret is its SASL password: any text.
#[pg_extern(
    schema = "outbox_internal",
    name = "_check_sink_settings",
    immutable,
    parallel_safe
)]
fn check_sink_settings_of_kind(
    kind: Option<&str>,
    url: Option<&str>,
    secret: Option<&str>,
    http_headers: Option<JsonB>,
    tls_ca: Option<&str>,
) {
    let bad =
        |setting: &'static str| move |why: String| OutboxError::InvalidSinkSetting { setting, why };
    if kind == Some("kafka") {
        kafka::bootstrap(url.unwrap_or_default())
            .map(drop)
            .map_err(bad("url"))
            .or_raise();
    } else if let Some(secret) = secret {
        webhook::Signer::new(secret)
            .map(drop)
            .map_err(bad("secret"))
            .or_raise();
    }
    if let Some(JsonB(serde_json::Value::Object(headers))) = &http_headers {
        for (name, value) in headers {
            let value = value.as_str().unwrap_or_default(); // a string: checked before
            http::check_header(name, value)
                .map_err(bad("http_headers"))
                .or_raise();
        }
    }
    if let Some(pem) = tls_ca {
        http::certificates(pem)
            .map(drop)
            .map_err(bad("tls_ca"))
            .or_raise();
    }
}

/// The 0.6.0 and 0.7.0 form (no kind: a webhook or REST sink), by the symbol their scripts
/// bind: upgrades from those versions call it before the 0.8.0 script replaces it.
#[pg_extern(sql = false)]
fn check_sink_settings(secret: Option<&str>, http_headers: Option<JsonB>, tls_ca: Option<&str>) {
    check_sink_settings_of_kind(None, None, secret, http_headers, tls_ca)
}
