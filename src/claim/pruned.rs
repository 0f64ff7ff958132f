//! Reads of the event log that lock only the partitions they may read, called from
//! sql/claim.sql: a claim's page (`_claim_page`), a window's events for the parked path and
//! settle (`_window_events`), the probe for events above a floor (`_any_events`) and the seq
//! range of late transactions at a window's opening (`_late_range`).
//!
//! Why native: a statement on outbox.events planned once for the session (a generic plan, see
//! sql/claim.sql) holds every partition, and each execution locks all of them and sets up
//! their pruning before it prunes: with 200 partitions, a third of a claim. These statements
//! name the bounds of the partitions around the time range [since, until) they are given as
//! constants instead, so the planner prunes the other partitions away and their plans, kept
//! for the session per pair of bounds, hold only what they read. A partition made, attached or
//! dropped invalidates the plans, which PostgreSQL then makes again. The bounds only widen
//! [since, until), which the SQL functions called use only to prune: the rows are theirs
//! (`_window`, `_shards_with_events`, `_late_seqs`), defined once in sql/claim.sql.

use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgTupleDesc;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{CStr, CString};

/// Seconds from the Unix epoch (to_timestamp's) to PostgreSQL's (a timestamptz's zero).
const POSTGRES_EPOCH_SECONDS: i64 = 946_684_800;
/// Kept plans past which the cache starts again: pairs of bounds change as time goes by.
const MAX_PLANS: usize = 64;

/// Partition bounds around a time range, in seconds since the Unix epoch (None: infinite).
type Bounds = (Option<i64>, Option<i64>);

/// A statement's parameter: its type and value (None: NULL).
type Param = (pg_sys::Oid, Option<pg_sys::Datum>);

/// The statements kept for the session.
#[derive(Clone, Copy, Hash, PartialEq, Eq)]
enum Statement {
    /// a claim's page, with outbox._cursor_log's type
    Page(Bounds, pg_sys::Oid),
    /// the claim row of a page
    Claimed(pg_sys::Oid),
    /// events of a window, with outbox._cursor_log's type
    Events(Bounds, pg_sys::Oid),
    /// whether shards have events above their floors
    AnyEvents(Bounds),
    /// the seq range of late transactions' events
    LateRange(Bounds),
}

/// The SQL of a statement. Every name is schema-qualified: callers pin search_path.
fn sql(statement: Statement) -> String {
    let bounds = |(lo, hi): Bounds| {
        let at = |b: Option<i64>, infinite: &str| match b {
            Some(seconds) => format!("pg_catalog.to_timestamp({seconds})"),
            None => format!("'{infinite}'::pg_catalog.timestamptz"),
        };
        format!("{}, {}", at(lo, "-infinity"), at(hi, "infinity"))
    };
    match statement {
        Statement::Page(b, _) => format!(
            "SELECT $3, $4, w.id, w.topic, w.aggregate_type, w.aggregate_id, w.event_type, \
                    w.payload, w.headers, w.created_at, w.seq, 1 \
               FROM outbox_internal._window($3, $1, NULL, $2, {}) AS w",
            bounds(b)
        ),
        Statement::Claimed(_) => "SELECT outbox_internal._append(\
                                      outbox_internal._claimed($1, $2, $3, $4, $5, '{}'))"
            .to_string(),
        Statement::Events(b, _) => format!(
            "SELECT w.* FROM outbox_internal._window($3, $1, $2, $4, {}) AS w",
            bounds(b)
        ),
        Statement::AnyEvents(b) => format!(
            "SELECT EXISTS (SELECT FROM outbox_internal._shards_with_events($1, $2, {}))",
            bounds(b)
        ),
        Statement::LateRange(b) => format!(
            "SELECT pg_catalog.min(l.seq), pg_catalog.max(l.seq) \
               FROM outbox_internal._late_seqs($1, $2, $3, $4, {}) AS l(seq)",
            bounds(b)
        ),
    }
}

thread_local! {
    static PLANS: RefCell<HashMap<Statement, pg_sys::SPIPlanPtr>> = RefCell::new(HashMap::new());
    static RUNNING: Cell<u32> = const { Cell::new(0) };
}

/// The version-1 call convention record PostgreSQL looks up for each C function.
macro_rules! v1 {
    ($($finfo:ident),*) => {$(
        #[unsafe(no_mangle)]
        pub extern "C" fn $finfo() -> &'static pg_sys::Pg_finfo_record {
            const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
            &V1
        }
    )*};
}
v1!(
    pg_finfo_outbox_claim_page,
    pg_finfo_outbox_window_events,
    pg_finfo_outbox_any_events,
    pg_finfo_outbox_late_range
);

/// Argument i of a call, as passed (where the function is STRICT, or the argument never NULL).
unsafe fn arg(fcinfo: pg_sys::FunctionCallInfo, i: usize) -> pg_sys::Datum {
    (*(*fcinfo).args.as_ptr().add(i)).value
}

/// Argument i of a call, None when NULL.
unsafe fn nullable_arg(fcinfo: pg_sys::FunctionCallInfo, i: usize) -> Option<pg_sys::Datum> {
    let a = *(*fcinfo).args.as_ptr().add(i);
    (!a.isnull).then_some(a.value)
}

/// A cursor (an outbox._cursor_log argument) as a flat row: PL/pgSQL passes its variable as
/// an expanded record.
unsafe fn flat_cursor(cursor: pg_sys::Datum) -> pg_sys::HeapTupleHeader {
    pg_sys::pg_detoast_datum(cursor.cast_mut_ptr()) as pg_sys::HeapTupleHeader
}

/// A field of a flat cursor, which must not be NULL.
unsafe fn cursor_field(cursor: pg_sys::HeapTupleHeader, name: &CStr) -> pg_sys::Datum {
    let mut null = false;
    let value = pg_sys::GetAttributeByName(cursor, name.as_ptr(), &mut null);
    if null {
        error!("outbox_ext: a claim's cursor has no {name:?}");
    }
    value
}

/// Argument i's type, as the call site declared it.
unsafe fn arg_type(fcinfo: pg_sys::FunctionCallInfo, i: usize) -> pg_sys::Oid {
    pg_sys::get_fn_expr_argtype((*fcinfo).flinfo, i as i32)
}

/// The bounds around [since, until), arguments i and i + 1 of a call.
unsafe fn bounds_of(fcinfo: pg_sys::FunctionCallInfo, i: usize) -> Bounds {
    window_bounds(
        arg(fcinfo, i).value() as i64,
        arg(fcinfo, i + 1).value() as i64,
    )
}

/// `_claim_page(cur, lim, owner, lease, since, until) RETURNS SETOF outbox.claimed`: at most
/// lim events of the cursor's window after its position, in seq order, as claimed rows of
/// epoch cur.epoch + 1, and, when there are any, the claim row leasing them to owner. Rows go
/// from the executor into the result once (a CTE copied them once before).
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn outbox_claim_page(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    let cursor_type = arg_type(fcinfo, 0);
    let bounds = bounds_of(fcinfo, 4);
    let mut page = RowReceiver::for_result(fcinfo);
    // the shard and the next epoch as values: fields of $1 would be read again for every row
    let cursor = flat_cursor(arg(fcinfo, 0));
    let shard = cursor_field(cursor, c"shard");
    let epoch = pg_sys::Datum::from(cursor_field(cursor, c"epoch").value() as i64 + 1);
    connect();
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
    pg_sys::Datum::from(0)
}

/// `_window_events(cur, upto, lim, since, until) RETURNS SETOF outbox.events`: `_window`'s
/// events of the cursor's window after its position, up to seq upto and at most lim (NULL:
/// all), in seq order.
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

/// `_any_events(shards int[], floors bigint[], since, until) RETURNS boolean`: whether any
/// of the shards has an event above its floor, made in [since, until).
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn outbox_any_events(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    let statement = Statement::AnyEvents(bounds_of(fcinfo, 2));
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
    let any = column(1) == Some(pg_sys::Datum::from(true));
    finish();
    pg_sys::Datum::from(any)
}

/// `_late_range(shard, floor_seq, seq_end, txids xid8[], since, until) RETURNS bigint[]`: the
/// least and greatest seq of the shard's events of those transactions in (floor_seq,
/// seq_end], made in [since, until); NULLs when there are none.
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

unsafe fn connect() {
    if pg_sys::SPI_connect() != pg_sys::SPI_OK_CONNECT as i32 {
        error!("outbox_ext: SPI_connect failed");
    }
}

unsafe fn finish() {
    if pg_sys::SPI_finish() != pg_sys::SPI_OK_FINISH as i32 {
        error!("outbox_ext: SPI_finish failed");
    }
}

/// Column i (from 1) of the one row the last statement returned into SPI_tuptable (by value).
unsafe fn column(i: i32) -> Option<pg_sys::Datum> {
    let table = pg_sys::SPI_tuptable;
    if table.is_null() || pg_sys::SPI_processed != 1 {
        error!("outbox_ext: a claim's statement did not return one row");
    }
    let mut null = false;
    let value = pg_sys::SPI_getbinval(*(*table).vals, (*table).tupdesc, i, &mut null);
    (!null).then_some(value)
}

/// Runs a kept statement (prepared on first use) with the given parameters, into `dest` (or
/// SPI_tuptable when null). read_only: in the caller's snapshot, for reads.
unsafe fn run(
    statement: Statement,
    params: &[Param],
    read_only: bool,
    dest: *mut pg_sys::DestReceiver,
) {
    let plan = PLANS.with(|plans| plans.borrow().get(&statement).copied());
    let plan = plan.unwrap_or_else(|| prepare(statement, params));
    let list = pg_sys::makeParamList(params.len() as i32);
    for (i, (ptype, value)) in params.iter().enumerate() {
        let p = (*list).params.as_mut_ptr().add(i);
        (*p).value = value.unwrap_or(pg_sys::Datum::from(0));
        (*p).isnull = value.is_none();
        (*p).pflags = pg_sys::PARAM_FLAG_CONST as u16;
        (*p).ptype = *ptype;
    }
    let options = pg_sys::SPIExecuteOptions {
        params: list,
        read_only,
        allow_nonatomic: false,
        must_return_tuples: false,
        tcount: 0,
        dest,
        owner: std::ptr::null_mut(),
    };
    let running = Running::start();
    let rc = pg_sys::SPI_execute_plan_extended(plan, &options);
    drop(running);
    if rc < 0 {
        error!("outbox_ext: a claim's statement failed ({rc})");
    }
}

/// Statements of ours executing in this backend: while one is (a nested call, were there
/// one), no kept plan is freed, for it may be that statement's.
struct Running;

impl Running {
    fn start() -> Running {
        RUNNING.with(|n| n.set(n.get() + 1));
        Running
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        RUNNING.with(|n| n.set(n.get() - 1)); // on an ERROR too: it unwinds through here
    }
}

/// Prepares and keeps a statement; when too many are kept and none is running, the others go
/// first.
unsafe fn prepare(statement: Statement, params: &[Param]) -> pg_sys::SPIPlanPtr {
    let text = CString::new(sql(statement)).expect("no NUL in SQL");
    let mut types: Vec<pg_sys::Oid> = params.iter().map(|(t, _)| *t).collect();
    let plan = pg_sys::SPI_prepare(text.as_ptr(), types.len() as i32, types.as_mut_ptr());
    if plan.is_null() || pg_sys::SPI_keepplan(plan) != 0 {
        error!("outbox_ext: could not prepare a claim's statement");
    }
    let old: Vec<pg_sys::SPIPlanPtr> = PLANS.with(|plans| {
        let mut plans = plans.borrow_mut();
        let old = if plans.len() >= MAX_PLANS && RUNNING.with(Cell::get) == 0 {
            plans.drain().map(|(_, p)| p).collect()
        } else {
            Vec::new()
        };
        plans.insert(statement, plan);
        old
    });
    for p in old {
        pg_sys::SPI_freeplan(p);
    }
    plan
}

/// The bounds of outbox.events' partitions around [since, until): the greatest at or below
/// since and the least at or above until, rounded outwards to whole seconds (the statements
/// name them with to_timestamp, which takes seconds).
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

/// Where a statement's rows go: into the function's result, counted, with the last seq kept
/// (rows come in seq order) for a page's claim row.
#[repr(C)]
struct RowReceiver {
    base: pg_sys::DestReceiver,
    store: *mut pg_sys::Tuplestorestate,
    /// the result's row type, which the statement's rows must have
    expected: pg_sys::TupleDesc,
    /// the seq column (from 1), found by name when the statement starts
    seq_column: i32,
    count: i64,
    last_seq: i64,
}

impl RowReceiver {
    /// A receiver for the result of a set-returning call, in materialize mode, as the row type
    /// the call declares.
    unsafe fn for_result(fcinfo: pg_sys::FunctionCallInfo) -> RowReceiver {
        pg_sys::InitMaterializedSRF(fcinfo, pg_sys::MAT_SRF_USE_EXPECTED_DESC as _);
        let result = (*fcinfo).resultinfo as *mut pg_sys::ReturnSetInfo;
        RowReceiver {
            base: pg_sys::DestReceiver {
                receiveSlot: Some(receive_slot),
                rStartup: Some(startup),
                rShutdown: Some(nothing),
                rDestroy: Some(nothing),
                mydest: pg_sys::CommandDest::DestTuplestore, // not read: SPI runs the callbacks
            },
            store: (*result).setResult,
            expected: (*result).setDesc,
            seq_column: 0,
            count: 0,
            last_seq: 0,
        }
    }
}

/// Checks that the statement's rows have the result's row type, column for column (a column
/// dropped from it would shift every later one), and finds seq.
#[pg_guard]
unsafe extern "C-unwind" fn startup(
    dest: *mut pg_sys::DestReceiver,
    _operation: i32,
    rows: pg_sys::TupleDesc,
) {
    let me = dest as *mut RowReceiver;
    let rows = PgTupleDesc::from_pg_unchecked(rows);
    let expected = PgTupleDesc::from_pg_unchecked((*me).expected);
    let same = rows.len() == expected.len()
        && rows
            .iter()
            .zip(expected.iter())
            .all(|(a, b)| a.atttypid == b.atttypid && !b.attisdropped);
    if !same {
        error!("outbox_ext: a claim's rows do not have the row type of its result");
    }
    match expected.iter().position(|attr| attr.name() == "seq") {
        Some(i) => (*me).seq_column = i as i32 + 1,
        None => error!("outbox_ext: a claim's rows have no seq"),
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn receive_slot(
    slot: *mut pg_sys::TupleTableSlot,
    dest: *mut pg_sys::DestReceiver,
) -> bool {
    let me = dest as *mut RowReceiver;
    let column = (*me).seq_column;
    if i32::from((*slot).tts_nvalid) < column {
        pg_sys::slot_getsomeattrs_int(slot, column);
    }
    (*me).last_seq = (*(*slot).tts_values.add(column as usize - 1)).value() as i64;
    (*me).count += 1;
    pg_sys::tuplestore_puttupleslot((*me).store, slot);
    true
}

// no pg_guard: it does nothing that could raise or panic
unsafe extern "C-unwind" fn nothing(_: *mut pg_sys::DestReceiver) {}
