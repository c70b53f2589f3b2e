//! Connecting to the store, running migrations, and the small amount of SQL dialect
//! difference between Postgres and SQLite.

use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use std::borrow::Cow;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Which engine holds the events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// PostgreSQL (`DATABASE_URL`).
    Postgres,
    /// SQLite (the embedded default).
    Sqlite,
}

/// Failures to open or migrate the store.
#[derive(Debug, thiserror::Error)]
pub enum DatabaseError {
    /// The database URL or file could not be opened.
    #[error("cannot connect to {target}")]
    Connect {
        /// What we tried to open (password removed).
        target: String,
        /// Why it failed.
        source: sqlx::Error,
    },
    /// A migration failed.
    #[error("migration failed")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The data directory could not be created.
    #[error("cannot create data directory {path}")]
    DataDir {
        /// The directory.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Any other database error.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

/// A pool on one of the two engines, plus the in-process wake-up signal for subscribers.
#[derive(Clone, Debug)]
pub enum Pool {
    /// Postgres.
    Postgres(PgPool),
    /// SQLite.
    Sqlite(SqlitePool),
}

/// The store: a pool, a signal raised whenever this process commits events, and the
/// health of the subscriptions running in this process.
#[derive(Clone, Debug)]
pub struct Database {
    pool: Pool,
    committed: Arc<watch::Sender<u64>>,
    /// Moved only by this process's own appends: what other instances are told of.
    appended: Arc<watch::Sender<u64>>,
    health: Arc<crate::stream::SubscriptionHealth>,
    items: Arc<crate::items::ItemHealth>,
    caches: Arc<crate::cache::Caches>,
    /// Postgres: writes the events of concurrent commands in groups.
    appender: Option<Arc<crate::group::GroupAppender>>,
}

/// How Ferry's connections behave when the store is slow or busy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreOptions {
    /// How long a request waits for a free connection before the store counts as
    /// unavailable (503 with `Retry-After`).
    pub acquire_timeout: Duration,
    /// SQLite: how long a writer waits for the write lock before giving up.
    pub sqlite_busy_timeout: Duration,
    /// Postgres: sessions of Ferry's that sit idle inside a transaction longer than this are
    /// ended by the server, so that one forgotten transaction cannot hold back every
    /// subscription of the global stream.
    pub idle_in_transaction_timeout: Duration,
    /// How many events' worth of aggregates each aggregate type keeps in this process, so
    /// that a command reads only the events after the cached ones; 0 turns the cache off.
    pub aggregate_cache_events: usize,
}

/// The default [`StoreOptions::aggregate_cache_events`]. Generous on purpose: when the
/// aggregates in use hold more events than the budget, least-recently-used eviction under a
/// round-robin load misses on nearly every command (the crash soak's 48 specifications with
/// 121,542 events did so at a budget of 100,000).
pub const DEFAULT_AGGREGATE_CACHE_EVENTS: usize = 1_000_000;

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            acquire_timeout: Duration::from_secs(10),
            sqlite_busy_timeout: Duration::from_secs(15),
            idle_in_transaction_timeout: Duration::from_secs(60),
            aggregate_cache_events: DEFAULT_AGGREGATE_CACHE_EVENTS,
        }
    }
}

/// True when `error` says the store cannot serve the request right now (unreachable,
/// overloaded, locked, shutting down) rather than that the request or Ferry is wrong: such
/// errors are answered 503 with `Retry-After` and retried by workers.
pub fn is_unavailable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => {
            let code = db.code();
            let code = code.as_deref().unwrap_or_default();
            // SQLite: BUSY (5) and LOCKED (6), with their extended codes (x + 256·n).
            let sqlite_busy = code.parse::<i64>().is_ok_and(|c| matches!(c & 0xff, 5 | 6));
            // Postgres: connection exceptions (08), insufficient resources (53), operator
            // intervention (57: shutdown, cannot connect now), lock not available (55P03).
            let postgres = code.len() == 5
                && (code.starts_with("08")
                    || code.starts_with("53")
                    || code.starts_with("57")
                    || code == "55P03");
            sqlite_busy || postgres
        }
        _ => false,
    }
}

/// Whether the statement broke a unique constraint (on the events table: another writer
/// stored the aggregate's sequence first).
pub fn is_unique_violation(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .is_some_and(|e| e.kind() == sqlx::error::ErrorKind::UniqueViolation)
}

/// Whether Postgres rolled the statement's transaction back so that another could go on
/// (a deadlock, 40P01, or a serialization failure, 40001): nothing of it was stored, and
/// running it again may succeed.
pub fn is_rolled_back_for_another(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| code == "40P01" || code == "40001")
}

/// Removes the password from a URL before it is shown.
pub fn redact_url(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('@') {
            Some((userinfo, host)) => {
                let user = userinfo.split(':').next().unwrap_or_default();
                format!("{scheme}://{user}:***@{host}")
            }
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

impl Database {
    /// Connects to Postgres at `url` with the default [`StoreOptions`].
    pub async fn connect_postgres(url: &str) -> Result<Self, DatabaseError> {
        Self::connect_postgres_with(url, &StoreOptions::default()).await
    }

    /// Connects to Postgres at `url`.
    pub async fn connect_postgres_with(
        url: &str,
        options: &StoreOptions,
    ) -> Result<Self, DatabaseError> {
        let connect_err = |source| DatabaseError::Connect {
            target: redact_url(url),
            source,
        };
        let idle_ms = options.idle_in_transaction_timeout.as_millis().to_string();
        let connect = sqlx::postgres::PgConnectOptions::from_str(url)
            .map_err(connect_err)?
            .options([("idle_in_transaction_session_timeout", idle_ms.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(options.acquire_timeout)
            .connect_with(connect)
            .await
            .map_err(connect_err)?;
        Ok(Self::from_pool(Pool::Postgres(pool))
            .with_aggregate_cache(options.aggregate_cache_events))
    }

    /// Opens (creating if needed) `ferry.db` in `data_dir`, in WAL mode.
    pub async fn open_sqlite(data_dir: &Path) -> Result<Self, DatabaseError> {
        std::fs::create_dir_all(data_dir).map_err(|source| DatabaseError::DataDir {
            path: data_dir.display().to_string(),
            source,
        })?;
        Self::open_sqlite_file(&data_dir.join("ferry.db")).await
    }

    /// Opens (creating if needed) an SQLite database file with the default [`StoreOptions`].
    pub async fn open_sqlite_file(path: &Path) -> Result<Self, DatabaseError> {
        Self::open_sqlite_file_with(path, &StoreOptions::default()).await
    }

    /// Opens (creating if needed) `ferry.db` in `data_dir`, in WAL mode, with `options`.
    pub async fn open_sqlite_with(
        data_dir: &Path,
        options: &StoreOptions,
    ) -> Result<Self, DatabaseError> {
        std::fs::create_dir_all(data_dir).map_err(|source| DatabaseError::DataDir {
            path: data_dir.display().to_string(),
            source,
        })?;
        Self::open_sqlite_file_with(&data_dir.join("ferry.db"), options).await
    }

    /// Opens (creating if needed) an SQLite database file.
    pub async fn open_sqlite_file_with(
        path: &Path,
        store: &StoreOptions,
    ) -> Result<Self, DatabaseError> {
        let target = path.display().to_string();
        let options = SqliteConnectOptions::from_str(&format!("sqlite://{target}"))
            .map_err(|source| DatabaseError::Connect {
                target: target.clone(),
                source,
            })?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(store.sqlite_busy_timeout)
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .acquire_timeout(store.acquire_timeout)
            // A future dropped inside sqlx's `begin_with` (a client that leaves while its
            // request waits for the write lock) can hand the connection back still inside
            // its `BEGIN IMMEDIATE`, holding the write lock with no guard to release it.
            // Such a connection is closed (which rolls back) instead of reused. The ping
            // first lets the rollback of a normally dropped transaction finish.
            .after_release(|conn, _| {
                Box::pin(async move {
                    sqlx::Connection::ping(&mut *conn).await?;
                    let depth = <sqlx::sqlite::SqliteTransactionManager as sqlx::TransactionManager>::get_transaction_depth(conn);
                    if depth > 0 {
                        tracing::warn!(depth, "closing a SQLite connection returned inside a transaction");
                    }
                    Ok(depth == 0)
                })
            })
            .connect_with(options)
            .await
            .map_err(|source| DatabaseError::Connect { target, source })?;
        Ok(Self::from_pool(Pool::Sqlite(pool)).with_aggregate_cache(store.aggregate_cache_events))
    }

    /// Wraps an existing pool, with an aggregate cache of the default size of its own (a
    /// second `Database` over the same pool behaves as another process would).
    pub fn from_pool(pool: Pool) -> Self {
        let appender = match &pool {
            Pool::Postgres(pool) => Some(Arc::new(crate::group::GroupAppender::new(pool.clone()))),
            Pool::Sqlite(_) => None,
        };
        Self {
            appender,
            pool,
            committed: Arc::new(watch::channel(0).0),
            appended: Arc::new(watch::channel(0).0),
            health: Arc::default(),
            items: Arc::default(),
            caches: Arc::new(crate::cache::Caches::new(DEFAULT_AGGREGATE_CACHE_EVENTS)),
        }
    }

    /// The same database with a fresh aggregate cache of `events` per aggregate type (0:
    /// none).
    pub fn with_aggregate_cache(mut self, events: usize) -> Self {
        self.caches = Arc::new(crate::cache::Caches::new(events));
        self
    }

    pub(crate) fn caches(&self) -> &crate::cache::Caches {
        &self.caches
    }

    /// Postgres: the group commit that a command's events go through when they are all it
    /// commits. SQLite has one writer at a time, so there is nothing to group.
    pub(crate) fn group_appender(&self) -> Option<&Arc<crate::group::GroupAppender>> {
        self.appender.as_ref()
    }

    /// What the group commit of this process has written (Postgres; `None` on SQLite,
    /// which appends one command at a time).
    pub fn group_stats(&self) -> Option<crate::group::GroupStats> {
        self.appender.as_ref().map(|a| a.stats())
    }

    /// What the subscriptions of this process report about themselves (e.g. stuck on an
    /// event they cannot handle), for readiness and metrics.
    pub fn subscription_health(&self) -> &crate::stream::SubscriptionHealth {
        &self.health
    }

    /// The items of this process's shared loops that keep failing (each retried on its
    /// own, with a growing delay), for the items' views, readiness and metrics.
    pub fn item_health(&self) -> &crate::items::ItemHealth {
        &self.items
    }

    /// Applies the migrations of `migrations/postgres` or `migrations/sqlite`.
    pub async fn migrate(&self) -> Result<(), DatabaseError> {
        match &self.pool {
            Pool::Postgres(pool) => sqlx::migrate!("../migrations/postgres").run(pool).await?,
            Pool::Sqlite(pool) => sqlx::migrate!("../migrations/sqlite").run(pool).await?,
        }
        Ok(())
    }

    /// The engine.
    pub fn backend(&self) -> Backend {
        match self.pool {
            Pool::Postgres(_) => Backend::Postgres,
            Pool::Sqlite(_) => Backend::Sqlite,
        }
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Changes after this process commits events. Subscribers also poll and (on Postgres)
    /// listen for NOTIFY from other instances, so a missed signal only delays them.
    pub fn subscribe_commits(&self) -> watch::Receiver<u64> {
        self.committed.subscribe()
    }

    /// Tells this process's subscribers that it committed events, and (on Postgres, through
    /// the notifier) the other instances' subscribers.
    pub fn signal_commit(&self) {
        self.appended.send_modify(|n| *n = n.wrapping_add(1));
        self.wake_subscribers();
    }

    /// Wakes this process's subscribers (another instance committed events).
    pub fn wake_subscribers(&self) {
        self.committed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Changes after this process appends events (not when another instance does).
    pub fn subscribe_appends(&self) -> watch::Receiver<u64> {
        self.appended.subscribe()
    }

    /// Rewrites `$1`-style placeholders for SQLite (`?1`), so that one SQL text serves both.
    pub fn sql<'a>(&self, text: &'a str) -> Cow<'a, str> {
        sql_for(self.backend(), text)
    }

    /// Runs one statement written with `$n` placeholders on its own (its own transaction);
    /// returns the rows affected.
    pub async fn execute(
        &self,
        sql: &str,
        params: &[crate::stream::Param],
    ) -> Result<u64, sqlx::Error> {
        let sql = self.sql(sql);
        Ok(match &self.pool {
            Pool::Postgres(p) => crate::bind_params!(sqlx::query(&sql), params)
                .execute(p)
                .await?
                .rows_affected(),
            Pool::Sqlite(p) => crate::bind_params!(sqlx::query(&sql), params)
                .execute(p)
                .await?
                .rows_affected(),
        })
    }

    /// As [`crate::stream::Tx::insert_returning_last`], as a statement on its own.
    pub async fn insert_returning_last(
        &self,
        sql: &str,
        params: &[crate::stream::Param],
    ) -> Result<Option<crate::stream::Position>, sqlx::Error> {
        let sql = self.sql(sql);
        let rows: Vec<(i64, i64)> = match &self.pool {
            Pool::Postgres(p) => {
                crate::bind_params!(sqlx::query_as(&sql), params)
                    .fetch_all(p)
                    .await?
            }
            Pool::Sqlite(p) => {
                crate::bind_params!(sqlx::query_as(&sql), params)
                    .fetch_all(p)
                    .await?
            }
        };
        Ok(crate::stream::last_position(rows))
    }

    /// True when the store answers a trivial query.
    pub async fn ping(&self) -> bool {
        match &self.pool {
            Pool::Postgres(p) => sqlx::query("SELECT 1").execute(p).await.is_ok(),
            Pool::Sqlite(p) => sqlx::query("SELECT 1").execute(p).await.is_ok(),
        }
    }

    /// Closes the pool.
    pub async fn close(&self) {
        match &self.pool {
            Pool::Postgres(p) => p.close().await,
            Pool::Sqlite(p) => p.close().await,
        }
    }
}

/// See [`Database::sql`].
pub fn sql_for(backend: Backend, text: &str) -> Cow<'_, str> {
    if backend == Backend::Postgres || !text.contains('$') {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) {
            out.push('?');
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Runs the same block against whichever pool the database has. The block sees `$pool` as a
/// concrete `PgPool` or `SqlitePool`, so sqlx types check for each engine.
#[macro_export]
macro_rules! on_pool {
    ($db:expr, $pool:ident => $body:expr) => {
        match $db.pool() {
            $crate::database::Pool::Postgres($pool) => $body,
            $crate::database::Pool::Sqlite($pool) => $body,
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_rewritten_for_sqlite_only() {
        let q = "SELECT a FROM t WHERE x = $1 AND y = $12 AND z = '$'";
        assert_eq!(sql_for(Backend::Postgres, q), q);
        assert_eq!(
            sql_for(Backend::Sqlite, q),
            "SELECT a FROM t WHERE x = ?1 AND y = ?12 AND z = '$'"
        );
    }

    #[test]
    fn passwords_are_not_shown() {
        assert_eq!(
            redact_url("postgres://ferry:secret@db:5432/ferry"),
            "postgres://ferry:***@db:5432/ferry"
        );
        assert_eq!(redact_url("postgres://db/ferry"), "postgres://db/ferry");
    }
}
