//! The durable work queue: one row per (item, step), inserted by the enqueuer subscription in
//! the same transaction as its checkpoint, and claimed by workers with a lease. A step is
//! never run by two workers at once, and at most one apply runs per environment.

use chrono::Utc;
use ferry_store::stream::{Param, Tx};
use ferry_store::{on_pool, Database};
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

/// A claimed item.
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
}

/// A work item row as selected: item, step, tenant, environment key, attempts, correlation, causation.
type DbRow = (
    String,
    String,
    String,
    String,
    i32,
    Option<String>,
    Option<String>,
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
    })
}

impl Queue {
    /// A queue; `instance` names this process in `claimed_by`.
    pub fn new(db: Database, instance: String) -> Self {
        Self { db, instance }
    }

    /// Claims the oldest due item, skipping applies for environments that already have one
    /// running. `None` when nothing is due.
    pub async fn claim(&self, lease: Duration) -> Result<Option<WorkItem>, sqlx::Error> {
        let now = now_ms();
        let sql = self.db.sql(
            "UPDATE work_items SET status = 'running', attempts = attempts + 1, claimed_by = $1,
                    lease_until = $2, updated_at = $3
              WHERE status = 'pending' AND (item_id, step) = (
                    SELECT w.item_id, w.step FROM work_items w
                     WHERE w.status = 'pending' AND w.not_before <= $3
                       AND NOT (w.step = 'apply' AND EXISTS (
                           SELECT 1 FROM work_items r
                            WHERE r.environment_key = w.environment_key AND r.step = 'apply' AND r.status = 'running'))
                     ORDER BY w.not_before, w.created_at LIMIT 1)
          RETURNING item_id, step, tenant_id, environment_key, attempts, correlation_id, causation_id",
        );
        let lease_until = now + lease.as_millis() as i64;
        let result: Result<Option<DbRow>, sqlx::Error> = on_pool!(self.db, pool => sqlx::query_as(&sql)
            .bind(&self.instance).bind(lease_until).bind(now)
            .fetch_optional(pool).await);
        match result {
            Ok(row) => Ok(row.and_then(item_of)),
            // Another instance started an apply in the same environment first.
            Err(sqlx::Error::Database(e))
                if e.kind() == sqlx::error::ErrorKind::UniqueViolation =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Extends the lease of a running item.
    pub async fn renew(&self, item: &WorkItem, lease: Duration) -> Result<(), sqlx::Error> {
        let sql = self.db.sql(
            "UPDATE work_items SET lease_until = $3 WHERE item_id = $1 AND step = $2 AND status = 'running'",
        );
        let until = now_ms() + lease.as_millis() as i64;
        on_pool!(self.db, pool => sqlx::query(&sql).bind(&item.item_id).bind(item.step.as_str()).bind(until)
            .execute(pool).await?.rows_affected());
        Ok(())
    }

    async fn finish(
        &self,
        item: &WorkItem,
        status: &str,
        error: Option<&str>,
        not_before: Option<i64>,
    ) -> Result<(), sqlx::Error> {
        let sql = self.db.sql(
            "UPDATE work_items SET status = $3, last_error = $4, lease_until = NULL,
                    not_before = COALESCE($5, not_before), updated_at = $6
              WHERE item_id = $1 AND step = $2",
        );
        on_pool!(self.db, pool => sqlx::query(&sql).bind(&item.item_id).bind(item.step.as_str())
            .bind(status).bind(error).bind(not_before).bind(now_ms())
            .execute(pool).await?.rows_affected());
        Ok(())
    }

    /// The step is done.
    pub async fn done(&self, item: &WorkItem) -> Result<(), sqlx::Error> {
        self.finish(item, "done", None, None).await
    }

    /// The step failed for good.
    pub async fn failed(&self, item: &WorkItem, reason: &str) -> Result<(), sqlx::Error> {
        self.finish(item, "failed", Some(reason), None).await
    }

    /// Try again after `delay`.
    pub async fn retry(
        &self,
        item: &WorkItem,
        reason: &str,
        delay: Duration,
    ) -> Result<(), sqlx::Error> {
        self.finish(
            item,
            "pending",
            Some(reason),
            Some(now_ms() + delay.as_millis() as i64),
        )
        .await
    }

    /// Items whose worker stopped without finishing (lease expired).
    pub async fn expired(&self) -> Result<Vec<WorkItem>, sqlx::Error> {
        let sql = self.db.sql(
            "SELECT item_id, step, tenant_id, environment_key, attempts, correlation_id, causation_id
               FROM work_items WHERE status = 'running' AND lease_until < $1",
        );
        let rows: Vec<DbRow> =
            on_pool!(self.db, pool => sqlx::query_as(&sql).bind(now_ms()).fetch_all(pool).await?);
        Ok(rows.into_iter().filter_map(item_of).collect())
    }

    /// When the item's step last finished (e.g. when the plan was made), in ms.
    pub async fn finished_at(&self, item_id: &str, step: Step) -> Result<Option<i64>, sqlx::Error> {
        let sql = self.db.sql(
            "SELECT updated_at FROM work_items WHERE item_id = $1 AND step = $2 AND status = 'done'",
        );
        Ok(
            on_pool!(self.db, pool => sqlx::query_scalar(&sql).bind(item_id).bind(step.as_str())
            .fetch_optional(pool).await?),
        )
    }

    /// Records a successful apply in an environment.
    pub async fn record_apply(
        &self,
        environment_key: &str,
        run_id: &str,
    ) -> Result<(), sqlx::Error> {
        let sql = self.db.sql(
            "INSERT INTO environment_applies (environment_key, run_id, applied_at) VALUES ($1, $2, $3)
             ON CONFLICT (environment_key) DO UPDATE SET run_id = excluded.run_id, applied_at = excluded.applied_at",
        );
        on_pool!(self.db, pool => sqlx::query(&sql).bind(environment_key).bind(run_id).bind(now_ms())
            .execute(pool).await?.rows_affected());
        Ok(())
    }

    /// The last successful apply in an environment: (run id, when in ms).
    pub async fn last_apply(
        &self,
        environment_key: &str,
    ) -> Result<Option<(String, i64)>, sqlx::Error> {
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
    ) -> Result<Option<(String, Option<String>, i64)>, sqlx::Error> {
        let sql = self.db.sql(
            "SELECT status, last_error, attempts FROM work_items WHERE item_id = $1 AND step = $2",
        );
        let row: Option<(String, Option<String>, i32)> = on_pool!(self.db, pool => sqlx::query_as(&sql).bind(item_id).bind(step.as_str()).fetch_optional(pool).await?);
        Ok(row.map(|(s, e, a)| (s, e, i64::from(a))))
    }
}
