//! Every GUC of outbox_ext, registered in one place under the reserved prefix `outbox_ext`.

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};
use std::ffi::CString;
use std::net::SocketAddr;
use std::time::Duration;

/// Largest payload `emit` accepts, in bytes of the stored jsonb. Superuser context: set per
/// role (`ALTER ROLE ... SET`) or in postgresql.conf (reloads on SIGHUP); a producer cannot
/// raise its own limit.
pub static MAX_PAYLOAD_BYTES: GucSetting<i32> = GucSetting::<i32>::new(1024 * 1024);

/// Databases the background worker serves, comma-separated. Reloads on SIGHUP.
pub static DATABASES: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

/// The role the background worker connects as (see src/worker/session.rs). Reloads on SIGHUP;
/// a worker takes it when it starts.
pub static WORKER_ROLE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c"outbox_worker"));

/// DROP EXTENSION outbox_ext drops undelivered events too (off: it is refused). Superusers,
/// per session.
pub static DROP_UNDELIVERED: GucSetting<bool> = GucSetting::<bool>::new(false);

/// Where the workers serve Prometheus metrics, `ip:port`; empty (the default): nowhere. The
/// worker of the Nth database in outbox_ext.databases listens on port + N - 1. Reloads on
/// SIGHUP; a worker takes it when it starts.
pub static METRICS_ADDRESS: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

/// Seconds between two runs of outbox.maintain() by the worker. Reloads on SIGHUP.
pub static MAINTAIN_INTERVAL: GucSetting<i32> = GucSetting::<i32>::new(60);

pub fn init() {
    GucRegistry::define_string_guc(
        c"outbox_ext.databases",
        c"Databases the outbox_ext background worker serves, comma-separated.",
        c"The worker waits in each until CREATE EXTENSION outbox_ext has run there.",
        &DATABASES,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"outbox_ext.worker_role",
        c"The role the outbox_ext background worker connects as.",
        c"outbox_worker (created by CREATE EXTENSION, NOLOGIN) by default; it needs no LOGIN.",
        &WORKER_ROLE,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"outbox_ext.metrics_address",
        c"Where the outbox_ext workers serve Prometheus metrics (ip:port); empty: nowhere.",
        c"The worker of the Nth database in outbox_ext.databases listens on port + N - 1. Use a loopback address unless the network is trusted.",
        &METRICS_ADDRESS,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox_ext.maintain_interval",
        c"How often the background worker runs outbox.maintain().",
        c"",
        &MAINTAIN_INTERVAL,
        1,
        86400,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_bool_guc(
        c"outbox_ext.drop_undelivered",
        c"Lets DROP EXTENSION outbox_ext drop events that were not delivered.",
        c"Off: the DROP is refused while a consumer has events pending, parked keys or dead letters.",
        &DROP_UNDELIVERED,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox_ext.max_payload_bytes",
        c"Largest event payload emit accepts, in bytes.",
        c"Larger payloads are refused with SQLSTATE 54000; store big bodies elsewhere.",
        &MAX_PAYLOAD_BYTES,
        0,
        i32::MAX,
        // a limit the operator sets for producers: one they could raise for themselves would be none
        GucContext::Suset,
        GucFlags::UNIT_BYTE,
    );
    // SAFETY: in _PG_init, on the process's only thread, after the GUCs above are defined; the
    // prefix is a static C string.
    unsafe { pgrx::pg_sys::MarkGUCPrefixReserved(c"outbox_ext".as_ptr()) };
}

/// The payload limit in bytes.
pub fn max_payload_bytes() -> i64 {
    i64::from(MAX_PAYLOAD_BYTES.get())
}

/// The databases named in outbox_ext.databases, trimmed, without empty names or repeats.
pub fn databases() -> Vec<String> {
    let list = DATABASES.get();
    let text = list.as_ref().and_then(|s| s.to_str().ok()).unwrap_or("");
    let mut names: Vec<String> = Vec::new();
    for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if !names.iter().any(|n| n == name) {
            names.push(name.to_owned());
        }
    }
    names
}

pub fn drop_undelivered() -> bool {
    DROP_UNDELIVERED.get()
}

/// The worker's role name; outbox_worker when the setting is empty.
pub fn worker_role() -> String {
    let role = WORKER_ROLE.get();
    match role.as_ref().and_then(|s| s.to_str().ok()).map(str::trim) {
        Some(name) if !name.is_empty() => name.to_owned(),
        _ => "outbox_worker".to_owned(),
    }
}

/// Where the worker of `database` serves metrics: None when off, an error for a bad setting.
pub fn metrics_address(database: &str) -> Result<Option<SocketAddr>, String> {
    let setting = METRICS_ADDRESS.get();
    let text = setting.as_ref().and_then(|s| s.to_str().ok()).unwrap_or("");
    let nth = databases().iter().position(|d| d == database).unwrap_or(0);
    nth_address(text, nth)
}

/// `text` (ip:port, or empty for none) with its port moved up by `nth`.
fn nth_address(text: &str, nth: usize) -> Result<Option<SocketAddr>, String> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    let mut address: SocketAddr = text.parse().map_err(|_| {
        format!("outbox_ext.metrics_address \"{text}\" is not ip:port (e.g. 127.0.0.1:9187)")
    })?;
    let port = u16::try_from(usize::from(address.port()) + nth).map_err(|_| {
        format!(
            "outbox_ext.metrics_address \"{text}\": port {} + {nth} is out of range",
            address.port()
        )
    })?;
    address.set_port(port);
    Ok(Some(address))
}

pub fn maintain_interval() -> Duration {
    Duration::from_secs(MAINTAIN_INTERVAL.get().max(1) as u64)
}

#[cfg(test)]
mod tests {
    use super::nth_address;

    #[test]
    fn the_nth_database_listens_n_ports_up() {
        assert_eq!(nth_address(" ", 3), Ok(None));
        let at = |text, nth| nth_address(text, nth).unwrap().unwrap().to_string();
        assert_eq!(at("127.0.0.1:9187", 0), "127.0.0.1:9187");
        assert_eq!(at("127.0.0.1:9187", 2), "127.0.0.1:9189");
        assert_eq!(at("[::1]:9187", 1), "[::1]:9188");
        assert!(nth_address("localhost:9187", 0)
            .unwrap_err()
            .contains("is not ip:port"));
        assert!(nth_address("127.0.0.1", 0).is_err());
        assert!(nth_address("127.0.0.1:65535", 1)
            .unwrap_err()
            .contains("out of range"));
    }
}
