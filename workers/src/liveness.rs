//! Whether the owner of a running apply can still be running it.
//!
//! A lapsed lease alone is not proof that an apply stopped: the owner may be alive with a
//! store it cannot reach, or with a clock that disagrees with the recoverer's. Recovery
//! therefore reports an interrupted apply only when its owner is **known gone**:
//!
//! * **Postgres** (several instances): right after claiming an apply, the owner takes a
//!   session advisory lock keyed by the claim's token (`hashtextextended('ferry:apply:' ||
//!   token, 0)`) on a connection of its own, outside the pool, and keeps it until the
//!   runner's future is dropped. A process that dies loses its connection and with it the
//!   lock. The owner also confirms the lock with each lease renewal (re-taking it on a new
//!   connection if its connection broke) and stops its runner when the lock cannot be
//!   confirmed for as long as the self-fencing margin (see `Workers` in the crate root).
//!   Another instance treats the owner as gone only when the lease has lapsed by its own
//!   clock for longer than the grace period (`Settings::recovery_grace`, which covers clock
//!   skew and the owner's time to stop) **and** the lock is free (probed with
//!   `pg_try_advisory_lock`, released at once).
//! * **SQLite** (one node, one process per data dir): claims live in this process's
//!   registry from just before the claim is written until the step's future is dropped. A
//!   running apply whose token is not registered was claimed by a previous process of this
//!   data dir (or by a step of this one that stopped its runner): its owner is gone, with
//!   no lease to wait for.

use crate::queue::WorkItem;
use ferry_store::database::Pool;
use ferry_store::Database;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};
use sqlx::Connection;
use std::collections::HashSet;
use std::sync::{LazyLock, Mutex};

/// The claims of this process (SQLite's proof of life).
static LIVE: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(Default::default);

/// The advisory lock key of a claim token (one SQL expression for owner and prober).
const KEY: &str = "hashtextextended('ferry:apply:' || $1, 0)";

fn live() -> std::sync::MutexGuard<'static, HashSet<String>> {
    // The set stays consistent even if a holder panicked (inserts and removes only).
    LIVE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Failures to take, confirm or probe a liveness lock.
#[derive(Debug, thiserror::Error)]
pub enum LivenessError {
    /// The database failed.
    #[error("liveness lock: store error: {0}")]
    Store(#[from] sqlx::Error),
    /// The lock is held by someone else (only a recoverer's short probe, or a stale owner).
    #[error("liveness lock of claim {0} is held by another session")]
    Taken(String),
}

/// How this store proves an owner alive.
#[derive(Debug, Clone)]
pub(crate) enum Liveness {
    /// Advisory locks on connections of their own.
    Postgres(PgPool),
    /// The process registry.
    Sqlite,
}

impl Liveness {
    pub(crate) fn of(db: &Database) -> Self {
        match db.pool() {
            Pool::Postgres(pool) => Self::Postgres(pool.clone()),
            Pool::Sqlite(_) => Self::Sqlite,
        }
    }

    /// A life for the claim about to be made with `token`; on SQLite it is registered now,
    /// before the claim is written, so no recoverer can see the claim without it.
    pub(crate) fn reserve(&self, token: &str) -> Life {
        match self {
            Self::Postgres(pool) => Life {
                token: token.to_string(),
                kind: Kind::Postgres(Box::new(Lock {
                    options: pool.connect_options().as_ref().clone(),
                    conn: None,
                    wanted: false,
                })),
            },
            Self::Sqlite => {
                live().insert(token.to_string());
                Life {
                    token: token.to_string(),
                    kind: Kind::Sqlite,
                }
            }
        }
    }

    /// True when the owner of the running apply `item` cannot still be running it (see the
    /// module doc). `now_ms` is the recoverer's clock.
    pub(crate) async fn owner_gone(
        &self,
        item: &WorkItem,
        now_ms: i64,
        grace_ms: i64,
    ) -> Result<bool, LivenessError> {
        match self {
            Self::Sqlite => Ok(!live().contains(&item.claim_token)),
            Self::Postgres(pool) => {
                if item.lease_until.saturating_add(grace_ms) >= now_ms {
                    return Ok(false);
                }
                let sql = format!(
                    "SELECT CASE WHEN pg_try_advisory_lock({KEY}) THEN pg_advisory_unlock({KEY}) ELSE false END"
                );
                let free: bool = sqlx::query_scalar(&sql)
                    .bind(&item.claim_token)
                    .fetch_one(pool)
                    .await?;
                Ok(free)
            }
        }
    }
}

enum Kind {
    Postgres(Box<Lock>),
    Sqlite,
}

/// A Postgres owner's advisory lock.
struct Lock {
    options: PgConnectOptions,
    /// The connection holding the lock, once taken.
    conn: Option<PgConnection>,
    /// Whether the lock is to be held (applies only).
    wanted: bool,
}

/// An owner's proof of life for one claim; released when dropped (a Postgres lock
/// connection dropped is closed, which ends its session and frees the lock).
pub(crate) struct Life {
    token: String,
    kind: Kind,
}

impl Life {
    /// Takes the proof of life of a claimed apply: on Postgres the advisory lock, on a new
    /// connection. Nothing to do on SQLite (registered before the claim).
    pub(crate) async fn hold(&mut self) -> Result<(), LivenessError> {
        let Kind::Postgres(lock) = &mut self.kind else {
            return Ok(());
        };
        let Lock {
            options,
            conn,
            wanted,
        } = lock.as_mut();
        *wanted = true;
        let mut fresh = PgConnection::connect_with(options).await?;
        let got: bool = sqlx::query_scalar(&format!("SELECT pg_try_advisory_lock({KEY})"))
            .bind(&self.token)
            .fetch_one(&mut fresh)
            .await?;
        if !got {
            return Err(LivenessError::Taken(self.token.clone()));
        }
        *conn = Some(fresh);
        Ok(())
    }

    /// Confirms the proof of life still holds; on Postgres, a broken lock connection is
    /// replaced and the lock taken again. Nothing to confirm where nothing was held.
    pub(crate) async fn confirm(&mut self) -> Result<(), LivenessError> {
        let Kind::Postgres(lock) = &mut self.kind else {
            return Ok(());
        };
        let Lock { conn, wanted, .. } = lock.as_mut();
        if !*wanted {
            return Ok(());
        }
        let Some(c) = conn.as_mut() else {
            return self.hold().await;
        };
        // The lock lives as long as the session: a working connection still holds it.
        match sqlx::query("SELECT 1").execute(&mut *c).await {
            Ok(_) => Ok(()),
            Err(error) => {
                tracing::warn!(%error, "lost the apply's liveness lock connection; taking the lock again");
                *conn = None;
                self.hold().await
            }
        }
    }

    /// Gives the proof of life up.
    pub(crate) async fn release(mut self) {
        if let Kind::Postgres(lock) = &mut self.kind {
            if let Some(c) = lock.conn.take() {
                if let Err(error) = c.close().await {
                    tracing::debug!(%error, "closing the liveness lock connection");
                }
            }
        }
    }
}

impl Drop for Life {
    fn drop(&mut self) {
        if matches!(self.kind, Kind::Sqlite) {
            live().remove(&self.token);
        }
    }
}
