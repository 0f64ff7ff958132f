//! Time partitions of the event log: created ahead, dropped once delivered (see sql/).

use pgrx::prelude::*;

extension_sql_file!(
    "../sql/partitions.sql",
    name = "partitions",
    requires = ["events", "inbox", "claim"]
);
