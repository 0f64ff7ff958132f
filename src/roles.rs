//! Schemas, roles and privileges: created first, granted last.

use pgrx::prelude::*;

/// The public API schema; Rust functions name it with `#[pg_extern(schema = "outbox")]`.
#[pg_schema]
mod outbox {}

/// Internal helpers (no role may use the schema); `#[pg_extern(schema = "outbox_internal")]`.
#[pg_schema]
mod outbox_internal {}
