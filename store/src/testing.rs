//! Test helpers: a fresh, migrated database per test on either engine.
//!
//! Postgres tests need `DATABASE_URL` (an account that may create databases); each test gets
//! its own database, dropped when the guard goes out of scope.

use crate::database::{Backend, Database};

/// A database that exists for one test.
pub struct TestDatabase {
    /// The migrated store.
    pub db: Database,
    /// The URL (Postgres) or file path (SQLite) of the store.
    pub location: String,
    admin_url: Option<String>,
    name: String,
    _dir: Option<tempfile::TempDir>,
}

/// Makes the rest of `tx`'s transaction plan as for a large table: the sequential and
/// bitmap scans a small test table invites are forbidden, so that a test can assert which
/// index a statement reads (`EXPLAIN`).
pub async fn plan_as_for_large_tables(tx: &mut sqlx::PgConnection) {
    for setting in ["enable_seqscan", "enable_bitmapscan"] {
        sqlx::query(&format!("SET LOCAL {setting} = off"))
            .execute(&mut *tx)
            .await
            .expect("a planner setting");
    }
}

/// The server URL tests use for Postgres.
pub fn postgres_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_string())
}

fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let base = match base.rfind('/') {
        Some(i) if base[..i].contains("://") && i > base.find("://").unwrap_or(0) + 2 => &base[..i],
        _ => base,
    };
    match query {
        Some(q) => format!("{base}/{name}?{q}"),
        None => format!("{base}/{name}"),
    }
}

impl TestDatabase {
    /// A fresh migrated database on `backend`.
    pub async fn new(backend: Backend) -> Self {
        match backend {
            Backend::Sqlite => {
                let dir = tempfile::tempdir().expect("temp dir");
                let db = Database::open_sqlite(dir.path())
                    .await
                    .expect("open sqlite");
                db.migrate().await.expect("migrate sqlite");
                Self {
                    db,
                    location: dir.path().join("ferry.db").display().to_string(),
                    admin_url: None,
                    name: String::new(),
                    _dir: Some(dir),
                }
            }
            Backend::Postgres => {
                let admin_url = postgres_url();
                let name = format!("ferry_test_{}", uuid::Uuid::new_v4().simple());
                let admin = Database::connect_postgres(&admin_url)
                    .await
                    .expect("connect postgres");
                crate::on_pool!(admin, pool => sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(pool).await.expect("create test database").rows_affected());
                admin.close().await;
                let url = with_database(&admin_url, &name);
                let db = Database::connect_postgres(&url)
                    .await
                    .expect("connect test database");
                db.migrate().await.expect("migrate postgres");
                Self {
                    db,
                    location: url,
                    admin_url: Some(admin_url),
                    name,
                    _dir: None,
                }
            }
        }
    }

    /// Closes the pool and drops the Postgres database.
    pub async fn cleanup(mut self) {
        self.db.close().await;
        if let Some(admin_url) = self.admin_url.take() {
            drop_database(&admin_url, &self.name).await;
        }
    }
}

/// A test that panicked before [`TestDatabase::cleanup`] still drops its database: from a
/// thread of its own, since Drop cannot await and the test's runtime may be gone.
impl Drop for TestDatabase {
    fn drop(&mut self) {
        let Some(admin_url) = self.admin_url.take() else {
            return;
        };
        let name = std::mem::take(&mut self.name);
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(runtime) = runtime {
                runtime.block_on(drop_database(&admin_url, &name));
            }
        })
        .join();
        if dropped.is_err() {
            tracing::warn!("could not drop a test database");
        }
    }
}

/// `DROP DATABASE … WITH (FORCE)`: ends the test's own connections too.
async fn drop_database(admin_url: &str, name: &str) {
    if let Ok(admin) = Database::connect_postgres(admin_url).await {
        let _ = crate::on_pool!(admin, pool => sqlx::query(&format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )).execute(pool).await.map(|r| r.rows_affected()));
        admin.close().await;
    }
}

/// Polls `check` until it returns `Some`, for at most ten seconds. The global stream on
/// Postgres holds an event back while any older transaction on the server still runs
/// (other tests included), so readers in tests wait for a condition, not a fixed time.
pub async fn eventually<T, F, Fut>(what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    eventually_within(what, 10, check).await
}

/// As [`eventually_within`], for checks that can say what they saw: `Err(seen)` keeps
/// polling, and the timeout names the last thing seen. The one polling loop of the tests.
pub async fn eventually_showing<T, F, Fut>(what: &str, secs: u64, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        match check().await {
            Ok(value) => return value,
            Err(seen) => assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}; last seen: {seen}"
            ),
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// As [`eventually`], for at most `secs` seconds (e.g. for a NATS server to restart): the
/// one polling helper every test uses.
pub async fn eventually_within<T, F, Fut>(what: &str, secs: u64, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    eventually_showing(what, secs, || {
        let attempt = check();
        async move { attempt.await.ok_or_else(|| "not yet".to_string()) }
    })
    .await
}

/// Declares one test per engine: `async fn name(backend) { … }` becomes the tests
/// `name::postgres` and `name::sqlite`, so that a failure on one engine never hides the
/// other's (a loop over both would stop at the first).
#[macro_export]
macro_rules! test_on_both_engines {
    ($(#[$meta:meta])* async fn $name:ident($backend:ident) $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $(#[$meta])*
            async fn run($backend: $crate::Backend) $body
            #[tokio::test]
            async fn postgres() {
                run($crate::Backend::Postgres).await
            }
            #[tokio::test]
            async fn sqlite() {
                run($crate::Backend::Sqlite).await
            }
        }
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn database_name_is_replaced() {
        assert_eq!(
            super::with_database("postgres://u@h:5432/postgres", "x"),
            "postgres://u@h:5432/x"
        );
        assert_eq!(
            super::with_database("postgres://u@h/postgres?sslmode=disable", "x"),
            "postgres://u@h/x?sslmode=disable"
        );
    }
}
