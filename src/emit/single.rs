//! `outbox.emit`, natively: the one call an application makes per business transaction, so
//! it costs about what a plain INSERT of the row costs. A C function with no PL/pgSQL frame
//! and no SECURITY DEFINER (whose `SET search_path` alone costs a GUC save and restore per
//! call): it checks the event, then writes it as the function's owner, as a SECURITY DEFINER
//! function would, through bulk emit's native path (`insert::Target`), which finds its table
//! and sequence by schema, not by search_path. When that path declines (a trigger, a
//! constraint, no partition for now()), it hands the event to `outbox.emit_many`, whose plain
//! INSERT does everything; that one statement names the function by schema, with argument
//! types that match it exactly, so a caller's search_path cannot redirect it.

use super::insert::{Fixed, Target};
use super::{check_event, uuid_v7};
use pgrx::prelude::*;
use pgrx::{pg_sys, JsonB, Uuid};

/// The arguments, in the order of the SQL signature (sql/emit.sql).
const AGGREGATE_TYPE: usize = 0;
const AGGREGATE_ID: usize = 1;
const EVENT_TYPE: usize = 2;
const PAYLOAD: usize = 3;
const HEADERS: usize = 4;
const TOPIC: usize = 5;

#[unsafe(no_mangle)]
pub extern "C" fn pg_finfo_outbox_emit() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

/// `outbox.emit(aggregate_type, aggregate_id, event_type, payload, headers, topic)`. Declared
/// by hand in sql/emit.sql: through `#[pg_extern]`, pgrx would turn the payload into a serde
/// value and back.
// SAFETY: called by fmgr for outbox.emit(text, text, text, jsonb, jsonb, text) (sql/emit.sql,
// LANGUAGE c, V1), in a transaction on the backend's thread: fcinfo has those six arguments,
// NULLs flagged; check_event raises for a NULL required one.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn outbox_emit(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    let raw = |n| (!pgrx::pg_arg_is_null(fcinfo, n)).then(|| pgrx::pg_getarg_datum_raw(fcinfo, n));
    let text = |n| pgrx::pg_getarg::<&str>(fcinfo, n);
    let payload = raw(PAYLOAD);
    check_event(
        text(AGGREGATE_TYPE),
        text(AGGREGATE_ID),
        text(EVENT_TYPE),
        payload.map(|p| super::payload_bytes(p)),
        pgrx::pg_getarg::<JsonB>(fcinfo, HEADERS).as_ref(),
        text(TOPIC),
    );
    crate::wake::note_emit();
    let id = uuid_v7();
    // All checked: the required ones are not NULL.
    let fixed = Fixed {
        topic: raw(TOPIC),
        aggregate_type: pgrx::pg_getarg_datum_raw(fcinfo, AGGREGATE_TYPE),
        event_type: pgrx::pg_getarg_datum_raw(fcinfo, EVENT_TYPE),
        headers: raw(HEADERS),
    };
    let key = pgrx::pg_getarg_datum_raw(fcinfo, AGGREGATE_ID);
    let _owner = AsUser::switch_to(function_owner((*(*fcinfo).flinfo).fn_oid));
    let id = match Target::open() {
        Some(target) => {
            target.write(&fixed, &[id], |_| (key, payload));
            target.close();
            id
        }
        None => emit_by_sql(fcinfo),
    };
    id.into_datum().unwrap_or(pg_sys::Datum::from(0))
}

/// Runs the rest of a scope as another user, the way a SECURITY DEFINER function runs its
/// body: the previous user comes back when dropped (also when unwinding from an ERROR; the
/// (sub)transaction's abort would restore it anyway).
struct AsUser {
    saved_user: pg_sys::Oid,
    saved_context: i32,
}

impl AsUser {
    // SAFETY: only sets backend globals; callers keep the AsUser for the scope, whose drop
    // restores them (an abort would too).
    unsafe fn switch_to(user: pg_sys::Oid) -> AsUser {
        let (mut saved_user, mut saved_context) = (pg_sys::InvalidOid, 0);
        pg_sys::GetUserIdAndSecContext(&mut saved_user, &mut saved_context);
        let context = saved_context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32;
        pg_sys::SetUserIdAndSecContext(user, context);
        AsUser {
            saved_user,
            saved_context,
        }
    }
}

impl Drop for AsUser {
    fn drop(&mut self) {
        // SAFETY: sets two backend globals back; cannot fail.
        unsafe { pg_sys::SetUserIdAndSecContext(self.saved_user, self.saved_context) };
    }
}

// SAFETY: in a transaction (syscache); the tuple is checked non-NULL and released after its
// fixed-width proowner is read.
unsafe fn function_owner(function: pg_sys::Oid) -> pg_sys::Oid {
    let tuple = pg_sys::SearchSysCache1(
        pg_sys::SysCacheIdentifier::PROCOID as _,
        pg_sys::Datum::from(function),
    );
    if tuple.is_null() {
        error!("outbox_ext: cache lookup failed for function {function:?}");
    }
    let owner = (*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_proc>(tuple)).proowner;
    pg_sys::ReleaseSysCache(tuple);
    owner
}

/// The event through `outbox.emit_many`'s plain INSERT, for tables the native path declines.
// SAFETY: fcinfo is outbox.emit's (see outbox_emit), its six arguments of those types.
unsafe fn emit_by_sql(fcinfo: pg_sys::FunctionCallInfo) -> Uuid {
    let arg = |n, oid| {
        let value =
            (!pgrx::pg_arg_is_null(fcinfo, n)).then(|| pgrx::pg_getarg_datum_raw(fcinfo, n));
        // SAFETY: the argument's datum, of the declared type, alive for this call.
        unsafe { pgrx::datum::DatumWithOid::new(value, oid) }
    };
    let args = [
        arg(AGGREGATE_TYPE, pg_sys::TEXTOID),
        arg(EVENT_TYPE, pg_sys::TEXTOID),
        arg(AGGREGATE_ID, pg_sys::TEXTOID),
        arg(PAYLOAD, pg_sys::JSONBOID),
        arg(HEADERS, pg_sys::JSONBOID),
        arg(TOPIC, pg_sys::TEXTOID),
    ];
    Spi::get_one_with_args::<Uuid>(
        "SELECT outbox.emit_many($1, $2, ARRAY[$3], ARRAY[$4], $5, $6)",
        &args,
    )
    .ok()
    .flatten()
    .unwrap_or_else(|| error!("outbox_ext: emit_many wrote no event"))
}
