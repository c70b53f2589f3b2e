//! The environments Ferry knows, recorded as events: recording one (a PlatformAdmin; until
//! the environment service's events arrive over NATS), reading it, and deciding the lowering
//! of its class. Creating one declares and plans its baseline.
//!
//! Lowering a class out of production waits for a second PlatformAdmin (a decision on the
//! pending lowering): until then the environment stays production, for every run.

use chrono::Utc;
use ferry_api::auth::Caller;
use ferry_api::extract::RequestIds;
use ferry_api::problem::ApiError;
use ferry_api::state::AppState;
use ferry_domain::environment::{
    BaselineProgram, Environment, EnvironmentCommand, EnvironmentRegistration, PendingLowering,
    SloObjective,
};
use ferry_domain::{EnvironmentClass, EnvironmentId};
use serde::{Deserialize, Serialize};

/// Body of `PUT /factory/environments/{environmentId}`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PutEnvironmentRequest {
    /// development, test, staging or production.
    pub environment_class: EnvironmentClass,
    /// Where the environment's health can be probed (http or https).
    #[serde(default)]
    pub health_url: Option<String>,
    /// The baseline program; else the configured default of the class is used.
    #[serde(default)]
    pub baseline_program: Option<BaselineProgram>,
    /// The service-level objective verification checks after an apply (a Prometheus query,
    /// `FERRY_PROMETHEUS_URL`), e.g. `{"query": "<error ratio>", "threshold": 0.01}`; none
    /// when absent.
    #[serde(default)]
    pub slo: Option<SloObjective>,
}

/// An environment as Ferry knows it.
#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvironmentView {
    /// The environment.
    pub environment_id: EnvironmentId,
    /// Its tenant.
    pub tenant_id: ferry_domain::TenantId,
    /// Its class.
    pub environment_class: EnvironmentClass,
    /// Its health URL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_url: Option<String>,
    /// Ready to receive changes.
    pub ready: bool,
    /// The baseline program it was created with, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_program: Option<BaselineProgram>,
    /// Its service-level objective, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slo: Option<SloObjective>,
    /// A lowering of the class out of production waiting for a second PlatformAdmin
    /// (`POST /factory/environments/{environmentId}/class-lowering`); until then the class
    /// above holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pending_class_lowering: Option<PendingLowering>,
}

/// Body of `POST /factory/environments/{environmentId}/class-lowering`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClassLoweringDecision {
    /// `approve` (someone other than the requester) lowers the class; `reject` keeps it.
    pub decision: ferry_domain::run::Decision,
}

/// What recording an environment did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recording {
    /// Recorded for the first time.
    Created,
    /// Updated, or unchanged.
    Updated,
    /// The class asked for is lower than production: that waits for a second PlatformAdmin,
    /// and the class is unchanged until then.
    LoweringPending,
}

fn view(env: &Environment) -> Option<EnvironmentView> {
    let r = env.registration()?;
    Some(EnvironmentView {
        environment_id: r.environment_id.clone(),
        tenant_id: r.tenant_id.clone(),
        environment_class: r.environment_class,
        health_url: r.health_url.clone(),
        ready: env.is_ready(),
        baseline_program: r.baseline_program.clone(),
        slo: r.slo.clone(),
        pending_class_lowering: env.pending_lowering().cloned(),
    })
}

/// An environment id as a caller gave it.
fn environment_id(raw: &str) -> Result<EnvironmentId, ApiError> {
    EnvironmentId::parse(raw).map_err(|e| ApiError::bad_field("environmentId", e))
}

/// Checks what a recording names that Ferry will reach later (the health URL verification
/// probes, the SLO query, the baseline program) against the tenant's confinement.
fn check_registration(
    state: &AppState,
    caller: &Caller,
    body: &PutEnvironmentRequest,
) -> Result<(), ApiError> {
    if let Some(url) = &body.health_url {
        let url = ferry_domain::ProbeUrl::parse(url.clone()).map_err(|_| {
            ApiError::invalid_field(
                "healthUrl",
                "must be an http(s) URL of at most 2048 characters",
            )
        })?;
        // Verification will send requests there: confined where the operator says so.
        state
            .confinement()
            .check_probe(&caller.tenant, &url)
            .map_err(|refusal| ApiError::invalid_field("healthUrl", refusal))?;
    }
    if let Some((field, reason)) = body.slo.as_ref().and_then(SloObjective::invalid) {
        return Err(ApiError::invalid_field(field, reason));
    }
    if let Some(slo) = &body.slo {
        // Every tenant's query goes to one Prometheus: it must read only this tenant's
        // series (confined again, with the rules of the day, before each evaluation).
        state
            .confinement()
            .confine_query(&caller.tenant, &slo.query)
            .map_err(|refusal| ApiError::invalid_field("slo.query", refusal))?;
    }
    if let Some(program) = &body.baseline_program {
        state
            .confinement()
            .check_baseline_program(&caller.tenant, program)
            .map_err(|refusal| {
                tracing::info!(%refusal, "baseline program refused");
                ApiError::invalid_field("baselineProgram.programRef", refusal)
            })?;
    }
    Ok(())
}

/// Recording the environment `environment` (as the caller named it; PlatformAdmin).
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, environment = %environment))]
pub async fn record(
    state: &AppState,
    caller: &Caller,
    ids: RequestIds,
    environment: &str,
    body: PutEnvironmentRequest,
) -> Result<(EnvironmentView, Recording), ApiError> {
    caller.require_platform_admin()?;
    let environment = environment_id(environment)?;
    check_registration(state, caller, &body)?;
    let registration = EnvironmentRegistration {
        environment_id: environment.clone(),
        tenant_id: caller.tenant.clone(),
        environment_class: body.environment_class,
        health_url: body.health_url,
        baseline_program: body.baseline_program,
        slo: body.slo,
        recorded_by: caller.actor.clone(),
        recorded_at: Utc::now(),
    };
    let metadata = caller.metadata(ids);
    let id = Environment::aggregate_id(&caller.tenant, &environment);
    let done = state
        .environments()
        .execute(
            &caller.tenant,
            &id,
            EnvironmentCommand::Register(Box::new(registration)),
            &metadata,
            true,
        )
        .await?;
    let created = done.sequence == 1 && !done.events.is_empty();
    let asked = body.environment_class;
    let view = view(&done.aggregate)
        .ok_or_else(|| ApiError::internal("environment without registration"))?;
    tracing::info!(created, class = ?view.environment_class, "environment recorded");
    let recording = if created {
        Recording::Created
    } else if view.environment_class != asked {
        // Lowering out of production waits for a second person.
        Recording::LoweringPending
    } else {
        Recording::Updated
    };
    Ok((view, recording))
}

/// The environment `environment` (as the caller named it) as Ferry knows it.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, environment = %environment))]
pub async fn environment(
    state: &AppState,
    caller: &Caller,
    environment: &str,
) -> Result<EnvironmentView, ApiError> {
    caller.require_read()?;
    let environment = environment_id(environment)?;
    let id = Environment::aggregate_id(&caller.tenant, &environment);
    state
        .environments()
        .load(&caller.tenant, &id)
        .await?
        .and_then(|(env, _)| view(&env))
        .ok_or_else(|| ApiError::NotFound(format!("no environment {environment}")))
}

/// A PlatformAdmin other than the one who asked approves lowering the class of `environment`
/// out of production (or anyone allowed refuses it).
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, environment = %environment))]
pub async fn decide_class_lowering(
    state: &AppState,
    caller: &Caller,
    ids: RequestIds,
    environment: &str,
    body: ClassLoweringDecision,
) -> Result<EnvironmentView, ApiError> {
    caller.require_platform_admin()?;
    let environment = environment_id(environment)?;
    let metadata = caller.metadata(ids);
    let id = Environment::aggregate_id(&caller.tenant, &environment);
    let done = state
        .environments()
        .execute(
            &caller.tenant,
            &id,
            EnvironmentCommand::DecideClassLowering {
                approve: body.decision == ferry_domain::run::Decision::Approve,
                by: caller.actor.clone(),
                at: Utc::now(),
            },
            &metadata,
            false,
        )
        .await?;
    let view = view(&done.aggregate)
        .ok_or_else(|| ApiError::internal("environment without registration"))?;
    tracing::info!(decision = ?body.decision, class = ?view.environment_class, "class lowering decided");
    Ok(view)
}
