//! outbox_ext: the transactional outbox inside PostgreSQL.
//!
//! Events are written in the caller's transaction (`emit`), read in commit order per shard
//! (`claim`), and delivered by a background worker (`worker`, `sinks`).

/// The version-1 call convention record PostgreSQL looks up for each C function declared in
/// sql/ (`LANGUAGE c ... AS 'MODULE_PATHNAME', 'name'`): `v1!(pg_finfo_name)`.
macro_rules! v1 {
    ($($finfo:ident),*) => {$(
        #[unsafe(no_mangle)]
        pub extern "C" fn $finfo() -> &'static pgrx::pg_sys::Pg_finfo_record {
            const V1: pgrx::pg_sys::Pg_finfo_record = pgrx::pg_sys::Pg_finfo_record { api_version: 1 };
            &V1
        }
    )*};
}

mod backup;
mod claim;
mod emit;
mod errors;
mod gucs;
mod replan;
mod roles;
mod sinks;
mod threads;
mod wake;
mod worker;

pgrx::pg_module_magic!();

// The install script, part by part, in the order it runs: each part requires the one before
// it, so this list is the order. Tables, types and functions are defined once, in these files;
// an upgrade script (sql/outbox_ext--A--B.sql) carries what changed. Native functions
// (#[pg_extern]) a part needs when it is created are named in its requires.
use pgrx::extension_sql_file;
extension_sql_file!("../sql/roles.sql", name = "roles", bootstrap);
extension_sql_file!("../sql/inbox.sql", name = "inbox", requires = ["roles"]);
extension_sql_file!(
    "../sql/events.sql",
    name = "events",
    requires = ["inbox", emit::shard_count]
);
extension_sql_file!(
    "../sql/consumers.sql",
    name = "consumers",
    requires = ["events"]
);
extension_sql_file!(
    "../sql/cursors.sql",
    name = "cursors",
    requires = ["consumers"]
);
extension_sql_file!(
    "../sql/parking.sql",
    name = "parking",
    requires = ["cursors"]
);
extension_sql_file!("../sql/claim.sql", name = "claim", requires = ["parking"]);
extension_sql_file!("../sql/settle.sql", name = "settle", requires = ["claim"]);
extension_sql_file!("../sql/replay.sql", name = "replay", requires = ["settle"]);
extension_sql_file!(
    "../sql/partitions.sql",
    name = "partitions",
    requires = ["replay"]
);
extension_sql_file!(
    "../sql/restore.sql",
    name = "restore",
    requires = ["partitions"]
);
extension_sql_file!("../sql/sinks.sql", name = "sinks", requires = ["restore"]);
extension_sql_file!("../sql/status.sql", name = "status", requires = ["sinks"]);
extension_sql_file!("../sql/dump.sql", name = "dump", requires = ["status"]);
extension_sql_file!(
    "../sql/drop_guard.sql",
    name = "drop_guard",
    requires = ["dump"]
);
extension_sql_file!(
    "../sql/emit.sql",
    name = "emit",
    requires = [
        "drop_guard",
        emit::batch_ids,
        emit::uuid_v7,
        emit::insert::insert_many
    ]
);
extension_sql_file!("../sql/grants.sql", name = "grants", finalize);

#[pgrx::pg_guard]
pub extern "C-unwind" fn _PG_init() {
    gucs::init();
    wake::init();
    worker::init();
}
