//! Reads of the read models: filters, cursor paging, and the bounded wait that gives a
//! client read-your-writes after a command.

use crate::projection::{
    EnvironmentsProjection, Progress, RunsProjection, SpecificationsProjection,
};
use crate::views::{CurrentSpecificationView, EnvironmentSpecificationView, RunView};
use base64::Engine;
use ferry_domain::specification::SpecificationVersion;
use ferry_domain::*;
use ferry_store::stream::{Param, Position};
use ferry_store::{bind_params, on_pool, Database};
use serde::de::DeserializeOwned;
use serde_json::Value;
use sqlx::types::Json;
use std::time::Duration;
use tokio::sync::watch;

/// A page of results and the cursor of the next one.
#[derive(Debug, Clone, PartialEq, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Page<T> {
    /// The items, newest first.
    pub items: Vec<T>,
    /// Pass as `cursor` to get the next page; absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// A cursor that does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cursor is not one this server issued")]
pub struct BadCursor;

/// Opaque cursor: the stream position of the last item on the page.
pub fn encode_cursor(position: i64) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("p:{position}"))
}

/// Reads a cursor made by [`encode_cursor`].
pub fn decode_cursor(cursor: &str) -> Result<i64, BadCursor> {
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(cursor)
        .map_err(|_| BadCursor)?;
    let text = String::from_utf8(bytes).map_err(|_| BadCursor)?;
    text.strip_prefix("p:")
        .and_then(|p| p.parse().ok())
        .filter(|p: &i64| *p > 0)
        .ok_or(BadCursor)
}

/// Filters of `GET /factory/provisioning/specifications`.
#[derive(Debug, Clone, Default)]
pub struct SpecificationFilter {
    /// Only this environment.
    pub environment_id: Option<EnvironmentId>,
    /// Only this project.
    pub project_id: Option<ProjectId>,
    /// Only this kind.
    pub kind: Option<SpecificationKind>,
    /// Only this specification's versions.
    pub specification_id: Option<SpecificationId>,
}

/// Filters of `GET /factory/provisioning/runs`.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    /// Only this environment.
    pub environment_id: Option<EnvironmentId>,
    /// Only this kind.
    pub kind: Option<ProvisioningKind>,
    /// Only this state.
    pub state: Option<ProvisioningState>,
    /// Only runs whose plan deletes or replaces something (`true`), or only the others.
    pub destructive: Option<bool>,
}

/// A failure to read.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// The database failed.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    /// A stored document no longer matches its type (rebuild the projection).
    #[error("stored document does not decode: {0}")]
    Document(#[from] serde_json::Error),
    /// A stored row's column does not parse as its type (rebuild the projection).
    #[error("stored row does not parse: {0}")]
    Row(String),
}

/// The read side.
#[derive(Clone)]
pub struct ReadModels {
    db: Database,
    progress: Option<Progress>,
}

fn doc<T: DeserializeOwned>(v: Value) -> Result<T, QueryError> {
    Ok(serde_json::from_value(v)?)
}

/// One page of `table`'s documents (a `position` and a `document` column) matching
/// `clauses` (with `params` for their `$n`), newest first, after `cursor`; and the cursor of
/// the next page, if there is one.
pub async fn page(
    db: &Database,
    table: &str,
    mut clauses: Vec<String>,
    mut params: Vec<Param>,
    limit: u32,
    cursor: Option<i64>,
) -> Result<(Vec<Value>, Option<String>), QueryError> {
    if let Some(c) = cursor {
        params.push(Param::Int(Some(c)));
        clauses.push(format!("position < ${}", params.len()));
    }
    params.push(Param::Int(Some(i64::from(limit) + 1)));
    let sql = format!(
        "SELECT position, document FROM {table} WHERE {} ORDER BY position DESC LIMIT ${}",
        clauses.join(" AND "),
        params.len()
    );
    let sql = db.sql(&sql);
    let mut rows: Vec<(i64, Json<Value>)> = on_pool!(db, pool =>
        bind_params!(sqlx::query_as(&sql), &params).fetch_all(pool).await?);
    let next = if rows.len() > limit as usize {
        rows.truncate(limit as usize);
        rows.last().map(|(p, _)| encode_cursor(*p))
    } else {
        None
    };
    Ok((rows.into_iter().map(|(_, d)| d.0).collect(), next))
}

impl ReadModels {
    /// Reads from `db`; `progress` (from the projector) wakes read-your-writes waits.
    pub fn new(db: Database, progress: Option<Progress>) -> Self {
        Self { db, progress }
    }

    /// Every declared version matching `filter`, newest first.
    pub async fn list_specifications(
        &self,
        tenant: &TenantId,
        filter: &SpecificationFilter,
        limit: u32,
        cursor: Option<i64>,
    ) -> Result<Page<SpecificationVersion>, QueryError> {
        let mut clauses = vec!["tenant_id = $1".to_string()];
        let mut params = vec![Param::Text(Some(tenant.to_string()))];
        let mut add = |column: &str, value: Option<String>| {
            if let Some(v) = value {
                params.push(Param::Text(Some(v)));
                clauses.push(format!("{column} = ${}", params.len()));
            }
        };
        add(
            "environment_id",
            filter.environment_id.as_ref().map(ToString::to_string),
        );
        add(
            "project_id",
            filter.project_id.as_ref().map(ToString::to_string),
        );
        add("kind", filter.kind.map(|k| k.as_str().to_string()));
        add(
            "specification_id",
            filter.specification_id.map(|s| s.to_string()),
        );
        let (docs, next_cursor) = page(
            &self.db,
            "rm_specification_versions",
            clauses,
            params,
            limit,
            cursor,
        )
        .await?;
        Ok(Page {
            items: docs.into_iter().map(doc).collect::<Result<_, _>>()?,
            next_cursor,
        })
    }

    /// Runs matching `filter`, newest first.
    pub async fn list_runs(
        &self,
        tenant: &TenantId,
        filter: &RunFilter,
        limit: u32,
        cursor: Option<i64>,
    ) -> Result<Page<RunView>, QueryError> {
        let mut clauses = vec!["tenant_id = $1".to_string()];
        let mut params = vec![Param::Text(Some(tenant.to_string()))];
        let mut add = |column: &str, value: Option<String>| {
            if let Some(v) = value {
                params.push(Param::Text(Some(v)));
                clauses.push(format!("{column} = ${}", params.len()));
            }
        };
        add(
            "environment_id",
            filter.environment_id.as_ref().map(ToString::to_string),
        );
        add("kind", filter.kind.map(|k| k.as_str().to_string()));
        add("state", filter.state.map(|s| s.as_str().to_string()));
        if let Some(destructive) = filter.destructive {
            // From the plan receipt in the document (no column of its own).
            let removes = match self.db.backend() {
                ferry_store::Backend::Postgres => {
                    "COALESCE((document->'planReceipt'->>'deletes')::int, 0) \
                     + COALESCE((document->'planReceipt'->>'replaces')::int, 0) > 0"
                }
                ferry_store::Backend::Sqlite => {
                    "COALESCE(json_extract(document, '$.planReceipt.deletes'), 0) \
                     + COALESCE(json_extract(document, '$.planReceipt.replaces'), 0) > 0"
                }
            };
            clauses.push(if destructive {
                format!("({removes})")
            } else {
                format!("NOT ({removes})")
            });
        }
        let (docs, next_cursor) = page(&self.db, "rm_runs", clauses, params, limit, cursor).await?;
        Ok(Page {
            items: docs.into_iter().map(doc).collect::<Result<_, _>>()?,
            next_cursor,
        })
    }

    /// One run of the tenant.
    pub async fn get_run(
        &self,
        tenant: &TenantId,
        id: ProvisioningRunId,
    ) -> Result<Option<RunView>, QueryError> {
        let sql = self
            .db
            .sql("SELECT document FROM rm_runs WHERE tenant_id = $1 AND provisioning_run_id = $2");
        let row: Option<(Json<Value>,)> = on_pool!(self.db, pool => sqlx::query_as(&sql)
            .bind(tenant.as_str()).bind(id.to_string()).fetch_optional(pool).await?);
        row.map(|(d,)| doc(d.0)).transpose()
    }

    /// The newest and last applied specification of each kind for an environment.
    pub async fn current_specification(
        &self,
        tenant: &TenantId,
        environment: &EnvironmentId,
    ) -> Result<Option<CurrentSpecificationView>, QueryError> {
        let sql = self.db.sql(
            "SELECT latest, applied FROM rm_environment_specifications
              WHERE tenant_id = $1 AND environment_id = $2 ORDER BY kind",
        );
        let rows: Vec<(Json<Value>, Option<Json<Value>>)> = on_pool!(self.db, pool =>
            sqlx::query_as(&sql).bind(tenant.as_str()).bind(environment.as_str()).fetch_all(pool).await?);
        if rows.is_empty() {
            return Ok(None);
        }
        let specifications = rows
            .into_iter()
            .map(|(latest, applied)| {
                let latest: SpecificationVersion = doc(latest.0)?;
                Ok(EnvironmentSpecificationView {
                    kind: latest.kind,
                    specification_id: latest.specification_id,
                    applied: applied.map(|a| doc(a.0)).transpose()?,
                    latest,
                })
            })
            .collect::<Result<_, QueryError>>()?;
        Ok(Some(CurrentSpecificationView {
            environment_id: environment.clone(),
            specifications,
        }))
    }

    /// Waits (at most `timeout`) until the run's view has reached `version`, the command's
    /// last event standing at `after` in the stream ([`ReadModels::wait_until`]).
    pub async fn wait_for_run(
        &self,
        tenant: &TenantId,
        id: ProvisioningRunId,
        version: u64,
        after: Option<Position>,
        timeout: Duration,
    ) -> Result<bool, QueryError> {
        let sql = self
            .db
            .sql("SELECT version FROM rm_runs WHERE tenant_id = $1 AND provisioning_run_id = $2");
        self.wait_for_own_events(timeout, &[RunsProjection::NAME], after, || async {
            let v: Option<i64> = on_pool!(self.db, pool => sqlx::query_scalar(&sql)
                .bind(tenant.as_str()).bind(id.to_string()).fetch_optional(pool).await?);
            Ok(v.is_some_and(|v| v as u64 >= version))
        })
        .await
    }

    /// Waits (at most `timeout`) until a specification version is visible in the lists
    /// and in the environment's current specification (`after` as in
    /// [`ReadModels::wait_until`]).
    pub async fn wait_for_specification(
        &self,
        tenant: &TenantId,
        id: SpecificationId,
        version: u32,
        after: Option<Position>,
        timeout: Duration,
    ) -> Result<bool, QueryError> {
        let sql = self.db.sql(
            "SELECT (SELECT count(*) FROM rm_specification_versions WHERE tenant_id = $1 AND specification_id = $2 AND version = $3)
                  + (SELECT count(*) FROM rm_environment_specifications WHERE tenant_id = $1 AND specification_id = $2 AND latest_version >= $3)",
        );
        let projections = [SpecificationsProjection::NAME, EnvironmentsProjection::NAME];
        self.wait_for_own_events(timeout, &projections, after, || async {
            let n: i64 = on_pool!(self.db, pool => sqlx::query_scalar(&sql)
                .bind(tenant.as_str()).bind(id.to_string()).bind(i64::from(version)).fetch_one(pool).await?);
            Ok(n == 2)
        })
        .await
    }

    /// The store it reads.
    pub fn db(&self) -> &Database {
        &self.db
    }

    /// Waits (at most `timeout`) until `check` holds: read-your-writes for any read model.
    /// `projections` are those whose tables `check` reads; `after` is where the command's
    /// last event stands in the stream (`None` when it recorded none). The read model is
    /// read once those projections have passed `after` here (at once when there is nothing
    /// to pass), again whenever one of them commits while `check` fails, and on a short poll,
    /// since another instance may be the one projecting.
    pub async fn wait_until<F, Fut>(
        &self,
        timeout: Duration,
        projections: &[&str],
        after: Option<Position>,
        check: F,
    ) -> Result<bool, QueryError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool, QueryError>>,
    {
        self.wait(timeout, projections, after, Confirm::ByCheck, check)
            .await
    }

    /// As [`ReadModels::wait_until`], for a `check` that only asks whether the command's
    /// own events were applied (e.g. a view's version): once this process's `projections`
    /// have passed `after` the wait ends without reading ([`Confirm::ByProgress`]).
    pub async fn wait_for_own_events<F, Fut>(
        &self,
        timeout: Duration,
        projections: &[&str],
        after: Option<Position>,
        check: F,
    ) -> Result<bool, QueryError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool, QueryError>>,
    {
        self.wait(timeout, projections, after, Confirm::ByProgress, check)
            .await
    }

    /// [`ReadModels::wait_until`], confirmed as `confirm` says.
    async fn wait<F, Fut>(
        &self,
        timeout: Duration,
        projections: &[&str],
        after: Option<Position>,
        confirm: Confirm,
        mut check: F,
    ) -> Result<bool, QueryError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool, QueryError>>,
    {
        let deadline = tokio::time::Instant::now() + timeout;
        // Marked as seen before the first look: a commit after it wakes the wait.
        let mut watched = self
            .progress
            .as_ref()
            .map(|p| p.watch(projections))
            .unwrap_or_default();
        let passed = |watched: &[watch::Receiver<Position>]| {
            after.is_none_or(|event| watched.iter().all(|at| *at.borrow() >= event))
        };
        let mut read = watched.is_empty() || passed(&watched);
        loop {
            // This process's projections committed the command's events: what the check
            // would read is there (they skip nothing; a failing batch holds them back).
            if confirm == Confirm::ByProgress
                && after.is_some()
                && !watched.is_empty()
                && passed(&watched)
            {
                return Ok(true);
            }
            if read && check().await? {
                return Ok(true);
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            let pause = (deadline - now).min(Duration::from_millis(50));
            if watched.is_empty() {
                tokio::time::sleep(pause).await;
                read = true;
                continue;
            }
            let moved =
                futures::future::select_all(watched.iter_mut().map(|r| Box::pin(r.changed())));
            let woken = tokio::time::timeout(pause, moved)
                .await
                .map(|(changed, _, _)| changed.is_ok());
            read = match woken {
                Ok(true) => passed(&watched),
                Ok(false) => {
                    // The projector stopped: poll from now on.
                    watched.clear();
                    true
                }
                // The poll.
                Err(_) => true,
            };
        }
    }
}

/// How a read-your-writes wait knows the command's effect is visible.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Confirm {
    /// Only by reading the read model (the check looks at more than the command's events,
    /// or keeps what it read).
    ByCheck,
    /// Once this process's projections have passed the command's last event, without a
    /// read: the check only asks whether they applied the command's own events. It still
    /// reads when there is no event to pass or another instance is the one projecting.
    ByProgress,
}

#[cfg(test)]
mod cursor_tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_reject_garbage() {
        assert_eq!(decode_cursor(&encode_cursor(42)), Ok(42));
        assert_eq!(decode_cursor("not-a-cursor"), Err(BadCursor));
        assert_eq!(decode_cursor(&encode_cursor(-1)), Err(BadCursor));
    }
}
