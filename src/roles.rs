//! Schemas, roles and privileges: created first, granted last.

use pgrx::prelude::*;

extension_sql_file!("../sql/roles.sql", name = "roles", bootstrap);
extension_sql_file!("../sql/grants.sql", name = "grants", finalize);

/// The public API schema; Rust functions name it with `#[pg_extern(schema = "outbox")]`.
#[pg_schema]
mod outbox {}

/// Internal helpers (no role may use the schema); `#[pg_extern(schema = "outbox_internal")]`.
#[pg_schema]
mod outbox_internal {}
