//! The provisioning API (HTTP): specifications, runs, an environment's current
//! specification, and the environments Ferry knows. Each handler parses the request, calls
//! the context's use case ([`use_cases`], [`environments`]) and shapes the answer; the route
//! declarations carry each operation's documentation, grouped per resource.
//!
//! A list handler checks the caller's scope before it parses the query, as the API always
//! has (a caller without the scope learns nothing about its query); the use case checks it
//! again, for every transport.

use super::environments::{self, ClassLoweringDecision, EnvironmentView, PutEnvironmentRequest};
use super::use_cases::{
    self, ApprovalRequest, CancelRequest, DeclareSpecificationRequest, DeclaredSpecification,
    PlanProvisioningRequest,
};
use super::views::{CurrentSpecificationView, RunFilter, RunView, SpecificationFilter};
use aide::axum::routing::{get_with, post_with, put_with};
use aide::axum::ApiRouter;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferry_api::auth::Caller;
use ferry_api::extract::{
    created, created_answer, enum_from_str, idempotency_key, OptionalJson, QueryParams, RequestIds,
    ValidJson,
};
use ferry_api::idempotent::Keyed;
use ferry_api::openapi::{schema_of, Doc, APPLY, READ};
use ferry_api::problem::ApiError;
use ferry_api::state::AppState;
use ferry_domain::specification::SpecificationVersion;
use ferry_domain::{
    EnvironmentId, ProjectId, ProvisioningKind, ProvisioningState, SpecificationId,
    SpecificationKind,
};
use ferry_projections::Page;
use serde_json::json;
use std::collections::HashMap;

/// `GET /factory/provisioning/specifications`
pub async fn list_specifications(
    State(state): State<AppState>,
    caller: Caller,
    Query(raw): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    caller.require_read()?;
    let q = QueryParams::new(
        raw,
        &[
            "environmentId",
            "projectId",
            "kind",
            "specificationId",
            "limit",
            "cursor",
        ],
    )?;
    let filter = SpecificationFilter {
        environment_id: q.parse(
            "environmentId",
            |v| EnvironmentId::parse(v).ok(),
            "an environment id",
        )?,
        project_id: q.parse("projectId", |v| ProjectId::parse(v).ok(), "a project id")?,
        kind: q.parse("kind", enum_from_str, "Environment or Workload")?,
        specification_id: q.parse(
            "specificationId",
            |v| SpecificationId::parse(v).ok(),
            "a UUID",
        )?,
    };
    let (limit, cursor) = q.page()?;
    let page = use_cases::list_specifications(&state, &caller, &filter, limit, cursor).await?;
    Ok(Json(page).into_response())
}

/// `POST /factory/provisioning/specifications`
pub async fn declare_specification(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    ValidJson { value: body, .. }: ValidJson<DeclareSpecificationRequest>,
) -> Result<Response, ApiError> {
    let declared = use_cases::declare_specification(&state, &caller, ids, body).await?;
    let location = format!(
        "/factory/provisioning/specifications?specificationId={}",
        declared.version.specification_id
    );
    Ok(created(&location, &declared))
}

/// `GET /factory/provisioning/runs`
pub async fn list_runs(
    State(state): State<AppState>,
    caller: Caller,
    Query(raw): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    caller.require_read()?;
    let q = QueryParams::new(raw, &["environmentId", "kind", "state", "limit", "cursor"])?;
    let filter = RunFilter {
        environment_id: q.parse("environmentId", |v| EnvironmentId::parse(v).ok(), "an environment id")?,
        kind: q.parse("kind", enum_from_str, "Baseline, Release, Reconciliation or Decommission")?,
        state: q.parse(
            "state",
            enum_from_str,
            "one of Requested, Planned, AwaitingApproval, Applying, Applied, Failed, Rejected, Cancelled, Superseded, InSync",
        )?,
        destructive: None,
    };
    let (limit, cursor) = q.page()?;
    let page = use_cases::list_runs(&state, &caller, &filter, limit, cursor).await?;
    Ok(Json(page).into_response())
}

/// `GET /factory/provisioning/runs/{provisioningRunId}`
pub async fn get_run(
    State(state): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> Result<Response, ApiError> {
    let run = use_cases::run(&state, &caller, &raw).await?;
    Ok(Json(run).into_response())
}

/// `POST /factory/provisioning/runs` (PlanProvisioning): records the run in `Requested`.
pub async fn plan_provisioning(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    headers: HeaderMap,
    ValidJson { value: body, raw }: ValidJson<PlanProvisioningRequest>,
) -> Result<Response, ApiError> {
    let key = idempotency_key(&headers)?;
    let keyed = key.as_ref().map(|key| Keyed { key, request: &raw });
    let planned = use_cases::plan(&state, &caller, ids, body, keyed).await?;
    Ok(created_answer("/factory/provisioning/runs/", &planned))
}

/// `GET /factory/provisioning/runs/{provisioningRunId}/logs`: the plan log, then the apply
/// log, as text.
pub async fn run_logs(
    State(state): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> Result<Response, ApiError> {
    let text = use_cases::run_logs(&state, &caller, &raw).await?;
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

/// `POST /factory/provisioning/runs/{provisioningRunId}/cancel`
pub async fn cancel_run(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    Path(raw): Path<String>,
    OptionalJson(body): OptionalJson<CancelRequest>,
) -> Result<Response, ApiError> {
    let run = use_cases::cancel(&state, &caller, ids, &raw, body).await?;
    Ok(Json(run).into_response())
}

/// `POST /factory/provisioning/runs/{provisioningRunId}/approval`
pub async fn decide_approval(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    Path(raw): Path<String>,
    ValidJson { value: body, .. }: ValidJson<ApprovalRequest>,
) -> Result<Response, ApiError> {
    let run = use_cases::decide_approval(&state, &caller, ids, &raw, body).await?;
    Ok(Json(run).into_response())
}

/// `GET /factory/provisioning/environments/{environmentId}/current-specification`
pub async fn current_specification(
    State(state): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> Result<Response, ApiError> {
    let view = use_cases::current_specification(&state, &caller, &raw).await?;
    Ok(Json(view).into_response())
}

/// `PUT /factory/environments/{environmentId}`: 201 when recorded, 200 when updated or
/// unchanged, 202 when lowering the class out of production waits for a second person.
pub async fn put_environment(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    Path(raw): Path<String>,
    ValidJson { value: body, .. }: ValidJson<PutEnvironmentRequest>,
) -> Result<Response, ApiError> {
    let (view, recording) = environments::record(&state, &caller, ids, &raw, body).await?;
    let status = match recording {
        environments::Recording::Created => StatusCode::CREATED,
        environments::Recording::LoweringPending => StatusCode::ACCEPTED,
        environments::Recording::Updated => StatusCode::OK,
    };
    Ok((status, Json(view)).into_response())
}

/// `GET /factory/environments/{environmentId}`.
pub async fn get_environment(
    State(state): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> Result<Response, ApiError> {
    let view = environments::environment(&state, &caller, &raw).await?;
    Ok(Json(view).into_response())
}

/// `POST /factory/environments/{environmentId}/class-lowering`
pub async fn decide_class_lowering(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    Path(raw): Path<String>,
    ValidJson { value: body, .. }: ValidJson<ClassLoweringDecision>,
) -> Result<Response, ApiError> {
    let view = environments::decide_class_lowering(&state, &caller, ids, &raw, body).await?;
    Ok(Json(view).into_response())
}

/// The provisioning context's routes with their documentation (declared in this order, which
/// the OpenAPI document's schema names follow).
pub fn routes() -> ApiRouter<AppState> {
    specification_routes()
        .merge(run_routes())
        .merge(environment_routes())
}

/// The path parameter of an environment.
fn environment_id() -> serde_json::Value {
    json!({"type": "string"})
}

/// `/factory/provisioning/specifications`.
fn specification_routes() -> ApiRouter<AppState> {
    ApiRouter::new().api_route(
        "/factory/provisioning/specifications",
        get_with(list_specifications, |op| {
            op.id("ListSpecifications")
                .summary("Every declared specification version, newest first.")
                .scope(READ)
                .query("environmentId", "Only this environment.", json!({"type": "string"}))
                .query("projectId", "Only this project.", json!({"type": "string"}))
                .query("kind", "Only this kind.", schema_of::<SpecificationKind>())
                .query(
                    "specificationId",
                    "Only this specification's versions.",
                    json!({"type": "string", "format": "uuid"}),
                )
                .paging()
                .response_with::<200, Json<Page<SpecificationVersion>>, _>(|r| {
                    r.description("A page of versions.")
                })
                .errors(&[400, 401, 403])
        })
        .post_with(declare_specification, |op| {
            op.id("DeclareSpecification")
                .summary("Declare a new immutable version of an environment's desired state.")
                .scope(APPLY)
                .response_with::<201, Json<DeclaredSpecification>, _>(|r| {
                    r.description("The new version, with warnings (e.g. an environment not recorded, treated as production).")
                })
                .errors(&[400, 401, 403, 409, 415, 422])
        }),
    )
}

/// `/factory/provisioning/runs` and one run's `cancel`, `approval` and `logs`.
fn run_routes() -> ApiRouter<AppState> {
    let run = "/factory/provisioning/runs/{provisioningRunId}";
    let run_id = || json!({"type": "string", "format": "uuid"});
    ApiRouter::new()
        .api_route(
            "/factory/provisioning/runs",
            get_with(list_runs, |op| {
                op.id("ListProvisioningRuns")
                    .summary("Runs by environment, kind and state, with receipts, newest first.")
                    .scope(READ)
                    .query("environmentId", "Only this environment.", json!({"type": "string"}))
                    .query("kind", "Only this kind.", schema_of::<ProvisioningKind>())
                    .query("state", "Only this state.", schema_of::<ProvisioningState>())
                    .paging()
                    .response_with::<200, Json<Page<RunView>>, _>(|r| r.description("A page of runs."))
                    .errors(&[400, 401, 403])
            })
            .post_with(plan_provisioning, |op| {
                op.id("PlanProvisioning")
                    .summary("Plan a specification version against an environment; the run starts in Requested.")
                    .scope(APPLY)
                    .idempotency_key()
                    .response_with::<201, Json<RunView>, _>(|r| r.description("The run."))
                    .errors(&[400, 401, 403, 409, 415, 422])
            }),
        )
        .api_route(
            run,
            get_with(get_run, move |op| {
                op.id("GetProvisioningRun")
                    .summary("One run with its plan, approval, apply receipt and logs.")
                    .scope(READ)
                    .path("provisioningRunId", "The run.", run_id())
                    .response_with::<200, Json<RunView>, _>(|r| r.description("The run."))
                    .errors(&[401, 403, 404])
            }),
        )
        .api_route(
            &format!("{run}/cancel"),
            post_with(cancel_run, move |op| {
                op.id("CancelProvisioning")
                    .summary("Cancel a run before apply.")
                    .scope(APPLY)
                    .path("provisioningRunId", "The run.", run_id())
                    .response_with::<200, Json<RunView>, _>(|r| r.description("The cancelled run."))
                    .errors(&[401, 403, 404, 409, 415, 422])
            }),
        )
        .api_route(
            &format!("{run}/approval"),
            post_with(decide_approval, move |op| {
                op.id("DecideApproval")
                    .summary("Approve or reject a run awaiting approval; the requester cannot approve.")
                    .scope(APPLY)
                    .path("provisioningRunId", "The run.", run_id())
                    .response_with::<200, Json<RunView>, _>(|r| {
                        r.description("The run after the decision.")
                    })
                    .errors(&[401, 403, 404, 409, 415, 422])
            }),
        )
        .api_route(
            &format!("{run}/logs"),
            get_with(run_logs, move |op| {
                op.id("GetProvisioningRunLogs")
                    .summary("The run's plan and apply logs as text (secrets redacted before storage).")
                    .scope(READ)
                    .path("provisioningRunId", "The run.", run_id())
                    .text(200, "The logs.", "text/plain")
                    .errors(&[401, 403, 404])
            }),
        )
}

/// An environment's current specification, and the environments Ferry knows with the
/// lowering of their class.
fn environment_routes() -> ApiRouter<AppState> {
    ApiRouter::new()
        .api_route(
            "/factory/provisioning/environments/{environmentId}/current-specification",
            get_with(current_specification, move |op| {
                op.id("GetCurrentSpecification")
                    .summary("The newest declared and the last applied specification of each kind for an environment.")
                    .scope(READ)
                    .path("environmentId", "The environment.", environment_id())
                    .response_with::<200, Json<CurrentSpecificationView>, _>(|r| {
                        r.description("The environment's specifications.")
                    })
                    .errors(&[400, 401, 403, 404])
            }),
        )
        .api_route(
            "/factory/environments/{environmentId}",
            put_with(put_environment, move |op| {
                op.id("PutEnvironment")
                    .summary("Record an environment (PlatformAdmin); a new one gets its baseline declared and planned.")
                    .scope(APPLY)
                    .path("environmentId", "The environment.", environment_id())
                    .response_with::<200, Json<EnvironmentView>, _>(|r| {
                        r.description("Updated or unchanged (201 when recorded for the first time).")
                    })
                    .response_with::<201, Json<EnvironmentView>, _>(|r| {
                        r.description("Recorded for the first time.")
                    })
                    .response_with::<202, Json<EnvironmentView>, _>(|r| {
                        r.description("Lowering the class out of production waits for a second PlatformAdmin (pendingClassLowering); the class is unchanged until then.")
                    })
                    .errors(&[400, 401, 403, 409, 415, 422])
            })
            .get_with(get_environment, move |op| {
                op.id("GetEnvironment")
                    .summary("An environment as Ferry knows it.")
                    .scope(READ)
                    .path("environmentId", "The environment.", environment_id())
                    .response_with::<200, Json<EnvironmentView>, _>(|r| {
                        r.description("The environment.")
                    })
                    .errors(&[400, 401, 403, 404])
            }),
        )
        .api_route(
            "/factory/environments/{environmentId}/class-lowering",
            post_with(decide_class_lowering, move |op| {
                op.id("DecideClassLowering")
                    .summary("Approve or reject lowering an environment's class out of production (PlatformAdmin; never the one who asked for it).")
                    .scope(APPLY)
                    .path("environmentId", "The environment.", environment_id())
                    .response_with::<200, Json<EnvironmentView>, _>(|r| {
                        r.description("The environment after the decision.")
                    })
                    .errors(&[400, 401, 403, 404, 409, 415, 422])
            }),
        )
}
