//! The promotions context's use cases: recording a release, requesting, deciding, rolling
//! back and concluding promotions, lifting a quarantine. Each owns its authorisation, its
//! checks, its command and its read-your-writes; HTTP (`routes`), gRPC and the console only
//! translate to and from them.

use super::metrics::observe;
use super::views::{self, DeliveryProjection, PromotionView, ReleaseState, ReleaseView};
use super::{OPERATE, PROMOTE, READ};
use crate::contexts::provisioning::views::ProvisioningReads;
use chrono::Utc;
use ferry_api::auth::{Caller, Role, SCOPE_EVENTS_PUBLISH};
use ferry_api::basis::Decided;
use ferry_api::extract::RequestIds;
use ferry_api::idempotent::{Created, IdempotentCommand, Keyed};
use ferry_api::problem::{refused_references, ApiError, FieldError};
use ferry_api::state::AppState;
use ferry_domain::environment::Environment;
use ferry_domain::promotion::{
    Hotfix, Promotion, PromotionCommand, PromotionError, PromotionRequest, PromotionState,
    Strategy, VerificationOutcome,
};
use ferry_domain::release::{
    EvaluationEvidence, PipelineResult, Release, ReleaseCommand, ReleaseError, ReleaseRecord,
    ReleaseVersion,
};
use ferry_domain::run::Decision;
use ferry_domain::text;
use ferry_domain::{
    EnvironmentClass, EnvironmentId, FactoryRunId, ProgramRef, ProgramVersion, ProjectId,
    PromotionId, ReleaseId,
};
use ferry_store::stream::Position;
use ferry_store::{Basis, Read};
use serde::{Deserialize, Serialize};

/// An Operator's action: `factory.delivery.operate` and the Operator role.
fn require_operator(caller: &Caller, action: &str) -> Result<(), ApiError> {
    caller.require_scope(OPERATE)?;
    if caller.has_role(Role::Operator) {
        Ok(())
    } else {
        Err(ApiError::Forbidden(format!(
            "{action} needs the Operator role"
        )))
    }
}

/// A reason an action requires (kept as evidence): present and renderable as text.
fn required_reason(reason: &str, action: &str) -> Result<(), ApiError> {
    if reason.trim().is_empty() {
        return Err(ApiError::invalid_field(
            "reason",
            format!("{action} needs a reason"),
        ));
    }
    text::check_free_text("reason", reason).map_err(ApiError::invalid_text)
}

/// Runs `command` on the promotion `id` (which must exist) and counts what it recorded.
async fn decide_existing(
    state: &AppState,
    caller: &Caller,
    ids: RequestIds,
    id: PromotionId,
    command: PromotionCommand,
) -> Result<ferry_store::Executed<Promotion>, ApiError> {
    let done = state
        .repository::<Promotion>()
        .execute(
            &caller.tenant,
            &id.to_string(),
            command,
            &caller.metadata(ids),
            false,
        )
        .await
        .map_err(|e| match e {
            ferry_store::CommandError::NotFound => ApiError::NotFound(format!("no promotion {id}")),
            other => ApiError::from_command(other, promotion_refusal),
        })?;
    observe(&done.aggregate, &done.events);
    Ok(done)
}

/// What recording answers: the release, and whether this call recorded it (else the same
/// release was recorded before).
#[derive(Debug)]
pub struct Recorded<V> {
    /// The resource.
    pub view: V,
    /// True when this call recorded it.
    pub created: bool,
}

/// A release refusal's status.
pub(crate) fn release_refusal(e: ReleaseError) -> ApiError {
    {
        match e {
            ReleaseError::Immutable(_) | ReleaseError::Withdrawn(_) => {
                ApiError::WrongState(e.to_string())
            }
            ReleaseError::NotRecorded => ApiError::NotFound(e.to_string()),
            ReleaseError::IdentityMismatch => ApiError::Rule {
                detail: e.to_string(),
                field: None,
            },
            ReleaseError::ReasonRequired => ApiError::invalid_field("reason", e.to_string()),
            ReleaseError::InvalidSmokeCheck { index, ref reason } => {
                ApiError::invalid_field(&format!("smokeChecks[{index}]"), reason.clone())
            }
            ReleaseError::AlreadyLifted(_) => ApiError::WrongState(e.to_string()),
            ReleaseError::InvalidText(invalid) => ApiError::invalid_text(invalid),
        }
    }
}

/// A promotion refusal's status.
pub(crate) fn promotion_refusal(e: PromotionError) -> ApiError {
    {
        match e {
            PromotionError::NotRequested => ApiError::NotFound(e.to_string()),
            PromotionError::SelfApproval(_) => ApiError::Forbidden(e.to_string()),
            PromotionError::ReasonRequired => ApiError::invalid_field("reason", e.to_string()),
            PromotionError::InvalidText(invalid) => ApiError::invalid_text(invalid),
            PromotionError::ApprovalMismatch(_) => ApiError::Rule {
                detail: e.to_string(),
                field: Some("approvalId".to_string()),
            },
            _ => ApiError::WrongState(e.to_string()),
        }
    }
}

/// Body of `PUT /factory/delivery/releases/{releaseId}`: the release as the release service
/// would report it in `ReleaseReady`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PutReleaseRequest {
    /// The project.
    pub project_id: ProjectId,
    /// Its version (e.g. `2.3.0`).
    pub version: ReleaseVersion,
    /// The release's infrastructure program, `<repository>#<folder>`.
    pub program_ref: ProgramRef,
    /// The program's commit.
    pub program_version: ProgramVersion,
    /// The pipeline's stages and their results.
    pub pipeline: Vec<PipelineResult>,
    /// True when the release carries agent-generated assets.
    #[serde(default)]
    pub has_agent_generated_assets: bool,
    /// The evaluation of those assets.
    #[serde(default)]
    pub evaluation_evidence: Option<EvaluationEvidence>,
    /// The smoke suite verification runs after each apply: `{"name", "url",
    /// "expectedStatus"}` (default 200), at most 20.
    #[serde(default)]
    pub smoke_checks: Vec<ferry_domain::release::SmokeCheck>,
}

/// Recording a release: a service identity with `factory.events.publish` (the release
/// service), or a PlatformAdmin with `factory.delivery.promote`.
fn require_release_recorder(caller: &Caller) -> Result<(), ApiError> {
    if caller.is_service() {
        return caller.require_scope(SCOPE_EVENTS_PUBLISH);
    }
    caller.require_scope(PROMOTE)?;
    if caller.has_role(Role::PlatformAdmin) {
        Ok(())
    } else {
        Err(ApiError::Forbidden(
            "recording a release needs the release service's identity or the PlatformAdmin role"
                .to_string(),
        ))
    }
}

/// `PUT /factory/delivery/releases/{releaseId}`: 201 when recorded, 200 when the same
/// release was recorded before.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, release = %id))]
pub async fn record_release(
    state: &AppState,
    caller: &Caller,
    ids: RequestIds,
    id: ReleaseId,
    body: PutReleaseRequest,
) -> Result<Recorded<ReleaseView>, ApiError> {
    require_release_recorder(caller)?;
    // The program a release deploys is a reference like any other: this tenant's only.
    state
        .confinement()
        .check_program(&caller.tenant, &body.program_ref, &body.program_version)
        .map_err(|refusal| {
            refused_references(vec![ferry_domain::confinement::FieldRefusal {
                field: "programRef".to_string(),
                refusal,
            }])
        })?;
    // Verification will send the smoke checks' requests: confined where the operator says so.
    for (i, check) in body.smoke_checks.iter().enumerate() {
        state
            .confinement()
            .check_probe(&caller.tenant, &check.url)
            .map_err(|refusal| {
                ApiError::invalid_field(&format!("smokeChecks[{i}].url"), refusal)
            })?;
    }
    // A commit or folder the repository does not hold is a typo, caught now.
    crate::contexts::provisioning::use_cases::check_program_found(
        state,
        caller,
        &body.program_ref,
        &body.program_version,
    )
    .await?;
    let record = ReleaseRecord {
        program_problem: None,
        release_id: id,
        tenant_id: caller.tenant.clone(),
        project_id: body.project_id,
        version: body.version,
        program_ref: body.program_ref,
        program_version: body.program_version,
        pipeline: body.pipeline,
        has_agent_generated_assets: body.has_agent_generated_assets,
        evaluation_evidence: body.evaluation_evidence,
        smoke_checks: body.smoke_checks,
        recorded_by: caller.actor.clone(),
        recorded_at: Utc::now(),
    };
    let done = state
        .repository::<Release>()
        .execute(
            &caller.tenant,
            &Release::aggregate_id(&caller.tenant, id),
            ReleaseCommand::Record(Box::new(record)),
            &caller.metadata(ids),
            true,
        )
        .await
        .map_err(|e| ApiError::from_command(e, release_refusal))?;
    let db = state.db().clone();
    let tenant = caller.tenant.clone();
    state
        .reads()
        .wait_until(
            state.read_your_writes(),
            &[DeliveryProjection::NAME],
            done.position,
            || async { Ok(views::get_release(&db, &tenant, id).await?.is_some()) },
        )
        .await?;
    // The read model, or, when it has not caught up in time, the aggregate's record.
    let view = match views::get_release(state.db(), &caller.tenant, id).await? {
        Some(view) => view,
        None => ReleaseView {
            release: done
                .aggregate
                .record()
                .cloned()
                .ok_or_else(|| ApiError::internal("a recorded release has no record"))?,
            state: ReleaseState::Ready,
            withdrawal: None,
            completed_in: views::completions(state.db(), &caller.tenant, id).await?,
        },
    };
    let created = !done.events.is_empty();
    if created {
        tracing::info!(release_id = %id, "release recorded");
    }
    Ok(Recorded { view, created })
}

/// Body of `POST /factory/delivery/promotions`.
#[derive(Debug, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RequestPromotionRequest {
    /// The release to promote (recorded and not withdrawn).
    pub release_id: ReleaseId,
    /// The environment to promote it into (recorded).
    pub environment_id: EnvironmentId,
    /// How to roll it out (default `AllAtOnce`); handed to the program as configuration.
    #[serde(default)]
    pub strategy: Strategy,
    /// The Factory run asking (the deploy-environment tool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<FactoryRunId>,
    /// A hotfix may skip the prior environment class when policy allows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotfix: Option<Hotfix>,
    /// A reference to the asking run's receipt, kept on the promotion as evidence (it grants
    /// nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt_ref: Option<ferry_domain::ReceiptRef>,
}

/// Requesting promotions: `factory.delivery.promote` on a service identity (the
/// deploy-environment tool) or an Operator, WorkspaceAdmin or PlatformAdmin.
fn require_promoter(caller: &Caller) -> Result<(), ApiError> {
    caller.require_scope(PROMOTE)?;
    if caller.is_service()
        || [Role::Operator, Role::WorkspaceAdmin, Role::PlatformAdmin]
            .into_iter()
            .any(|r| caller.has_role(r))
    {
        Ok(())
    } else {
        Err(ApiError::Forbidden(
            "requesting a promotion needs the Operator, WorkspaceAdmin or PlatformAdmin role"
                .to_string(),
        ))
    }
}

/// `POST /factory/delivery/promotions` (RequestPromotion): the promotion starts in
/// `Requested` (queued while another promotion holds the environment).
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant))]
pub async fn request(
    state: &AppState,
    caller: &Caller,
    ids: RequestIds,
    body: RequestPromotionRequest,
    keyed: Option<Keyed<'_>>,
) -> Result<Created<PromotionView>, ApiError> {
    require_promoter(caller)?;
    if let Some(hotfix) = &body.hotfix {
        if hotfix.reason.trim().is_empty() {
            return Err(ApiError::invalid_field(
                "hotfix.reason",
                "a hotfix needs a reason",
            ));
        }
        text::check_free_text("hotfix.reason", &hotfix.reason).map_err(ApiError::invalid_text)?;
    }
    // The release and the environment as recorded (the aggregates, not the read model,
    // which may lag): the cached copies, which the append checks (see `ferry_api::basis`).
    let mut decision = Decided::decide(|read| promotion_basis(state, caller, &body, read)).await?;
    // A release rolled back in an environment is quarantined there.
    let (rolled_back, previous) = views::quarantine_and_current_release(
        state.db(),
        &caller.tenant,
        body.release_id,
        &body.environment_id,
    )
    .await?;
    if let Some(rolled_back) = rolled_back {
        return Err(ApiError::Unprocessable(vec![FieldError::new(
            "releaseId",
            format!(
                "release {} was rolled back in {} (promotion {rolled_back}): it is quarantined there",
                decision.decided.record.version, body.environment_id
            ),
        )]));
    }
    let key = keyed.map(|k| k.key);
    let command = IdempotentCommand {
        db: state.db(),
        tenant: &caller.tenant,
        keyed,
        operation: "RequestPromotion",
        owner: ids.request_id.to_string(),
    };
    let created = command
        .create(|id: PromotionId| async move {
            let executed = decision
                .execute(
                    |read| promotion_basis(state, caller, &body, read),
                    |decided: &PromotionBasis| {
                        let request = promotion_request(caller, &body, decided, id, previous);
                        let basis = decided.basis.clone();
                        async move {
                            state
                                .repository::<Promotion>()
                                .execute_on(
                                    &caller.tenant,
                                    &id.to_string(),
                                    PromotionCommand::Request(Box::new(request)),
                                    &caller.metadata(ids),
                                    true,
                                    &basis,
                                )
                                .await
                        }
                    },
                )
                .await?;
            // The request as this command recorded it, when it was this command that did.
            let (requested, after) = match executed {
                Ok(requested) => {
                    observe(&requested.aggregate, &requested.events);
                    let first = &requested.events[..1.min(requested.events.len())];
                    (PromotionView::from_events(first), requested.position)
                }
                // Another request with this key created it first: answer with that one.
                Err(
                    ferry_store::CommandError::Domain(PromotionError::AlreadyRequested)
                    | ferry_store::CommandError::Conflict,
                ) if key.is_some() => (None, None),
                Err(e) => return Err(ApiError::from_command(e, promotion_refusal)),
            };
            // Read your writes, then answer with the promotion as requested (its first
            // event): the driver may already have moved it on, and the answer to a
            // request is the request.
            wait_for_version(state, caller, id, 1, after).await?;
            match requested {
                Some(view) => Ok(view),
                None => state
                    .repository::<Promotion>()
                    .load_events(&caller.tenant, &id.to_string())
                    .await
                    .map_err(|e| ApiError::from_command(e, promotion_refusal))?
                    .and_then(|events| PromotionView::from_events(&events[..1.min(events.len())]))
                    .ok_or_else(|| ApiError::NotFound(format!("no promotion {id}"))),
            }
        })
        .await?;
    tracing::info!(promotion_id = %created.id(), "promotion requested");
    Ok(created)
}

/// The promotion `body` asks for, as decided on `decided`.
fn promotion_request(
    caller: &Caller,
    body: &RequestPromotionRequest,
    decided: &PromotionBasis,
    id: PromotionId,
    previous: Option<ReleaseId>,
) -> PromotionRequest {
    PromotionRequest {
        promotion_id: id,
        tenant_id: caller.tenant.clone(),
        project_id: decided.record.project_id.clone(),
        release_id: body.release_id,
        environment_id: body.environment_id.clone(),
        environment_class: decided.environment_class,
        strategy: body.strategy,
        run_id: body.run_id,
        hotfix: body.hotfix.clone(),
        receipt_ref: body.receipt_ref.clone(),
        previous_release_id: previous,
        rollback_of: None,
        requested_by: caller.actor.clone(),
        requested_at: Utc::now(),
    }
}

/// What a promotion request is decided on besides the promotion: the release and the
/// environment's class, with the bases the promotion's append checks.
struct PromotionBasis {
    record: ReleaseRecord,
    environment_class: EnvironmentClass,
    basis: [Basis; 3],
}

/// Reads and checks the release and the environment `body` names.
async fn promotion_basis(
    state: &AppState,
    caller: &Caller,
    body: &RequestPromotionRequest,
    read: Read,
) -> Result<PromotionBasis, ApiError> {
    let no_release =
        || ApiError::invalid_field("releaseId", format!("no release {}", body.release_id));
    let (release, release_basis) = state
        .repository::<Release>()
        .load_basis(
            &caller.tenant,
            &Release::aggregate_id(&caller.tenant, body.release_id),
            read,
        )
        .await
        .map_err(|e| ApiError::from_command(e, release_refusal))?;
    let release = release.ok_or_else(no_release)?;
    let record = release.record().cloned().ok_or_else(no_release)?;
    if release.is_withdrawn() {
        return Err(ApiError::Unprocessable(vec![FieldError::new(
            "releaseId",
            format!(
                "release {} was withdrawn: {}",
                record.version,
                release.withdrawal_reason().unwrap_or("no reason given")
            ),
        )]));
    }
    let (environment, environment_basis) = state
        .repository::<Environment>()
        .load_basis(
            &caller.tenant,
            &Environment::aggregate_id(&caller.tenant, &body.environment_id),
            read,
        )
        .await
        .map_err(|e| ApiError::from_command(e, |d| ApiError::WrongState(d.to_string())))?;
    let environment_class = environment.and_then(|e| e.class()).ok_or_else(|| {
        ApiError::invalid_field(
            "environmentId",
            format!("no environment {} is recorded", body.environment_id),
        )
    })?;
    // The environment's Workload specification belongs to one project for its whole life;
    // the hand-off declares the release's project there. A release of another project is
    // refused now, not discovered by the driver (ARCHITECTURE.md, Invariants).
    let specification = ferry_domain::SpecificationId::for_environment(
        &caller.tenant,
        &body.environment_id,
        ferry_domain::SpecificationKind::Workload,
    );
    let (workload, specification_basis) = state
        .repository::<ferry_domain::specification::DeploymentSpecification>()
        .load_basis(&caller.tenant, &specification.to_string(), read)
        .await
        .map_err(|e| ApiError::from_command(e, |d| ApiError::WrongState(d.to_string())))?;
    if let Some(existing) = workload.as_ref().and_then(|w| w.latest()) {
        if existing.project_id != record.project_id {
            return Err(ApiError::invalid_field(
                "projectId",
                format!(
                    "the release belongs to project {}, but {}'s Workload specification belongs to project {}: a specification keeps its project for its whole life",
                    record.project_id, body.environment_id, existing.project_id
                ),
            ));
        }
    }
    Ok(PromotionBasis {
        record,
        environment_class,
        basis: [release_basis, environment_basis, specification_basis],
    })
}

/// Waits (at most the read-your-writes bound) until the read model holds the promotion at
/// `version` or later; `after` is where the command's last event stands in the stream.
async fn wait_for_version(
    state: &AppState,
    caller: &Caller,
    id: PromotionId,
    version: u64,
    after: Option<Position>,
) -> Result<(), ApiError> {
    let db = state.db().clone();
    let tenant = caller.tenant.clone();
    state
        .reads()
        .wait_for_own_events(
            state.read_your_writes(),
            &[DeliveryProjection::NAME],
            after,
            || async {
                Ok(views::promotion_version(&db, &tenant, id)
                    .await?
                    .is_some_and(|v| v >= version))
            },
        )
        .await?;
    Ok(())
}

/// The promotion's view once it reflects at least `version` (read your writes; `after` as
/// in [`wait_for_version`]).
async fn wait_for_promotion(
    state: &AppState,
    caller: &Caller,
    id: PromotionId,
    version: u64,
    after: Option<Position>,
) -> Result<PromotionView, ApiError> {
    let db = state.db().clone();
    let tenant = caller.tenant.clone();
    // The view the wait read last: the answer, without reading it once more.
    let seen = std::sync::Mutex::new(None);
    state
        .reads()
        .wait_until(
            state.read_your_writes(),
            &[DeliveryProjection::NAME],
            after,
            || async {
                let view = views::get_promotion(&db, &tenant, id)
                    .await?
                    .filter(|view| view.version >= version);
                let found = view.is_some();
                if let Ok(mut seen) = seen.lock() {
                    *seen = view;
                }
                Ok(found)
            },
        )
        .await?;
    match seen.into_inner().ok().flatten() {
        Some(view) => Ok(view),
        // The read model has not caught up in time: the same view, from the aggregate.
        None => state
            .repository::<Promotion>()
            .load_events(&caller.tenant, &id.to_string())
            .await
            .map_err(|e| ApiError::from_command(e, promotion_refusal))?
            .and_then(|events| PromotionView::from_events(&events))
            .ok_or_else(|| ApiError::NotFound(format!("no promotion {id}"))),
    }
}

/// `GET /factory/delivery/promotions/{promotionId}`
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, promotion = %id))]
pub async fn promotion(
    state: &AppState,
    caller: &Caller,
    id: PromotionId,
) -> Result<PromotionView, ApiError> {
    caller.require_scope(READ)?;
    let mut view = views::get_promotion(state.db(), &caller.tenant, id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no promotion {id}")))?;
    view.stuck = state
        .db()
        .item_health()
        .problem(super::driver::LOOP, caller.tenant.as_str(), &id.to_string())
        .map(views::StuckView::from);
    with_approval_plan(state, caller, view).await
}

/// The log of the plan the promotion's approval covers, for those who decide it
/// (`factory.delivery.read`, which does not reach the run itself).
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, promotion = %id))]
pub async fn approval_plan_log(
    state: &AppState,
    caller: &Caller,
    id: PromotionId,
) -> Result<String, ApiError> {
    caller.require_scope(READ)?;
    let view = views::get_promotion(state.db(), &caller.tenant, id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no promotion {id}")))?;
    let approval = view
        .approval
        .as_ref()
        .ok_or_else(|| ApiError::NotFound(format!("promotion {id} has no approval with a plan")))?;
    let reference = format!("artifacts:runs/{}/plan.log", approval.provisioning_run_id);
    let bytes =
        state.artifacts().get(&reference).await.map_err(|_| {
            ApiError::NotFound(format!("the plan of promotion {id} has no log yet"))
        })?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// One event of a promotion's history, for its timeline.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TimelineEntry {
    /// Its place in the promotion's history (1, 2, …).
    pub sequence: i64,
    /// What happened (`PromotionRequested`, `GateEvaluated`, …).
    pub event: String,
    /// Who, when a person or a worker is recorded.
    pub actor: Option<String>,
    /// When.
    pub recorded_at: chrono::DateTime<Utc>,
}

/// A promotion's events, oldest first: what happened to it, who did it and when.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, promotion = %id))]
pub async fn timeline(
    state: &AppState,
    caller: &Caller,
    id: PromotionId,
) -> Result<Vec<TimelineEntry>, ApiError> {
    caller.require_scope(READ)?;
    let history = state
        .repository::<Promotion>()
        .load_history(&caller.tenant, &id.to_string())
        .await
        .map_err(|e| ApiError::from_command(e, promotion_refusal))?
        .ok_or_else(|| ApiError::NotFound(format!("no promotion {id}")))?;
    Ok(history
        .iter()
        .map(|typed| TimelineEntry {
            sequence: typed.sequence,
            event: typed.event.stored_type().name.to_string(),
            actor: typed.metadata.actor().map(str::to_string),
            recorded_at: typed.recorded_at,
        })
        .collect())
}

/// `view` with the plan its approval covers, read from the run that planned it: only when
/// that run's plan is exactly the one the approval was asked for (its inputs hash).
async fn with_approval_plan(
    state: &AppState,
    caller: &Caller,
    mut view: PromotionView,
) -> Result<PromotionView, ApiError> {
    let Some(approval) = &view.approval else {
        return Ok(view);
    };
    let run = state
        .reads()
        .get_run(&caller.tenant, approval.provisioning_run_id)
        .await?;
    view.approval_plan = run.and_then(|run| {
        let plan = run.plan_receipt?;
        (plan.inputs_hash == approval.plan_inputs_hash).then(|| views::ApprovalPlan {
            provisioning_run_id: run.provisioning_run_id,
            log: format!(
                "/factory/delivery/promotions/{}/approval/plan-log",
                view.promotion_id
            ),
            inputs_hash: plan.inputs_hash,
            program_version: plan.program_version,
            adds: plan.adds,
            changes: plan.changes,
            deletes: plan.deletes,
            replaces: plan.replaces,
            resources: plan.resources,
        })
    });
    Ok(view)
}

/// Body of `POST /factory/delivery/promotions/{promotionId}/approval`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DecideApprovalRequest {
    /// `approve` or `reject`.
    pub decision: Decision,
    /// Why (kept with the decision).
    #[serde(default)]
    pub reason: Option<String>,
}

/// `POST /factory/delivery/promotions/{promotionId}/approval`: a Reviewer or PlatformAdmin
/// other than the requester decides the production approval, which covers exactly the plan
/// attached to it.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, promotion = %id))]
pub async fn decide_approval(
    state: &AppState,
    caller: &Caller,
    ids: RequestIds,
    id: PromotionId,
    body: DecideApprovalRequest,
) -> Result<PromotionView, ApiError> {
    caller.require_scope(PROMOTE)?;
    if !(caller.has_role(Role::Reviewer) || caller.has_role(Role::PlatformAdmin)) {
        return Err(ApiError::Forbidden(
            "deciding a promotion's approval needs the Reviewer or PlatformAdmin role".to_string(),
        ));
    }
    let command = PromotionCommand::DecideApproval {
        approval_id: None,
        decision: body.decision,
        decided_by: caller.actor.clone(),
        reason: body.reason.filter(|r| !r.trim().is_empty()),
        at: Utc::now(),
    };
    let done = decide_existing(state, caller, ids, id, command).await?;
    tracing::info!(decision = ?body.decision, "promotion approval decided");
    let view = wait_for_promotion(state, caller, id, done.sequence as u64, done.position).await?;
    with_approval_plan(state, caller, view).await
}

/// Body of `POST /factory/delivery/promotions/{promotionId}/rollback`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RollbackRequest {
    /// Why (required; kept as evidence).
    pub reason: String,
}

/// `POST /factory/delivery/promotions/{promotionId}/rollback`: an Operator rolls a completed
/// promotion back to the release completed in that environment before it. The rollback is a
/// promotion of that release through the same gates except the approval; the rolled-back
/// release is quarantined in the environment.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, promotion = %id))]
pub async fn rollback(
    state: &AppState,
    caller: &Caller,
    ids: RequestIds,
    id: PromotionId,
    body: RollbackRequest,
) -> Result<PromotionView, ApiError> {
    require_operator(caller, "rolling back")?;
    // Checked before anything is written: a rollback is two promotions' commands.
    required_reason(&body.reason, "a rollback")?;
    let promotions = state.repository::<Promotion>();
    let (promotion, _) = promotions
        .load(&caller.tenant, &id.to_string())
        .await
        .map_err(|e| ApiError::from_command(e, promotion_refusal))?
        .ok_or_else(|| ApiError::NotFound(format!("no promotion {id}")))?;
    let request = promotion
        .request()
        .cloned()
        .ok_or_else(|| ApiError::NotFound(format!("no promotion {id}")))?;
    if promotion.state() != Some(PromotionState::Completed) {
        return Err(ApiError::WrongState(format!(
            "only a completed promotion is rolled back (this one is {})",
            promotion.state().map_or("unknown", PromotionState::as_str)
        )));
    }
    // Only the release running there now can be rolled back.
    let current = views::current_release(state.db(), &caller.tenant, &request.environment_id)
        .await?
        .map(|(_, completion)| completion.promotion_id);
    if current != Some(id) {
        return Err(ApiError::WrongState(format!(
            "release {} is no longer the one running in {}",
            request.release_id, request.environment_id
        )));
    }
    let previous = request.previous_release_id.ok_or_else(|| {
        ApiError::WrongState(format!(
            "no release completed in {} before this one: nothing to restore",
            request.environment_id
        ))
    })?;
    // Quarantine holds on every path into an environment: rolling back a rollback would
    // bring back the release it rolled back.
    if let Some(rolled_back) = views::rolled_back_in(
        state.db(),
        &caller.tenant,
        previous,
        &request.environment_id,
    )
    .await?
    {
        return Err(ApiError::WrongState(format!(
            "release {previous} was rolled back in {} (promotion {rolled_back}): it is quarantined there; lift the quarantine before restoring it",
            request.environment_id
        )));
    }
    super::driver::start_rollback(
        &promotions,
        &caller.metadata(ids),
        &request,
        previous,
        false,
        caller.actor.clone(),
        body.reason,
    )
    .await
    .map_err(|e| ApiError::from_command(e, promotion_refusal))?;
    let version = promotions
        .load(&caller.tenant, &id.to_string())
        .await
        .map_err(|e| ApiError::from_command(e, promotion_refusal))?
        .map_or(1, |(_, sequence)| sequence as u64);
    // The rollback's events are not at hand: read at once, then on each commit.
    wait_for_promotion(state, caller, id, version, None).await
}

/// Body of `POST /factory/delivery/promotions/{promotionId}/verification`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VerdictRequest {
    /// `Passed` completes the promotion; `Failed` fails it (and rolls back, when on).
    pub outcome: VerificationOutcome,
    /// Why (required; kept with the verification).
    pub reason: String,
}

/// `POST /factory/delivery/promotions/{promotionId}/verification`: an Operator passes or
/// fails a verification held as inconclusive or in error (the tooling failed, not the
/// release).
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, promotion = %id))]
pub async fn verdict(
    state: &AppState,
    caller: &Caller,
    ids: RequestIds,
    id: PromotionId,
    body: VerdictRequest,
) -> Result<PromotionView, ApiError> {
    require_operator(caller, "deciding a held verification")?;
    if !matches!(
        body.outcome,
        VerificationOutcome::Passed | VerificationOutcome::Failed
    ) {
        return Err(ApiError::invalid_field(
            "outcome",
            "must be Passed or Failed",
        ));
    }
    let command = PromotionCommand::ConcludeVerification {
        outcome: body.outcome,
        reason: body.reason,
        by: Some(caller.actor.clone()),
        at: Utc::now(),
    };
    let done = decide_existing(state, caller, ids, id, command).await?;
    tracing::info!(outcome = ?body.outcome, "held verification decided");
    wait_for_promotion(state, caller, id, done.sequence as u64, done.position).await
}

/// Body of `POST /factory/delivery/releases/{releaseId}/quarantines/{environmentId}/lift`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LiftQuarantineRequest {
    /// Why the release may go there again (required; kept as evidence).
    pub reason: String,
}

/// A lifted quarantine.
#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuarantineLiftView {
    /// The release.
    pub release_id: ReleaseId,
    /// The environment it may be promoted into again.
    pub environment_id: EnvironmentId,
    /// The rolled-back promotion whose quarantine was lifted.
    pub promotion_id: PromotionId,
    /// Why.
    pub reason: String,
    /// Who.
    pub lifted_by: ferry_domain::Actor,
    /// When.
    pub lifted_at: chrono::DateTime<Utc>,
}

/// `POST /factory/delivery/releases/{releaseId}/quarantines/{environmentId}/lift`: an
/// Operator lets a release rolled back in an environment be promoted there again. Which
/// rollback is lifted comes from the promotions Ferry holds, never from the body.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, release = %release, environment = %environment))]
pub async fn lift_quarantine(
    state: &AppState,
    caller: &Caller,
    ids: RequestIds,
    release: ReleaseId,
    environment: EnvironmentId,
    body: LiftQuarantineRequest,
) -> Result<QuarantineLiftView, ApiError> {
    require_operator(caller, "lifting a quarantine")?;
    required_reason(&body.reason, "lifting a quarantine")?;
    let rolled_back = views::rolled_back_in(state.db(), &caller.tenant, release, &environment)
        .await?
        .ok_or_else(|| {
            ApiError::WrongState(format!(
                "release {release} is not quarantined in {environment}"
            ))
        })?;
    let lifted_at = Utc::now();
    let lifted = state
        .repository::<Release>()
        .execute(
            &caller.tenant,
            &Release::aggregate_id(&caller.tenant, release),
            ReleaseCommand::LiftQuarantine {
                environment_id: environment.clone(),
                promotion_id: rolled_back,
                reason: body.reason.clone(),
                by: caller.actor.clone(),
                at: lifted_at,
            },
            &caller.metadata(ids),
            false,
        )
        .await
        .map_err(|e| match e {
            ferry_store::CommandError::NotFound => {
                ApiError::NotFound(format!("no release {release}"))
            }
            other => ApiError::from_command(other, release_refusal),
        })?;
    // Read your writes: a promotion requested next is no longer refused.
    let db = state.db().clone();
    let tenant = caller.tenant.clone();
    let env = environment.clone();
    state
        .reads()
        .wait_until(
            state.read_your_writes(),
            &[DeliveryProjection::NAME],
            lifted.position,
            || async {
                Ok(views::rolled_back_in(&db, &tenant, release, &env)
                    .await?
                    .is_none())
            },
        )
        .await?;
    tracing::info!(promotion_id = %rolled_back, "quarantine lifted");
    Ok(QuarantineLiftView {
        release_id: release,
        environment_id: environment,
        promotion_id: rolled_back,
        reason: body.reason,
        lifted_by: caller.actor.clone(),
        lifted_at,
    })
}
