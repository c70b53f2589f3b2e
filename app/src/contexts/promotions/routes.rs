//! The delivery API: releases, promotions, an environment's current release. Commands go
//! through the context's use cases ([`use_cases`]); this module translates HTTP to them.

use super::use_cases::{
    self, DecideApprovalRequest, LiftQuarantineRequest, PutReleaseRequest, QuarantineLiftView,
    RequestPromotionRequest, RollbackRequest, VerdictRequest,
};
use super::views::{
    self, PromotionFilter, PromotionView, ReleaseFilter, ReleaseState, ReleaseView,
};
use super::{OPERATE, PROMOTE, READ};
use aide::axum::routing::{get_with, post_with, put_with};
use aide::axum::ApiRouter;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferry_api::auth::Caller;
use ferry_api::extract::{
    created, created_answer, enum_from_str, idempotency_key, QueryParams, RequestIds, ValidJson,
};
use ferry_api::idempotent::Keyed;
use ferry_api::openapi::{schema_of, Doc};
use ferry_api::problem::ApiError;
use ferry_api::state::AppState;
use ferry_domain::promotion::gates::Completion;
use ferry_domain::promotion::PromotionState;
use ferry_domain::release::ReleaseVersion;
use ferry_domain::{EnvironmentClass, EnvironmentId, ProjectId, PromotionId, ReleaseId};
use serde::Serialize;
use serde_json::json;
use std::collections::HashMap;

fn release_id(raw: &str) -> Result<ReleaseId, ApiError> {
    ReleaseId::parse(raw).map_err(|e| ApiError::bad_field("releaseId", e))
}

fn promotion_id(raw: &str) -> Result<PromotionId, ApiError> {
    PromotionId::parse(raw)
        .map_err(|_| ApiError::NotFound(format!("no promotion {raw:?} (promotion ids are UUIDs)")))
}

/// `PUT /factory/delivery/releases/{releaseId}`: 201 when recorded, 200 when the same
/// release was recorded before.
pub async fn put_release(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    Path(raw): Path<String>,
    ValidJson { value: body, .. }: ValidJson<PutReleaseRequest>,
) -> Result<Response, ApiError> {
    let id = release_id(&raw)?;
    let recorded = use_cases::record_release(&state, &caller, ids, id, body).await?;
    Ok(if recorded.created {
        created(&format!("/factory/delivery/releases/{id}"), &recorded.view)
    } else {
        Json(recorded.view).into_response()
    })
}

/// `GET /factory/delivery/releases`
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant))]
pub async fn list_releases(
    State(state): State<AppState>,
    caller: Caller,
    Query(raw): Query<HashMap<String, String>>,
) -> Result<Json<ferry_projections::Page<ReleaseView>>, ApiError> {
    caller.require_scope(READ)?;
    let q = QueryParams::new(raw, &["projectId", "version", "state", "limit", "cursor"])?;
    let filter = ReleaseFilter {
        project_id: q.parse("projectId", |v| ProjectId::parse(v).ok(), "a project id")?,
        version: q.parse(
            "version",
            |v| ReleaseVersion::parse(v).ok(),
            "a release version",
        )?,
        state: q.parse("state", enum_from_str, "Ready or Withdrawn")?,
    };
    let (limit, cursor) = q.page()?;
    Ok(Json(
        views::list_releases(state.db(), &caller.tenant, &filter, limit, cursor).await?,
    ))
}

/// `GET /factory/delivery/releases/{releaseId}`
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, release = %raw))]
pub async fn get_release(
    State(state): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> Result<Json<ReleaseView>, ApiError> {
    caller.require_scope(READ)?;
    let id = ReleaseId::parse(&raw)
        .map_err(|_| ApiError::NotFound(format!("no release {raw:?} (release ids are UUIDs)")))?;
    views::get_release(state.db(), &caller.tenant, id)
        .await?
        .map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("no release {id}")))
}

/// `POST /factory/delivery/promotions` (RequestPromotion): the promotion starts in
/// `Requested` (queued while another promotion holds the environment).
pub async fn request_promotion(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    headers: HeaderMap,
    ValidJson { value: body, raw }: ValidJson<RequestPromotionRequest>,
) -> Result<Response, ApiError> {
    let key = idempotency_key(&headers)?;
    let keyed = key.as_ref().map(|key| Keyed { key, request: &raw });
    let requested = use_cases::request(&state, &caller, ids, body, keyed).await?;
    Ok(created_answer("/factory/delivery/promotions/", &requested))
}

/// `GET /factory/delivery/promotions`
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant))]
pub async fn list_promotions(
    State(state): State<AppState>,
    caller: Caller,
    Query(raw): Query<HashMap<String, String>>,
) -> Result<Json<ferry_projections::Page<PromotionView>>, ApiError> {
    caller.require_scope(READ)?;
    let q = QueryParams::new(
        raw,
        &["environmentId", "releaseId", "state", "limit", "cursor"],
    )?;
    let filter = PromotionFilter {
        environment_id: q.parse(
            "environmentId",
            |v| EnvironmentId::parse(v).ok(),
            "an environment id",
        )?,
        release_id: q.parse("releaseId", |v| ReleaseId::parse(v).ok(), "a UUID")?,
        state: q.parse(
            "state",
            enum_from_str::<PromotionState>,
            "one of Requested, GatesEvaluating, AwaitingApproval, Approved, Deploying, Verifying, Completed, Rejected, Failed, RolledBack",
        )?,
    };
    let (limit, cursor) = q.page()?;
    Ok(Json(
        views::list_promotions(state.db(), &caller.tenant, &filter, limit, cursor).await?,
    ))
}

/// `GET /factory/delivery/promotions/{promotionId}`
pub async fn get_promotion(
    State(state): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> Result<Json<PromotionView>, ApiError> {
    let id = promotion_id(&raw)?;
    Ok(Json(use_cases::promotion(&state, &caller, id).await?))
}

/// `GET /factory/delivery/promotions/{promotionId}/approval/plan-log`: the log of the plan
/// the promotion's approval covers, for those who decide it (`factory.delivery.read`, which
/// does not reach the run itself).
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, promotion = %raw))]
pub async fn approval_plan_log(
    State(state): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> Result<Response, ApiError> {
    let id = promotion_id(&raw)?;
    let log = use_cases::approval_plan_log(&state, &caller, id).await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], log).into_response())
}

/// `POST /factory/delivery/promotions/{promotionId}/approval`: a Reviewer or PlatformAdmin
/// other than the requester decides the production approval, which covers exactly the plan
/// attached to it.
pub async fn decide_approval(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    Path(raw): Path<String>,
    ValidJson { value: body, .. }: ValidJson<DecideApprovalRequest>,
) -> Result<Json<PromotionView>, ApiError> {
    let id = promotion_id(&raw)?;
    Ok(Json(
        use_cases::decide_approval(&state, &caller, ids, id, body).await?,
    ))
}

/// `POST /factory/delivery/promotions/{promotionId}/rollback`: an Operator rolls a completed
/// promotion back to the release completed in that environment before it.
pub async fn rollback(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    Path(raw): Path<String>,
    ValidJson { value: body, .. }: ValidJson<RollbackRequest>,
) -> Result<Json<PromotionView>, ApiError> {
    let id = promotion_id(&raw)?;
    Ok(Json(
        use_cases::rollback(&state, &caller, ids, id, body).await?,
    ))
}

/// `POST /factory/delivery/promotions/{promotionId}/verification`: an Operator passes or
/// fails a held verification.
pub async fn verdict(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    Path(raw): Path<String>,
    ValidJson { value: body, .. }: ValidJson<VerdictRequest>,
) -> Result<Json<PromotionView>, ApiError> {
    let id = promotion_id(&raw)?;
    Ok(Json(
        use_cases::verdict(&state, &caller, ids, id, body).await?,
    ))
}

/// The release running in an environment.
#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CurrentReleaseView {
    /// The environment.
    pub environment_id: EnvironmentId,
    /// The release last completed there (and not rolled back).
    pub release_id: ReleaseId,
    /// Its version.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<ReleaseVersion>,
    /// The promotion that completed it.
    pub completion: Completion,
}

/// `GET /factory/environments/{environmentId}/current-release`
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, environment = %raw))]
pub async fn current_release(
    State(state): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> Result<Json<CurrentReleaseView>, ApiError> {
    caller.require_scope(READ)?;
    let environment =
        EnvironmentId::parse(&raw).map_err(|e| ApiError::bad_field("environmentId", e))?;
    let (release_id, completion) = views::current_release(state.db(), &caller.tenant, &environment)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no release has completed in {environment}")))?;
    let version = views::get_release(state.db(), &caller.tenant, release_id)
        .await?
        .map(|r| r.release.version);
    Ok(Json(CurrentReleaseView {
        environment_id: environment,
        release_id,
        version,
        completion,
    }))
}

/// `POST /factory/delivery/releases/{releaseId}/quarantines/{environmentId}/lift`: an
/// Operator lets a release rolled back in an environment be promoted there again.
pub async fn lift_quarantine(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    Path(raw): Path<(String, String)>,
    ValidJson { value: body, .. }: ValidJson<LiftQuarantineRequest>,
) -> Result<Json<QuarantineLiftView>, ApiError> {
    let release = release_id(&raw.0)?;
    let environment =
        EnvironmentId::parse(&raw.1).map_err(|e| ApiError::bad_field("environmentId", e))?;
    Ok(Json(
        use_cases::lift_quarantine(&state, &caller, ids, release, environment, body).await?,
    ))
}

/// Every delivery route with its documentation.
pub fn routes() -> ApiRouter<AppState> {
    release_routes()
        .merge(promotion_routes())
        .merge(promotion_action_routes())
}

fn uuid_path() -> serde_json::Value {
    json!({"type": "string", "format": "uuid"})
}

/// Releases and their quarantines.
fn release_routes() -> ApiRouter<AppState> {
    let release_path = uuid_path;
    ApiRouter::new()
        .api_route(
            "/factory/delivery/releases",
            get_with(list_releases, |op| {
                op.id("ListReleases")
                    .summary("Releases Ferry may promote, newest first, each with the environments it completed in.")
                    .scope(READ)
                    .query("projectId", "Only this project's.", json!({"type": "string"}))
                    .query("version", "Only this version (with projectId: one release, e.g. shop@4.2.0).", json!({"type": "string"}))
                    .query("state", "Only in this state.", schema_of::<ReleaseState>())
                    .paging()
                    .response_with::<200, Json<ferry_projections::Page<ReleaseView>>, _>(|r| {
                        r.description("A page of releases.")
                    })
                    .errors(&[400, 401, 403])
            }),
        )
        .api_route(
            "/factory/delivery/releases/{releaseId}",
            put_with(put_release, move |op| {
                op.id("PutRelease")
                    .summary("Record a release as ready (for users without a release service): the release service's identity (factory.events.publish) or a PlatformAdmin (factory.delivery.promote). The same release again changes nothing; another under the same id is refused.")
                    .scope(PROMOTE)
                    .path("releaseId", "The release.", release_path())
                    .response_with::<200, Json<ReleaseView>, _>(|r| {
                        r.description("Already recorded, unchanged (201 when recorded now).")
                    })
                    .response_with::<201, Json<ReleaseView>, _>(|r| {
                        r.description("Recorded now.")
                    })
                    .errors(&[400, 401, 403, 409, 415, 422])
            })
            .get_with(get_release, move |op| {
                op.id("GetRelease")
                    .summary("One release with the environments it completed in.")
                    .scope(READ)
                    .path("releaseId", "The release.", release_path())
                    .response_with::<200, Json<ReleaseView>, _>(|r| r.description("The release."))
                    .errors(&[401, 403, 404])
            }),
        )
        .api_route(
            "/factory/delivery/releases/{releaseId}/quarantines/{environmentId}/lift",
            post_with(lift_quarantine, move |op| {
                op.id("LiftQuarantine")
                    .summary("Let a release rolled back in an environment be promoted there again (Operator; reason required, kept as evidence).")
                    .scope(OPERATE)
                    .path("releaseId", "The release.", release_path())
                    .path("environmentId", "The environment it was rolled back in.", json!({"type": "string"}))
                    .response_with::<200, Json<QuarantineLiftView>, _>(|r| {
                        r.description("The lifted quarantine.")
                    })
                    .errors(&[400, 401, 403, 404, 409, 415, 422])
            }),
        )
}

/// Requesting, reading and deciding promotions; the environments they go into.
fn promotion_routes() -> ApiRouter<AppState> {
    let promotion_path = uuid_path;
    ApiRouter::new()
        .api_route(
            "/factory/delivery/promotions",
            get_with(list_promotions, |op| {
                op.id("ListPromotions")
                    .summary("Promotions by environment, release and state, with gates, newest first.")
                    .scope(READ)
                    .query("environmentId", "Only into this environment.", json!({"type": "string"}))
                    .query("releaseId", "Only of this release.", json!({"type": "string", "format": "uuid"}))
                    .query("state", "Only in this state.", schema_of::<PromotionState>())
                    .paging()
                    .response_with::<200, Json<ferry_projections::Page<PromotionView>>, _>(|r| {
                        r.description("A page of promotions.")
                    })
                    .errors(&[400, 401, 403])
            })
            .post_with(request_promotion, |op| {
                op.id("RequestPromotion")
                    .summary("Promote a ready release into an environment: gates in order (pipeline results, policy, prior environment class, environment ready, evaluation evidence), then, for production, an approval by someone other than the requester. Queued while another promotion holds the environment.")
                    .scope(PROMOTE)
                    .idempotency_key()
                    .response_with::<201, Json<PromotionView>, _>(|r| r.description("The promotion."))
                    .errors(&[400, 401, 403, 409, 415, 422])
            }),
        )
        .api_route(
            "/factory/delivery/promotions/{promotionId}",
            get_with(get_promotion, move |op| {
                op.id("GetPromotion")
                    .summary("One promotion with gates, approval, desired state, verification and rollback evidence.")
                    .scope(READ)
                    .path("promotionId", "The promotion.", promotion_path())
                    .response_with::<200, Json<PromotionView>, _>(|r| r.description("The promotion."))
                    .errors(&[401, 403, 404])
            }),
        )
        .api_route(
            "/factory/delivery/promotions/{promotionId}/approval",
            post_with(decide_approval, move |op| {
                op.id("DecidePromotionApproval")
                    .summary("Approve or reject a production promotion's approval (Reviewer or PlatformAdmin; never the requester). It covers exactly the plan attached to it.")
                    .scope(PROMOTE)
                    .path("promotionId", "The promotion.", promotion_path())
                    .response_with::<200, Json<PromotionView>, _>(|r| {
                        r.description("The promotion after the decision.")
                    })
                    .errors(&[401, 403, 404, 409, 415, 422])
            }),
        )
        .api_route(
            "/factory/environments",
            get_with(super::environments::list_environments, |op| {
                op.id("ListEnvironments")
                    .summary("The tenant's environments, newest first, each with its class, readiness, the release current there per project, the promotions in flight, the last applied specification versions, open drift proposals and quarantines.")
                    .scope(READ)
                    .query("environmentClass", "Only this class.", schema_of::<EnvironmentClass>())
                    .paging()
                    .response_with::<200, Json<ferry_projections::Page<super::environments::EnvironmentSummary>>, _>(|r| {
                        r.description("A page of environments.")
                    })
                    .errors(&[400, 401, 403])
            }),
        )
}

/// What follows a promotion: its plan log, rollback and verification verdict, and the
/// release current in an environment.
fn promotion_action_routes() -> ApiRouter<AppState> {
    let promotion_path = uuid_path;
    ApiRouter::new()
        .api_route(
            "/factory/delivery/promotions/{promotionId}/approval/plan-log",
            get_with(approval_plan_log, move |op| {
                op.id("GetPromotionApprovalPlanLog")
                    .summary("The log of the plan the promotion's approval covers, as text (secrets redacted before storage), for those who decide it.")
                    .scope(READ)
                    .path("promotionId", "The promotion.", promotion_path())
                    .text(200, "The plan log.", "text/plain")
                    .errors(&[401, 403, 404])
            }),
        )
        .api_route(
            "/factory/delivery/promotions/{promotionId}/rollback",
            post_with(rollback, move |op| {
                op.id("RollbackPromotion")
                    .summary("Roll a completed promotion back to the release completed in that environment before it (Operator; reason required). The rollback is a promotion of that release through the same gates except the approval; the rolled-back release is quarantined there.")
                    .scope(OPERATE)
                    .path("promotionId", "The promotion.", promotion_path())
                    .response_with::<200, Json<PromotionView>, _>(|r| {
                        r.description("The promotion with its rollback under way.")
                    })
                    .errors(&[401, 403, 404, 409, 415, 422])
            }),
        )
        .api_route(
            "/factory/delivery/promotions/{promotionId}/verification",
            post_with(verdict, move |op| {
                op.id("DecideVerification")
                    .summary("Pass or fail a verification held as inconclusive or in error (Operator; reason required).")
                    .scope(OPERATE)
                    .path("promotionId", "The promotion.", promotion_path())
                    .response_with::<200, Json<PromotionView>, _>(|r| {
                        r.description("The promotion after the verdict.")
                    })
                    .errors(&[401, 403, 404, 409, 415, 422])
            }),
        )
        .api_route(
            "/factory/environments/{environmentId}/current-release",
            get_with(current_release, |op| {
                op.id("GetCurrentRelease")
                    .summary("The release currently completed in an environment.")
                    .scope(READ)
                    .path("environmentId", "The environment.", json!({"type": "string"}))
                    .response_with::<200, Json<CurrentReleaseView>, _>(|r| {
                        r.description("The current release.")
                    })
                    .errors(&[400, 401, 403, 404])
            }),
        )
}

/// The scopes the delivery routes name, for `ferry token`.
pub const SCOPES: [&str; 3] = [READ, PROMOTE, OPERATE];
