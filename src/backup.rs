//! Keeping what the outbox holds through backups, restores and DROP EXTENSION.
//!
//! - `sql/dump.sql`: what pg_dump writes of the extension's tables, and why.
//! - `sql/restore.sql`: how a state restored from a dump is recognised and rebased onto the
//!   transaction ids of the cluster it lands in.
//! - `sql/drop_guard.sql` and `outbox_guard_drop` here: a statement that would drop outbox_ext
//!   (DROP EXTENSION, or a cascade or DROP OWNED that takes it along) is refused while events
//!   are undelivered, keys parked or dead letters kept, unless `outbox_ext.drop_undelivered` is
//!   on.

use crate::gucs;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::{PgLogLevel, PgSqlErrorCode};

v1!(pg_finfo_outbox_guard_drop);

/// The event trigger on DROP EXTENSION, DROP LANGUAGE and DROP OWNED (ddl_command_start, while
/// our tables still exist): when the statement may drop outbox_ext and something would be lost,
/// raise 2BP01 with what and how to proceed.
// SAFETY: called by fmgr as the event trigger function outbox_internal._guard_drop
// (sql/drop_guard.sql: LANGUAGE c, no arguments) in the DDL's transaction; context is
// checked to be EventTriggerData before it is read.
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

/// True if the statement may drop outbox_ext: DROP EXTENSION naming it; DROP EXTENSION or DROP
/// LANGUAGE naming plpgsql with CASCADE (outbox_ext's functions are written in PL/pgSQL, and a
/// cascade that reaches an extension's member takes the whole extension); DROP OWNED BY the
/// role that owns it. (DROP SCHEMA of its schemas PostgreSQL refuses by itself.)
// SAFETY: tree is NULL or a node of the statement's parse tree, alive while the trigger
// runs; each cast follows a check of its NodeTag.
unsafe fn drops_outbox_ext(tree: *mut pg_sys::Node) -> bool {
    if tree.is_null() {
        return false;
    }
    match (*tree).type_ {
        pg_sys::NodeTag::T_DropStmt => {
            use pg_sys::ObjectType::{OBJECT_EXTENSION, OBJECT_LANGUAGE};
            let stmt = tree as *mut pg_sys::DropStmt;
            let cascade = (*stmt).behavior == pg_sys::DropBehavior::DROP_CASCADE;
            match (*stmt).removeType {
                OBJECT_EXTENSION => {
                    names(stmt, b"outbox_ext") || (cascade && names(stmt, b"plpgsql"))
                }
                OBJECT_LANGUAGE => cascade && names(stmt, b"plpgsql"),
                _ => false,
            }
        }
        pg_sys::NodeTag::T_DropOwnedStmt => {
            let roles = pgrx::PgList::<pg_sys::RoleSpec>::from_pg(
                (*(tree as *mut pg_sys::DropOwnedStmt)).roles,
            );
            let owner = outbox_ext_owner();
            let owns = roles
                .iter_ptr()
                .any(|role| Some(pg_sys::get_rolespec_oid(role, true)) == owner);
            owns
        }
        _ => false,
    }
}

/// Whether a DROP statement names the object `name`.
// SAFETY: stmt is a DropStmt of the parse tree; an object is read as a String only after
// its tag is checked, and its sval is a NUL-terminated C string.
unsafe fn names(stmt: *mut pg_sys::DropStmt, name: &[u8]) -> bool {
    let objects = pgrx::PgList::<pg_sys::Node>::from_pg((*stmt).objects);
    let named = objects.iter_ptr().any(|object| {
        (*object).type_ == pg_sys::NodeTag::T_String
            && std::ffi::CStr::from_ptr((*(object as *mut pg_sys::String)).sval).to_bytes() == name
    });
    named
}

/// The role that owns outbox_ext (None if it is not installed).
fn outbox_ext_owner() -> Option<pg_sys::Oid> {
    Spi::get_one::<pg_sys::Oid>(
        "SELECT e.extowner FROM pg_catalog.pg_extension e \
          WHERE e.extname OPERATOR(pg_catalog.=) 'outbox_ext'",
    )
    .ok()
    .flatten()
}
