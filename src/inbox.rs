//! The inbox: dedup by message id for idempotent consumers (see sql/inbox.sql).

use pgrx::prelude::*;

extension_sql_file!("../sql/inbox.sql", name = "inbox", requires = ["roles"]);
