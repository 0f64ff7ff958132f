//! Keeping what the outbox holds through backups, restores and DROP EXTENSION.
//!
//! - `sql/dump.sql`: what pg_dump writes of the extension's tables, and why.
//! - `sql/restore.sql`: how a state restored from a dump is recognised and rebased onto the
//!   transaction ids of the cluster it lands in.
//! - `sql/drop_guard.sql` and `outbox_guard_drop` here: DROP EXTENSION outbox_ext is refused
//!   while events are undelivered, keys parked or dead letters kept, unless
//!   `outbox_ext.drop_undelivered` is on.

use crate::gucs;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::{PgLogLevel, PgSqlErrorCode};

extension_sql_file!(
    "../sql/restore.sql",
    name = "restore",
    requires = ["claim", "partitions"]
);
extension_sql_file!(
    "../sql/drop_guard.sql",
    name = "drop_guard",
    requires = ["status"]
);
extension_sql_file!(
    "../sql/dump.sql",
    name = "dump",
    requires = ["restore", "status", "sinks", "inbox", "partitions"]
);

#[unsafe(no_mangle)]
pub extern "C" fn pg_finfo_outbox_guard_drop() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

/// The event trigger on DROP EXTENSION (ddl_command_start, while our tables still exist): when
/// the statement drops outbox_ext and something would be lost, raise 2BP01 with what and how
/// to proceed.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn outbox_guard_drop(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    let context = (*fcinfo).context;
    if context.is_null() || (*context).type_ != pg_sys::NodeTag::T_EventTriggerData {
        error!("outbox_internal._guard_drop() runs only as an event trigger");
    }
    let tree = (*(context as *mut pg_sys::EventTriggerData)).parsetree;
    if drops_outbox_ext(tree) && !gucs::drop_undelivered() {
        let lost = Spi::get_one::<String>("SELECT outbox_internal._undelivered()")
            .ok()
            .flatten();
        if let Some(lost) = lost {
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_DEPENDENT_OBJECTS_STILL_EXIST,
                "cannot drop extension outbox_ext: it holds events that were not delivered",
                "outbox_ext",
            )
            .set_detail(lost)
            .set_hint(
                "Let the consumers deliver them (outbox.status shows what is pending), drop the \
                 consumers that need not have them (outbox.drop_consumer, outbox.drop_sink), or \
                 SET outbox_ext.drop_undelivered = on to drop them with the extension.",
            )
            .report(PgLogLevel::ERROR);
        }
    }
    pg_sys::Datum::from(0)
}

/// True if the statement is DROP EXTENSION naming outbox_ext.
unsafe fn drops_outbox_ext(tree: *mut pg_sys::Node) -> bool {
    if tree.is_null() || (*tree).type_ != pg_sys::NodeTag::T_DropStmt {
        return false;
    }
    let stmt = tree as *mut pg_sys::DropStmt;
    if (*stmt).removeType != pg_sys::ObjectType::OBJECT_EXTENSION {
        return false;
    }
    let names = pgrx::PgList::<pg_sys::Node>::from_pg((*stmt).objects);
    let named = names.iter_ptr().any(|name| {
        (*name).type_ == pg_sys::NodeTag::T_String
            && std::ffi::CStr::from_ptr((*(name as *mut pg_sys::String)).sval).to_bytes()
                == b"outbox_ext"
    });
    named
}
