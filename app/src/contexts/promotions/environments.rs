//! `GET /factory/environments`: what runs where, in one request. Each of the tenant's
//! environments with its class and readiness (the environment as recorded), the release
//! current there per project, the promotions in flight, the quarantined releases (the
//! delivery read model), the last applied specification version of each kind and the open
//! drift proposals (the provisioning read model).

use super::READ;
use crate::contexts::provisioning::views::ProvisioningReads;
use axum::extract::{Query, State};
use axum::Json;
use ferry_api::auth::Caller;
use ferry_api::extract::QueryParams;
use ferry_api::problem::ApiError;
use ferry_api::state::AppState;
use ferry_domain::environment::{Environment, EnvironmentRegistration, PendingLowering};
use ferry_domain::{
    EnvironmentClass, EnvironmentId, ProjectId, PromotionId, ReleaseId, SpecificationKind, TenantId,
};
use ferry_projections::queries::{encode_cursor, QueryError};
use ferry_projections::Page;
use ferry_store::{on_pool, Database};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// One environment as the list shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvironmentSummary {
    /// The environment.
    pub environment_id: EnvironmentId,
    /// Its class now.
    pub environment_class: EnvironmentClass,
    /// Whether it was last reported ready.
    pub ready: bool,
    /// A lowering of its class out of production waiting for a second person.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_class_lowering: Option<PendingLowering>,
    /// The release last completed there, per project.
    pub current_releases: Vec<CurrentRelease>,
    /// The promotions into it not finished yet, oldest first.
    pub promotions_in_flight: Vec<PromotionInFlight>,
    /// The last applied specification version of each kind.
    pub applied_specifications: Vec<AppliedSpecification>,
    /// Reconciliations that would change it, waiting for an Operator.
    pub open_drift_proposals: u64,
    /// Releases rolled back there and not lifted: they may not be promoted there.
    pub quarantines: Vec<Quarantine>,
}

/// The release current in an environment for one project.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CurrentRelease {
    /// The project.
    pub project_id: ProjectId,
    /// The release.
    pub release_id: ReleaseId,
    /// The promotion that completed it there.
    pub promotion_id: PromotionId,
}

/// A promotion into the environment not finished yet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PromotionInFlight {
    /// The promotion.
    pub promotion_id: PromotionId,
    /// Its release.
    pub release_id: ReleaseId,
    /// Where it is (`Requested` … `Verifying`).
    pub state: String,
}

/// The last applied version of one kind of specification.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AppliedSpecification {
    /// `Environment` or `Workload`.
    pub kind: SpecificationKind,
    /// The version applied last.
    pub version: u32,
}

/// A release quarantined in the environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Quarantine {
    /// The release.
    pub release_id: ReleaseId,
    /// The promotion rolled back there.
    pub promotion_id: PromotionId,
}

/// `GET /factory/environments[?environmentClass=&limit=&cursor=]`: the tenant's
/// environments, newest first.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant))]
pub async fn list_environments(
    State(state): State<AppState>,
    caller: Caller,
    Query(raw): Query<HashMap<String, String>>,
) -> Result<Json<Page<EnvironmentSummary>>, ApiError> {
    let q = QueryParams::new(raw, &["environmentClass", "limit", "cursor"])?;
    let class: Option<EnvironmentClass> = q.parse(
        "environmentClass",
        |v| serde_json::from_value(serde_json::Value::String(v.to_string())).ok(),
        "development, test, staging or production",
    )?;
    let (limit, cursor) = q.page()?;
    environments(&state, &caller, class, limit, cursor)
        .await
        .map(Json)
}

/// The tenant's environments (of `class`, when given), newest first, a page of `limit`
/// after `cursor`: what runs where, for any transport.
pub async fn environments(
    state: &AppState,
    caller: &Caller,
    class: Option<EnvironmentClass>,
    limit: u32,
    cursor: Option<i64>,
) -> Result<Page<EnvironmentSummary>, ApiError> {
    caller.require_scope(READ)?;
    let db = state.db();
    let mut items = Vec::new();
    let mut next_cursor = None;
    // Environments by when they were first recorded; the class is the aggregate's, so the
    // filter is applied as they are read, until the page is full.
    for (aggregate_id, first) in environment_ids(db, &caller.tenant, cursor).await? {
        let Some((environment, _)) = state
            .environments()
            .load(&caller.tenant, &aggregate_id)
            .await?
        else {
            continue;
        };
        let Some(registration) = environment.registration() else {
            continue;
        };
        if class.is_some_and(|c| c != registration.environment_class) {
            continue;
        }
        if items.len() == limit as usize {
            next_cursor = Some(encode_cursor(first + 1));
            break;
        }
        items.push(summary(state, &caller.tenant, &environment, registration).await?);
    }
    Ok(Page { items, next_cursor })
}

/// The tenant's environment aggregates, newest first, with the position of their first
/// event (below `before` when given).
async fn environment_ids(
    db: &Database,
    tenant: &TenantId,
    before: Option<i64>,
) -> Result<Vec<(String, i64)>, QueryError> {
    let prefix = format!("{tenant}/");
    let sql = db.sql(
        "SELECT aggregate_id, MIN(global_position) AS first FROM events
          WHERE aggregate_type = 'Environment' AND substr(aggregate_id, 1, $2) = $1
          GROUP BY aggregate_id HAVING MIN(global_position) < $3 ORDER BY first DESC",
    );
    let rows: Vec<(String, i64)> = on_pool!(db, pool => sqlx::query_as(&sql)
        .bind(&prefix).bind(i32::try_from(prefix.chars().count()).unwrap_or(i32::MAX)).bind(before.unwrap_or(i64::MAX))
        .fetch_all(pool).await?);
    Ok(rows)
}

async fn summary(
    state: &AppState,
    tenant: &TenantId,
    environment: &Environment,
    registration: &EnvironmentRegistration,
) -> Result<EnvironmentSummary, ApiError> {
    let db = state.db();
    let id = registration.environment_id.clone();
    let current = db.sql(
        "SELECT project_id, release_id, promotion_id FROM (
           SELECT r.project_id, c.release_id, c.promotion_id,
                  ROW_NUMBER() OVER (PARTITION BY r.project_id ORDER BY c.position DESC) AS n
             FROM rm_release_completions c
             JOIN rm_releases r ON r.tenant_id = c.tenant_id AND r.release_id = c.release_id
            WHERE c.tenant_id = $1 AND c.environment_id = $2) latest
          WHERE n = 1 ORDER BY project_id",
    );
    let current: Vec<(String, String, String)> = on_pool!(db, pool => sqlx::query_as(&current)
        .bind(tenant.as_str()).bind(id.as_str()).fetch_all(pool).await.map_err(QueryError::from)?);
    let in_flight = db.sql(
        "SELECT promotion_id, release_id, state FROM rm_promotions
          WHERE tenant_id = $1 AND environment_id = $2
            AND state IN ('Requested', 'GatesEvaluating', 'AwaitingApproval', 'Approved',
                          'Deploying', 'Verifying')
          ORDER BY position",
    );
    let in_flight: Vec<(String, String, String)> = on_pool!(db, pool => sqlx::query_as(&in_flight)
        .bind(tenant.as_str()).bind(id.as_str()).fetch_all(pool).await.map_err(QueryError::from)?);
    let quarantined = db.sql(
        "SELECT p.release_id, p.promotion_id FROM rm_promotions p
          WHERE p.tenant_id = $1 AND p.environment_id = $2 AND p.state = 'RolledBack'
            AND NOT EXISTS (SELECT 1 FROM rm_quarantine_lifts l
                             WHERE l.promotion_id = p.promotion_id AND l.tenant_id = p.tenant_id)
          ORDER BY p.position",
    );
    let quarantined: Vec<(String, String)> = on_pool!(db, pool => sqlx::query_as(&quarantined)
        .bind(tenant.as_str()).bind(id.as_str()).fetch_all(pool).await.map_err(QueryError::from)?);
    let proposals = db.sql(
        "SELECT count(*) FROM rm_runs
          WHERE tenant_id = $1 AND environment_id = $2
            AND kind = 'Reconciliation' AND state = 'AwaitingApproval'",
    );
    let proposals: i64 = on_pool!(db, pool => sqlx::query_scalar(&proposals)
        .bind(tenant.as_str()).bind(id.as_str()).fetch_one(pool).await.map_err(QueryError::from)?);
    let applied = state
        .reads()
        .current_specification(tenant, &id)
        .await?
        .map(|current| {
            current
                .specifications
                .into_iter()
                .filter_map(|s| {
                    s.applied.map(|a| AppliedSpecification {
                        kind: s.kind,
                        version: a.version,
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    // Rows of the read model hold ids Ferry wrote; one that does not parse is skipped.
    Ok(EnvironmentSummary {
        environment_id: id,
        environment_class: registration.environment_class,
        ready: environment.is_ready(),
        pending_class_lowering: environment.pending_lowering().cloned(),
        current_releases: current
            .into_iter()
            .filter_map(|(project, release, promotion)| {
                Some(CurrentRelease {
                    project_id: ProjectId::parse(&project).ok()?,
                    release_id: ReleaseId::parse(&release).ok()?,
                    promotion_id: PromotionId::parse(&promotion).ok()?,
                })
            })
            .collect(),
        promotions_in_flight: in_flight
            .into_iter()
            .filter_map(|(promotion, release, state)| {
                Some(PromotionInFlight {
                    promotion_id: PromotionId::parse(&promotion).ok()?,
                    release_id: ReleaseId::parse(&release).ok()?,
                    state,
                })
            })
            .collect(),
        applied_specifications: applied,
        open_drift_proposals: u64::try_from(proposals).unwrap_or_default(),
        quarantines: quarantined
            .into_iter()
            .filter_map(|(release, promotion)| {
                Some(Quarantine {
                    release_id: ReleaseId::parse(&release).ok()?,
                    promotion_id: PromotionId::parse(&promotion).ok()?,
                })
            })
            .collect(),
    })
}
