//! Monitoring: outbox.status and outbox.shard_status (see sql/status.sql).

use pgrx::prelude::*;

extension_sql_file!(
    "../sql/status.sql",
    name = "status",
    requires = ["claim", "partitions", "sinks"]
);
