//! The native write of both emits (`Target`): rows go into the partition that holds now() the
//! way COPY writes them (one multi-insert per page of rows, then their index entries), instead
//! of one executor INSERT per row. `outbox_internal._insert_many` is bulk emit's entry to it; the native
//! `outbox.emit` (`single`) writes its one row through it too.
//!
//! Nothing is written when the table is not as it expects (a trigger, a rule, row security, a
//! CHECK or NOT NULL constraint it would not enforce, an index with an expression or a
//! predicate, a changed column list, no partition but the default one for now()):
//! `Target::open` returns None and `outbox.emit_many`'s plain INSERT, which does all that,
//! writes instead.

use super::{check_batch_fields, check_payload_size, check_size, required, uuid_v7};
use super::{MAX_KEY_BYTES, SHARD_COUNT};
use crate::errors::OrRaise;
use crate::gucs;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::{AnyArray, JsonB, PgTupleDesc, Uuid};
use std::ffi::CStr;
use std::ptr::null_mut;

/// The columns of outbox.events, in order, with their types (sql/events.sql).
const COLUMNS: [(&str, pg_sys::Oid); 11] = [
    ("id", pg_sys::UUIDOID),
    ("topic", pg_sys::TEXTOID),
    ("aggregate_type", pg_sys::TEXTOID),
    ("aggregate_id", pg_sys::TEXTOID),
    ("event_type", pg_sys::TEXTOID),
    ("payload", pg_sys::JSONBOID),
    ("headers", pg_sys::JSONBOID),
    ("created_at", pg_sys::TIMESTAMPTZOID),
    ("txid", pg_sys::XID8OID),
    ("seq", pg_sys::INT8OID),
    ("shard", pg_sys::INT4OID),
];
/// Columns that may hold NULL (topic, payload, headers); a NOT NULL on them takes the SQL path.
const NULLABLE: [usize; 3] = [1, 5, 6];
/// Rows per multi-insert, as COPY batches them: a huge batch never holds all its rows at once.
const CHUNK: usize = 100;

// What computes the column values as the plain INSERT does: nextval (its permission check
// done once per batch, in Target::open) and the C function behind hashtextextended(text,
// bigint), called through DirectFunctionCall, which pgrx guards. Both may raise an ERROR.
// SAFETY: as PostgreSQL declares them (commands/sequence.h, utils/fmgrprotos.h):
// int64 nextval_internal(Oid, bool) and Datum hashtextextended(PG_FUNCTION_ARGS).
unsafe extern "C-unwind" {
    fn nextval_internal(relid: pg_sys::Oid, check_permissions: bool) -> i64;
    fn hashtextextended(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum;
}

/// Checks a batch as `_batch_ids` does and writes it; returns the ids in array order, or NULL
/// when the plain INSERT has to do it. Called by `outbox.emit_many` only (no one else may
/// execute it: it writes without the executor's permission checks, so it checks INSERT itself).
#[allow(clippy::too_many_arguments)]
#[pg_extern(
    schema = "outbox_internal",
    name = "_insert_many",
    volatile,
    parallel_unsafe
)]
fn insert_many(
    aggregate_type: Option<&str>,
    event_type: Option<&str>,
    headers: Option<JsonB>,
    topic: Option<&str>,
    aggregate_ids: Array<&str>,
    payloads: AnyArray,
) -> Option<Vec<Uuid>> {
    check_batch_fields(aggregate_type, event_type, headers.as_ref(), topic);
    // SAFETY: both arrays are arguments of this call, alive until it returns.
    let (keys, payloads) = unsafe {
        if payloads.oid() != pg_sys::JSONBARRAYOID {
            return None;
        }
        (
            Elements::of(
                aggregate_ids.into_array_type().cast_mut().cast(),
                pg_sys::TEXTOID,
            ),
            Elements::of(payloads.datum().cast_mut_ptr(), pg_sys::JSONBOID),
        )
    };
    check_payload_size(payloads.largest(), gucs::max_payload_bytes()).or_raise();
    for i in 0..keys.len() {
        // SAFETY: a non-NULL text datum points to a varlena.
        let bytes = keys
            .get(i)
            .map(|k| unsafe { pgrx::varlena::varsize_any_exhdr(k.cast_mut_ptr()) });
        match bytes {
            None => required("aggregate_id", None, MAX_KEY_BYTES).or_raise(),
            Some(n) => check_size("aggregate_id", n, MAX_KEY_BYTES).or_raise(),
        }
    }
    if keys.len() != payloads.len() {
        return None; // emit_many checked the lengths; this is only a guard
    }
    crate::wake::note_emit();
    let ids: Vec<Uuid> = (0..keys.len()).map(|_| uuid_v7()).collect();
    let fixed = Fixed {
        topic: topic.into_datum(),
        aggregate_type: aggregate_type.into_datum()?, // checked: not NULL
        event_type: event_type.into_datum()?,
        headers: headers.and_then(|h| h.into_datum()),
    };
    // SAFETY: the table and sequence are opened, used and closed within this call.
    unsafe {
        let target = Target::open()?;
        // The keys are checked: as many as ids, none NULL.
        let row = |i| {
            (
                keys.get(i).unwrap_or(pg_sys::Datum::from(0)),
                payloads.get(i),
            )
        };
        target.write(&fixed, &ids, row);
        target.close();
    }
    Some(ids)
}

/// The elements of an array argument, as stored (nothing parsed or copied).
struct Elements {
    datums: *mut pg_sys::Datum,
    nulls: *mut bool,
    len: usize,
}

impl Elements {
    // SAFETY: callers pass an array datum (possibly toasted) of elem_type, within the call:
    // the detoasted copy, datums and nulls are palloc'd there and outlive the Elements.
    unsafe fn of(array: *mut pg_sys::varlena, elem_type: pg_sys::Oid) -> Elements {
        let array = pg_sys::pg_detoast_datum(array) as *mut pg_sys::ArrayType;
        let (mut typlen, mut byval, mut align) = (0, false, 0);
        pg_sys::get_typlenbyvalalign(elem_type, &mut typlen, &mut byval, &mut align);
        let (mut datums, mut nulls, mut len) = (null_mut(), null_mut(), 0);
        pg_sys::deconstruct_array(
            array,
            elem_type,
            typlen.into(),
            byval,
            align,
            &mut datums,
            &mut nulls,
            &mut len,
        );
        Elements {
            datums,
            nulls,
            len: len as usize,
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    /// The i-th element, or None for a NULL one.
    fn get(&self, i: usize) -> Option<pg_sys::Datum> {
        assert!(i < self.len);
        // SAFETY: deconstruct_array filled len datums and nulls.
        unsafe { (!*self.nulls.add(i)).then(|| *self.datums.add(i)) }
    }

    /// Size of the largest payload, uncompressed (see payload_bytes).
    fn largest(&self) -> Option<i64> {
        (0..self.len)
            .filter_map(|i| self.get(i))
            // SAFETY: a non-NULL jsonb datum points to a varlena.
            .map(|d| unsafe { super::payload_bytes(d) })
            .max()
    }
}

/// What every row of the batch shares.
pub(super) struct Fixed {
    pub topic: Option<pg_sys::Datum>,
    pub aggregate_type: pg_sys::Datum,
    pub event_type: pg_sys::Datum,
    pub headers: Option<pg_sys::Datum>,
}

/// The partition rows go to, opened for inserting, with its indexes.
pub(super) struct Target {
    parent: pg_sys::Relation,
    part: pg_sys::Relation,
    seq: pg_sys::Oid,
    estate: *mut pg_sys::EState,
    rri: *mut pg_sys::ResultRelInfo,
}

impl Target {
    /// Opens the partition that holds now(), or returns None (nothing locked beyond what a
    /// plain INSERT would lock) when the SQL path must write.
    // SAFETY: callers are in a transaction on the backend's thread (catalog lookups, locks),
    // and write and close the Target in that same call.
    pub unsafe fn open() -> Option<Target> {
        let nsp = pg_sys::get_namespace_oid(c"outbox".as_ptr(), true);
        let parent_oid = pg_sys::get_relname_relid(c"events".as_ptr(), nsp);
        let seq = pg_sys::get_relname_relid(c"event_seq".as_ptr(), nsp);
        let may = |rel, mode| {
            pg_sys::pg_class_aclcheck(rel, pg_sys::GetUserId(), mode as _)
                == pg_sys::AclResult::ACLCHECK_OK
        };
        if parent_oid == pg_sys::InvalidOid
            || seq == pg_sys::InvalidOid
            || !may(parent_oid, pg_sys::ACL_INSERT)
            || !may(seq, pg_sys::ACL_USAGE | pg_sys::ACL_UPDATE)
        {
            return None;
        }
        let parent = pg_sys::table_open(parent_oid, pg_sys::RowExclusiveLock as _);
        let part_oid = match partition_for(parent, pg_sys::GetCurrentTransactionStartTimestamp()) {
            Some(oid) if plain_insert_ok(parent) => oid,
            _ => {
                pg_sys::table_close(parent, pg_sys::NoLock as _);
                return None;
            }
        };
        let part = pg_sys::table_open(part_oid, pg_sys::RowExclusiveLock as _);
        if !(plain_insert_ok(part) && has_event_columns(part)) {
            pg_sys::table_close(part, pg_sys::NoLock as _);
            pg_sys::table_close(parent, pg_sys::NoLock as _);
            return None;
        }
        let estate = pg_sys::CreateExecutorState();
        let rri = pg_sys::palloc0(size_of::<pg_sys::ResultRelInfo>()) as *mut pg_sys::ResultRelInfo;
        pg_sys::InitResultRelInfo(rri, part, 1, null_mut(), 0);
        pg_sys::ExecOpenIndices(rri, false);
        let target = Target {
            parent,
            part,
            seq,
            estate,
            rri,
        };
        if indexes_run_code(rri) {
            target.close();
            return None;
        }
        Some(target)
    }

    /// Writes one row per id, in order (the seqs are taken in that order, after the xid);
    /// `row(i)` gives the i-th row's key (not NULL) and payload.
    // SAFETY: callers pass an open Target and datums of the columns' types (the key not NULL),
    // alive until it returns; open checked the partition's 11 columns and its multi_insert, so
    // every slot has 11 values and nulls.
    pub unsafe fn write(
        &self,
        fixed: &Fixed,
        ids: &[Uuid],
        row: impl Fn(usize) -> (pg_sys::Datum, Option<pg_sys::Datum>),
    ) {
        let txid = pg_sys::Datum::from(pg_sys::GetTopFullTransactionId().value);
        let created_at = pg_sys::Datum::from(pg_sys::GetCurrentTransactionStartTimestamp());
        let cid = pg_sys::GetCurrentCommandId(true);
        let slots: Vec<*mut pg_sys::TupleTableSlot> = (0..ids.len().min(CHUNK))
            .map(|_| pg_sys::table_slot_create(self.part, null_mut()))
            .collect();
        let Some(multi_insert) = (*(*self.part).rd_tableam).multi_insert else {
            error!("outbox_ext: the events partition's access method cannot multi-insert");
        };
        for start in (0..ids.len()).step_by(CHUNK) {
            let n = (ids.len() - start).min(CHUNK);
            for (i, &slot) in slots.iter().take(n).enumerate() {
                let (key, payload) = row(start + i);
                let values = [
                    Some(pg_sys::Datum::from(ids[start + i].as_bytes().as_ptr())),
                    fixed.topic,
                    Some(fixed.aggregate_type),
                    Some(key),
                    Some(fixed.event_type),
                    payload,
                    fixed.headers,
                    Some(created_at),
                    Some(txid),
                    Some(self.next_seq()),
                    Some(pg_sys::Datum::from(shard_of(key))),
                ];
                pg_sys::ExecClearTuple(slot);
                for (col, value) in values.into_iter().enumerate() {
                    *(*slot).tts_values.add(col) = value.unwrap_or(pg_sys::Datum::from(0));
                    *(*slot).tts_isnull.add(col) = value.is_none();
                }
                pg_sys::ExecStoreVirtualTuple(slot);
            }
            // Through pgrx's guard, as every pg_sys call: an ERROR here must not unwind C-style
            // over these Rust frames.
            let (part, batch) = (self.part, slots.as_ptr().cast_mut());
            pg_sys::ffi::pg_guard_ffi_boundary(|| {
                multi_insert(part, batch, n as i32, cid, 0, null_mut())
            });
            for &slot in slots.iter().take(n) {
                self.insert_index_entries(slot);
            }
        }
        for slot in slots {
            pg_sys::ExecDropSingleTupleTableSlot(slot);
        }
    }

    // SAFETY: in the transaction of open, which checked USAGE and UPDATE on the sequence; its
    // ERROR comes back through pgrx's guard.
    unsafe fn next_seq(&self) -> pg_sys::Datum {
        let seq = self.seq;
        pg_sys::Datum::from(pg_sys::ffi::pg_guard_ffi_boundary(|| {
            nextval_internal(seq, false)
        }))
    }

    // SAFETY: slot was just stored into self.part by multi_insert (its tid set), whose indexes
    // open opened in self.rri; the per-tuple memory reset holds only what index insertion made.
    unsafe fn insert_index_entries(&self, slot: *mut pg_sys::TupleTableSlot) {
        #[cfg(feature = "pg15")]
        let recheck = pg_sys::ExecInsertIndexTuples(
            self.rri,
            slot,
            self.estate,
            false,
            false,
            null_mut(),
            null_mut(),
        );
        #[cfg(not(feature = "pg15"))]
        let recheck = pg_sys::ExecInsertIndexTuples(
            self.rri,
            slot,
            self.estate,
            false,
            false,
            null_mut(),
            null_mut(),
            false,
        );
        if !recheck.is_null() {
            pg_sys::list_free(recheck); // conflicts to recheck: only with deferred unique indexes
        }
        let econtext = (*self.estate).es_per_tuple_exprcontext;
        if !econtext.is_null() {
            pg_sys::MemoryContextReset((*econtext).ecxt_per_tuple_memory);
        }
    }

    /// Closes what open opened; the locks stay until the transaction ends, as an INSERT's do.
    // SAFETY: self comes from open, in this transaction, and is consumed: nothing closes twice.
    pub unsafe fn close(self) {
        pg_sys::ExecCloseIndices(self.rri);
        pg_sys::FreeExecutorState(self.estate);
        pg_sys::table_close(self.part, pg_sys::NoLock as _);
        pg_sys::table_close(self.parent, pg_sys::NoLock as _);
    }
}

/// outbox.shard_of, as sql/events.sql defines it: hashtextextended(key, 0) modulo the count.
// SAFETY: callers pass a non-NULL text datum, which hashtextextended (V1, text and bigint)
// detoasts itself; its ERROR comes back through pgrx's guard.
unsafe fn shard_of(key: pg_sys::Datum) -> i32 {
    let hash = pg_sys::DirectFunctionCall2Coll(
        Some(hashtextextended),
        pg_sys::DEFAULT_COLLATION_OID,
        key,
        pg_sys::Datum::from(0i64),
    )
    .value() as i64;
    let n = i64::from(SHARD_COUNT);
    (((hash % n) + n) % n) as i32
}

/// The partition of outbox.events (RANGE on created_at) that holds `at`, as
/// get_partition_for_tuple finds it: the one after the greatest bound at or below `at`. None
/// for the default partition too: a concurrent ATTACH may be narrowing its range, which only
/// the executor's check of the default partition's constraint sees.
// SAFETY: parent is open and locked; outbox.events is PARTITION BY RANGE (created_at)
// (sql/events.sql), so boundinfo has ndatums kinds and datums and ndatums + 1 indexes.
unsafe fn partition_for(parent: pg_sys::Relation, at: pg_sys::TimestampTz) -> Option<pg_sys::Oid> {
    use pg_sys::PartitionRangeDatumKind::*;
    if (*(*parent).rd_rel).relkind as u8 != pg_sys::RELKIND_PARTITIONED_TABLE {
        return None;
    }
    let desc = pg_sys::RelationGetPartitionDesc(parent, true);
    let bounds = (*desc).boundinfo;
    if bounds.is_null() {
        return None;
    }
    let mut below = -1isize; // the greatest bound <= at
    for i in 0..(*bounds).ndatums as isize {
        let at_or_below = match **(*bounds).kind.offset(i) {
            PARTITION_RANGE_DATUM_MINVALUE => true,
            PARTITION_RANGE_DATUM_MAXVALUE => false,
            _ => (**(*bounds).datums.offset(i)).value() as i64 <= at,
        };
        if !at_or_below {
            break;
        }
        below = i;
    }
    let index = *(*bounds).indexes.offset(below + 1);
    if index < 0 || !*(*desc).is_leaf.offset(index as isize) {
        return None;
    }
    Some(*(*desc).oids.offset(index as isize))
}

/// Whether writing rows straight into `rel` skips nothing a plain INSERT would do: no trigger
/// that would fire, no rule (an admin's `ON INSERT DO ALSO` on outbox.events), no row
/// security, no CHECK constraints or generated columns.
// SAFETY: rel is open and locked: its relcache entry (rd_att, rd_rel, constr) is valid.
unsafe fn plain_insert_ok(rel: pg_sys::Relation) -> bool {
    let constr = (*(*rel).rd_att).constr;
    no_trigger_fires(rel)
        && !(*(*rel).rd_rel).relhasrules
        && !(*(*rel).rd_rel).relrowsecurity
        && (constr.is_null() || ((*constr).num_check == 0 && !(*constr).has_generated_stored))
}

/// Whether an index of the partition runs code of its own, an expression or a predicate (an
/// admin's index on outbox.events): written here, it would run as the function's owner under
/// the caller's search_path (a SQL function's body is parsed as it runs), where the SQL path
/// runs it under emit_many's pinned one.
// SAFETY: rri's indexes are open (ExecOpenIndices): ri_NumIndices IndexInfo pointers.
unsafe fn indexes_run_code(rri: *mut pg_sys::ResultRelInfo) -> bool {
    (0..(*rri).ri_NumIndices as usize).any(|i| {
        let info = *(*rri).ri_IndexRelationInfo.add(i);
        !(*info).ii_Expressions.is_null() || !(*info).ii_Predicate.is_null()
    })
}

/// Whether `rel` has no trigger but the reach and seal triggers (sql/partitions.sql), and they
/// fire no row here: they are off on this partition, or `rel` is the partitioned table, whose
/// row triggers fire on its partitions only. A partition where one is on (its time lies ahead,
/// or is over: a clock ran ahead or went back) takes the SQL path, which fires it.
// SAFETY: rel is open and locked; a non-NULL trigdesc has numtriggers triggers, each with
// a NUL-terminated tgname.
unsafe fn no_trigger_fires(rel: pg_sys::Relation) -> bool {
    let desc = (*rel).trigdesc;
    if desc.is_null() {
        return true;
    }
    let partitioned = (*(*rel).rd_rel).relkind as u8 == pg_sys::RELKIND_PARTITIONED_TABLE;
    (0..(*desc).numtriggers as usize).all(|i| {
        let trigger = &*(*desc).triggers.add(i);
        matches!(
            CStr::from_ptr(trigger.tgname).to_bytes(),
            b"outbox_reach" | b"outbox_seal"
        ) && (partitioned || trigger.tgenabled as u8 == b'D')
    })
}

/// Whether `rel` is a heap-like table with the events' columns and types, in order, and NOT
/// NULL only where rows always have a value.
// SAFETY: rel is open and locked; rd_att has natts attributes, borrowed from the relcache
// (from_pg_unchecked does not release it).
unsafe fn has_event_columns(rel: pg_sys::Relation) -> bool {
    let desc = (*rel).rd_att;
    if (*(*rel).rd_rel).relkind as u8 != pg_sys::RELKIND_RELATION
        || (*rel).rd_tableam.is_null()
        || (*(*rel).rd_tableam).multi_insert.is_none()
        || (*desc).natts as usize != COLUMNS.len()
    {
        return false;
    }
    let attrs = PgTupleDesc::from_pg_unchecked(desc);
    COLUMNS.iter().enumerate().all(|(i, (name, type_oid))| {
        attrs.get(i).is_some_and(|attr| {
            !attr.attisdropped
                && attr.name() == *name
                && attr.atttypid == *type_oid
                && !(attr.attnotnull && NULLABLE.contains(&i))
        })
    })
}
