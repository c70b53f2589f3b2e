//! The GitOps reconciler: re-plans each environment's applied specifications as
//! `Reconciliation` runs, on the schedule (`FERRY_RECONCILE_SCHEDULE`, cron syntax) and on
//! demand (`POST /factory/provisioning/reconcile`, `ferry reconcile`).
//!
//! A run is named after its tenant, specification and window
//! ([`ProvisioningRunId::for_reconciliation`]), so every instance and every restart that
//! reconciles a scheduled window lands on the same run: it is planned once. The workers
//! plan it like any run (the simulated runner's cloud, or `pulumi preview`, shows drift
//! made outside Ferry); what happens then is the run's rule (`ferry_domain::run`): no
//! difference ends it `InSync`; deletes and replaces, and anything in production, wait in
//! `AwaitingApproval` as a proposal an Operator approves exactly as planned; adds and
//! in-place changes elsewhere apply when `AutoApplyNonDestructive` is on and policy allows.
//!
//! It re-plans the version last *applied* there, never a newer declaration: a release a
//! rollback took out is not put back by reconciliation. When the last apply of that
//! specification there failed, the run says so (`follows_failed_apply`) and its fix is a
//! proposal, never applied blindly. The environment's ignore rules
//! (`ferry_domain::drift`) are applied by the planner. An environment with a run in flight
//! (requested, planning or applying) or a promotion holding it is skipped for the window,
//! and says so.

use super::views::ProvisioningReads;
use chrono::{DateTime, Utc};
use ferry_domain::environment::Environment;
use ferry_domain::run::{ProvisioningRun, RunCommand, RunError, RunRequest};
use ferry_domain::specification::SpecificationVersion;
use ferry_domain::{
    Actor, EnvironmentId, ProvisioningKind, ProvisioningRunId, SpecificationId, SpecificationKind,
    TenantId,
};
use ferry_store::{on_pool, Backend, CommandError, Database, EventMetadata, Repository};
use serde::Serialize;
use sqlx::types::Json;
use std::str::FromStr;

/// Which environments to reconcile.
#[derive(Debug, Clone, Default)]
pub struct Scope {
    /// Only this tenant's (every tenant's when unset).
    pub tenant: Option<TenantId>,
    /// Only this environment (of `tenant`).
    pub environment: Option<EnvironmentId>,
}

/// What one reconciliation pass did.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Reconciliation {
    /// The window it reconciled (a scheduled time, or `manual/<id>`).
    pub window: String,
    /// The runs it started, or found started for this window.
    pub runs: Vec<ReconciliationRun>,
    /// Environments it left alone this window, and why.
    pub skipped: Vec<SkippedEnvironment>,
}

/// One `Reconciliation` run.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReconciliationRun {
    /// The run.
    pub provisioning_run_id: ProvisioningRunId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// The specification re-planned.
    pub specification_id: SpecificationId,
    /// Its kind.
    pub kind: SpecificationKind,
    /// The version last applied there, re-planned.
    pub specification_version: u32,
    /// False when this window's run existed already (another instance, or a retry).
    pub started: bool,
}

/// An environment not reconciled this window.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SkippedEnvironment {
    /// The environment.
    pub environment_id: EnvironmentId,
    /// Why.
    pub reason: String,
}

/// Why a pass could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The read models could not be read.
    #[error("reading the environments' specifications: {0}")]
    Read(#[from] sqlx::Error),
    /// A stored document did not decode.
    #[error("a stored specification does not decode: {0}")]
    Document(#[from] serde_json::Error),
    /// A run could not be recorded.
    #[error("recording a reconciliation run: {0}")]
    Command(String),
}

/// The schedule, cron syntax (five fields, UTC), checked once.
#[derive(Debug, Clone)]
pub struct Schedule(croner::Cron);

impl Schedule {
    /// Parses `pattern` (e.g. `0 */4 * * *`).
    pub fn parse(pattern: &str) -> Result<Self, croner::errors::CronError> {
        croner::Cron::from_str(pattern).map(Self)
    }

    /// The first window after `now`.
    pub fn next_after(&self, now: &DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.0.find_next_occurrence(now, false).ok()
    }
}

/// The scheduled window starting at `at`, as runs are named after it.
pub fn scheduled_window(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%dT%H:%MZ").to_string()
}

/// One manual pass's own window (an Operator's request is never folded into another's).
pub fn manual_window() -> String {
    format!("manual/{}", uuid::Uuid::new_v4())
}

/// The reconciler's name among the loops whose failing items are reported
/// (`ferry_store::items`).
pub const LOOP: &str = "reconciler";

/// Re-plans every applied specification in `scope` for `window`, as `by`.
pub async fn reconcile(
    db: &Database,
    scope: &Scope,
    window: &str,
    by: &Actor,
) -> Result<Reconciliation, ReconcileError> {
    let runs: Repository<ProvisioningRun> = Repository::new(db.clone(), ());
    let environments: Repository<Environment> = Repository::new(db.clone(), ());
    let mut done = Reconciliation {
        window: window.to_string(),
        runs: Vec::new(),
        skipped: Vec::new(),
    };
    // Whether each environment is busy, decided before this pass starts anything there: its
    // own first run must not keep its other specification (baseline and workload) out.
    let mut busy_before: std::collections::HashMap<(TenantId, EnvironmentId), Option<String>> =
        std::collections::HashMap::new();
    for applied in applied_specifications(db, scope).await? {
        // Each specification on its own: one that fails (whatever its tenant holds) is
        // named in the pass's `skipped`, the log, `/readyz` and `/metrics`, and every other
        // is still reconciled. The next window tries it again.
        let (tenant, item) = (
            applied.tenant_id.clone(),
            applied.specification_id.to_string(),
        );
        let health = db.item_health();
        let one = reconcile_one(
            db,
            &runs,
            &environments,
            &applied,
            window,
            by,
            &mut busy_before,
            &mut done,
        )
        .await;
        match one {
            Ok(()) => {
                health.succeeded(LOOP, tenant.as_str(), &item);
            }
            Err(error) => {
                let problem = health.failed(LOOP, tenant.as_str(), &item, &error.to_string());
                tracing::warn!(
                    %tenant, environment = %applied.environment_id, specification = %item,
                    %error, attempts = problem.attempts,
                    "reconciling a specification failed; the others go on"
                );
                done.skipped.push(SkippedEnvironment {
                    environment_id: applied.environment_id.clone(),
                    reason: format!(
                        "its {} specification could not be reconciled: {error}",
                        applied.kind.as_str()
                    ),
                });
            }
        }
    }
    Ok(done)
}

/// Reconciles one applied specification in `window` (see [`reconcile`]).
#[allow(clippy::too_many_arguments)]
async fn reconcile_one(
    db: &Database,
    runs: &Repository<ProvisioningRun>,
    environments: &Repository<Environment>,
    applied: &Applied,
    window: &str,
    by: &Actor,
    busy_before: &mut std::collections::HashMap<(TenantId, EnvironmentId), Option<String>>,
    done: &mut Reconciliation,
) -> Result<(), ReconcileError> {
    let tenant = &applied.tenant_id;
    let environment = &applied.environment_id;
    let run_id = reconciliation_run_id(runs, applied, window).await?;
    let entry = |started| ReconciliationRun {
        provisioning_run_id: run_id,
        environment_id: environment.clone(),
        specification_id: applied.specification_id,
        kind: applied.kind,
        specification_version: applied.version,
        started,
    };
    // This window's run exists: another instance or an earlier attempt started it.
    let existing = runs
        .load(tenant, &run_id.to_string())
        .await
        .map_err(|e| ReconcileError::Command(e.to_string()))?;
    if existing.is_some() {
        done.runs.push(entry(false));
        return Ok(());
    }
    let key = (tenant.clone(), environment.clone());
    if !busy_before.contains_key(&key) {
        let reason = busy(db, tenant, environment).await?;
        busy_before.insert(key.clone(), reason);
    }
    if let Some(reason) = busy_before.get(&key).cloned().flatten() {
        if !done
            .skipped
            .iter()
            .any(|s| &s.environment_id == environment)
        {
            tracing::info!(%tenant, %environment, %reason, "reconciliation skipped");
            done.skipped.push(SkippedEnvironment {
                environment_id: environment.clone(),
                reason,
            });
        }
        return Ok(());
    }
    let class = environments
        .load(tenant, &Environment::aggregate_id(tenant, environment))
        .await
        .map_err(|e| ReconcileError::Command(e.to_string()))?
        .and_then(|(e, _)| e.class());
    let request = RunRequest {
        provisioning_run_id: run_id,
        tenant_id: tenant.clone(),
        project_id: applied.project_id.clone(),
        environment_id: environment.clone(),
        // Unknown environments count as production (the domain's rule).
        environment_class: class,
        specification_id: applied.specification_id,
        specification_version: applied.version,
        kind: ProvisioningKind::Reconciliation,
        promotion_id: None,
        approval_id: None,
        follows_failed_apply: last_apply_failed(db, applied).await?,
        requested_by: by.clone(),
        requested_at: Utc::now(),
    };
    let metadata = metadata(tenant, by, run_id);
    let started = match runs
        .execute(
            tenant,
            &run_id.to_string(),
            RunCommand::Request(Box::new(request)),
            &metadata,
            true,
        )
        .await
    {
        Ok(_) => true,
        // Another instance recorded it between the look and the write.
        Err(CommandError::Domain(RunError::AlreadyRequested) | CommandError::Conflict) => false,
        Err(e) => return Err(ReconcileError::Command(e.to_string())),
    };
    tracing::info!(%tenant, %environment, run = %run_id, started, "reconciliation run");
    if started {
        supersede_open_proposals(runs, db, applied, run_id, by).await?;
    }
    done.runs.push(entry(started));
    Ok(())
}

/// The run of `applied` in `window`: the one a version before issue 37 named
/// ([`ProvisioningRunId::legacy_for_reconciliation`]) when it exists in this tenant and
/// reconciles that specification (an instance of the old version reconciled this window),
/// else the unambiguous name.
async fn reconciliation_run_id(
    runs: &Repository<ProvisioningRun>,
    applied: &Applied,
    window: &str,
) -> Result<ProvisioningRunId, ReconcileError> {
    let tenant = &applied.tenant_id;
    let named = ProvisioningRunId::for_reconciliation(tenant, applied.specification_id, window);
    let legacy =
        ProvisioningRunId::legacy_for_reconciliation(tenant, applied.specification_id, window);
    let found = runs
        .load(tenant, &legacy.to_string())
        .await
        .map_err(|e| ReconcileError::Command(e.to_string()))?;
    let reconciles = found.is_some_and(|(run, _)| {
        run.request().is_some_and(|r| {
            r.kind == ProvisioningKind::Reconciliation
                && r.specification_id == applied.specification_id
        })
    });
    Ok(if reconciles { legacy } else { named })
}

/// The metadata of the events the reconciler causes: `by`, correlated with `run`.
fn metadata(tenant: &TenantId, by: &Actor, run: ProvisioningRunId) -> EventMetadata {
    EventMetadata {
        tenant_id: tenant.clone(),
        actor: by.clone(),
        correlation_id: run.as_uuid(),
        causation_id: run.as_uuid(),
        request_id: uuid::Uuid::new_v4(),
    }
}

/// A newer re-plan replaces the open proposals of the same specification there: they wait
/// no longer (superseded, never applied), and the new run's plan is the one to decide on.
async fn supersede_open_proposals(
    runs: &Repository<ProvisioningRun>,
    db: &Database,
    applied: &Applied,
    newer: ProvisioningRunId,
    by: &Actor,
) -> Result<(), ReconcileError> {
    let sql = db.sql(
        "SELECT provisioning_run_id FROM rm_runs
          WHERE tenant_id = $1 AND environment_id = $2 AND kind = 'Reconciliation'
            AND state = 'AwaitingApproval' AND provisioning_run_id <> $3",
    );
    let open: Vec<String> = on_pool!(db, pool => sqlx::query_scalar(&sql)
        .bind(applied.tenant_id.as_str()).bind(applied.environment_id.as_str())
        .bind(newer.to_string()).fetch_all(pool).await?);
    for run in open {
        let metadata = metadata(&applied.tenant_id, by, newer);
        let command = RunCommand::Supersede {
            reason: format!("a newer reconciliation (run {newer}) re-plans this environment"),
            at: Utc::now(),
        };
        match runs
            .execute(&applied.tenant_id, &run, command, &metadata, false)
            .await
        {
            // Decided or superseded meanwhile: nothing to replace.
            Ok(_) | Err(CommandError::Domain(_) | CommandError::Conflict) => {}
            Err(e) => return Err(ReconcileError::Command(e.to_string())),
        }
        tracing::info!(superseded = %run, by = %newer, "open proposal superseded");
    }
    Ok(())
}

/// A specification's version last applied in an environment.
struct Applied {
    tenant_id: TenantId,
    environment_id: EnvironmentId,
    project_id: ferry_domain::ProjectId,
    specification_id: SpecificationId,
    kind: SpecificationKind,
    version: u32,
}

/// Every specification version last applied in `scope`.
async fn applied_specifications(
    db: &Database,
    scope: &Scope,
) -> Result<Vec<Applied>, ReconcileError> {
    let sql = db.sql(
        "SELECT latest, applied FROM rm_environment_specifications
          WHERE applied IS NOT NULL
            AND ($1 = '' OR tenant_id = $1) AND ($2 = '' OR environment_id = $2)
          ORDER BY tenant_id, environment_id, kind",
    );
    let tenant = scope.tenant.as_ref().map_or("", TenantId::as_str);
    let environment = scope.environment.as_ref().map_or("", EnvironmentId::as_str);
    let rows: Vec<(Json<serde_json::Value>, Json<serde_json::Value>)> = on_pool!(db, pool => sqlx::query_as(&sql)
            .bind(tenant).bind(environment).fetch_all(pool).await?);
    rows.into_iter()
        .map(|(Json(latest), Json(applied))| {
            // The specification's identity from its newest version, the version from the apply.
            let latest: SpecificationVersion = serde_json::from_value(latest)?;
            let applied: crate::contexts::provisioning::views::AppliedSpecification =
                serde_json::from_value(applied)?;
            Ok(Applied {
                tenant_id: latest.tenant_id,
                environment_id: latest.environment_id,
                project_id: latest.project_id,
                specification_id: latest.specification_id,
                kind: latest.kind,
                version: applied.version,
            })
        })
        .collect()
}

/// The run whose apply of this specification in this environment was the last one tried,
/// if that apply failed: the environment is partly changed, and the reconciliation that
/// follows proposes the fix instead of applying it (nothing is retried blindly). The
/// specification and the apply are chosen by the statement: among the environment's newest
/// runs the other specifications' applies could crowd this one's out.
async fn last_apply_failed(
    db: &Database,
    applied: &Applied,
) -> Result<Option<ProvisioningRunId>, ReconcileError> {
    let sql = match db.backend() {
        Backend::Postgres => {
            "SELECT document FROM rm_runs
              WHERE tenant_id = $1 AND environment_id = $2 AND state IN ('Applied', 'Failed')
                AND document->>'specificationId' = $3
                AND jsonb_typeof(document->'applyReceipt') = 'object'
              ORDER BY position DESC LIMIT 1"
        }
        Backend::Sqlite => {
            "SELECT document FROM rm_runs
              WHERE tenant_id = $1 AND environment_id = $2 AND state IN ('Applied', 'Failed')
                AND json_extract(document, '$.specificationId') = $3
                AND json_type(document, '$.applyReceipt') = 'object'
              ORDER BY position DESC LIMIT 1"
        }
    };
    let sql = db.sql(sql);
    let last: Option<Json<crate::contexts::provisioning::views::RunView>> = on_pool!(db, pool => sqlx::query_scalar(&sql)
        .bind(applied.tenant_id.as_str()).bind(applied.environment_id.as_str())
        .bind(applied.specification_id.to_string())
        .fetch_optional(pool).await?);
    Ok(last
        .map(|Json(run)| run)
        .filter(|run| run.state == ferry_domain::ProvisioningState::Failed)
        .map(|run| run.provisioning_run_id))
}

/// A run in flight in an environment (read through the runs' environment index).
const RUN_IN_FLIGHT: &str = "SELECT provisioning_run_id, state FROM rm_runs
  WHERE tenant_id = $1 AND environment_id = $2
    AND state IN ('Requested', 'Planned', 'Applying') LIMIT 1";

/// Why `environment` must not be reconciled now, if it must not: a run in flight there, or
/// a promotion holding it.
async fn busy(
    db: &Database,
    tenant: &TenantId,
    environment: &EnvironmentId,
) -> Result<Option<String>, ReconcileError> {
    let runs = db.sql(RUN_IN_FLIGHT);
    let run: Option<(String, String)> = on_pool!(db, pool => sqlx::query_as(&runs)
        .bind(tenant.as_str()).bind(environment.as_str()).fetch_optional(pool).await?);
    if let Some((run, state)) = run {
        return Ok(Some(format!("run {run} is {state} there")));
    }
    let slots = db.sql(
        "SELECT promotion_id FROM promotion_slots WHERE tenant_id = $1 AND environment_id = $2",
    );
    let promotion: Option<String> = on_pool!(db, pool => sqlx::query_scalar(&slots)
        .bind(tenant.as_str()).bind(environment.as_str()).fetch_optional(pool).await?);
    Ok(promotion.map(|p| format!("promotion {p} holds it")))
}

/// Body of `POST /factory/provisioning/reconcile` (optional).
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReconcileRequest {
    /// Only this environment (every environment of the tenant when absent).
    #[serde(default)]
    pub environment_id: Option<EnvironmentId>,
}

/// `POST /factory/provisioning/reconcile`: re-plans the caller's environments now, each a
/// `Reconciliation` run in a window of its own; 202 with the runs and what was skipped.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant))]
pub async fn reconcile_now(
    axum::extract::State(state): axum::extract::State<ferry_api::state::AppState>,
    caller: ferry_api::auth::Caller,
    ferry_api::extract::OptionalJson(body): ferry_api::extract::OptionalJson<ReconcileRequest>,
) -> Result<(axum::http::StatusCode, axum::Json<Reconciliation>), ferry_api::problem::ApiError> {
    use ferry_api::problem::ApiError;
    caller.require_apply()?;
    let environment = body.and_then(|b| b.environment_id);
    let scope = Scope {
        tenant: Some(caller.tenant.clone()),
        environment: environment.clone(),
    };
    let done = reconcile(state.db(), &scope, &manual_window(), &caller.actor)
        .await
        .map_err(ApiError::internal)?;
    // Read your writes, as every command answers: a GET of a run named here finds it.
    for run in done.runs.iter().filter(|r| r.started) {
        state
            .reads()
            .wait_for_run(
                &caller.tenant,
                run.provisioning_run_id,
                1,
                None,
                state.read_your_writes(),
            )
            .await?;
    }
    if let Some(environment) = environment {
        if done.runs.is_empty() && done.skipped.is_empty() {
            return Err(ApiError::NotFound(format!(
                "no specification has been applied in {environment}: nothing to reconcile"
            )));
        }
    }
    Ok((axum::http::StatusCode::ACCEPTED, axum::Json(done)))
}

/// `GET /factory/provisioning/proposals`: open reconciliation proposals (Reconciliation
/// runs awaiting approval, with the plan's resources), newest first.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant))]
pub async fn list_proposals(
    axum::extract::State(state): axum::extract::State<ferry_api::state::AppState>,
    caller: ferry_api::auth::Caller,
    axum::extract::Query(raw): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> Result<
    axum::Json<ferry_projections::Page<crate::contexts::provisioning::views::RunView>>,
    ferry_api::problem::ApiError,
> {
    caller.require_read()?;
    let q = ferry_api::extract::QueryParams::new(
        raw,
        &["environmentId", "destructive", "limit", "cursor"],
    )?;
    let filter = crate::contexts::provisioning::views::RunFilter {
        environment_id: q.parse(
            "environmentId",
            |v| EnvironmentId::parse(v).ok(),
            "an environment id",
        )?,
        kind: Some(ProvisioningKind::Reconciliation),
        state: Some(ferry_domain::ProvisioningState::AwaitingApproval),
        destructive: q.parse("destructive", |v| v.parse().ok(), "true or false")?,
    };
    let (limit, cursor) = q.page()?;
    let page = state
        .reads()
        .list_runs(&caller.tenant, &filter, limit, cursor)
        .await?;
    Ok(axum::Json(page))
}

/// The reconciler's routes, with their documentation.
pub fn routes() -> aide::axum::ApiRouter<ferry_api::state::AppState> {
    use ferry_api::openapi::Doc;
    aide::axum::ApiRouter::new()
        .api_route(
            "/factory/provisioning/proposals",
            aide::axum::routing::get_with(list_proposals, |op| {
                op.id("ListProposals")
                    .summary("Open reconciliation proposals: Reconciliation runs awaiting an approval of exactly their plan (its resources show what would change), newest first. A newer re-plan of the environment supersedes them; FERRY_APPROVAL_EXPIRY_MINUTES expires them.")
                    .scope(ferry_api::auth::SCOPE_READ)
                    .query("environmentId", "Only this environment.", serde_json::json!({"type": "string"}))
                    .query("destructive", "Only proposals that delete or replace (true), or only the others (false).", serde_json::json!({"type": "boolean"}))
                    .paging()
                    .response_with::<200, axum::Json<ferry_projections::Page<crate::contexts::provisioning::views::RunView>>, _>(|r| {
                        r.description("A page of proposals.")
                    })
                    .errors(&[400, 401, 403])
            }),
        )
        .api_route(
        "/factory/provisioning/reconcile",
        aide::axum::routing::post_with(reconcile_now, |op| {
            op.id("Reconcile")
                .summary("Re-plan the tenant's environments now (or one, `environmentId`): a Reconciliation run of each applied specification, skipping environments with a run or a promotion in flight. No difference ends a run InSync; deletes, replaces and anything in production wait as proposals; other differences apply when AutoApplyNonDestructive is on.")
                .scope(ferry_api::auth::SCOPE_APPLY)
                .response_with::<202, axum::Json<Reconciliation>, _>(|r| {
                    r.description("The runs started and the environments skipped.")
                })
                .errors(&[400, 401, 403, 404, 415, 422])
        }),
    )
}

/// Runs the reconciler on `schedule` until shutdown: each window once (the runs are named
/// after it, so instances that reconcile the same window meet on the same runs).
pub fn spawn_schedule(
    db: Database,
    schedule: Schedule,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    use tracing::Instrument;
    let by = Actor::parse("system:reconciler").unwrap_or_else(|_| unreachable!("a valid actor"));
    tokio::spawn(
        async move {
            loop {
                let Some(next) = schedule.next_after(&Utc::now()) else {
                    tracing::warn!("the reconcile schedule has no next window; stopping");
                    return;
                };
                let wait = (next - Utc::now()).to_std().unwrap_or_default();
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = shutdown.changed() => return,
                }
                let window = scheduled_window(next);
                let all = Scope::default();
                match leading(&db, || reconcile(&db, &all, &window, &by)).await {
                    Ok(None) => {
                        tracing::info!(%window, "another instance is reconciling this window");
                    }
                    Ok(Some(done)) => tracing::info!(
                        %window, runs = done.runs.len(), skipped = done.skipped.len(),
                        "reconciled"
                    ),
                    Err(error) => tracing::error!(%window, %error, "reconciliation failed"),
                }
            }
        }
        .instrument(tracing::info_span!("reconciler")),
    );
}

/// The key of the reconciler's advisory lock ("ferry-reconcile" in ASCII, truncated).
const LEADER_LOCK: i64 = 0x6665_7272_792d_7263;

/// Runs `pass` as the reconciler leader: on Postgres only while holding the advisory lock
/// (one instance at a time; another finds it taken and leaves the window to it), on SQLite
/// (one node) always. `None` when another instance leads. The runs' names keep a window
/// planned once even if a late instance passes after the leader.
pub async fn leading<F, Fut>(
    db: &Database,
    pass: F,
) -> Result<Option<Reconciliation>, ReconcileError>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<Reconciliation, ReconcileError>>,
{
    let ferry_store::database::Pool::Postgres(pool) = db.pool() else {
        return pass().await.map(Some);
    };
    // A transaction-scoped lock: released with the transaction, also if this process dies.
    let mut tx = pool.begin().await?;
    let leader: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
        .bind(LEADER_LOCK)
        .fetch_one(&mut *tx)
        .await?;
    if !leader {
        return Ok(None);
    }
    let done = pass().await;
    tx.commit().await?;
    done.map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_domain::ProjectId;
    use ferry_store::testing::TestDatabase;

    /// A row of the runs read model as the projection writes it, with an apply receipt of
    /// `apply` (none when the run did not reach its apply).
    async fn run_row(
        db: &Database,
        position: i64,
        specification: SpecificationId,
        state: &str,
        apply: Option<&str>,
    ) -> ProvisioningRunId {
        let id = ProvisioningRunId::new_random();
        let mut document = serde_json::json!({
            "provisioningRunId": id, "tenantId": "acme", "projectId": "payments",
            "environmentId": "payments-test", "specificationId": specification,
            "specificationVersion": 1, "kind": "Release", "state": state,
            "requestedBy": "alice", "startedAt": Utc::now(), "updatedAt": Utc::now(),
            "version": 4,
        });
        if let Some(result) = apply {
            document["applyReceipt"] = serde_json::json!({
                "outputs": {}, "durationSeconds": 1.0, "result": result, "runnerVersion": "test",
            });
        }
        let sql = db.sql(
            "INSERT INTO rm_runs (provisioning_run_id, tenant_id, environment_id, kind, state,
               position, version, updated_at, document)
             VALUES ($1, 'acme', 'payments-test', 'Release', $2, $3, 4, $4, $5)",
        );
        on_pool!(db, pool => sqlx::query(&sql)
            .bind(id.to_string()).bind(state).bind(position).bind(Utc::now())
            .bind(Json(document)).execute(pool).await.map(|_| ()))
        .unwrap();
        id
    }

    #[tokio::test]
    async fn the_look_for_a_run_in_flight_reads_the_environments_index() {
        let t = TestDatabase::new(Backend::Postgres).await;
        runs_table(&t.db).await;
        let ferry_store::database::Pool::Postgres(pool) = t.db.pool().clone() else {
            unreachable!()
        };
        let mut tx = pool.begin().await.unwrap();
        ferry_store::testing::plan_as_for_large_tables(&mut tx).await;
        let (plan,): (serde_json::Value,) =
            sqlx::query_as(&format!("EXPLAIN (FORMAT JSON) {RUN_IN_FLIGHT}"))
                .bind("acme")
                .bind("payments-test")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
        let plan = plan.to_string();
        assert!(plan.contains("_environment"), "{plan}");
        drop(tx);
        t.cleanup().await;
    }

    async fn runs_table(db: &Database) {
        projection_tables(db, "runs").await;
    }

    /// The tables of the provisioning projection `name`.
    async fn projection_tables(db: &Database, name: &str) {
        let projection = crate::contexts::provisioning::views::provisioning_projections()
            .into_iter()
            .find(|p| p.name() == name)
            .unwrap();
        ferry_projections::ProjectionRunner::live(projection)
            .ensure_tables(db)
            .await
            .unwrap();
    }

    ferry_store::test_on_both_engines! {
        async fn a_failed_apply_is_found_behind_any_number_of_other_specifications_applies(backend) {
            let t = TestDatabase::new(backend).await;
            runs_table(&t.db).await;
            let tenant = TenantId::parse("acme").unwrap();
            let environment = EnvironmentId::parse("payments-test").unwrap();
            let spec = |kind| SpecificationId::for_environment(&tenant, &environment, kind);
            let (infra, workload) = (spec(SpecificationKind::Environment), spec(SpecificationKind::Workload));
            let applied = |specification_id, kind| Applied {
                tenant_id: tenant.clone(),
                environment_id: environment.clone(),
                project_id: ProjectId::parse("payments").unwrap(),
                specification_id,
                kind,
                version: 1,
            };
            let infra_applied = applied(infra, SpecificationKind::Environment);
            let workload_applied = applied(workload, SpecificationKind::Workload);
            // The infrastructure's apply failed; then the workload was applied 150 times
            // (each reconciliation window, say), and the infrastructure failed a plan.
            let failed = run_row(&t.db, 1, infra, "Failed", Some("Failed")).await;
            for position in 2..152 {
                run_row(&t.db, position, workload, "Applied", Some("Succeeded")).await;
            }
            run_row(&t.db, 152, infra, "Failed", None).await;
            assert_eq!(
                last_apply_failed(&t.db, &infra_applied).await.unwrap(),
                Some(failed),
                "{backend:?}"
            );
            assert_eq!(last_apply_failed(&t.db, &workload_applied).await.unwrap(), None);
            // Put right by a later apply: nothing to propose.
            run_row(&t.db, 153, infra, "Applied", Some("Succeeded")).await;
            assert_eq!(last_apply_failed(&t.db, &infra_applied).await.unwrap(), None);
            t.cleanup().await;
        }
    }

    /// `tenant`'s `environment` with its Environment specification applied at version 1, as
    /// the environments projection records it; the specification.
    async fn applied_row(db: &Database, tenant: &str, environment: &str) -> SpecificationId {
        let (t, e) = (
            TenantId::parse(tenant).unwrap(),
            EnvironmentId::parse(environment).unwrap(),
        );
        let id = SpecificationId::for_environment(&t, &e, SpecificationKind::Environment);
        let latest = serde_json::json!({
            "specificationId": id, "tenantId": tenant, "projectId": "payments",
            "environmentId": environment, "kind": "Environment", "version": 1,
            "programRef": "https://git.example.com/infra.git#envs/dev",
            "programVersion": "a".repeat(40), "configRefs": {}, "secretRefs": {},
            "declaredBy": "alice", "declaredAt": Utc::now(),
        });
        let applied = serde_json::json!({
            "version": 1, "provisioningRunId": ProvisioningRunId::new_random(),
            "appliedAt": Utc::now(),
        });
        let sql = db.sql(
            "INSERT INTO rm_environment_specifications
               (tenant_id, environment_id, kind, specification_id, latest_version, latest, applied)
             VALUES ($1, $2, 'Environment', $3, 1, $4, $5)",
        );
        on_pool!(db, pool => sqlx::query(&sql)
            .bind(tenant).bind(environment).bind(id.to_string())
            .bind(Json(latest)).bind(Json(applied)).execute(pool).await.map(|_| ()))
        .unwrap();
        id
    }

    ferry_store::test_on_both_engines! {
        async fn one_tenant_s_bad_specification_never_stops_another_s_reconciliation(backend) {
            let t = TestDatabase::new(backend).await;
            runs_table(&t.db).await;
            projection_tables(&t.db, "environments").await;
            let window = "2026-12-07T12:00Z";
            // `acme` comes first in the pass; the name of its window's run is taken by a run
            // of another tenant (issue 37 made such a squat from a tenant's Idempotency-Key;
            // here it is written straight to the store, as whatever else could go wrong).
            let acme_spec = applied_row(&t.db, "acme", "payments-dev").await;
            applied_row(&t.db, "zeta", "shop-dev").await;
            let acme = TenantId::parse("acme").unwrap();
            let squatted = ProvisioningRunId::for_reconciliation(&acme, acme_spec, window);
            let squatter = TenantId::parse("squatter").unwrap();
            let by = Actor::parse("mallory").unwrap();
            let runs: Repository<ProvisioningRun> = Repository::new(t.db.clone(), ());
            let request = RunRequest {
                provisioning_run_id: squatted,
                tenant_id: squatter.clone(),
                project_id: ProjectId::parse("payments").unwrap(),
                environment_id: EnvironmentId::parse("mine").unwrap(),
                environment_class: None,
                specification_id: SpecificationId::new_random(),
                specification_version: 1,
                kind: ProvisioningKind::Release,
                promotion_id: None,
                approval_id: None,
                follows_failed_apply: None,
                requested_by: by.clone(),
                requested_at: Utc::now(),
            };
            runs.execute(
                &squatter,
                &squatted.to_string(),
                RunCommand::Request(Box::new(request)),
                &metadata(&squatter, &by, squatted),
                true,
            )
            .await
            .unwrap();

            let system = Actor::parse("system:reconciler").unwrap();
            let done = reconcile(&t.db, &Scope::default(), window, &system)
                .await
                .unwrap_or_else(|e| panic!("one specification ended the pass: {e}"));
            // Zeta's specification was reconciled all the same.
            assert_eq!(done.runs.len(), 1, "{backend:?}: {:?}", done);
            assert_eq!(done.runs[0].environment_id.as_str(), "shop-dev");
            assert!(done.runs[0].started);
            let zeta = TenantId::parse("zeta").unwrap();
            let run = runs
                .load(&zeta, &done.runs[0].provisioning_run_id.to_string())
                .await
                .unwrap();
            assert!(run.is_some_and(|(r, _)| r.request().is_some_and(|r| r.kind == ProvisioningKind::Reconciliation)));
            // Acme's says why, in the pass's answer and in the process's failing items.
            assert_eq!(done.skipped.len(), 1, "{done:?}");
            assert_eq!(done.skipped[0].environment_id.as_str(), "payments-dev");
            assert!(
                done.skipped[0].reason.starts_with("its Environment specification could not be reconciled"),
                "{done:?}"
            );
            let failing = t.db.item_health().problems();
            assert_eq!(failing.len(), 1, "{failing:?}");
            assert_eq!((failing[0].r#loop.as_str(), failing[0].tenant.as_str()), (LOOP, "acme"));
            t.cleanup().await;
        }
    }

    ferry_store::test_on_both_engines! {
        async fn a_window_an_old_version_reconciled_keeps_its_old_named_run(backend) {
            let t = TestDatabase::new(backend).await;
            runs_table(&t.db).await;
            projection_tables(&t.db, "environments").await;
            let window = "2026-12-07T16:00Z";
            let spec = applied_row(&t.db, "acme", "payments-dev").await;
            let acme = TenantId::parse("acme").unwrap();
            // An instance of the version before issue 37 reconciled this window.
            let old = ProvisioningRunId::legacy_for_reconciliation(&acme, spec, window);
            let by = Actor::parse("system:reconciler").unwrap();
            let runs: Repository<ProvisioningRun> = Repository::new(t.db.clone(), ());
            let request = RunRequest {
                provisioning_run_id: old,
                tenant_id: acme.clone(),
                project_id: ProjectId::parse("payments").unwrap(),
                environment_id: EnvironmentId::parse("payments-dev").unwrap(),
                environment_class: None,
                specification_id: spec,
                specification_version: 1,
                kind: ProvisioningKind::Reconciliation,
                promotion_id: None,
                approval_id: None,
                follows_failed_apply: None,
                requested_by: by.clone(),
                requested_at: Utc::now(),
            };
            runs.execute(&acme, &old.to_string(), RunCommand::Request(Box::new(request)), &metadata(&acme, &by, old), true)
                .await
                .unwrap();
            let done = reconcile(&t.db, &Scope::default(), window, &by).await.unwrap();
            assert_eq!(done.runs.len(), 1, "{done:?}");
            assert_eq!(done.runs[0].provisioning_run_id, old, "{backend:?}");
            assert!(!done.runs[0].started);
            // A window it did not reconcile gets the new name.
            let done = reconcile(&t.db, &Scope::default(), "2026-12-07T20:00Z", &by).await.unwrap();
            assert_eq!(
                done.runs[0].provisioning_run_id,
                ProvisioningRunId::for_reconciliation(&acme, spec, "2026-12-07T20:00Z")
            );
            t.cleanup().await;
        }
    }

    #[test]
    fn the_schedule_is_cron_syntax_and_names_its_windows() {
        let every_four_hours = Schedule::parse("0 */4 * * *").unwrap();
        let now = DateTime::parse_from_rfc3339("2026-12-03T09:30:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let next = every_four_hours.next_after(&now).unwrap();
        assert_eq!(scheduled_window(next), "2026-12-03T12:00Z");
        assert!(Schedule::parse("every four hours").is_err());
        assert!(Schedule::parse("61 * * * *").is_err());
        assert_ne!(manual_window(), manual_window());
    }
}
