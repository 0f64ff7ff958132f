//! Reads of the event log that lock only the partitions they may read, called from
//! sql/cursors.sql: a claim's page (`_claim_page`), a window's events for the parked path and
//! settle (`_window_events`), the probe for events above a floor (`_any_events`) and the seq
//! range of late transactions at a window's opening (`_late_range`).
//!
//! Why native: a statement on outbox.events planned once for the session (a generic plan, see
//! sql/cursors.sql) holds every partition, and each execution locks all of them and sets up
//! their pruning before it prunes: with 200 partitions, a third of a claim. These statements
//! name the bounds of the partitions around the time range [since, until) they are given as
//! constants instead, so the planner prunes the other partitions away and their plans, kept
//! for the session per pair of bounds, hold only what they read. A partition made, attached or
//! dropped invalidates the plans, which PostgreSQL then makes again. The bounds only widen
//! [since, until), which the SQL functions called use only to prune: the rows are theirs
//! (`_window` and the `_window_in_order` it calls, `_shards_with_events`, `_late_seqs`),
//! defined once in sql/cursors.sql.

use super::result::RowReceiver;
use super::statements::{column, connect, finish, run, Bounds, Param, Statement};
use super::{arg, arg_type, nullable_arg};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::ffi::CStr;

/// Seconds from the Unix epoch (to_timestamp's) to PostgreSQL's (a timestamptz's zero).
const POSTGRES_EPOCH_SECONDS: i64 = 946_684_800;

v1!(
    pg_finfo_outbox_claim_page,
    pg_finfo_outbox_claim_page_0_18,
    pg_finfo_outbox_window_events,
    pg_finfo_outbox_any_events,
    pg_finfo_outbox_shards_with_new_events,
    pg_finfo_outbox_late_range
);

/// A cursor (an outbox._cursor_log argument) as a flat row: PL/pgSQL passes its variable as
/// an expanded record.
// SAFETY: callers pass a non-NULL composite datum (a cursor argument); pg_detoast_datum
// returns it flat, an expanded record flattened into a palloc'd copy.
unsafe fn flat_cursor(cursor: pg_sys::Datum) -> pg_sys::HeapTupleHeader {
    pg_sys::pg_detoast_datum(cursor.cast_mut_ptr()) as pg_sys::HeapTupleHeader
}

/// A field of a flat cursor, which must not be NULL.
// SAFETY: cursor is a flat row from flat_cursor; GetAttributeByName looks its row type up
// and raises for a field it lacks.
unsafe fn cursor_field(cursor: pg_sys::HeapTupleHeader, name: &CStr) -> pg_sys::Datum {
    let mut null = false;
    let value = pg_sys::GetAttributeByName(cursor, name.as_ptr(), &mut null);
    if null {
        error!("outbox_ext: a claim's cursor has no {name:?}");
    }
    value
}

/// A field of a flat cursor, None when NULL.
// SAFETY: as for cursor_field: a flat row from flat_cursor.
unsafe fn nullable_cursor_field(
    cursor: pg_sys::HeapTupleHeader,
    name: &CStr,
) -> Option<pg_sys::Datum> {
    let mut null = false;
    let value = pg_sys::GetAttributeByName(cursor, name.as_ptr(), &mut null);
    (!null).then_some(value)
}

/// The parameters of Statement::InOrderPage: shard, epoch, and what `_window` passes to
/// `_window_in_order` for a page (after its position, up to a restored cursor's last seq, at
/// most lim).
// SAFETY: cursor is a flat outbox._cursor_log row (sql/cursors.sql: lo_seq, after_seq and
// restored_seq bigint, lo_top xid8, hi_snap pg_snapshot); hi_snap points into it, and the
// caller keeps it until the statement has run.
unsafe fn in_order_page_params(
    cursor: pg_sys::HeapTupleHeader,
    shard: pg_sys::Datum,
    epoch: pg_sys::Datum,
    lim: pg_sys::Datum,
) -> [Param; 7] {
    let seq = |name: &CStr| nullable_cursor_field(cursor, name).map(|d| d.value() as i64);
    let lo_seq = cursor_field(cursor, c"lo_seq").value() as i64;
    let after = seq(c"after_seq").map_or(lo_seq, |after_seq| after_seq.max(lo_seq));
    let upto = seq(c"restored_seq").unwrap_or(i64::MAX);
    let hi_snap = cursor_field(cursor, c"hi_snap");
    [
        (pg_sys::INT4OID, Some(shard)),
        (pg_sys::INT8OID, Some(epoch)),
        (pg_sys::INT8OID, Some(pg_sys::Datum::from(after))),
        (pg_sys::INT8OID, Some(pg_sys::Datum::from(upto))),
        (pg_sys::INT4OID, Some(lim)),
        (pg_sys::XID8OID, Some(cursor_field(cursor, c"lo_top"))),
        (pg_sys::PG_SNAPSHOTOID, Some(hi_snap)),
    ]
}

/// The bounds around [since, until), arguments i and i + 1 of a call.
// SAFETY: the callers' functions are STRICT, with timestamptz arguments i and i + 1.
unsafe fn bounds_of(fcinfo: pg_sys::FunctionCallInfo, i: usize) -> Bounds {
    window_bounds(
        arg(fcinfo, i).value() as i64,
        arg(fcinfo, i + 1).value() as i64,
    )
}

/// `_claim_page` of 0.16.0's SQL (`RETURNS SETOF outbox.claimed`) and 0.17.0's (`RETURNS
/// bigint`), which have no `_window_in_order`: every page is read through `_window`.
// SAFETY: called by fmgr for _claim_page of 0.16.0's and 0.17.0's SQL (LANGUAGE c, STRICT,
// the six arguments claim_page reads), in a transaction on the backend's thread.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn outbox_claim_page(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    claim_page(fcinfo, false)
}

/// `_claim_page(cur, lim, owner, lease, since, until) RETURNS bigint` (sql/cursors.sql): hands out
/// at most lim events of the cursor's window after its position, in seq order, as claimed rows
/// of epoch cur.epoch + 1, into the result of the claim in progress (result.rs), and, when
/// there are any, writes the claim row leasing them to owner. Returns how many it handed out.
// SAFETY: called by fmgr for outbox_internal._claim_page (sql/cursors.sql: LANGUAGE c,
// STRICT, the six arguments claim_page reads), in a transaction on the backend's thread.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn outbox_claim_page_0_18(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    claim_page(fcinfo, true)
}

/// A claim's page; in_order_alone: when the cursor has no late range, read only its events in
/// commit order (`_window_in_order`), with the cursor's fields as values.
// SAFETY: fcinfo is _claim_page's (STRICT: its six arguments are not NULL); page lives on
// this frame until its statements have run, and connect is paired with finish.
unsafe fn claim_page(fcinfo: pg_sys::FunctionCallInfo, in_order_alone: bool) -> pg_sys::Datum {
    let cursor_type = arg_type(fcinfo, 0);
    let bounds = bounds_of(fcinfo, 4);
    // 0.16.0's SQL declares it SETOF and returns the page itself: so it runs on this library
    // from the library's install until ALTER EXTENSION UPDATE
    let mut page = if (*(*fcinfo).flinfo).fn_retset {
        RowReceiver::for_result(fcinfo)
    } else {
        RowReceiver::for_claim()
    };
    // the shard and the next epoch as values: fields of $1 would be read again for every row
    let cursor = flat_cursor(arg(fcinfo, 0));
    let shard = cursor_field(cursor, c"shard");
    let epoch = pg_sys::Datum::from(cursor_field(cursor, c"epoch").value() as i64 + 1);
    let in_order = in_order_alone
        && nullable_cursor_field(cursor, c"late_from").is_none()
        && nullable_cursor_field(cursor, c"hi_snap").is_some();
    connect();
    if in_order {
        run(
            Statement::InOrderPage(bounds),
            &in_order_page_params(cursor, shard, epoch, arg(fcinfo, 1)),
            false,
            (&raw mut page).cast(),
        );
    } else {
        run(
            Statement::Page(bounds, cursor_type),
            &[
                (cursor_type, Some(arg(fcinfo, 0))),
                (pg_sys::INT4OID, Some(arg(fcinfo, 1))),
                (pg_sys::INT4OID, Some(shard)),
                (pg_sys::INT8OID, Some(epoch)),
            ],
            false,
            (&raw mut page).cast(),
        );
    }
    if page.count > 0 {
        let exhausted = page.count < i64::from(arg(fcinfo, 1).value() as i32);
        run(
            Statement::Claimed(cursor_type),
            &[
                (cursor_type, Some(arg(fcinfo, 0))),
                (pg_sys::TEXTOID, Some(arg(fcinfo, 2))),
                (pg_sys::INTERVALOID, Some(arg(fcinfo, 3))),
                (pg_sys::INT8OID, Some(pg_sys::Datum::from(page.last_seq))),
                (pg_sys::BOOLOID, Some(pg_sys::Datum::from(exhausted))),
            ],
            false,
            std::ptr::null_mut(),
        );
    }
    finish();
    pg_sys::Datum::from(page.count)
}

/// `_window_events(cur, upto, lim, since, until) RETURNS SETOF outbox.events`: `_window`'s
/// events of the cursor's window after its position, up to seq upto and at most lim (NULL:
/// all), in seq order.
// SAFETY: called by fmgr for outbox_internal._window_events (sql/cursors.sql: LANGUAGE c,
// SETOF, five arguments, not STRICT: each read as nullable), in a transaction on the
// backend's thread; rows lives on this frame until the statement has run.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn outbox_window_events(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    let (cursor, since, until) = (
        nullable_arg(fcinfo, 0),
        nullable_arg(fcinfo, 3),
        nullable_arg(fcinfo, 4),
    );
    let (Some(cursor), Some(since), Some(until)) = (cursor, since, until) else {
        error!("outbox_ext: _window_events needs a cursor, since and until");
    };
    let cursor_type = arg_type(fcinfo, 0);
    let bounds = window_bounds(since.value() as i64, until.value() as i64);
    let mut rows = RowReceiver::for_result(fcinfo);
    connect();
    run(
        Statement::Events(bounds, cursor_type),
        &[
            (cursor_type, Some(cursor)),
            (pg_sys::INT8OID, nullable_arg(fcinfo, 1)),
            (
                pg_sys::INT4OID,
                Some(cursor_field(flat_cursor(cursor), c"shard")),
            ),
            (pg_sys::INT4OID, nullable_arg(fcinfo, 2)),
        ],
        true,
        (&raw mut rows).cast(),
    );
    finish();
    pg_sys::Datum::from(0)
}

/// Connects and runs a statement over the call's (shards int[], floors bigint[]), its first
/// two arguments; the caller reads the result and finishes.
unsafe fn run_over_shards(fcinfo: pg_sys::FunctionCallInfo, statement: Statement) {
    connect();
    run(
        statement,
        &[
            (pg_sys::INT4ARRAYOID, Some(arg(fcinfo, 0))),
            (pg_sys::INT8ARRAYOID, Some(arg(fcinfo, 1))),
        ],
        true,
        std::ptr::null_mut(),
    );
}

/// `_any_events(shards int[], floors bigint[], since, until) RETURNS boolean`: whether any
/// of the shards has an event above its floor, made in [since, until).
// SAFETY: called by fmgr for outbox_internal._any_events (sql/cursors.sql: LANGUAGE c,
// STRICT, int[], bigint[] and two timestamptz), in a transaction on the backend's thread.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn outbox_any_events(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    run_over_shards(fcinfo, Statement::AnyEvents(bounds_of(fcinfo, 2)));
    let any = column(1) == Some(pg_sys::Datum::from(true));
    finish();
    pg_sys::Datum::from(any)
}

/// `_shards_with_new_events(shards int[], floors bigint[], since, until) RETURNS int[]`: the
/// shards among shards that have an event above their floor, made in [since, until), in
/// order; NULL when none has.
// SAFETY: called by fmgr for outbox_internal._shards_with_new_events (sql/cursors.sql:
// LANGUAGE c, STRICT, int[], bigint[] and two timestamptz), in a transaction on the
// backend's thread.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn outbox_shards_with_new_events(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    run_over_shards(fcinfo, Statement::ShardsWithEvents(bounds_of(fcinfo, 2)));
    // copied out of SPI's memory before finish frees it
    let shards = column(1).and_then(|d| Vec::<i32>::from_datum(d, false));
    finish();
    match shards.and_then(IntoDatum::into_datum) {
        Some(datum) => datum,
        None => {
            (*fcinfo).isnull = true;
            pg_sys::Datum::from(0)
        }
    }
}

/// `_late_range(shard, floor_seq, seq_end, txids xid8[], since, until) RETURNS bigint[]`: the
/// least and greatest seq of the shard's events of those transactions in (floor_seq,
/// seq_end], made in [since, until); NULLs when there are none.
// SAFETY: called by fmgr for outbox_internal._late_range (sql/cursors.sql: LANGUAGE c,
// STRICT, six arguments), in a transaction on the backend's thread.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn outbox_late_range(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    let statement = Statement::LateRange(bounds_of(fcinfo, 4));
    connect();
    run(
        statement,
        &[
            (pg_sys::INT4OID, Some(arg(fcinfo, 0))),
            (pg_sys::INT8OID, Some(arg(fcinfo, 1))),
            (pg_sys::INT8OID, Some(arg(fcinfo, 2))),
            (arg_type(fcinfo, 3), Some(arg(fcinfo, 3))),
        ],
        true,
        std::ptr::null_mut(),
    );
    let range: Vec<Option<i64>> = (1..=2)
        .map(|i| column(i).map(|d| d.value() as i64))
        .collect();
    finish();
    range.into_datum().unwrap_or(pg_sys::Datum::from(0))
}

/// The bounds of outbox.events' partitions around [since, until): the greatest at or below
/// since and the least at or above until, rounded outwards to whole seconds (the statements
/// name them with to_timestamp, which takes seconds).
// SAFETY: in a transaction; outbox.events is open (its lock kept) while its bounds are
// read, and is PARTITION BY RANGE (created_at) (sql/events.sql): kind and datums have
// ndatums entries.
unsafe fn window_bounds(since: i64, until: i64) -> Bounds {
    use pg_sys::PartitionRangeDatumKind::PARTITION_RANGE_DATUM_VALUE;
    let nsp = pg_sys::get_namespace_oid(c"outbox".as_ptr(), false);
    let oid = pg_sys::get_relname_relid(c"events".as_ptr(), nsp);
    if oid == pg_sys::InvalidOid {
        error!("outbox_ext: outbox.events is missing");
    }
    let rel = pg_sys::table_open(oid, pg_sys::AccessShareLock as _);
    let (mut lo, mut hi) = (None, None);
    if (*(*rel).rd_rel).relkind as u8 == pg_sys::RELKIND_PARTITIONED_TABLE {
        let bounds = (*pg_sys::RelationGetPartitionDesc(rel, true)).boundinfo;
        let n = if bounds.is_null() {
            0
        } else {
            (*bounds).ndatums as usize
        };
        for i in 0..n {
            if **(*bounds).kind.add(i) != PARTITION_RANGE_DATUM_VALUE {
                continue;
            }
            let at = (**(*bounds).datums.add(i)).value() as i64;
            if at == i64::MIN || at == i64::MAX {
                continue; // FROM ('-infinity') or TO ('infinity'): no finite bound to name
            }
            let seconds = at.div_euclid(1_000_000) + POSTGRES_EPOCH_SECONDS;
            if at <= since {
                lo = Some(seconds);
            }
            if at >= until && hi.is_none() {
                hi = Some(seconds + i64::from(at.rem_euclid(1_000_000) > 0));
            }
        }
    }
    pg_sys::table_close(rel, pg_sys::NoLock as _);
    (lo, hi)
}
