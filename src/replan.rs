//! Plans over the parking tables made again as those tables grow (called from
//! sql/parking.sql after each insert into them).
//!
//! Why: the statements of claim and settle are planned once per session (generic plans, see
//! sql/cursors.sql), and the parking tables are empty most of the time, so their plans are
//! often made when a table has no rows. To the planner such a table holds one row, and every
//! index that any of a statement's conditions matches costs the same: a plan may read a
//! consumer's whole queue for each event it looks up, and it is kept as the queue grows, until
//! the next ANALYZE of the table. So each time a parking table has doubled in pages since this
//! backend last did it, the table's cached plans are invalidated, in every backend, when the
//! transaction commits (a relcache invalidation, as ANALYZE sends): the next execution plans
//! them again, at the table's size then.

use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::RefCell;
use std::collections::HashMap;

/// Fewer pages than this, and a table is too small for its plans to matter.
const LEAST_PAGES: u32 = 2;

thread_local! {
    /// Per table, its size in pages when this backend first saw it or last had its plans made
    /// again. (Kept if the transaction aborts and its invalidation with it: the next doubling
    /// makes the plans again.)
    static REPLANNED_AT: RefCell<HashMap<pg_sys::Oid, u32>> = RefCell::new(HashMap::new());
}

v1!(pg_finfo_outbox_replan_when_grown);

/// `_replan_when_grown(rel regclass) RETURNS void`: invalidates rel's cached plans when it has
/// doubled in pages since this backend last did so.
// SAFETY: called by fmgr for outbox_internal._replan_when_grown (sql/parking.sql: LANGUAGE c,
// STRICT, one regclass) in a transaction, on a table the calling statement holds a lock on.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn outbox_replan_when_grown(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    let rel = pg_sys::Oid::from((*(*fcinfo).args.as_ptr()).value.value() as u32);
    let relation = pg_sys::relation_open(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
    let pages = match (*(*relation).rd_rel).relkind as u8 {
        pg_sys::RELKIND_RELATION => Some(pg_sys::RelationGetNumberOfBlocksInFork(
            relation,
            pg_sys::ForkNumber::MAIN_FORKNUM,
        )),
        _ => None, // no pages of its own (a view, a partitioned table): nothing to do
    };
    pg_sys::relation_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
    let Some(pages) = pages else {
        return pg_sys::Datum::from(0);
    };
    let replan = REPLANNED_AT.with(|at| {
        let mut at = at.borrow_mut();
        // a backend's first call takes the size as it finds it: its plans are as new as that
        // (else every new session would make every session plan again)
        let last = at.entry(rel).or_insert(pages);
        let (replan, next) = replan_at(*last, pages);
        *last = next;
        replan
    });
    if replan {
        pg_sys::CacheInvalidateRelcacheByRelid(rel);
    }
    pg_sys::Datum::from(0)
}

/// Whether a table of `pages`, last replanned at `last` pages, is to be replanned now, and the
/// size to remember: replanned once it is at least LEAST_PAGES and twice `last`; a table that
/// shrank to less than half (VACUUM truncated it) is remembered at its new size, so that its
/// next growth replans again.
fn replan_at(last: u32, pages: u32) -> (bool, u32) {
    if pages >= LEAST_PAGES && pages >= last.saturating_mul(2) {
        (true, pages)
    } else if pages < last / 2 {
        (false, pages)
    } else {
        (false, last)
    }
}

#[cfg(test)]
mod tests {
    use super::replan_at;

    #[test]
    fn a_table_is_replanned_each_time_it_doubles() {
        let mut last = 0;
        let mut replanned = Vec::new();
        for pages in 0..=40 {
            let (replan, next) = replan_at(last, pages);
            if replan {
                replanned.push(pages);
            }
            last = next;
        }
        assert_eq!(replanned, [2, 4, 8, 16, 32]);
    }

    #[test]
    fn a_table_that_shrank_is_replanned_as_it_grows_again() {
        assert_eq!(replan_at(64, 3), (false, 3));
        assert_eq!(replan_at(3, 6), (true, 6));
        assert_eq!(replan_at(64, 40), (false, 64));
    }
}
