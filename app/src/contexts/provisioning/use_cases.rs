//! The provisioning context's use cases for specifications and runs: declaring a
//! specification, requesting a plan, cancelling a run, deciding its approval, and reading
//! specifications, runs and their logs. Each owns its authorisation, its checks, its command
//! and its read-your-writes; HTTP (`routes`), gRPC and the inbound handlers only translate to
//! and from them. The environments' use cases are in `environments`.
//!
//! A run or an environment is named as its caller gave it: an id that cannot be one names
//! nothing, answered after the caller's scope is checked, so a caller without it learns
//! nothing about what it named.

use super::views::{
    CurrentSpecificationView, ProvisioningReads, RunFilter, RunView, SpecificationFilter,
};
use chrono::Utc;
use ferry_api::auth::Caller;
use ferry_api::basis::Decided;
use ferry_api::extract::RequestIds;
use ferry_api::idempotent::{Created, IdempotentCommand, Keyed};
use ferry_api::problem::{refused_references, ApiError, FieldError};
use ferry_api::state::AppState;
use ferry_domain::environment::Environment;
use ferry_domain::run::{Decision, RunCommand, RunEvent, RunRequest};
use ferry_domain::specification::{Declaration, SpecificationCommand, SpecificationVersion};
use ferry_domain::*;
use ferry_projections::Page;
use ferry_store::{Basis, Read};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Body of `POST /factory/provisioning/specifications`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeclareSpecificationRequest {
    /// The environment.
    pub environment_id: EnvironmentId,
    /// The project.
    pub project_id: ProjectId,
    /// `Environment` or `Workload`.
    pub kind: SpecificationKind,
    /// `<repository>#<folder>`.
    pub program_ref: ProgramRef,
    /// The program's Git commit.
    pub program_version: ProgramVersion,
    /// The release it deploys.
    #[serde(default)]
    pub release_id: Option<ReleaseId>,
    /// Roll-out strategy.
    #[serde(default)]
    pub strategy: Option<Strategy>,
    /// Configuration references by name (`file:///…`, `https://…`).
    #[serde(default)]
    pub config_refs: BTreeMap<String, ConfigRef>,
    /// Secret references by name (`env://NAME`, `file:///path`, `vault://mount/path#key`).
    #[serde(default)]
    pub secret_refs: BTreeMap<String, SecretRef>,
}

/// Body of `POST /factory/provisioning/runs` (PlanProvisioning).
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PlanProvisioningRequest {
    /// The specification to plan.
    pub specification_id: SpecificationId,
    /// Its version.
    pub specification_version: u32,
    /// The environment (must be the specification's).
    pub environment_id: EnvironmentId,
    /// Baseline, Release, Reconciliation or Decommission.
    pub kind: ProvisioningKind,
    /// Refused: only Ferry's promotions hand-off sets a promotion (a caller cannot
    /// supply a promotion's approval).
    #[serde(default)]
    pub promotion_id: Option<serde_json::Value>,
    /// Refused: see `promotionId`.
    #[serde(default)]
    pub approval_id: Option<serde_json::Value>,
}

/// Why a caller's body can never carry a promotion or its approval.
const HAND_OFF_ONLY: &str = "set only by Ferry when an approved promotion it holds hands over \
its desired state; a caller cannot supply a promotion or an approval";

/// Body of `POST /factory/provisioning/runs/{id}/cancel` (optional).
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CancelRequest {
    /// Why.
    #[serde(default)]
    pub reason: Option<String>,
}

/// Body of `POST /factory/provisioning/runs/{id}/approval`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApprovalRequest {
    /// `approve` or `reject`.
    pub decision: Decision,
    /// Why.
    #[serde(default)]
    pub reason: Option<String>,
}

/// The answer to a declaration: the new version, and what the caller should know about it.
#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeclaredSpecification {
    /// The new version.
    #[serde(flatten)]
    pub version: SpecificationVersion,
    /// E.g. that its environment is not recorded and is treated as production.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// An optional reason: blank is none; otherwise fit to show (see `ferry_domain::text`).
fn check_reason(reason: &Option<String>) -> Result<Option<String>, ApiError> {
    match reason.as_deref().map(str::trim) {
        None | Some("") => Ok(None),
        Some(r) => {
            ferry_domain::text::check_free_text("reason", r).map_err(ApiError::invalid_text)?;
            Ok(Some(r.to_string()))
        }
    }
}

fn check_ref_keys<T>(field: &str, refs: &BTreeMap<String, T>) -> Result<(), ApiError> {
    for key in refs.keys() {
        if key.is_empty()
            || key.len() > 256
            || key
                .chars()
                .any(|c| c.is_whitespace() || ferry_domain::text::is_hidden_or_control(c))
        {
            return Err(ApiError::invalid_field(
                &format!("{field}.{key}"),
                "names must be 1 to 256 characters without whitespace, control or invisible characters",
            ));
        }
    }
    Ok(())
}

/// A page of the tenant's specification versions that `filter` selects, newest first.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant))]
pub async fn list_specifications(
    state: &AppState,
    caller: &Caller,
    filter: &SpecificationFilter,
    limit: u32,
    cursor: Option<i64>,
) -> Result<Page<SpecificationVersion>, ApiError> {
    caller.require_read()?;
    Ok(state
        .reads()
        .list_specifications(&caller.tenant, filter, limit, cursor)
        .await?)
}

/// Declaring a new immutable version of an environment's desired state (the use case behind
/// `POST /factory/provisioning/specifications`).
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant))]
pub async fn declare_specification(
    state: &AppState,
    caller: &Caller,
    ids: RequestIds,
    body: DeclareSpecificationRequest,
) -> Result<DeclaredSpecification, ApiError> {
    caller.require_apply()?;
    check_ref_keys("configRefs", &body.config_refs)?;
    check_ref_keys("secretRefs", &body.secret_refs)?;
    // Every reference must be one this tenant may reach; refused before any event.
    state
        .confinement()
        .check_specification(
            &caller.tenant,
            &body.program_ref,
            &body.program_version,
            &body.config_refs,
            &body.secret_refs,
        )
        .map_err(refused_references)?;
    // A typo in the folder or the commit is caught now, not at plan time.
    check_program_found(state, caller, &body.program_ref, &body.program_version).await?;
    let warnings = unrecorded_environment(state, caller, &body.environment_id).await?;
    let id = SpecificationId::for_environment(&caller.tenant, &body.environment_id, body.kind);
    let declaration = Declaration {
        specification_id: id,
        tenant_id: caller.tenant.clone(),
        project_id: body.project_id,
        environment_id: body.environment_id,
        kind: body.kind,
        program_ref: body.program_ref,
        program_version: body.program_version,
        release_id: body.release_id,
        strategy: body.strategy,
        config_refs: body.config_refs,
        secret_refs: body.secret_refs,
        declared_by: caller.actor.clone(),
        declared_at: Utc::now(),
    };
    let done = state
        .specifications()
        .execute(
            &caller.tenant,
            &id.to_string(),
            SpecificationCommand::Declare(Box::new(declaration)),
            &caller.metadata(ids),
            true,
        )
        .await?;
    let version: SpecificationVersion = done
        .aggregate
        .latest()
        .cloned()
        .ok_or_else(|| ApiError::internal("declared specification has no version"))?;
    state
        .reads()
        .wait_for_specification(
            &caller.tenant,
            id,
            version.version,
            done.position,
            state.read_your_writes(),
        )
        .await?;
    tracing::info!(specification_id = %id, version = version.version, ?warnings, "specification declared");
    Ok(DeclaredSpecification { version, warnings })
}

/// An environment Ferry has not heard of counts as production: the warning that says so, if
/// `environment` is one.
async fn unrecorded_environment(
    state: &AppState,
    caller: &Caller,
    environment: &EnvironmentId,
) -> Result<Vec<String>, ApiError> {
    let known = state
        .environments()
        .load(
            &caller.tenant,
            &Environment::aggregate_id(&caller.tenant, environment),
        )
        .await?
        .is_some_and(|(env, _)| env.registration().is_some());
    Ok(if known {
        Vec::new()
    } else {
        vec![format!(
            "environment {environment} is not recorded: its runs are treated as production (an approval for every apply) until it is recorded with PUT /factory/environments/{environment} or the environment service's EnvironmentCreated"
        )]
    })
}

/// Looks a declared program up where its repository can be reached: a commit or folder it
/// does not hold is a 422 naming `programVersion` or `programRef` and what is missing. A
/// repository that cannot be reached now is left to plan time, which checks again.
pub async fn check_program_found(
    state: &AppState,
    caller: &Caller,
    program: &ferry_domain::ProgramRef,
    version: &ferry_domain::ProgramVersion,
) -> Result<(), ApiError> {
    use ferry_domain::ports::sources::SourceError;
    match state
        .programs()
        .locate(&caller.tenant, program, version)
        .await
    {
        Ok(()) => Ok(()),
        Err(e @ SourceError::CommitNotFound { .. }) => {
            Err(ApiError::invalid_field("programVersion", e))
        }
        Err(e @ SourceError::FolderNotFound { .. }) => {
            Err(ApiError::invalid_field("programRef", e))
        }
        Err(e) => {
            tracing::info!(error = %e, "program not looked up at declaration; planning checks it");
            Ok(())
        }
    }
}

/// The newest declared and the last applied specification of each kind for `environment`
/// (as the caller named it).
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, environment = %environment))]
pub async fn current_specification(
    state: &AppState,
    caller: &Caller,
    environment: &str,
) -> Result<CurrentSpecificationView, ApiError> {
    caller.require_read()?;
    let environment = EnvironmentId::parse(environment.to_string())
        .map_err(|e| ApiError::bad_field("environmentId", e))?;
    state
        .reads()
        .current_specification(&caller.tenant, &environment)
        .await?
        .ok_or_else(|| {
            ApiError::NotFound(format!(
                "no specification declared for environment {environment}"
            ))
        })
}

/// A page of the tenant's runs that `filter` selects, newest first.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant))]
pub async fn list_runs(
    state: &AppState,
    caller: &Caller,
    filter: &RunFilter,
    limit: u32,
    cursor: Option<i64>,
) -> Result<Page<RunView>, ApiError> {
    caller.require_read()?;
    Ok(state
        .reads()
        .list_runs(&caller.tenant, filter, limit, cursor)
        .await?)
}

/// A run id as a caller gave it: one that is not a UUID names no run.
fn run_id(raw: &str) -> Result<ProvisioningRunId, ApiError> {
    ProvisioningRunId::parse(raw)
        .map_err(|_| ApiError::NotFound(format!("no provisioning run {raw:?} (run ids are UUIDs)")))
}

/// One run (as the caller named it) with its plan, approval, apply receipt and logs.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, run = %run))]
pub async fn run(state: &AppState, caller: &Caller, run: &str) -> Result<RunView, ApiError> {
    caller.require_read()?;
    let id = run_id(run)?;
    state
        .reads()
        .get_run(&caller.tenant, id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no provisioning run {id}")))
}

/// Requesting a plan (the use case behind `POST /factory/provisioning/runs`): an Operator's
/// run of a declared specification version, in `Requested`.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant))]
pub async fn plan(
    state: &AppState,
    caller: &Caller,
    ids: RequestIds,
    body: PlanProvisioningRequest,
    keyed: Option<Keyed<'_>>,
) -> Result<Created<RunView>, ApiError> {
    caller.require_apply()?;
    // Authority never comes from a body: an approval named here would let any Operator
    // apply to production unapproved.
    let forged: Vec<FieldError> = [
        ("promotionId", body.promotion_id.is_some()),
        ("approvalId", body.approval_id.is_some()),
    ]
    .into_iter()
    .filter(|(_, present)| *present)
    .map(|(field, _)| FieldError::new(field, HAND_OFF_ONLY))
    .collect();
    if !forged.is_empty() {
        return Err(ApiError::Unprocessable(forged));
    }
    if body.specification_version == 0 {
        return Err(ApiError::invalid_field(
            "specificationVersion",
            "versions start at 1",
        ));
    }
    // Decided on the cached specification and environment, which the append checks (see
    // `ferry_api::basis`).
    let mut decision = Decided::decide(|read| plan_basis(state, caller, &body, read)).await?;
    let key = keyed.map(|k| k.key);
    let command = IdempotentCommand {
        db: state.db(),
        tenant: &caller.tenant,
        keyed,
        operation: "PlanProvisioning",
        owner: ids.request_id.to_string(),
    };
    let planned = command
        .create(|run_id: ProvisioningRunId| async move {
            let executed = decision
                .execute(
                    |read| plan_basis(state, caller, &body, read),
                    |decided: &PlanBasis| {
                        let request = run_request(caller, &body, decided, run_id);
                        let basis = decided.basis.clone();
                        async move {
                            state
                                .runs()
                                .execute_on(
                                    &caller.tenant,
                                    &run_id.to_string(),
                                    RunCommand::Request(Box::new(request)),
                                    &caller.metadata(ids),
                                    true,
                                    &basis,
                                )
                                .await
                        }
                    },
                )
                .await?;
            let (view, after) = match executed {
                Ok(done) => (fold(done.history.as_deref())?, done.position),
                // Another request with this key created the run first (it committed
                // before us, or concurrently): answer with that run.
                Err(
                    e @ (ferry_store::CommandError::Domain(
                        ferry_domain::run::RunError::AlreadyRequested,
                    )
                    | ferry_store::CommandError::Conflict),
                ) if key.is_some() => {
                    match state
                        .runs()
                        .load_events(&caller.tenant, &run_id.to_string())
                        .await?
                    {
                        // The other request waits for its own events; this one reads at once.
                        Some(history) => (fold(Some(&history))?, None),
                        None => return Err(e.into()),
                    }
                }
                Err(e) => return Err(e.into()),
            };
            state
                .reads()
                .wait_for_run(
                    &caller.tenant,
                    run_id,
                    view.version,
                    after,
                    state.read_your_writes(),
                )
                .await?;
            Ok(view)
        })
        .await?;
    if let Created::New { view, .. } = &planned {
        state.telemetry().run_reached(
            caller.tenant.as_str(),
            view.kind.as_str(),
            view.state.as_str(),
        );
    }
    tracing::info!(provisioning_run_id = %planned.id(), "provisioning requested");
    Ok(planned)
}

/// The run `body` asks for, as decided on `decided`.
fn run_request(
    caller: &Caller,
    body: &PlanProvisioningRequest,
    decided: &PlanBasis,
    run_id: ProvisioningRunId,
) -> RunRequest {
    RunRequest {
        provisioning_run_id: run_id,
        tenant_id: caller.tenant.clone(),
        project_id: decided.project_id.clone(),
        environment_id: body.environment_id.clone(),
        // Unknown environments count as production (the domain's rule).
        environment_class: decided.environment_class,
        specification_id: body.specification_id,
        specification_version: body.specification_version,
        kind: body.kind,
        promotion_id: None,
        approval_id: None,
        follows_failed_apply: None,
        requested_by: caller.actor.clone(),
        requested_at: Utc::now(),
    }
}

/// What a plan request is decided on besides its run: the specification version it names
/// and its environment's class, with the bases the run's append checks.
struct PlanBasis {
    project_id: ProjectId,
    environment_class: Option<EnvironmentClass>,
    basis: [Basis; 2],
}

/// Reads and checks the specification version and the environment `body` names.
async fn plan_basis(
    state: &AppState,
    caller: &Caller,
    body: &PlanProvisioningRequest,
    read: Read,
) -> Result<PlanBasis, ApiError> {
    let (spec, spec_basis) = state
        .specifications()
        .load_basis(&caller.tenant, &body.specification_id.to_string(), read)
        .await?;
    let spec = spec.ok_or_else(|| {
        ApiError::invalid_field(
            "specificationId",
            format!("no specification {}", body.specification_id),
        )
    })?;
    let version = spec.version(body.specification_version).ok_or_else(|| {
        ApiError::invalid_field(
            "specificationVersion",
            format!(
                "specification {} has no version {} (latest is {})",
                body.specification_id,
                body.specification_version,
                spec.latest().map_or(0, |v| v.version)
            ),
        )
    })?;
    if version.environment_id != body.environment_id {
        return Err(ApiError::invalid_field(
            "environmentId",
            format!(
                "specification {} belongs to environment {}",
                body.specification_id, version.environment_id
            ),
        ));
    }
    let (environment, environment_basis) = state
        .environments()
        .load_basis(
            &caller.tenant,
            &Environment::aggregate_id(&caller.tenant, &body.environment_id),
            read,
        )
        .await?;
    Ok(PlanBasis {
        project_id: version.project_id.clone(),
        environment_class: environment.and_then(|e| e.class()),
        basis: [spec_basis, environment_basis],
    })
}

fn fold(history: Option<&[RunEvent]>) -> Result<RunView, ApiError> {
    history
        .and_then(RunView::from_events)
        .ok_or_else(|| ApiError::internal("run history missing or not starting with a request"))
}

/// Runs `command` on the run `run` (as the caller named it; it must exist), counts the state
/// it reached and waits until the read model shows it.
async fn run_command(
    state: &AppState,
    caller: &Caller,
    ids: RequestIds,
    run: &str,
    command: RunCommand,
) -> Result<RunView, ApiError> {
    let id = run_id(run)?;
    let done = state
        .runs()
        .execute(
            &caller.tenant,
            &id.to_string(),
            command,
            &caller.metadata(ids),
            false,
        )
        .await
        .map_err(|e| match e {
            ferry_store::CommandError::NotFound => {
                ApiError::NotFound(format!("no provisioning run {id}"))
            }
            other => other.into(),
        })?;
    let view = fold(done.history.as_deref())?;
    if !done.events.is_empty() {
        state.telemetry().run_reached(
            caller.tenant.as_str(),
            view.kind.as_str(),
            view.state.as_str(),
        );
    }
    state
        .reads()
        .wait_for_run(
            &caller.tenant,
            id,
            view.version,
            done.position,
            state.read_your_writes(),
        )
        .await?;
    Ok(view)
}

/// The run's plan log, then its apply log, as text (secrets were redacted before they were
/// stored).
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, run = %run))]
pub async fn run_logs(state: &AppState, caller: &Caller, run: &str) -> Result<String, ApiError> {
    caller.require_read()?;
    let id = run_id(run)?;
    if state.reads().get_run(&caller.tenant, id).await?.is_none() {
        return Err(ApiError::NotFound(format!("no provisioning run {id}")));
    }
    let mut text = String::new();
    for step in ["plan", "apply"] {
        let reference = format!("artifacts:runs/{id}/{step}.log");
        if let Ok(bytes) = state.artifacts().get(&reference).await {
            text.push_str(&format!("==> {step} ({reference})\n"));
            text.push_str(&String::from_utf8_lossy(&bytes));
            if !text.ends_with('\n') {
                text.push('\n');
            }
        }
    }
    if text.is_empty() {
        return Err(ApiError::NotFound(format!("run {id} has no logs yet")));
    }
    Ok(text)
}

/// Cancelling a run before its apply.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, run = %run))]
pub async fn cancel(
    state: &AppState,
    caller: &Caller,
    ids: RequestIds,
    run: &str,
    body: Option<CancelRequest>,
) -> Result<RunView, ApiError> {
    caller.require_apply()?;
    let reason = check_reason(&body.and_then(|b| b.reason))?;
    let command = RunCommand::Cancel {
        cancelled_by: caller.actor.clone(),
        reason,
        at: Utc::now(),
    };
    let view = run_command(state, caller, ids, run, command).await?;
    tracing::info!("provisioning run cancelled");
    Ok(view)
}

/// Approving or rejecting a run awaiting approval (its requester cannot approve it).
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, run = %run))]
pub async fn decide_approval(
    state: &AppState,
    caller: &Caller,
    ids: RequestIds,
    run: &str,
    body: ApprovalRequest,
) -> Result<RunView, ApiError> {
    caller.require_apply()?;
    let reason = check_reason(&body.reason)?;
    let command = RunCommand::DecideApproval {
        decision: body.decision,
        decided_by: caller.actor.clone(),
        reason,
        approval_id: None,
        at: Utc::now(),
    };
    let view = run_command(state, caller, ids, run, command).await?;
    tracing::info!(decision = ?body.decision, "approval decided");
    Ok(view)
}
