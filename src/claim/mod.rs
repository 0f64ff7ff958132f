//! Claims: consumers read the event log per shard, in commit order, under leases, with key
//! isolation, retries and dead letters. Almost all of it is SQL (sql/consumers.sql, cursors.sql,
//! parking.sql, claim.sql, settle.sql, replay.sql): relays in any
//! language and the background worker call the same functions. Native parts: `result` makes
//! outbox.claim's and outbox.settle_and_claim's results, `pruned` runs a claim's reads of the
//! event log so that they lock only the partitions they may read, with the statements of
//! `statements`.

use pgrx::pg_sys;

mod pruned;
mod result;
mod statements;

/// Argument i of a call, as passed (where the function is STRICT, or the argument never NULL).
// SAFETY: callers pass their own call's fcinfo and i below its nargs (their SQL declaration
// has that many arguments).
unsafe fn arg(fcinfo: pg_sys::FunctionCallInfo, i: usize) -> pg_sys::Datum {
    (*(*fcinfo).args.as_ptr().add(i)).value
}

/// Argument i of a call, None when NULL.
// SAFETY: as for arg: the current call's fcinfo, i below its nargs.
unsafe fn nullable_arg(fcinfo: pg_sys::FunctionCallInfo, i: usize) -> Option<pg_sys::Datum> {
    let a = *(*fcinfo).args.as_ptr().add(i);
    (!a.isnull).then_some(a.value)
}

/// Argument i's type, as the call site declared it.
// SAFETY: fcinfo is the current call's, so flinfo is valid; get_fn_expr_argtype returns
// InvalidOid when it cannot tell.
unsafe fn arg_type(fcinfo: pg_sys::FunctionCallInfo, i: usize) -> pg_sys::Oid {
    pg_sys::get_fn_expr_argtype((*fcinfo).flinfo, i as i32)
}
