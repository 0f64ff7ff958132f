//! outbox_ext: the transactional outbox inside PostgreSQL.
//!
//! Events are written in the caller's transaction (`emit`), read in commit order per shard
//! (`claim`), and delivered by a background worker (`worker`, `sinks`).

mod backup;
mod claim;
mod emit;
mod errors;
mod gucs;
mod inbox;
mod partitions;
mod roles;
mod sinks;
mod status;
mod wake;
mod worker;

pgrx::pg_module_magic!();

#[pgrx::pg_guard]
pub extern "C-unwind" fn _PG_init() {
    gucs::init();
    wake::init();
    worker::init();
}
