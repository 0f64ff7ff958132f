//! The one error type of outbox_ext. Every user mistake maps to its own SQLSTATE and a hint
//! that names the fix; nothing a user can cause ends as XX000.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutboxError {
    /// A required argument was NULL.
    NullArgument(&'static str),
    /// A required text argument was empty.
    EmptyArgument(&'static str),
    /// A text argument is longer than emit takes.
    TooLong {
        arg: &'static str,
        bytes: usize,
        limit: usize,
    },
    /// The payload is larger than `outbox_ext.max_payload_bytes`.
    PayloadTooLarge { bytes: i64, limit: i64 },
    /// `headers` is not a JSON object whose values are all strings.
    InvalidHeaders(String),
    /// The topic is not a valid Kafka topic name.
    InvalidTopic(String),
    /// A sink setting the worker could not use (`setting`: secret, http_headers, tls_ca).
    InvalidSinkSetting { setting: &'static str, why: String },
    /// An emit in a read-only transaction (`SET TRANSACTION READ ONLY`, or a standby).
    ReadOnly { standby: bool },
}

impl OutboxError {
    fn sqlstate(&self) -> PgSqlErrorCode {
        use PgSqlErrorCode::*;
        match self {
            OutboxError::NullArgument(_) => ERRCODE_NULL_VALUE_NOT_ALLOWED,
            OutboxError::EmptyArgument(_) => ERRCODE_INVALID_PARAMETER_VALUE,
            OutboxError::PayloadTooLarge { .. } | OutboxError::TooLong { .. } => {
                ERRCODE_PROGRAM_LIMIT_EXCEEDED
            }
            OutboxError::InvalidHeaders(_) => ERRCODE_INVALID_PARAMETER_VALUE,
            OutboxError::InvalidTopic(_) => ERRCODE_INVALID_NAME,
            OutboxError::InvalidSinkSetting { .. } => ERRCODE_INVALID_PARAMETER_VALUE,
            OutboxError::ReadOnly { .. } => ERRCODE_READ_ONLY_SQL_TRANSACTION,
        }
    }

    fn message(&self) -> String {
        match self {
            OutboxError::NullArgument(arg) => format!("{arg} must not be NULL"),
            OutboxError::EmptyArgument(arg) => format!("{arg} must not be empty"),
            OutboxError::TooLong { arg, bytes, limit } => {
                format!("{arg} is {bytes} bytes, over the limit of {limit} bytes")
            }
            OutboxError::PayloadTooLarge { bytes, limit } => {
                format!("payload is {bytes} bytes, over the limit of {limit} bytes")
            }
            OutboxError::InvalidHeaders(why) => format!("invalid headers: {why}"),
            OutboxError::InvalidTopic(topic) => format!("invalid topic name \"{topic}\""),
            OutboxError::InvalidSinkSetting { setting, why } => {
                format!("invalid sink {setting}: {why}")
            }
            OutboxError::ReadOnly { .. } => {
                "cannot emit an event in a read-only transaction".into()
            }
        }
    }

    fn hint(&self) -> String {
        match self {
            OutboxError::NullArgument("aggregate_id")
            | OutboxError::EmptyArgument("aggregate_id") => {
                "Pass the aggregate id: it is the key that orders events and picks their shard."
                    .into()
            }
            OutboxError::NullArgument(arg) | OutboxError::EmptyArgument(arg) => {
                format!("Pass a non-empty {arg}.")
            }
            OutboxError::TooLong {
                arg: "aggregate_id",
                limit,
                ..
            } => format!(
                "An aggregate id is at most {limit} bytes (it is stored in index entries); \
                 pass a shorter key, e.g. a hash of this one."
            ),
            OutboxError::TooLong { arg, limit, .. } => {
                format!("A {arg} is at most {limit} bytes.")
            }
            OutboxError::PayloadTooLarge { .. } => {
                "Store large bodies elsewhere and emit a reference, \
                 or raise outbox_ext.max_payload_bytes."
                    .into()
            }
            OutboxError::InvalidHeaders(_) => {
                "Pass headers as a JSON object of strings, e.g. '{\"trace-id\": \"abc\"}'.".into()
            }
            OutboxError::InvalidTopic(_) => "A topic is 1 to 249 characters of ASCII letters, \
                 digits, '.', '_' and '-', and not \".\" or \"..\"; or NULL for the default."
                .into(),
            OutboxError::InvalidSinkSetting {
                setting: "secret", ..
            } => "Give whsec_ and the base64 of 24 to 64 random bytes, e.g. 'whsec_' || \
                  encode(sha256(gen_random_uuid()::text::bytea), 'base64')."
                .into(),
            OutboxError::InvalidSinkSetting {
                setting: "http_headers",
                ..
            } => "Header names are tokens such as Authorization or X-Api-Key, not ones the sink \
                  sets (Content-Type, Content-Length, Host, webhook-*, Idempotency-Key); \
                  values are one line."
                .into(),
            OutboxError::InvalidSinkSetting { setting: "url", .. } => {
                "A kafka sink's URL is kafka://host:port[,host:port...] (plaintext) or \
                 kafkas://... (TLS), e.g. 'kafka://broker1:9092,broker2:9092'."
                    .into()
            }
            OutboxError::ReadOnly { standby: true } => {
                "This server is a standby: emit on the primary, in the transaction that writes \
                 the business data."
                    .into()
            }
            OutboxError::ReadOnly { standby: false } => {
                "Emit in a read-write transaction, the one that writes the business data.".into()
            }
            OutboxError::InvalidSinkSetting { .. } => {
                "Paste the CA certificate(s) in PEM form (-----BEGIN CERTIFICATE----- ...), \
                 or NULL to trust the public roots."
                    .into()
            }
        }
    }

    /// Raise this error as a PostgreSQL ERROR; the current transaction aborts.
    pub fn raise(self) -> ! {
        ErrorReport::new(self.sqlstate(), self.message(), "outbox_ext")
            .set_hint(self.hint())
            .report(PgLogLevel::ERROR);
        unreachable!("ERROR does not return")
    }
}

/// Unwrap a result, raising the error as a PostgreSQL ERROR.
pub trait OrRaise<T> {
    fn or_raise(self) -> T;
}

impl<T> OrRaise<T> for Result<T, OutboxError> {
    fn or_raise(self) -> T {
        self.unwrap_or_else(|e| e.raise())
    }
}
