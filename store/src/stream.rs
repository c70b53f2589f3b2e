//! The global stream: every stored event, in an order that never skips a late commit, read
//! by subscriptions that keep their own checkpoints (ARCHITECTURE.md, The global stream).
//!
//! On Postgres a reader only takes events whose inserting transaction is older than the
//! oldest transaction still running (`transaction_id < pg_snapshot_xmin(...)`) and orders
//! by `(transaction_id, global_position)`: a transaction that took an earlier position but
//! commits later is read when it commits, never jumped over. On SQLite there is one writer
//! at a time, so the position order is the commit order.
//!
//! A subscription handles a batch and moves its checkpoint in the same transaction, so each
//! event takes effect exactly once.

use crate::database::{Backend, Database, DatabaseError, Pool};
use crate::events::DecodeError;
use crate::metadata::StoredMetadata;
use crate::repository::BoxError;
use chrono::{DateTime, Utc};
use serde_json::value::RawValue;
use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::sqlite::SqliteRow;
use sqlx::{Postgres, Row, Sqlite, Transaction};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use uuid::Uuid;

/// A position in the global stream. On SQLite `transaction_id` is always 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Position {
    /// The inserting transaction (Postgres `xid8`).
    pub transaction_id: i64,
    /// The event's global position.
    pub global_position: i64,
}

/// One event as stored, with its place in the global stream.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredEvent {
    /// Where it is in the stream.
    pub position: Position,
    /// Unique per event; the CloudEvent id and `Nats-Msg-Id` downstream.
    pub event_id: Uuid,
    /// `ProvisioningRun`, `DeploymentSpecification`, …
    pub aggregate_type: String,
    /// The aggregate's id.
    pub aggregate_id: String,
    /// The aggregate's sequence number of this event.
    pub sequence: i64,
    /// Stable event type string.
    pub event_type: String,
    /// Event schema version.
    pub event_version: String,
    /// The serialized domain event, as the store holds it.
    pub payload: Payload,
    /// The metadata (tenantId, actor, correlationId, causationId, requestId).
    pub metadata: StoredMetadata,
    /// When the store recorded it.
    pub recorded_at: DateTime<Utc>,
}

/// A stored event's payload as JSON text, checked to be JSON but not parsed into a tree: a
/// typed decode reads it straight into the event's type (one pass, no `Value` between),
/// and only an upcast or a reader of unknown events builds the tree.
#[derive(Clone)]
pub struct Payload(Box<RawValue>);

impl Payload {
    /// The payload of `text`, or why it is not JSON.
    pub fn parse(text: String) -> Result<Self, serde_json::Error> {
        RawValue::from_string(text).map(Self)
    }

    /// The JSON text.
    pub fn get(&self) -> &str {
        self.0.get()
    }

    /// The payload as a JSON tree.
    pub fn to_value(&self) -> Result<Value, serde_json::Error> {
        serde_json::from_str(self.0.get())
    }
}

impl From<&Value> for Payload {
    fn from(value: &Value) -> Self {
        // A `Value` always serializes (its keys are strings); `null` is unreachable.
        Self(serde_json::value::to_raw_value(value).unwrap_or_else(|_| RawValue::NULL.to_owned()))
    }
}

/// Equal when the texts are: two reads of one stored event compare equal.
impl PartialEq for Payload {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.get())
    }
}

impl StoredEvent {
    /// The tenant from the metadata.
    pub fn tenant_id(&self) -> Option<&str> {
        self.metadata.tenant_id()
    }
}

/// A value bound to a statement; lets one piece of SQL run on either engine.
#[derive(Debug, Clone)]
pub enum Param {
    /// Text (or NULL).
    Text(Option<String>),
    /// 64-bit integer (or NULL).
    Int(Option<i64>),
    /// JSON document (jsonb on Postgres, text on SQLite) (or NULL).
    Json(Option<Value>),
    /// Timestamp (or NULL).
    Time(Option<DateTime<Utc>>),
}

/// The most parameters one statement binds: SQLite allows 32,766, Postgres 65,535.
const MAX_PARAMETERS: usize = 30_000;

/// `$from, $from+1, …` for `count` parameters.
fn placeholders(from: usize, count: usize) -> String {
    (from..from + count)
        .map(|n| format!("${n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A batch of rows as one Postgres array per column, for `insert_rows`.
enum ColumnArray<'a> {
    Text(Vec<Option<&'a str>>),
    Int(Vec<Option<i64>>),
    Json(Vec<Option<sqlx::types::Json<&'a Value>>>),
    Time(Vec<Option<DateTime<Utc>>>),
}

struct ColumnArrays<'a>(Vec<ColumnArray<'a>>);

impl<'a> ColumnArrays<'a> {
    /// The columns of `rows`, or `None` if a row is not `width` wide or a column holds
    /// values of more than one kind.
    fn of(width: usize, rows: &'a [Vec<Param>]) -> Option<Self> {
        let mut columns: Vec<ColumnArray<'a>> = rows
            .first()?
            .iter()
            .map(|first| match first {
                Param::Text(_) => ColumnArray::Text(Vec::with_capacity(rows.len())),
                Param::Int(_) => ColumnArray::Int(Vec::with_capacity(rows.len())),
                Param::Json(_) => ColumnArray::Json(Vec::with_capacity(rows.len())),
                Param::Time(_) => ColumnArray::Time(Vec::with_capacity(rows.len())),
            })
            .collect();
        if columns.len() != width {
            return None;
        }
        for row in rows {
            if row.len() != width {
                return None;
            }
            for (column, value) in columns.iter_mut().zip(row) {
                match (column, value) {
                    (ColumnArray::Text(c), Param::Text(v)) => c.push(v.as_deref()),
                    (ColumnArray::Int(c), Param::Int(v)) => c.push(*v),
                    (ColumnArray::Json(c), Param::Json(v)) => {
                        c.push(v.as_ref().map(sqlx::types::Json))
                    }
                    (ColumnArray::Time(c), Param::Time(v)) => c.push(*v),
                    _ => return None,
                }
            }
        }
        Some(Self(columns))
    }

    /// `$1::text[], $2::bigint[], …`, one per column.
    fn placeholders(&self) -> String {
        self.0
            .iter()
            .enumerate()
            .map(|(i, column)| {
                let kind = match column {
                    ColumnArray::Text(_) => "text",
                    ColumnArray::Int(_) => "bigint",
                    ColumnArray::Json(_) => "jsonb",
                    ColumnArray::Time(_) => "timestamptz",
                };
                format!("${}::{kind}[]", i + 1)
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn bind<'q>(
        self,
        mut query: sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>
    where
        'a: 'q,
    {
        for column in self.0 {
            query = match column {
                ColumnArray::Text(c) => query.bind(c),
                ColumnArray::Int(c) => query.bind(c),
                ColumnArray::Json(c) => query.bind(c),
                ColumnArray::Time(c) => query.bind(c),
            };
        }
        query
    }
}

/// A transaction on either engine.
pub enum Tx {
    /// Postgres.
    Postgres(Transaction<'static, Postgres>),
    /// SQLite.
    Sqlite(Transaction<'static, Sqlite>),
}

/// Binds a slice of [`Param`]s to a sqlx query on either engine.
#[macro_export]
macro_rules! bind_params {
    ($query:expr, $params:expr) => {{
        let mut q = $query;
        for p in $params {
            q = match p {
                // Borrowed, not cloned: a batch's documents are bound as they are.
                $crate::stream::Param::Text(v) => q.bind(v.as_deref()),
                $crate::stream::Param::Int(v) => q.bind(*v),
                $crate::stream::Param::Json(v) => q.bind(v.as_ref().map(sqlx::types::Json)),
                $crate::stream::Param::Time(v) => q.bind(*v),
            };
        }
        q
    }};
}

/// The last position a reader can take now: every event read after it comes later in the
/// stream's order (on Postgres, events of a transaction still running come after it). A
/// live reader that starts here misses nothing that happens from now on. The start of the
/// stream when it is empty.
pub async fn head(db: &Database) -> Result<Position, sqlx::Error> {
    let row: Option<(i64, i64)> = match db.pool() {
        Pool::Postgres(pool) => {
            sqlx::query_as(
                "SELECT transaction_id::text::bigint, global_position FROM events
                  WHERE transaction_id < pg_snapshot_xmin(pg_current_snapshot())
                  ORDER BY events.transaction_id DESC, events.global_position DESC LIMIT 1",
            )
            .fetch_optional(pool)
            .await?
        }
        Pool::Sqlite(pool) => {
            sqlx::query_as(
                "SELECT 0, global_position FROM events ORDER BY global_position DESC LIMIT 1",
            )
            .fetch_optional(pool)
            .await?
        }
    };
    Ok(
        row.map_or_else(Position::default, |(transaction_id, global_position)| {
            Position {
                transaction_id,
                global_position,
            }
        }),
    )
}

// The ORDER BY names the table's columns: a bare `transaction_id` would mean the output
// column of that name (the `::bigint` cast above), which no index serves, and every batch
// would sort the whole table.
pub(crate) const PG_BATCH: &str = "
SELECT global_position, transaction_id::text::bigint AS transaction_id, event_id::text AS event_id,
       aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata, recorded_at
  FROM events
 WHERE (transaction_id, global_position) > ($1::text::xid8, $2)
   AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())
 ORDER BY events.transaction_id, events.global_position
 LIMIT $3";

const SQLITE_BATCH: &str = "
SELECT global_position, 0 AS transaction_id, event_id, aggregate_type, aggregate_id, sequence,
       event_type, event_version, payload, metadata, recorded_at
  FROM events
 WHERE global_position > ?1
 ORDER BY global_position
 LIMIT ?2";

pub(crate) fn pg_event(row: &PgRow) -> Result<StoredEvent, sqlx::Error> {
    let event_id: String = row.try_get("event_id")?;
    Ok(StoredEvent {
        position: Position {
            transaction_id: row.try_get("transaction_id")?,
            global_position: row.try_get("global_position")?,
        },
        event_id: Uuid::parse_str(&event_id).map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        sequence: row.try_get("sequence")?,
        event_type: row.try_get("event_type")?,
        event_version: row.try_get("event_version")?,
        payload: Payload(
            row.try_get::<sqlx::types::Json<Box<RawValue>>, _>("payload")?
                .0,
        ),
        metadata: StoredMetadata::parse(
            row.try_get::<sqlx::types::Json<Box<RawValue>>, _>("metadata")?
                .0,
        ),
        recorded_at: row.try_get("recorded_at")?,
    })
}

pub(crate) fn sqlite_event(row: &SqliteRow) -> Result<StoredEvent, sqlx::Error> {
    let event_id: String = row.try_get("event_id")?;
    let recorded_at: String = row.try_get("recorded_at")?;
    let payload: String = row.try_get("payload")?;
    let metadata: String = row.try_get("metadata")?;
    let decode = |e: serde_json::Error| sqlx::Error::Decode(Box::new(e));
    Ok(StoredEvent {
        position: Position {
            transaction_id: 0,
            global_position: row.try_get("global_position")?,
        },
        event_id: Uuid::parse_str(&event_id).map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        sequence: row.try_get("sequence")?,
        event_type: row.try_get("event_type")?,
        event_version: row.try_get("event_version")?,
        payload: Payload::parse(payload).map_err(decode)?,
        metadata: StoredMetadata::parse(RawValue::from_string(metadata).map_err(decode)?),
        recorded_at: DateTime::parse_from_rfc3339(&recorded_at)
            .map_err(|e| sqlx::Error::Decode(Box::new(e)))?
            .with_timezone(&Utc),
    })
}

impl Tx {
    /// Begins a transaction. On SQLite it takes the write lock at once (`BEGIN IMMEDIATE`):
    /// a deferred transaction that reads and then writes fails with `SQLITE_BUSY` when
    /// another connection wrote in between, instead of waiting its turn.
    pub async fn begin(db: &Database) -> Result<Self, sqlx::Error> {
        Ok(match db.pool() {
            Pool::Postgres(p) => Tx::Postgres(p.begin().await?),
            Pool::Sqlite(p) => Tx::Sqlite(p.begin_with("BEGIN IMMEDIATE").await?),
        })
    }

    /// Begins a transaction for a batch of [`Handler`]s; when every one of them is
    /// [`Handler::replayable`], its commit on Postgres does not wait for the WAL flush
    /// (`synchronous_commit = off` for this transaction only, set in the `BEGIN`'s own
    /// round trip). A crash of Postgres can then lose the batch's last commits, and with
    /// them the checkpoint's move: the handlers read those events again, which is what
    /// replayable means. The events themselves were flushed when they were appended.
    pub async fn begin_for(db: &Database, handlers: &[&dyn Handler]) -> Result<Self, sqlx::Error> {
        match db.pool() {
            Pool::Postgres(p) if handlers.iter().all(|h| h.replayable()) => Ok(Tx::Postgres(
                p.begin_with("BEGIN; SET LOCAL synchronous_commit = off")
                    .await?,
            )),
            _ => Self::begin(db).await,
        }
    }

    /// The engine.
    pub fn backend(&self) -> Backend {
        match self {
            Tx::Postgres(_) => Backend::Postgres,
            Tx::Sqlite(_) => Backend::Sqlite,
        }
    }

    /// Commits.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        match self {
            Tx::Postgres(t) => t.commit().await,
            Tx::Sqlite(t) => t.commit().await,
        }
    }

    /// Runs one statement written with `$n` placeholders; returns the rows affected.
    pub async fn execute(&mut self, sql: &str, params: &[Param]) -> Result<u64, sqlx::Error> {
        let sql = crate::database::sql_for(self.backend(), sql);
        Ok(match self {
            Tx::Postgres(t) => crate::bind_params!(sqlx::query(&sql), params)
                .execute(&mut **t)
                .await?
                .rows_affected(),
            Tx::Sqlite(t) => crate::bind_params!(sqlx::query(&sql), params)
                .execute(&mut **t)
                .await?
                .rows_affected(),
        })
    }

    /// Runs an insert whose rows return `(transaction_id, global_position)`; returns the
    /// greatest of them (the last event's place in the stream), `None` for no rows.
    pub async fn insert_returning_last(
        &mut self,
        sql: &str,
        params: &[Param],
    ) -> Result<Option<Position>, sqlx::Error> {
        let sql = crate::database::sql_for(self.backend(), sql);
        let rows: Vec<(i64, i64)> = match self {
            Tx::Postgres(t) => {
                crate::bind_params!(sqlx::query_as(&sql), params)
                    .fetch_all(&mut **t)
                    .await?
            }
            Tx::Sqlite(t) => {
                crate::bind_params!(sqlx::query_as(&sql), params)
                    .fetch_all(&mut **t)
                    .await?
            }
        };
        Ok(last_position(rows))
    }

    /// Runs a query whose one row is one integer (e.g. a `COUNT(*)`).
    pub async fn count(&mut self, sql: &str, params: &[Param]) -> Result<i64, sqlx::Error> {
        let sql = crate::database::sql_for(self.backend(), sql);
        match self {
            Tx::Postgres(t) => {
                crate::bind_params!(sqlx::query_scalar(&sql), params)
                    .fetch_one(&mut **t)
                    .await
            }
            Tx::Sqlite(t) => {
                crate::bind_params!(sqlx::query_scalar(&sql), params)
                    .fetch_one(&mut **t)
                    .await
            }
        }
    }

    /// Reads one JSON column of the first row of a query (e.g. a stored document).
    pub async fn fetch_json(
        &mut self,
        sql: &str,
        params: &[Param],
    ) -> Result<Option<Value>, sqlx::Error> {
        let sql = crate::database::sql_for(self.backend(), sql);
        match self {
            Tx::Postgres(t) => {
                let row = crate::bind_params!(sqlx::query(&sql), params)
                    .fetch_optional(&mut **t)
                    .await?;
                row.map(|r| r.try_get::<Value, _>(0)).transpose()
            }
            Tx::Sqlite(t) => {
                let row = crate::bind_params!(sqlx::query(&sql), params)
                    .fetch_optional(&mut **t)
                    .await?;
                match row {
                    None => Ok(None),
                    Some(r) => {
                        let text: String = r.try_get(0)?;
                        serde_json::from_str(&text)
                            .map(Some)
                            .map_err(|e| sqlx::Error::Decode(Box::new(e)))
                    }
                }
            }
        }
    }

    /// Inserts `rows` (one value per column each); `tail` is the conflict clause. A batch of
    /// a subscription writes its rows this way in a statement or a few instead of one per
    /// event. Returns the rows affected.
    ///
    /// On Postgres each column is bound as one array (`INSERT INTO {table} ({columns})
    /// SELECT * FROM UNNEST($1::text[], ...) {tail}`): the statement's text depends only on
    /// the table and its columns, so it is parsed and planned once per connection and
    /// reused, where a multi-row `VALUES` list would be a new statement (parsed, planned and
    /// cached anew, thousands of parameters) for every row count. A column whose values are
    /// not all of one kind falls back to `VALUES`, as SQLite always does (as many rows to a
    /// statement as its limit on parameters allows).
    pub async fn insert_rows(
        &mut self,
        table: &str,
        columns: &[&str],
        rows: Vec<Vec<Param>>,
        tail: &str,
    ) -> Result<u64, sqlx::Error> {
        if rows.is_empty() {
            return Ok(0);
        }
        if let Tx::Postgres(t) = self {
            if let Some(arrays) = ColumnArrays::of(columns.len(), &rows) {
                let sql = format!(
                    "INSERT INTO {table} ({}) SELECT * FROM UNNEST({}) {tail}",
                    columns.join(", "),
                    arrays.placeholders()
                );
                return Ok(arrays
                    .bind(sqlx::query(&sql))
                    .execute(&mut **t)
                    .await?
                    .rows_affected());
            }
        }
        let per_statement = (MAX_PARAMETERS / columns.len().max(1)).max(1);
        let mut affected = 0;
        let mut rows = rows.into_iter().peekable();
        while rows.peek().is_some() {
            let mut sql = format!("INSERT INTO {table} ({}) VALUES ", columns.join(", "));
            let mut params = Vec::new();
            for (i, row) in rows.by_ref().take(per_statement).enumerate() {
                sql.push_str(if i == 0 { "(" } else { ", (" });
                sql.push_str(&placeholders(params.len() + 1, row.len()));
                sql.push(')');
                params.extend(row);
            }
            sql.push(' ');
            sql.push_str(tail);
            affected += self.execute(&sql, &params).await?;
        }
        Ok(affected)
    }

    /// The rows of `select`, whose first column is text (a key) and second a JSON document,
    /// for `keys`: `select` ends in `IN` (e.g. the stored documents of a batch's
    /// aggregates). On Postgres text keys are bound as one array (`IN (SELECT
    /// unnest($1::text[]))`, one statement text whatever their number); otherwise the
    /// statement runs once per chunk of keys that it can bind.
    pub async fn fetch_documents(
        &mut self,
        select: &str,
        keys: &[Param],
    ) -> Result<Vec<(String, Value)>, sqlx::Error> {
        let mut found = Vec::new();
        if keys.is_empty() {
            return Ok(found);
        }
        if let Tx::Postgres(t) = self {
            let texts: Option<Vec<&str>> = keys
                .iter()
                .map(|k| match k {
                    Param::Text(Some(text)) => Some(text.as_str()),
                    _ => None,
                })
                .collect();
            if let Some(texts) = texts {
                let sql = format!("{select} (SELECT unnest($1::text[]))");
                // Planned at each call, never from a cached generic plan: a plan cached
                // while the table was small (a fresh or rebuilt one) is a scan of the
                // whole table, kept as it grows until the next ANALYZE.
                let query = sqlx::query(&sql).bind(texts).persistent(false);
                for row in query.fetch_all(&mut **t).await? {
                    found.push((row.try_get(0)?, row.try_get(1)?));
                }
                return Ok(found);
            }
        }
        for chunk in keys.chunks(MAX_PARAMETERS) {
            let sql = format!("{select} ({})", placeholders(1, chunk.len()));
            let sql = crate::database::sql_for(self.backend(), &sql).into_owned();
            match self {
                Tx::Postgres(t) => {
                    let rows = crate::bind_params!(sqlx::query(&sql), chunk)
                        .fetch_all(&mut **t)
                        .await?;
                    for row in rows {
                        found.push((row.try_get(0)?, row.try_get(1)?));
                    }
                }
                Tx::Sqlite(t) => {
                    let rows = crate::bind_params!(sqlx::query(&sql), chunk)
                        .fetch_all(&mut **t)
                        .await?;
                    for row in rows {
                        let document: String = row.try_get(1)?;
                        let document = serde_json::from_str(&document)
                            .map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
                        found.push((row.try_get(0)?, document));
                    }
                }
            }
        }
        Ok(found)
    }

    /// Takes the subscription's checkpoint and holds it until commit: the row is locked on
    /// Postgres, and on SQLite this first write takes the database's write lock, so two
    /// runners of one subscription never handle the same batch.
    pub async fn claim_checkpoint(&mut self, name: &str) -> Result<Position, sqlx::Error> {
        let sql = "UPDATE subscription_checkpoints SET updated_at = updated_at WHERE name = $1
                   RETURNING transaction_id, global_position";
        let sql = crate::database::sql_for(self.backend(), sql);
        // The row nearly always exists: one round trip; the first time, create it and claim.
        let (transaction_id, global_position) = match self.claim_existing(&sql, name).await? {
            Some(found) => found,
            None => {
                self.execute(
                    "INSERT INTO subscription_checkpoints (name) VALUES ($1) ON CONFLICT (name) DO NOTHING",
                    &[Param::Text(Some(name.to_string()))],
                )
                .await?;
                self.claim_existing(&sql, name)
                    .await?
                    .ok_or(sqlx::Error::RowNotFound)?
            }
        };
        Ok(Position {
            transaction_id,
            global_position,
        })
    }

    async fn claim_existing(
        &mut self,
        sql: &str,
        name: &str,
    ) -> Result<Option<(i64, i64)>, sqlx::Error> {
        match self {
            Tx::Postgres(t) => {
                sqlx::query_as(sql)
                    .bind(name)
                    .fetch_optional(&mut **t)
                    .await
            }
            Tx::Sqlite(t) => {
                sqlx::query_as(sql)
                    .bind(name)
                    .fetch_optional(&mut **t)
                    .await
            }
        }
    }

    /// Takes the checkpoints of several subscriptions and holds them until commit, like
    /// [`Tx::claim_checkpoint`] for each; returns their positions in the order of `names`.
    /// The rows are locked in name order, so two transactions claiming overlapping sets (two
    /// instances, or a rebuild's swap, which claims in the same order) wait for each other
    /// instead of deadlocking. On Postgres it is one statement.
    pub async fn claim_checkpoints(
        &mut self,
        names: &[&str],
    ) -> Result<Vec<Position>, sqlx::Error> {
        let mut sorted: Vec<&str> = names.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let found: HashMap<String, Position> = match self {
            Tx::Postgres(t) => {
                // LockRows sits above the sort in the plan: the rows are locked in name order.
                let rows: Vec<(String, i64, i64)> = sqlx::query_as(
                    "SELECT name, transaction_id, global_position FROM subscription_checkpoints
                     WHERE name = ANY($1) ORDER BY name FOR UPDATE",
                )
                .bind(&sorted)
                .fetch_all(&mut **t)
                .await?;
                rows.into_iter()
                    .map(|(name, transaction_id, global_position)| {
                        let at = Position {
                            transaction_id,
                            global_position,
                        };
                        (name, at)
                    })
                    .collect()
            }
            Tx::Sqlite(_) => HashMap::new(),
        };
        let mut positions = HashMap::with_capacity(sorted.len());
        for name in sorted {
            let at = match found.get(name) {
                Some(at) => *at,
                // SQLite (one writer at a time anyway), or a checkpoint not created yet.
                None => self.claim_checkpoint(name).await?,
            };
            positions.insert(name, at);
        }
        Ok(names.iter().map(|name| positions[name]).collect())
    }

    /// Moves several subscriptions' checkpoints (call after [`Tx::claim_checkpoints`]); one
    /// statement on Postgres.
    pub async fn save_checkpoints(
        &mut self,
        moved: &[(&str, Position)],
    ) -> Result<(), sqlx::Error> {
        match self {
            Tx::Postgres(t) if moved.len() > 1 => {
                let names: Vec<&str> = moved.iter().map(|(name, _)| *name).collect();
                let transactions: Vec<i64> =
                    moved.iter().map(|(_, at)| at.transaction_id).collect();
                let positions: Vec<i64> = moved.iter().map(|(_, at)| at.global_position).collect();
                sqlx::query(
                    "UPDATE subscription_checkpoints AS c
                     SET transaction_id = m.transaction_id, global_position = m.global_position,
                         updated_at = now()
                     FROM UNNEST($1::text[], $2::bigint[], $3::bigint[])
                          AS m(name, transaction_id, global_position)
                     WHERE c.name = m.name",
                )
                .bind(&names)
                .bind(&transactions)
                .bind(&positions)
                .execute(&mut **t)
                .await?;
            }
            _ => {
                for (name, at) in moved {
                    self.save_checkpoint(name, *at).await?;
                }
            }
        }
        Ok(())
    }

    /// Moves the subscription's checkpoint (call after [`Tx::claim_checkpoint`]).
    pub async fn save_checkpoint(&mut self, name: &str, to: Position) -> Result<(), sqlx::Error> {
        let now = match self.backend() {
            Backend::Postgres => "now()",
            Backend::Sqlite => "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
        };
        let sql = format!(
            "UPDATE subscription_checkpoints SET transaction_id = $2, global_position = $3, updated_at = {now} WHERE name = $1"
        );
        self.execute(
            &sql,
            &[
                Param::Text(Some(name.to_string())),
                Param::Int(Some(to.transaction_id)),
                Param::Int(Some(to.global_position)),
            ],
        )
        .await?;
        Ok(())
    }

    /// Up to `limit` events after `after`, in stream order.
    pub async fn read_batch(
        &mut self,
        after: Position,
        limit: i64,
    ) -> Result<Vec<StoredEvent>, sqlx::Error> {
        match self {
            Tx::Postgres(t) => read_pg(&mut **t, after, limit).await,
            Tx::Sqlite(t) => read_sqlite(&mut **t, after, limit).await,
        }
    }
}

/// The greatest of `(transaction_id, global_position)` rows.
pub(crate) fn last_position(rows: Vec<(i64, i64)>) -> Option<Position> {
    rows.into_iter()
        .map(|(transaction_id, global_position)| Position {
            transaction_id,
            global_position,
        })
        .max()
}

/// Creates a subscription's checkpoint at the start of the stream unless it exists, so
/// that status and readiness list it before its first batch.
pub async fn ensure_checkpoint(db: &Database, name: &str) -> Result<(), sqlx::Error> {
    let mut tx = Tx::begin(db).await?;
    tx.execute(
        "INSERT INTO subscription_checkpoints (name) VALUES ($1) ON CONFLICT (name) DO NOTHING",
        &[Param::Text(Some(name.to_string()))],
    )
    .await?;
    tx.commit().await
}

/// Reads up to `limit` events after `after` outside any subscription.
pub async fn read_after(
    db: &Database,
    after: Position,
    limit: i64,
) -> Result<Vec<StoredEvent>, sqlx::Error> {
    // One statement on the pool, outside any transaction: it sees one snapshot on either
    // engine, and a caller that drops this future (a client leaving the SSE stream) cannot
    // hand a connection back to the pool inside an open transaction (which, on SQLite,
    // would keep the write lock from every other writer).
    match db.pool() {
        Pool::Postgres(p) => read_pg(p, after, limit).await,
        Pool::Sqlite(p) => read_sqlite(p, after, limit).await,
    }
}

/// [`read_after`], ending the batch once its payloads pass `max_bytes`: the events whose
/// payloads start within that many bytes of the batch's start (so always the first, however
/// large). The rows past it are counted by the store, never sent; a reader that holds a
/// batch at a time (the SSE stream of a caller reading history from the start) holds at
/// most `max_bytes` and one event, whatever the events' sizes.
pub async fn read_after_bounded(
    db: &Database,
    after: Position,
    limit: i64,
    max_bytes: i64,
) -> Result<Vec<StoredEvent>, sqlx::Error> {
    let rows = match db.pool() {
        Pool::Postgres(p) => sqlx::query(PG_BOUNDED_BATCH)
            .bind(after.transaction_id.to_string())
            .bind(after.global_position)
            .bind(limit)
            .bind(max_bytes)
            .fetch_all(p)
            .await?
            .iter()
            .map(pg_event)
            .collect(),
        Pool::Sqlite(p) => sqlx::query(SQLITE_BOUNDED_BATCH)
            .bind(after.global_position)
            .bind(limit)
            .bind(max_bytes)
            .fetch_all(p)
            .await?
            .iter()
            .map(sqlite_event)
            .collect(),
    };
    rows
}

/// [`PG_BATCH`] with a running sum of the payloads' sizes, cut at `$4` bytes.
const PG_BOUNDED_BATCH: &str = "
SELECT * FROM (
SELECT global_position, transaction_id::text::bigint AS transaction_id, event_id::text AS event_id,
       aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata, recorded_at,
       SUM(octet_length(payload::text)) OVER (ORDER BY events.transaction_id, events.global_position)
         - octet_length(payload::text) AS bytes_before
  FROM events
 WHERE (transaction_id, global_position) > ($1::text::xid8, $2)
   AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())
 ORDER BY events.transaction_id, events.global_position
 LIMIT $3) page
 WHERE bytes_before = 0 OR bytes_before < $4
 ORDER BY transaction_id, global_position";

/// [`SQLITE_BATCH`] with a running sum of the payloads' sizes, cut at `?3` bytes.
const SQLITE_BOUNDED_BATCH: &str = "
SELECT * FROM (
SELECT global_position, 0 AS transaction_id, event_id, aggregate_type, aggregate_id, sequence,
       event_type, event_version, payload, metadata, recorded_at,
       SUM(length(CAST(payload AS BLOB))) OVER (ORDER BY global_position)
         - length(CAST(payload AS BLOB)) AS bytes_before
  FROM events
 WHERE global_position > ?1
 ORDER BY global_position
 LIMIT ?2)
 WHERE bytes_before = 0 OR bytes_before < ?3
 ORDER BY global_position";

/// The stream's batch read on Postgres, in a transaction or on the pool.
async fn read_pg<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    after: Position,
    limit: i64,
) -> Result<Vec<StoredEvent>, sqlx::Error> {
    sqlx::query(PG_BATCH)
        .bind(after.transaction_id.to_string())
        .bind(after.global_position)
        .bind(limit)
        .fetch_all(executor)
        .await?
        .iter()
        .map(pg_event)
        .collect()
}

/// The stream's batch read on SQLite, in a transaction or on the pool.
async fn read_sqlite<'e>(
    executor: impl sqlx::SqliteExecutor<'e>,
    after: Position,
    limit: i64,
) -> Result<Vec<StoredEvent>, sqlx::Error> {
    sqlx::query(SQLITE_BATCH)
        .bind(after.global_position)
        .bind(limit)
        .fetch_all(executor)
        .await?
        .iter()
        .map(sqlite_event)
        .collect()
}

/// A subscription's progress, for `ferry projections status` and `/readyz`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SubscriptionStatus {
    /// The subscription.
    pub name: String,
    /// Its checkpoint.
    pub position: Position,
    /// Events stored after the checkpoint: counted up to [`LAG_COUNTED`], estimated from
    /// the positions beyond (see `lag_estimated`).
    pub lag: i64,
    /// True when `lag` is the distance from the checkpoint to the head, not a count: more
    /// than [`LAG_COUNTED`] events wait.
    pub lag_estimated: bool,
    /// The newest position in the store.
    pub head: i64,
}

/// How many events after a checkpoint are counted one by one. `/readyz` and `/metrics`
/// read every subscription's lag, and counting a backlog of millions (a relay that NATS
/// refused for a day) takes seconds, past a probe's or a scrape's timeout just when the
/// figure matters; beyond this the lag is the positions' distance.
pub const LAG_COUNTED: i64 = 100_000;

/// The checkpoint and lag of every subscription with a checkpoint row.
pub async fn subscription_status(db: &Database) -> Result<Vec<SubscriptionStatus>, sqlx::Error> {
    subscription_status_counting(db, LAG_COUNTED).await
}

/// [`subscription_status`] counting at most `counted` events per subscription.
pub(crate) async fn subscription_status_counting(
    db: &Database,
    counted: i64,
) -> Result<Vec<SubscriptionStatus>, sqlx::Error> {
    let rows: Vec<(String, i64, i64)> = crate::on_pool!(db, pool => sqlx::query_as(
        "SELECT name, transaction_id, global_position FROM subscription_checkpoints ORDER BY name"
    ).fetch_all(pool).await?);
    let head: i64 = crate::on_pool!(db, pool => sqlx::query_scalar(
        "SELECT COALESCE(MAX(global_position), 0) FROM events"
    ).fetch_one(pool).await?);
    let mut out = Vec::with_capacity(rows.len());
    for (name, transaction_id, global_position) in rows {
        let counted_lag: i64 = match db.pool() {
            Pool::Postgres(p) => {
                sqlx::query_scalar(
                    "SELECT count(*) FROM (SELECT 1 FROM events
                      WHERE (transaction_id, global_position) > ($1::text::xid8, $2) LIMIT $3) after",
                )
                .bind(transaction_id.to_string())
                .bind(global_position)
                .bind(counted)
                .fetch_one(p)
                .await?
            }
            Pool::Sqlite(p) => {
                sqlx::query_scalar(
                    "SELECT count(*) FROM (SELECT 1 FROM events WHERE global_position > ?1 LIMIT ?2)",
                )
                .bind(global_position)
                .bind(counted)
                .fetch_one(p)
                .await?
            }
        };
        // At the cap, more wait: the positions' distance (positions a rolled-back append
        // took are in it, so it errs high, never to zero).
        let lag_estimated = counted_lag >= counted;
        let lag = if lag_estimated {
            (head - global_position).max(counted_lag)
        } else {
            counted_lag
        };
        out.push(SubscriptionStatus {
            name,
            position: Position {
                transaction_id,
                global_position,
            },
            lag,
            lag_estimated,
            head,
        });
    }
    Ok(out)
}

/// A transaction that holds the global stream back: on Postgres readers only take events
/// older than the oldest running transaction, so while it runs, every event committed after
/// it started waits, on every instance.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamHolder {
    /// The backend's process id (`pg_terminate_backend(pid)` ends it), or `None` for a
    /// prepared transaction.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
    /// The prepared transaction's id, for a prepared transaction.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prepared_gid: Option<String>,
    /// The database it runs in (any database of the server holds Ferry's stream back).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub database: Option<String>,
    /// Its `application_name`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub application: Option<String>,
    /// `active`, `idle in transaction`, …
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// How long its transaction has run, in seconds.
    pub age_seconds: f64,
    /// Events already committed that wait behind it.
    pub waiting_events: i64,
}

/// The transaction holding the global stream back, if one has run longer than `threshold`
/// (Postgres only; SQLite has a single writer and no such hold).
pub async fn stream_holder(
    db: &Database,
    threshold: Duration,
) -> Result<Option<StreamHolder>, sqlx::Error> {
    let Pool::Postgres(pool) = db.pool() else {
        return Ok(None);
    };
    type Row = (
        Option<i32>,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
        f64,
        i64,
    );
    let row: Option<Row> = sqlx::query_as(
        "WITH horizon AS (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin),
              holders AS (
                SELECT a.pid, NULL::text AS gid, a.datname::text AS datname,
                       a.application_name::text AS app, a.state::text AS state, a.xact_start AS since
                  FROM pg_stat_activity a, horizon h
                 WHERE a.backend_xid IS NOT NULL
                   AND a.backend_xid::text::bigint = h.xmin::text::bigint % 4294967296
                UNION ALL
                SELECT NULL, p.gid, p.database::text, NULL, 'prepared', p.prepared
                  FROM pg_prepared_xacts p, horizon h
                 WHERE p.transaction::text::bigint = h.xmin::text::bigint % 4294967296)
         SELECT pid, gid, datname, app, state,
                EXTRACT(EPOCH FROM (now() - since))::float8 AS age,
                (SELECT count(*) FROM events e, horizon h WHERE e.transaction_id >= h.xmin) AS waiting
           FROM holders
          WHERE since < now() - make_interval(secs => $1)
          ORDER BY since LIMIT 1",
    )
    .bind(threshold.as_secs_f64())
    .fetch_optional(pool)
    .await?;
    Ok(row.map(
        |(pid, prepared_gid, database, application, state, age_seconds, waiting_events)| {
            StreamHolder {
                pid,
                prepared_gid,
                database,
                application,
                state,
                age_seconds,
                waiting_events,
            }
        },
    ))
}

/// What a subscription does with each event, inside the batch's transaction. It sees events
/// as stored; Ferry's subscriptions are [`crate::events::Subscription`]s, which decode them
/// (through the upcasters) for one typed subscriber per aggregate.
#[async_trait::async_trait]
pub trait Handler: Send + Sync {
    /// The subscription's checkpoint name.
    fn name(&self) -> &str;
    /// Applies one event. An error rolls the whole batch back; it is retried later.
    async fn handle(&self, tx: &mut Tx, event: &StoredEvent) -> Result<(), HandlerError>;

    /// Whether what the handler writes follows from the stream alone and lives only in the
    /// batch's transaction (a read model), so that losing a committed batch costs nothing but
    /// reading it again. Such batches commit without waiting for the WAL flush (see
    /// [`Tx::begin_for`]). A handler that causes an effect outside its tables must say
    /// `false`, the default: a lost commit would repeat the effect.
    fn replayable(&self) -> bool {
        false
    }

    /// Applies a batch of events in stream order. The default hands them to
    /// [`Handler::handle`] one by one; a handler that can write a batch with fewer statements
    /// overrides it. Its result must equal handling the events one by one.
    async fn handle_batch(&self, tx: &mut Tx, events: &[StoredEvent]) -> Result<(), HandlerError> {
        for event in events {
            self.handle(tx, event)
                .await
                .map_err(|source| HandlerError::at(event, source))?;
        }
        Ok(())
    }
}

/// A handler's failure.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// A database error.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    /// A stored event that does not decode into its aggregate's event type, or whose
    /// aggregate type Ferry does not know (see [`crate::events`]).
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// A record the handler needs besides the event (a read model's row, the run's request)
    /// is missing or unreadable although the events say it must be there.
    #[error("{what}: {source}")]
    Record {
        /// Which record.
        what: String,
        /// What is wrong with it.
        source: BoxError,
    },
    /// A batch read for a subscription at one position found its checkpoint elsewhere
    /// (another runner moved it); nothing was applied.
    #[error("subscription {name}'s checkpoint is at {}, not at {} where its batch was read", .found.global_position, .expected.global_position)]
    Moved {
        /// The subscription.
        name: String,
        /// Where the batch was read from.
        expected: Position,
        /// Where the checkpoint stood.
        found: Position,
    },
    /// The handler failed on this event; the batch was rolled back and nothing is skipped.
    #[error("event {event_id} ({event_type}) at position {}: {source}", .position.global_position)]
    AtEvent {
        /// Where the event is.
        position: Position,
        /// Its id.
        event_id: Uuid,
        /// Its type.
        event_type: String,
        /// What the handler said.
        source: Box<HandlerError>,
    },
}

impl HandlerError {
    /// `source`, tied to the event it failed on (unless it already is).
    pub fn at(event: &StoredEvent, source: HandlerError) -> Self {
        match source {
            at @ HandlerError::AtEvent { .. } => at,
            source => HandlerError::AtEvent {
                position: event.position,
                event_id: event.event_id,
                event_type: event.event_type.clone(),
                source: Box::new(source),
            },
        }
    }
}

/// A subscription that keeps failing on the same event: it retries, never skips, and says
/// so in `/readyz`, the log and the metrics until the event is handled.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SubscriptionProblem {
    /// The subscription.
    pub name: String,
    /// The failing event's position, when the failure is tied to one event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub position: Option<Position>,
    /// The failing event's id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_id: Option<Uuid>,
    /// Its type.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_type: Option<String>,
    /// The last error.
    pub error: String,
    /// Consecutive failed attempts.
    pub attempts: u64,
    /// When the first of them failed.
    pub since: DateTime<Utc>,
}

/// The problems of the subscriptions running in this process (shared by every clone of the
/// [`Database`]).
#[derive(Debug, Default)]
pub struct SubscriptionHealth {
    problems: std::sync::Mutex<std::collections::BTreeMap<String, SubscriptionProblem>>,
}

impl SubscriptionHealth {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<String, SubscriptionProblem>> {
        // A panic while holding this lock leaves a consistent map: take it over.
        self.problems
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a failed attempt of subscription `name`; returns the problem as it stands.
    pub fn failed(&self, name: &str, error: &HandlerError) -> SubscriptionProblem {
        let (position, event_id, event_type) = match error {
            HandlerError::AtEvent {
                position,
                event_id,
                event_type,
                ..
            } => (Some(*position), Some(*event_id), Some(event_type.clone())),
            _ => (None, None, None),
        };
        let mut problems = self.lock();
        let problem = problems
            .entry(name.to_string())
            .and_modify(|p| {
                if p.event_id != event_id {
                    // A different event fails now: the count starts again.
                    p.attempts = 0;
                    p.since = Utc::now();
                }
                p.attempts += 1;
                p.error = error.to_string();
                p.position = position;
                p.event_id = event_id;
                p.event_type = event_type.clone();
            })
            .or_insert_with(|| SubscriptionProblem {
                name: name.to_string(),
                position,
                event_id,
                event_type: event_type.clone(),
                error: error.to_string(),
                attempts: 1,
                since: Utc::now(),
            });
        problem.clone()
    }

    /// Subscription `name` handled a batch (or had nothing to do): it is healthy again.
    pub fn recovered(&self, name: &str) -> Option<SubscriptionProblem> {
        self.lock().remove(name)
    }

    /// Every current problem, by subscription name.
    pub fn problems(&self) -> Vec<SubscriptionProblem> {
        self.lock().values().cloned().collect()
    }
}

/// How many events one transaction handles at most.
pub const BATCH_SIZE: i64 = 256;

/// Handles one batch; returns how many events it took.
pub async fn run_batch(db: &Database, handler: &dyn Handler) -> Result<usize, HandlerError> {
    run_batch_of(db, handler, BATCH_SIZE).await
}

/// Handles one batch of at most `limit` events in one transaction; returns how many it took.
///
/// The batch goes to [`Handler::handle_batch`]. When that fails without naming the event, the
/// batch is rolled back and handled again one event at a time, so that the error, and the
/// subscription's reported problem, name the event that fails.
pub async fn run_batch_of(
    db: &Database,
    handler: &dyn Handler,
    limit: i64,
) -> Result<usize, HandlerError> {
    Ok(run_batch_taking(db, handler, limit).await?.events)
}

async fn run_batch_taking(
    db: &Database,
    handler: &dyn Handler,
    limit: i64,
) -> Result<Taken, HandlerError> {
    match run_one_batch(db, handler, limit, true).await {
        Err(error) if !matches!(error, HandlerError::AtEvent { .. }) => {
            tracing::debug!(%error, "batch failed; handling it one event at a time");
            run_one_batch(db, handler, limit, false).await
        }
        done => done,
    }
}

async fn run_one_batch(
    db: &Database,
    handler: &dyn Handler,
    limit: i64,
    batched: bool,
) -> Result<Taken, HandlerError> {
    let mut tx = Tx::begin_for(db, &[handler]).await?;
    let from = tx.claim_checkpoint(handler.name()).await?;
    let events = tx.read_batch(from, limit).await?;
    let Some(last) = events.last().map(|e| e.position) else {
        tx.commit().await?;
        // Another instance may have moved it: waiters here learn of that too.
        return Ok(Taken {
            events: 0,
            reached: Some(from),
        });
    };
    if batched {
        handler.handle_batch(&mut tx, &events).await?;
    } else {
        for event in &events {
            handler
                .handle(&mut tx, event)
                .await
                .map_err(|source| HandlerError::at(event, source))?;
        }
    }
    tx.save_checkpoint(handler.name(), last).await?;
    tx.commit().await?;
    Ok(Taken {
        events: events.len(),
        reached: Some(last),
    })
}

/// Applies `events`, read after `from` by the caller, to a subscription whose checkpoint
/// stands at `from`, and moves the checkpoint past them, in one transaction. Several
/// subscriptions replaying the same stretch (a rebuild) read it once this way.
pub async fn apply_read_batch(
    db: &Database,
    handler: &dyn Handler,
    from: Position,
    events: &[StoredEvent],
) -> Result<(), HandlerError> {
    let Some(last) = events.last().map(|e| e.position) else {
        return Ok(());
    };
    let mut tx = Tx::begin_for(db, &[handler]).await?;
    let found = tx.claim_checkpoint(handler.name()).await?;
    if found != from {
        return Err(HandlerError::Moved {
            name: handler.name().to_string(),
            expected: from,
            found,
        });
    }
    handler.handle_batch(&mut tx, events).await?;
    tx.save_checkpoint(handler.name(), last).await?;
    tx.commit().await?;
    Ok(())
}

/// Handles batches until the subscription has nothing left to read; returns the count.
pub async fn catch_up(db: &Database, handler: &dyn Handler) -> Result<usize, HandlerError> {
    Ok(catch_up_taking(db, handler).await?.events)
}

async fn catch_up_taking(db: &Database, handler: &dyn Handler) -> Result<Taken, HandlerError> {
    let mut total = Taken::default();
    loop {
        let taken = run_batch_taking(db, handler, BATCH_SIZE).await?;
        total.add(taken);
        if taken.events < BATCH_SIZE as usize {
            return Ok(total);
        }
    }
}

/// Handles one batch for several subscriptions in one transaction: their checkpoints are
/// claimed together, the stream is read once from the earliest of them, and each handler gets
/// the events after its own checkpoint. Returns how many events each handler took and how
/// many were read.
pub async fn run_batch_together(
    db: &Database,
    handlers: &[&dyn Handler],
    limit: i64,
) -> Result<(Vec<Taken>, usize), HandlerError> {
    let mut taken = vec![Taken::default(); handlers.len()];
    let names: Vec<&str> = handlers.iter().map(|h| h.name()).collect();
    let mut tx = Tx::begin_for(db, handlers).await?;
    let froms = tx.claim_checkpoints(&names).await?;
    let Some(earliest) = froms.iter().min().copied() else {
        return Ok((taken, 0));
    };
    let events = tx.read_batch(earliest, limit).await?;
    let mut moved = Vec::with_capacity(handlers.len());
    for (i, (handler, from)) in handlers.iter().zip(&froms).enumerate() {
        let mine = &events[events.partition_point(|e| e.position <= *from)..];
        let Some(last) = mine.last().map(|e| e.position) else {
            taken[i].reached = Some(*from);
            continue;
        };
        handler.handle_batch(&mut tx, mine).await?;
        moved.push((names[i], last));
        taken[i] = Taken {
            events: mine.len(),
            reached: Some(last),
        };
    }
    if !moved.is_empty() {
        tx.save_checkpoints(&moved).await?;
    }
    tx.commit().await?;
    Ok((taken, events.len()))
}

/// What a subscription took in a catch-up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Taken {
    /// How many events.
    pub events: usize,
    /// Where its checkpoint stands afterwards (moved here or by another instance); `None`
    /// when it was not read.
    pub reached: Option<Position>,
}

impl Taken {
    fn add(&mut self, more: Taken) {
        self.events += more.events;
        self.reached = self.reached.max(more.reached);
    }
}

/// Runs batches for several subscriptions together until nothing is left to read; returns
/// what each handler took, and whether they stand far apart: a full batch that some handler
/// had already taken (one far behind the others, e.g. a projection new in this version
/// replaying the whole stream). Then it stops, so that the caller can run them a batch at a
/// time each and the others do not wait for the replay.
pub async fn catch_up_together(
    db: &Database,
    handlers: &[&dyn Handler],
) -> Result<(Vec<Taken>, bool), HandlerError> {
    let mut total = vec![Taken::default(); handlers.len()];
    loop {
        let (taken, read) = run_batch_together(db, handlers, BATCH_SIZE).await?;
        let full = read >= BATCH_SIZE as usize;
        let apart = full && taken.iter().any(|t| t.events == 0);
        for (sum, more) in total.iter_mut().zip(taken) {
            sum.add(more);
        }
        if !full || apart {
            return Ok((total, apart));
        }
    }
}

/// A subscription run by [`run_subscriptions`]: its handler and, optionally, a counter moved
/// whenever it commits events (read-your-writes waits watch it).
pub struct Running {
    /// The handler.
    pub handler: Arc<dyn Handler>,
    /// The checkpoint it reached, moved after each catch-up that handled events.
    pub progress: Option<watch::Sender<Position>>,
}

/// Runs a subscription until `shutdown` turns true: catch up, then wait for a commit signal
/// (in-process or Postgres NOTIFY) or the poll interval. Errors are retried with a growing
/// pause, so one bad moment of the database does not stop the subscription; an event that
/// keeps failing is never skipped: the subscription reports itself stuck on it (the log, the
/// database's [`SubscriptionHealth`], hence `/readyz` and the metrics) until it goes through.
pub async fn run_subscription(
    db: Database,
    handler: Arc<dyn Handler>,
    poll: Duration,
    shutdown: watch::Receiver<bool>,
    progress: Option<watch::Sender<Position>>,
) {
    run_subscriptions(db, vec![Running { handler, progress }], poll, shutdown).await
}

/// Runs several subscriptions on one task, as [`run_subscription`] runs one, sharing each
/// batch: one transaction reads the stream once and applies it to all of them, instead of
/// a transaction (and a commit) per subscription. When that fails, they catch up one at a
/// time, so that the error, the reported problem and the retries belong to the subscription
/// that fails while the others go on; once all have caught up they share batches again.
pub async fn run_subscriptions(
    db: Database,
    subscriptions: Vec<Running>,
    poll: Duration,
    shutdown: watch::Receiver<bool>,
) {
    let names: Vec<&str> = subscriptions.iter().map(|s| s.handler.name()).collect();
    let span = tracing::info_span!("subscription", name = names.join(",").as_str());
    tracing::Instrument::instrument(subscription_loop(db, &subscriptions, poll, shutdown), span)
        .await
}

async fn subscription_loop(
    db: Database,
    subscriptions: &[Running],
    poll: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut commits = db.subscribe_commits();
    let handlers: Vec<&dyn Handler> = subscriptions.iter().map(|s| s.handler.as_ref()).collect();
    // Per subscription, so that one failing subscription waits out its pause while the
    // others keep up.
    let mut retries = vec![Retry::default(); subscriptions.len()];
    let mut together = subscriptions.len() > 1;
    loop {
        if *shutdown.borrow() {
            return;
        }
        if together {
            match catch_up_together(&db, &handlers).await {
                Ok((taken, apart)) => {
                    for (subscription, taken) in subscriptions.iter().zip(taken) {
                        caught_up(&db, subscription, taken);
                    }
                    if apart {
                        tracing::debug!("far apart; a batch at a time each until caught up");
                        together = false;
                        continue;
                    }
                }
                Err(error) => {
                    tracing::debug!(%error, "shared batch failed; catching up one at a time");
                    together = false;
                    continue;
                }
            }
        } else {
            catch_up_in_turn(&db, subscriptions, &mut retries, &shutdown).await;
            together = subscriptions.len() > 1 && retries.iter().all(|r| r.due.is_none());
        }
        let next_retry = retries.iter().filter_map(|r| r.due).min();
        // A failing subscription's retry is due at its time; the others go on at each commit.
        let retry = async {
            match next_retry {
                Some(due) => tokio::time::sleep_until(due).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = commits.changed() => {}
            _ = tokio::time::sleep(poll) => {}
            _ = retry => {}
            _ = shutdown.changed() => {}
        }
    }
}

/// A subscription's pause after failures: how long the next one lasts, and when the
/// current one ends (`None`: not failing).
#[derive(Clone, Copy)]
struct Retry {
    backoff: Duration,
    due: Option<tokio::time::Instant>,
}

impl Default for Retry {
    fn default() -> Self {
        Self {
            backoff: Duration::from_millis(100),
            due: None,
        }
    }
}

/// One batch each in turn, until none has a full batch left, skipping those whose pause
/// has not ended: a subscription far behind (or failing) does not hold the others back.
async fn catch_up_in_turn(
    db: &Database,
    subscriptions: &[Running],
    retries: &mut [Retry],
    shutdown: &watch::Receiver<bool>,
) {
    let mut total = vec![Taken::default(); subscriptions.len()];
    let mut ran = vec![false; subscriptions.len()];
    let mut failed = vec![false; subscriptions.len()];
    loop {
        let now = tokio::time::Instant::now();
        let mut more = false;
        for (i, subscription) in subscriptions.iter().enumerate() {
            if failed[i] || retries[i].due.is_some_and(|due| due > now) {
                continue;
            }
            ran[i] = true;
            let handler = subscription.handler.as_ref();
            match run_batch_taking(db, handler, BATCH_SIZE).await {
                Ok(taken) => {
                    more |= taken.events >= BATCH_SIZE as usize;
                    total[i].add(taken);
                }
                Err(error) => {
                    failed[i] = true;
                    let retry = &mut retries[i];
                    let problem = db.subscription_health().failed(handler.name(), &error);
                    tracing::error!(
                        %error,
                        subscription = handler.name(),
                        attempts = problem.attempts,
                        event_id = ?problem.event_id,
                        position = ?problem.position.map(|p| p.global_position),
                        retry_in_ms = retry.backoff.as_millis() as u64,
                        "subscription is stuck: batch failed, nothing skipped; retrying"
                    );
                    retry.due = Some(tokio::time::Instant::now() + retry.backoff);
                    retry.backoff = (retry.backoff * 2).min(Duration::from_secs(30));
                }
            }
        }
        if !more || *shutdown.borrow() {
            break;
        }
    }
    for (i, subscription) in subscriptions.iter().enumerate() {
        if ran[i] && !failed[i] {
            caught_up(db, subscription, total[i]);
            retries[i] = Retry::default();
        }
    }
}

/// Records that a subscription caught up after taking `taken`.
fn caught_up(db: &Database, subscription: &Running, taken: Taken) {
    let name = subscription.handler.name();
    if let Some(problem) = db.subscription_health().recovered(name) {
        tracing::info!(
            subscription = name,
            attempts = problem.attempts,
            "subscription recovered"
        );
    }
    if taken.events > 0 {
        tracing::debug!(subscription = name, events = taken.events, "handled");
    }
    if let (Some(reached), Some(progress)) = (taken.reached, &subscription.progress) {
        progress.send_if_modified(|at| {
            let moved = reached > *at;
            *at = (*at).max(reached);
            moved
        });
    }
}

/// On Postgres, tells the other instances when this one appends events and forwards what
/// they tell to this process's subscribers, over `NOTIFY ferry_events`. Subscribers also
/// poll, so a lost notification only delays them.
///
/// The notification is sent after the append, in a statement of its own, and one stands for
/// every append made while the last was sent or within 5 ms of it. It is not sent from the appending transaction
/// (a trigger did that once): Postgres serialises the commits of notifying transactions
/// under one lock held through the commit's WAL flush, so every command waited for every
/// other's flush instead of sharing one.
pub fn spawn_notifications(db: &Database, shutdown: watch::Receiver<bool>) {
    let Pool::Postgres(pool) = db.pool().clone() else {
        return;
    };
    // Lets the listener skip this instance's own notifications.
    let token = Uuid::new_v4().simple().to_string();
    tokio::spawn(notify_others(
        db.subscribe_appends(),
        pool.clone(),
        token.clone(),
        shutdown.clone(),
    ));
    tokio::spawn(listen_to_others(db.clone(), pool, token, shutdown));
}

async fn notify_others(
    mut appends: watch::Receiver<u64>,
    pool: sqlx::PgPool,
    token: String,
    mut shutdown: watch::Receiver<bool>,
) {
    // At most one notification per this time: a burst of appends costs one statement.
    const LINGER: Duration = Duration::from_millis(5);
    let mut last = tokio::time::Instant::now();
    loop {
        tokio::select! {
            changed = appends.changed() => if changed.is_err() { return },
            _ = shutdown.changed() => return,
        }
        tokio::select! {
            _ = tokio::time::sleep_until(last + LINGER) => {}
            _ = shutdown.changed() => return,
        }
        // Appends made during the pause are told by this notification.
        appends.borrow_and_update();
        last = tokio::time::Instant::now();
        if let Err(error) = sqlx::query("SELECT pg_notify('ferry_events', $1)")
            .bind(&token)
            .execute(&pool)
            .await
        {
            tracing::warn!(%error, "cannot notify other instances of new events; they poll meanwhile");
        }
    }
}

async fn listen_to_others(
    db: Database,
    pool: sqlx::PgPool,
    token: String,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let mut listener = match sqlx::postgres::PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(error) => {
                tracing::warn!(%error, "cannot LISTEN for events; polling only");
                tokio::time::sleep(Duration::from_secs(5)).await;
                continue;
            }
        };
        if let Err(error) = listener.listen("ferry_events").await {
            tracing::warn!(%error, "LISTEN ferry_events failed; polling only");
            tokio::time::sleep(Duration::from_secs(5)).await;
            continue;
        }
        loop {
            tokio::select! {
                n = listener.recv() => match n {
                    Ok(n) if n.payload() == token => {}
                    Ok(_) => db.wake_subscribers(),
                    Err(error) => {
                        tracing::warn!(%error, "event notifications interrupted");
                        break;
                    }
                },
                _ = shutdown.changed() => return,
            }
        }
    }
}

/// Converts a store error into the error type used at start-up.
impl From<HandlerError> for DatabaseError {
    fn from(e: HandlerError) -> Self {
        match e {
            HandlerError::Sql(e) => DatabaseError::Sql(e),
            other => DatabaseError::Sql(sqlx::Error::Protocol(other.to_string())),
        }
    }
}
