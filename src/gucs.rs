//! Every GUC of outbox_ext, registered in one place under the reserved prefix `outbox_ext`.

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};

/// Largest payload `emit` accepts, in bytes of the stored jsonb. Reloads on SIGHUP; users may
/// lower or raise it per session.
pub static MAX_PAYLOAD_BYTES: GucSetting<i32> = GucSetting::<i32>::new(1024 * 1024);

pub fn init() {
    GucRegistry::define_int_guc(
        c"outbox_ext.max_payload_bytes",
        c"Largest event payload emit accepts, in bytes.",
        c"Larger payloads are refused with SQLSTATE 54000; store big bodies elsewhere.",
        &MAX_PAYLOAD_BYTES,
        0,
        i32::MAX,
        GucContext::Userset,
        GucFlags::UNIT_BYTE,
    );
    unsafe { pgrx::pg_sys::MarkGUCPrefixReserved(c"outbox_ext".as_ptr()) };
}

/// The payload limit in bytes.
pub fn max_payload_bytes() -> i64 {
    i64::from(MAX_PAYLOAD_BYTES.get())
}
