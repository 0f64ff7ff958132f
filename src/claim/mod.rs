//! Claims: consumers read the event log per shard, in commit order, under leases, with key
//! isolation, retries and dead letters. Almost all of it is SQL (sql/claim.sql): relays in any
//! language and the background worker call the same functions. `pruned` runs a claim's reads of
//! the event log so that they lock only the partitions they may read.

mod pruned;

use pgrx::prelude::*;

extension_sql_file!("../../sql/claim.sql", name = "claim", requires = ["events"]);
