//! The durable work queue: one row per (item, step), inserted by the enqueuer subscription in
//! the same transaction as its checkpoint, and claimed by workers with a lease. A step is
//! never run by two workers at once, and at most one apply runs per environment.
//!
//! **Fencing.** Every claim writes a fresh `claim_token` into the row. Every later write of
//! the item (renew, done, failed, retry, storing a result) is conditioned on that token and
//! on `status = 'running'`; a write that changes no row is [`QueueError::ClaimLost`]: the
//! item was taken over (by recovery) and the writer must not touch it again. Recovery
//! settles an item with the token it read, so two recoverers never both settle one item.
//!
//! **Results.** When an apply's runner returns, its result is stored on the item (column
//! `result`, a [`RunnerResult`] document) before the run's outcome is recorded; a later
//! claim of the item finds it and records it without running the runner again. Storing a
//! successful result also records the environment's last apply, in the same transaction,
//! so a stale plan is recognised even while the outcome is still being recorded. An
//! environment whose apply has a stored but unrecorded result (the item is back to
//! `pending` after a store error) does not let another apply be claimed.

use crate::clock::{ms, Clock, SystemClock};
use chrono::Utc;
use ferry_domain::receipts::ApplyReceipt;
use ferry_store::stream::{Param, Tx};
use ferry_store::{on_pool, Database};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;

/// What kind of work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Plan a requested run (`provisioningRunId + plan`).
    Plan,
    /// Apply an authorised run (`provisioningRunId + apply`).
    Apply,
    /// Declare and plan a new environment's baseline.
    Baseline,
    /// Reject a run whose approval was not decided in time.
    Expiry,
}

impl Step {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plan => "plan",
            Self::Apply => "apply",
            Self::Baseline => "baseline",
            Self::Expiry => "expiry",
        }
    }
    fn parse(s: &str) -> Option<Self> {
        match s {
            "plan" => Some(Self::Plan),
            "apply" => Some(Self::Apply),
            "baseline" => Some(Self::Baseline),
            "expiry" => Some(Self::Expiry),
            _ => None,
        }
    }
}

/// A claimed (or, for recovery, a running) item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkItem {
    /// The run id (or environment aggregate id for a baseline).
    pub item_id: String,
    /// The step.
    pub step: Step,
    /// The tenant.
    pub tenant_id: String,
    /// `tenant/environment`.
    pub environment_key: String,
    /// How many times it was claimed, this time included.
    pub attempts: i64,
    /// The correlation id of the event that caused it.
    pub correlation_id: Option<String>,
    /// The event that caused it.
    pub causation_id: Option<String>,
    /// The claim's fencing token: every write of the item must carry it.
    pub claim_token: String,
    /// When the lease ends, in ms (as the claimer's clock saw it).
    pub lease_until: i64,
}

/// What the runner of an apply produced, stored on the item before the outcome is recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunnerResult {
    /// The apply receipt: outputs, duration, result, runner version, failing resource.
    pub receipt: ApplyReceipt,
    /// Why it failed (redacted), when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Where the (redacted) apply log was stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logs_ref: Option<String>,
}

/// Failures of the queue.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// The store failed.
    #[error("work queue store error: {0}")]
    Store(#[from] sqlx::Error),
    /// The write found the item no longer claimed with this token and running: another
    /// instance or recovery took it over. Nothing was written.
    #[error("lost the claim on {step} of {item_id}: the item was taken over, nothing written")]
    ClaimLost {
        /// The item.
        item_id: String,
        /// The step.
        step: &'static str,
    },
    /// A stored runner result could not be written or read as JSON.
    #[error("the runner result of {item_id} cannot be stored or read")]
    Result {
        /// The item.
        item_id: String,
        /// Why.
        source: serde_json::Error,
    },
}

/// Milliseconds since the epoch.
pub fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

/// Inserts an item unless it exists (the idempotency key is the primary key).
#[allow(clippy::too_many_arguments)]
pub async fn enqueue(
    tx: &mut Tx,
    item_id: &str,
    step: Step,
    tenant: &str,
    environment_key: &str,
    not_before_ms: i64,
    correlation_id: Option<String>,
    causation_id: Option<String>,
) -> Result<(), sqlx::Error> {
    let now = now_ms();
    tx.execute(
        "INSERT INTO work_items (item_id, step, tenant_id, environment_key, not_before, correlation_id, causation_id, created_at, updated_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8) ON CONFLICT (item_id, step) DO NOTHING",
        &[
            Param::Text(Some(item_id.to_string())),
            Param::Text(Some(step.as_str().to_string())),
            Param::Text(Some(tenant.to_string())),
            Param::Text(Some(environment_key.to_string())),
            Param::Int(Some(not_before_ms)),
            Param::Text(correlation_id),
            Param::Text(causation_id),
            Param::Int(Some(now)),
        ],
    )
    .await?;
    Ok(())
}

/// The queue over a database.
#[derive(Clone)]
pub struct Queue {
    db: Database,
    instance: String,
    clock: Arc<dyn Clock>,
}

/// The columns every item query selects, in [`DbRow`] order.
const COLUMNS: &str = "item_id, step, tenant_id, environment_key, attempts, correlation_id, causation_id, claim_token, lease_until";

/// A work item row as selected (see [`COLUMNS`]).
type DbRow = (
    String,
    String,
    String,
    String,
    i32,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<i64>,
);

fn item_of(r: DbRow) -> Option<WorkItem> {
    Some(WorkItem {
        step: Step::parse(&r.1)?,
        item_id: r.0,
        tenant_id: r.2,
        environment_key: r.3,
        attempts: i64::from(r.4),
        correlation_id: r.5,
        causation_id: r.6,
        // A running row always has both (claims set them; migration 0005 gave old rows a
        // token); a missing one makes the item's fenced writes fail, never succeed.
        claim_token: r.7.unwrap_or_default(),
        lease_until: r.8.unwrap_or(0),
    })
}

impl Queue {
    /// A queue on the system clock; `instance` names this process in `claimed_by`.
    pub fn new(db: Database, instance: String) -> Self {
        Self::with_clock(db, instance, Arc::new(SystemClock))
    }

    /// A queue whose leases and times follow `clock`.
    pub fn with_clock(db: Database, instance: String, clock: Arc<dyn Clock>) -> Self {
        Self {
            db,
            instance,
            clock,
        }
    }

    /// The queue's clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Claims a due item with the fresh fencing token `token`, skipping applies for
    /// environments that already have one running (or one whose stored result is not yet
    /// recorded). `None` when nothing is due.
    ///
    /// The slots are shared fairly between tenants: the item claimed is the oldest of a
    /// tenant with the fewest items running, so a tenant's backlog (however many plans it
    /// asks for, however long each takes) never keeps another tenant's first item waiting
    /// for more than the next free slot.
    pub async fn claim(
        &self,
        token: &str,
        lease: Duration,
    ) -> Result<Option<WorkItem>, QueueError> {
        let now = self.clock.now_ms();
        let sql = format!(
            "UPDATE work_items SET status = 'running', attempts = attempts + 1, claimed_by = $1,
                    claim_token = $4, lease_until = $2, updated_at = $3
              WHERE status = 'pending' AND (item_id, step) = (
                    SELECT w.item_id, w.step FROM work_items w
                      LEFT JOIN (SELECT tenant_id, COUNT(*) AS n FROM work_items
                                  WHERE status = 'running' GROUP BY tenant_id) busy
                        ON busy.tenant_id = w.tenant_id
                     WHERE w.status = 'pending' AND w.not_before <= $3
                       AND NOT (w.step = 'apply' AND EXISTS (
                           SELECT 1 FROM work_items r
                            WHERE r.environment_key = w.environment_key AND r.step = 'apply'
                              AND r.item_id <> w.item_id
                              AND (r.status = 'running' OR (r.status = 'pending' AND r.result IS NOT NULL))))
                     ORDER BY COALESCE(busy.n, 0), w.not_before, w.created_at LIMIT 1)
          RETURNING {COLUMNS}"
        );
        let sql = self.db.sql(&sql);
        let lease_until = now.saturating_add(ms(lease));
        let result: Result<Option<DbRow>, sqlx::Error> = on_pool!(self.db, pool => sqlx::query_as(&sql)
            .bind(&self.instance).bind(lease_until).bind(now).bind(token)
            .fetch_optional(pool).await);
        match result {
            Ok(row) => Ok(row.and_then(item_of)),
            // Another instance started an apply in the same environment first.
            Err(sqlx::Error::Database(e))
                if e.kind() == sqlx::error::ErrorKind::UniqueViolation =>
            {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    fn lost(item: &WorkItem) -> QueueError {
        QueueError::ClaimLost {
            item_id: item.item_id.clone(),
            step: item.step.as_str(),
        }
    }

    /// Extends the lease of the item claimed as `item`; returns the new end of the lease.
    pub async fn renew(&self, item: &WorkItem, lease: Duration) -> Result<i64, QueueError> {
        let sql = self.db.sql(
            "UPDATE work_items SET lease_until = $4
              WHERE item_id = $1 AND step = $2 AND claim_token = $3 AND status = 'running'",
        );
        let until = self.clock.now_ms().saturating_add(ms(lease));
        let n = on_pool!(self.db, pool => sqlx::query(&sql).bind(&item.item_id).bind(item.step.as_str())
            .bind(&item.claim_token).bind(until)
            .execute(pool).await?.rows_affected());
        if n == 0 {
            return Err(Self::lost(item));
        }
        Ok(until)
    }

    async fn finish(
        &self,
        item: &WorkItem,
        status: &str,
        error: Option<&str>,
        not_before: Option<i64>,
    ) -> Result<(), QueueError> {
        let sql = self.db.sql(
            "UPDATE work_items SET status = $4, last_error = $5, lease_until = NULL,
                    not_before = COALESCE($6, not_before), updated_at = $7
              WHERE item_id = $1 AND step = $2 AND claim_token = $3 AND status = 'running'",
        );
        let n = on_pool!(self.db, pool => sqlx::query(&sql).bind(&item.item_id).bind(item.step.as_str())
            .bind(&item.claim_token).bind(status).bind(error).bind(not_before).bind(self.clock.now_ms())
            .execute(pool).await?.rows_affected());
        if n == 0 {
            return Err(Self::lost(item));
        }
        Ok(())
    }

    /// The step is done.
    pub async fn done(&self, item: &WorkItem) -> Result<(), QueueError> {
        self.finish(item, "done", None, None).await
    }

    /// The step failed for good.
    pub async fn failed(&self, item: &WorkItem, reason: &str) -> Result<(), QueueError> {
        self.finish(item, "failed", Some(reason), None).await
    }

    /// Try again after `delay`.
    pub async fn retry(
        &self,
        item: &WorkItem,
        reason: &str,
        delay: Duration,
    ) -> Result<(), QueueError> {
        let not_before = self.clock.now_ms().saturating_add(ms(delay));
        self.finish(item, "pending", Some(reason), Some(not_before))
            .await
    }

    /// Stores what the apply's runner produced on the item (see the module doc); a
    /// successful result also becomes the environment's last apply, in one transaction.
    pub async fn store_result(
        &self,
        item: &WorkItem,
        result: &RunnerResult,
    ) -> Result<(), QueueError> {
        let json = serde_json::to_string(result).map_err(|source| QueueError::Result {
            item_id: item.item_id.clone(),
            source,
        })?;
        let now = self.clock.now_ms();
        let mut tx = Tx::begin(&self.db).await?;
        let n = tx
            .execute(
                "UPDATE work_items SET result = $4, updated_at = $5
                  WHERE item_id = $1 AND step = $2 AND claim_token = $3 AND status = 'running'",
                &[
                    Param::Text(Some(item.item_id.clone())),
                    Param::Text(Some(item.step.as_str().to_string())),
                    Param::Text(Some(item.claim_token.clone())),
                    Param::Text(Some(json)),
                    Param::Int(Some(now)),
                ],
            )
            .await?;
        if n == 0 {
            return Err(Self::lost(item));
        }
        if result.receipt.result == ferry_domain::receipts::ApplyResult::Succeeded {
            tx.execute(
                "INSERT INTO environment_applies (environment_key, run_id, applied_at) VALUES ($1, $2, $3)
                 ON CONFLICT (environment_key) DO UPDATE SET run_id = excluded.run_id, applied_at = excluded.applied_at",
                &[
                    Param::Text(Some(item.environment_key.clone())),
                    Param::Text(Some(item.item_id.clone())),
                    Param::Int(Some(now)),
                ],
            )
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The runner result stored on the item, if its runner already ran.
    pub async fn stored_result(&self, item: &WorkItem) -> Result<Option<RunnerResult>, QueueError> {
        let sql = self
            .db
            .sql("SELECT result FROM work_items WHERE item_id = $1 AND step = $2");
        let text: Option<Option<String>> = on_pool!(self.db, pool => sqlx::query_scalar(&sql)
            .bind(&item.item_id).bind(item.step.as_str()).fetch_optional(pool).await?);
        text.flatten()
            .map(|t| serde_json::from_str(&t))
            .transpose()
            .map_err(|source| QueueError::Result {
                item_id: item.item_id.clone(),
                source,
            })
    }

    /// Every running item (for recovery, which decides which owners are gone).
    pub async fn running(&self) -> Result<Vec<WorkItem>, QueueError> {
        let sql = format!("SELECT {COLUMNS} FROM work_items WHERE status = 'running'");
        let rows: Vec<DbRow> =
            on_pool!(self.db, pool => sqlx::query_as(&sql).fetch_all(pool).await?);
        Ok(rows.into_iter().filter_map(item_of).collect())
    }

    /// When the item's step last finished (e.g. when the plan was made), in ms.
    pub async fn finished_at(&self, item_id: &str, step: Step) -> Result<Option<i64>, QueueError> {
        let sql = self.db.sql(
            "SELECT updated_at FROM work_items WHERE item_id = $1 AND step = $2 AND status = 'done'",
        );
        Ok(
            on_pool!(self.db, pool => sqlx::query_scalar(&sql).bind(item_id).bind(step.as_str())
            .fetch_optional(pool).await?),
        )
    }

    /// The last successful apply in an environment: (run id, when in ms).
    pub async fn last_apply(
        &self,
        environment_key: &str,
    ) -> Result<Option<(String, i64)>, QueueError> {
        let sql = self
            .db
            .sql("SELECT run_id, applied_at FROM environment_applies WHERE environment_key = $1");
        Ok(
            on_pool!(self.db, pool => sqlx::query_as(&sql).bind(environment_key).fetch_optional(pool).await?),
        )
    }

    /// Status of one item (for tests and diagnostics).
    pub async fn status(
        &self,
        item_id: &str,
        step: Step,
    ) -> Result<Option<(String, Option<String>, i64)>, QueueError> {
        let sql = self.db.sql(
            "SELECT status, last_error, attempts FROM work_items WHERE item_id = $1 AND step = $2",
        );
        let row: Option<(String, Option<String>, i32)> = on_pool!(self.db, pool => sqlx::query_as(&sql).bind(item_id).bind(step.as_str()).fetch_optional(pool).await?);
        Ok(row.map(|(s, e, a)| (s, e, i64::from(a))))
    }
}
