//! Claims: consumers read the event log per shard, in commit order, under leases, with key
//! isolation, retries and dead letters. All of it is SQL (sql/claim.sql): relays in any
//! language and the background worker call the same functions.

use pgrx::prelude::*;

extension_sql_file!("../sql/claim.sql", name = "claim", requires = ["events"]);
