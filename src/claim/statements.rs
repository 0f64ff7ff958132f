//! The statements of claims' native functions (pruned.rs, result.rs), prepared on first use
//! and kept for the session.

use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::CString;

/// Kept plans past which the cache starts again: pairs of bounds change as time goes by.
const MAX_PLANS: usize = 64;

/// Partition bounds around a time range, in seconds since the Unix epoch (None: infinite).
pub type Bounds = (Option<i64>, Option<i64>);

/// A statement's parameter: its type and value (None: NULL).
pub type Param = (pg_sys::Oid, Option<pg_sys::Datum>);

/// The statements kept for the session.
#[derive(Clone, Copy, Hash, PartialEq, Eq)]
pub enum Statement {
    /// a claim's page, with outbox._cursor_log's type
    Page(Bounds, pg_sys::Oid),
    /// a claim's page of a cursor with no late range: its events in commit order alone
    InOrderPage(Bounds),
    /// the claim row of a page
    Claimed(pg_sys::Oid),
    /// events of a window, with outbox._cursor_log's type
    Events(Bounds, pg_sys::Oid),
    /// whether shards have events above their floors
    AnyEvents(Bounds),
    /// which shards have events above their floors
    ShardsWithEvents(Bounds),
    /// the seq range of late transactions' events
    LateRange(Bounds),
    /// outbox.claim's body, whose rows go into the result of outbox.claim (result.rs), with
    /// so many arguments (the SQL of 0.24.0 and before has no shards)
    ClaimBody(usize),
    /// outbox.settle_and_claim's body, likewise
    SettleAndClaimBody(usize),
}

impl Statement {
    /// Whether it is a claim's body, which runs the others (src/claim/result.rs).
    fn is_body(self) -> bool {
        matches!(
            self,
            Statement::ClaimBody(_) | Statement::SettleAndClaimBody(_)
        )
    }
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
        Statement::InOrderPage(b) => format!(
            "SELECT $1, $2, w.id, w.topic, w.aggregate_type, w.aggregate_id, w.event_type, \
                    w.payload, w.headers, w.created_at, w.seq, 1 \
               FROM outbox_internal._window_in_order($1, $3, $4, $5, $6, $7, {}) AS w",
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
        Statement::ShardsWithEvents(b) => format!(
            "SELECT pg_catalog.array_agg(s.shard ORDER BY s.shard) \
               FROM outbox_internal._shards_with_events($1, $2, {}) AS s(shard)",
            bounds(b)
        ),
        Statement::LateRange(b) => format!(
            "SELECT pg_catalog.min(l.seq), pg_catalog.max(l.seq) \
               FROM outbox_internal._late_seqs($1, $2, $3, $4, {}) AS l(seq)",
            bounds(b)
        ),
        Statement::ClaimBody(n) => {
            format!("SELECT * FROM outbox_internal._claim_body({})", args(n))
        }
        Statement::SettleAndClaimBody(n) => format!(
            "SELECT * FROM outbox_internal._settle_and_claim_body({})",
            args(n)
        ),
    }
}

/// "$1, $2, ..., $n"
fn args(n: usize) -> String {
    (1..=n)
        .map(|i| format!("${i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

thread_local! {
    static PLANS: RefCell<HashMap<Statement, pg_sys::SPIPlanPtr>> = RefCell::new(HashMap::new());
    static RUNNING: Cell<u32> = const { Cell::new(0) };
}

// SAFETY: callers are in a transaction on the backend's thread and call finish before
// returning (after an ERROR, the abort ends the connection).
pub unsafe fn connect() {
    if pg_sys::SPI_connect() != pg_sys::SPI_OK_CONNECT as i32 {
        error!("outbox_ext: SPI_connect failed");
    }
}

// SAFETY: callers connected earlier in the same call and use nothing of SPI's memory after.
pub unsafe fn finish() {
    if pg_sys::SPI_finish() != pg_sys::SPI_OK_FINISH as i32 {
        error!("outbox_ext: SPI_finish failed");
    }
}

/// Column i (from 1) of the one row the last statement returned into SPI_tuptable (by value).
// SAFETY: callers are between connect and finish, after run with a null dest: SPI_tuptable
// is checked to hold one row (SPI_getbinval answers NULL for a column it lacks).
pub unsafe fn column(i: i32) -> Option<pg_sys::Datum> {
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
// SAFETY: callers are between connect and finish, each param's datum of its type and alive
// until this returns, dest null or a RowReceiver that outlives it; the plan is a kept one
// that prepare frees only while no statement of ours runs.
pub unsafe fn run(
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
    // a claim's body runs the others inside it: counted, it would keep any plan from ever
    // being freed in a session that only claims (and it is never freed itself)
    let running = (!statement.is_body()).then(Running::start);
    let rc = pg_sys::SPI_execute_plan_extended(plan, &options);
    drop(running);
    if rc < 0 {
        error!("outbox_ext: a claim's statement failed ({rc})");
    }
}

/// Statements of ours other than claims' bodies executing in this backend: while one is (a
/// nested call, were there one), no kept plan is freed, for it may be that statement's.
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

/// Prepares and keeps a statement; when too many are kept and none is running, the others
/// but claims' bodies (one of which may be running) go first.
// SAFETY: between connect and finish (SPI_prepare needs the connection); SPI_keepplan moves
// the plan out of SPI's memory. Plans are freed only when RUNNING is 0, so none that is
// executing is freed (claims' bodies, not counted, never are).
unsafe fn prepare(statement: Statement, params: &[Param]) -> pg_sys::SPIPlanPtr {
    let text = CString::new(sql(statement)).expect("no NUL in SQL");
    let mut types: Vec<pg_sys::Oid> = params.iter().map(|(t, _)| *t).collect();
    let plan = pg_sys::SPI_prepare(text.as_ptr(), types.len() as i32, types.as_mut_ptr());
    if plan.is_null() || pg_sys::SPI_keepplan(plan) != 0 {
        error!("outbox_ext: could not prepare a claim's statement");
    }
    let old: Vec<pg_sys::SPIPlanPtr> = PLANS.with(|plans| {
        let mut plans = plans.borrow_mut();
        let mut old = Vec::new();
        if plans.len() >= MAX_PLANS && RUNNING.with(Cell::get) == 0 {
            let evicted: Vec<Statement> = plans.keys().copied().filter(|s| !s.is_body()).collect();
            old = evicted.iter().filter_map(|s| plans.remove(s)).collect();
        }
        plans.insert(statement, plan);
        old
    });
    for p in old {
        pg_sys::SPI_freeplan(p);
    }
    plan
}
