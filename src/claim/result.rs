//! A claim's result. outbox.claim and outbox.settle_and_claim are native so that the events a
//! claim hands out go from the executor into the call's result once. Their bodies are PL/pgSQL
//! (`_claim_body` in sql/claim.sql and `_settle_and_claim_body` in sql/settle.sql); a page of a window, the bulk
//! of every claim, is written by `_claim_page` (pruned.rs) straight into the result of the
//! claim in progress, and the rows a body returns itself (the parked path's) follow it there.
//! (Passed up through PL/pgSQL's RETURN QUERY, every row was copied again in each function on
//! the way: two more copies, a quarter of a claim of 1,000 events.) A row written there stays
//! whatever happens after, so a page is refused inside a subtransaction the claim did not
//! start in (an exception handler's block, which could catch an error after the page and roll
//! back its claim row): an error ends the claim, and InProgress forgets its result.

use super::nullable_arg;
use super::statements::{connect, finish, run, Param, Statement};
use pgrx::pg_sys;
use pgrx::pg_sys::panic::{CaughtError, ErrorReport};
use pgrx::prelude::*;
use pgrx::PgTupleDesc;
use std::cell::Cell;

v1!(pg_finfo_outbox_claim, pg_finfo_outbox_settle_and_claim);

/// Where rows go: a result being built, and its row type (which the rows must have).
#[derive(Clone, Copy)]
struct Target {
    store: *mut pg_sys::Tuplestorestate,
    desc: pg_sys::TupleDesc,
}

/// A claim in progress: its result, and the subtransaction it runs in.
#[derive(Clone, Copy)]
struct Claim {
    result: Target,
    subtransaction: pg_sys::SubTransactionId,
}

thread_local! {
    /// The claim in progress in this backend, into whose result its page goes.
    static CLAIM: Cell<Option<Claim>> = const { Cell::new(None) };
}

/// `outbox.claim(consumer text, batch_size int, lease interval, owner text, shards int)`.
// SAFETY: called by fmgr for outbox.claim (sql/claim.sql: LANGUAGE c, SETOF, five arguments
// of the types below, or the first four in the SQL of 0.24.0 and before), in a transaction on
// the backend's thread; run_body checks nargs.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn outbox_claim(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    use pg_sys::{INT4OID, INTERVALOID, TEXTOID};
    run_body(
        fcinfo,
        Statement::ClaimBody,
        &[TEXTOID, INT4OID, INTERVALOID, TEXTOID, INT4OID],
    )
}

/// `outbox.settle_and_claim(consumer text, shard int, epoch bigint, failures jsonb,
/// batch_size int, lease interval, owner text, shards int)`.
// SAFETY: called by fmgr for outbox.settle_and_claim (sql/settle.sql: LANGUAGE c, SETOF,
// eight arguments of the types below, or the first seven in the SQL of 0.24.0 and before),
// in a transaction on the backend's thread; run_body checks nargs.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn outbox_settle_and_claim(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    use pg_sys::{INT4OID, INT8OID, INTERVALOID, JSONBOID, TEXTOID};
    let types = [
        TEXTOID,
        INT4OID,
        INT8OID,
        JSONBOID,
        INT4OID,
        INTERVALOID,
        TEXTOID,
        INT4OID,
    ];
    run_body(fcinfo, Statement::SettleAndClaimBody, &types)
}

/// Runs a claim's body with the call's arguments (of the given types, the last left out by
/// the SQL of 0.24.0 and before, which runs on this library until ALTER EXTENSION UPDATE), as
/// the claim in progress: the rows of its page and the rows it returns make the call's result.
// SAFETY: fcinfo is a set-returning call's, its arguments of these types (their count
// checked below); rows (dest) outlives the statement, and the claim is unset again when
// this returns or unwinds (InProgress), so no page writes into a finished call's result.
unsafe fn run_body(
    fcinfo: pg_sys::FunctionCallInfo,
    body: fn(usize) -> Statement,
    types: &[pg_sys::Oid],
) -> pg_sys::Datum {
    let nargs = (*fcinfo).nargs as usize;
    if nargs != types.len() && nargs != types.len() - 1 {
        error!("outbox_ext: a claim was called with {nargs} arguments");
    }
    let body = body(nargs);
    let params: Vec<Param> = (0..nargs)
        .map(|i| (types[i], nullable_arg(fcinfo, i)))
        .collect();
    let mut rows = RowReceiver::for_result(fcinfo);
    let claim = InProgress::start(Claim {
        result: rows.target,
        subtransaction: pg_sys::GetCurrentSubTransactionId(),
    });
    let dest: *mut pg_sys::DestReceiver = (&raw mut rows).cast();
    connect();
    PgTryBuilder::new(|| run(body, &params, false, dest))
        .catch_others(raise_as_the_body_did)
        .execute();
    finish();
    drop(claim);
    pg_sys::Datum::from(0)
}

/// Raises an error of a claim's body again with its SQLSTATE, message, detail and hint. (Left
/// to pgrx, an error caught at its FFI boundary gets a Rust backtrace for DETAIL when the
/// server runs with RUST_BACKTRACE set.) Its CONTEXT lines are not kept: pgrx does not keep them.
fn raise_as_the_body_did(error: CaughtError) {
    let CaughtError::PostgresError(raised) = error else {
        error.rethrow()
    };
    let mut report = ErrorReport::new(
        raised.sql_error_code(),
        raised.message().to_string(),
        "outbox_ext claim",
    );
    if let Some(detail) = raised.detail() {
        report = report.set_detail(detail);
    }
    if let Some(hint) = raised.hint() {
        report = report.set_hint(hint);
    }
    report.report(PgLogLevel::ERROR);
}

/// The claim in progress while it lives; the one before (none, unless claims nest) after.
struct InProgress(Option<Claim>);

impl InProgress {
    fn start(claim: Claim) -> InProgress {
        InProgress(CLAIM.with(|current| current.replace(Some(claim))))
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        CLAIM.with(|current| current.set(self.0)); // on an ERROR too: it unwinds through here
    }
}

/// Where a statement's rows go: into the function's result, counted, with the last seq kept
/// (rows come in seq order) for a page's claim row.
#[repr(C)]
pub struct RowReceiver {
    base: pg_sys::DestReceiver,
    target: Target,
    /// the seq column (from 1), found by name when the statement starts
    seq_column: i32,
    pub count: i64,
    pub last_seq: i64,
}

impl RowReceiver {
    /// A receiver for the result of a set-returning call, in materialize mode, as the row type
    /// the call declares.
    // SAFETY: fcinfo is a set-returning call's; InitMaterializedSRF raises unless the caller
    // takes a materialized set of a known row type, and sets setResult and setDesc.
    pub unsafe fn for_result(fcinfo: pg_sys::FunctionCallInfo) -> RowReceiver {
        pg_sys::InitMaterializedSRF(fcinfo, pg_sys::MAT_SRF_USE_EXPECTED_DESC as _);
        let result = (*fcinfo).resultinfo as *mut pg_sys::ReturnSetInfo;
        RowReceiver::writing_into(Target {
            store: (*result).setResult,
            desc: (*result).setDesc,
        })
    }

    /// A receiver for the result of the claim in progress (outbox.claim's or
    /// outbox.settle_and_claim's), in the subtransaction the claim runs in.
    // SAFETY: CLAIM is set only while run_body runs up the stack (InProgress), so the claim's
    // tuplestore and row type, in its call's per-query memory, are still there.
    pub unsafe fn for_claim() -> RowReceiver {
        match CLAIM.with(Cell::get) {
            Some(claim) if claim.subtransaction == pg_sys::GetCurrentSubTransactionId() => {
                RowReceiver::writing_into(claim.result)
            }
            Some(_) => error!("outbox_ext: a claim's page is read only where the claim began, not in a subtransaction"),
            None => error!("outbox_ext: a claim's page is read only inside a claim"),
        }
    }

    fn writing_into(target: Target) -> RowReceiver {
        RowReceiver {
            base: pg_sys::DestReceiver {
                receiveSlot: Some(receive_slot),
                rStartup: Some(startup),
                rShutdown: Some(nothing),
                rDestroy: Some(nothing),
                mydest: pg_sys::CommandDest::DestTuplestore, // not read: SPI runs the callbacks
            },
            target,
            seq_column: 0,
            count: 0,
            last_seq: 0,
        }
    }
}

/// Checks that the statement's rows have the result's row type, column for column (a column
/// dropped from it would shift every later one), and finds seq.
// SAFETY: called by the executor (through SPI) as rStartup of a RowReceiver from here:
// dest points to it (repr(C), the DestReceiver first), on a frame that outlives the
// statement; rows is the statement's tuple descriptor.
#[pg_guard]
unsafe extern "C-unwind" fn startup(
    dest: *mut pg_sys::DestReceiver,
    _operation: i32,
    rows: pg_sys::TupleDesc,
) {
    let me = dest as *mut RowReceiver;
    let rows = PgTupleDesc::from_pg_unchecked(rows);
    let expected = PgTupleDesc::from_pg_unchecked((*me).target.desc);
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

// SAFETY: called by the executor for each row, after startup on the same dest: seq_column
// is at least 1, the slot has the result's row type, and target.store is alive.
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
    pg_sys::tuplestore_puttupleslot((*me).target.store, slot);
    true
}

// no pg_guard: it does nothing that could raise or panic
// SAFETY: the executor may call it as rShutdown or rDestroy; it reads nothing.
unsafe extern "C-unwind" fn nothing(_: *mut pg_sys::DestReceiver) {}
