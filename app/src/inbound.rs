//! What Ferry does with the events it hears (over NATS or `POST /factory/events`):
//!
//! | event | effect |
//! |---|---|
//! | `EnvironmentCreated` | records the environment (class, health URL, baseline program): its baseline is planned |
//! | `EnvironmentStateChanged` | records its readiness |
//! | `ApprovalDecided` | decides the named promotion's pending approval (it must name that approval), or approves or rejects the named run awaiting approval (expired = rejected); a promotion's run is decided only through its promotion |
//! | `ReleaseReady` | records the release (it needs its program, commit and version to be promotable; a commit or folder its repository does not hold is recorded as the release's problem, and its promotions are rejected at the pipeline gate) |
//! | `ReleaseWithdrawn` | withdraws the release: promotions of it not yet deploying are rejected |
//! | `ProvisioningApplied`, `ProvisioningFailed` | logged only: Ferry's promotions follow their runs in process (the promotions driver) |
//!
//! Every effect is committed with the message's "handled" mark (one transaction), and its
//! actor is who sent the event (the token's subject over HTTP, `nats:<source>` over NATS),
//! never a name the payload carries. A decision already recorded on the run (the same
//! approval again, under another message id) is a duplicate, not a refusal. Domain refusals
//! are permanent (the message is dead-lettered with the reason); a concurrent change or an
//! unavailable store is transient (redelivered later).

use crate::contexts::promotions::metrics::observe;
use chrono::Utc;
use ferry_domain::confinement::Confinement;
use ferry_domain::environment::{
    BaselineProgram, Environment, EnvironmentCommand, EnvironmentRegistration,
};
use ferry_domain::ports::sources::{ProgramSource, SourceError};
use ferry_domain::promotion::{Promotion, PromotionCommand};
use ferry_domain::release::{Release, ReleaseCommand, ReleaseRecord, ReleaseVersion};
use ferry_domain::run::{Decision, ProvisioningRun, RunCommand};
use ferry_domain::Actor;
use ferry_messaging::inbound::{
    ApprovalDecision, Handled, InboundEnvelope, InboundError, InboundEvent, InboundHandler,
};
use ferry_store::{CommandError, EventMetadata, Repository};
use ferry_workers::metrics::Metrics;
use std::sync::Arc;

/// The handler of inbound events.
pub struct FerryInbound {
    environments: Repository<Environment>,
    releases: Repository<Release>,
    promotions: Repository<Promotion>,
    runs: Repository<ProvisioningRun>,
    metrics: Arc<Metrics>,
    confinement: Arc<Confinement>,
    programs: Arc<dyn ProgramSource>,
}

impl FerryInbound {
    /// A handler over `db`; programs an event names must pass `confinement`, and a
    /// release's program is looked up in `programs`.
    pub fn new(
        db: ferry_store::Database,
        metrics: Arc<Metrics>,
        confinement: Arc<Confinement>,
        programs: Arc<dyn ProgramSource>,
    ) -> Self {
        Self {
            environments: Repository::new(db.clone(), ()),
            releases: Repository::new(db.clone(), ()),
            promotions: Repository::new(db.clone(), ()),
            runs: Repository::new(db, ()),
            metrics,
            confinement,
            programs,
        }
    }
}

fn classify<E: std::error::Error>(e: CommandError<E>) -> InboundError {
    match e {
        CommandError::Domain(d) => InboundError::Permanent(d.to_string()),
        CommandError::NotFound => {
            InboundError::Permanent("no such record for this tenant".to_string())
        }
        // Also: the claim was taken over by another delivery (the mark matched no row).
        CommandError::Conflict | CommandError::Moved => {
            InboundError::Transient("concurrent change, or the claim was lost".to_string())
        }
        CommandError::Unavailable(s) | CommandError::Store(s) => {
            InboundError::Transient(ferry_store::error_chain(s.as_ref()))
        }
    }
}

fn metadata(envelope: &InboundEnvelope, actor: Actor) -> EventMetadata {
    let request_id = uuid::Uuid::new_v4();
    let correlation_id = envelope
        .correlation_id
        .as_deref()
        .and_then(|c| uuid::Uuid::parse_str(c).ok())
        .unwrap_or(request_id);
    // The causing message's id is a CloudEvent id; keep it when it is a uuid.
    let causation_id = uuid::Uuid::parse_str(&envelope.id).unwrap_or(request_id);
    EventMetadata {
        tenant_id: envelope.tenant_id.clone(),
        actor,
        correlation_id,
        causation_id,
        request_id,
    }
}

#[async_trait::async_trait]
impl InboundHandler for FerryInbound {
    async fn handle(&self, envelope: InboundEnvelope) -> Result<Handled, InboundError> {
        let tenant = envelope.tenant_id.clone();
        match &envelope.event {
            InboundEvent::EnvironmentCreated(e) => {
                if e.tenant_id != tenant {
                    return Err(InboundError::Permanent(
                        "payload tenantId differs from the CloudEvent's".to_string(),
                    ));
                }
                let baseline_program = match (&e.program_ref, &e.program_version) {
                    (Some(program_ref), Some(program_version)) => Some(BaselineProgram {
                        program_ref: program_ref.clone(),
                        program_version: program_version.clone(),
                    }),
                    _ => None,
                };
                // The health URL verification probes is confined where the operator says so.
                if let Some(url) = &e.health_url {
                    let url = ferry_domain::ProbeUrl::parse(url.clone())
                        .map_err(|e| InboundError::Permanent(format!("healthUrl: {e}")))?;
                    self.confinement
                        .check_probe(&tenant, &url)
                        .map_err(|refusal| {
                            InboundError::Permanent(format!("healthUrl: {refusal}"))
                        })?;
                }
                // The program is the tenant's reference like any other: confined.
                if let Some(program) = &baseline_program {
                    self.confinement
                        .check_baseline_program(&tenant, program)
                        .map_err(|refusal| {
                            InboundError::Permanent(format!("programRef: {refusal}"))
                        })?;
                }
                // The environment service knows no objective: keep the one an administrator
                // set (PUT /factory/environments) rather than clear it.
                let slo = self
                    .environments
                    .load(
                        &tenant,
                        &Environment::aggregate_id(&tenant, &e.environment_id),
                    )
                    .await
                    .map_err(classify)?
                    .and_then(|(existing, _)| existing.registration().and_then(|r| r.slo.clone()));
                let registration = EnvironmentRegistration {
                    environment_id: e.environment_id.clone(),
                    tenant_id: tenant.clone(),
                    environment_class: e.environment_class,
                    health_url: e.health_url.clone(),
                    baseline_program,
                    slo,
                    recorded_by: envelope.actor.clone(),
                    recorded_at: Utc::now(),
                };
                self.environments
                    .execute_linked(
                        &tenant,
                        &Environment::aggregate_id(&tenant, &e.environment_id),
                        EnvironmentCommand::Register(Box::new(registration)),
                        &metadata(&envelope, envelope.actor.clone()),
                        true,
                        Some(&envelope.mark),
                    )
                    .await
                    .map_err(classify)?;
            }
            InboundEvent::EnvironmentStateChanged(e) => {
                let command = EnvironmentCommand::ChangeState {
                    ready: e.state.eq_ignore_ascii_case("ready"),
                    state: e.state.clone(),
                    by: envelope.actor.clone(),
                    // Ordered by when the environment service observed it.
                    at: envelope.time.unwrap_or_else(Utc::now),
                };
                let result = self
                    .environments
                    .execute_linked(
                        &tenant,
                        &Environment::aggregate_id(&tenant, &e.environment_id),
                        command,
                        &metadata(&envelope, envelope.actor.clone()),
                        false,
                        Some(&envelope.mark),
                    )
                    .await;
                match result {
                    Ok(_) => {}
                    // It may arrive before EnvironmentCreated: try again later.
                    Err(CommandError::NotFound) => {
                        return Err(InboundError::Transient(format!(
                            "environment {} is not recorded yet",
                            e.environment_id
                        )))
                    }
                    Err(other) => return Err(classify(other)),
                }
            }
            InboundEvent::ApprovalDecided(a) => {
                if let Some(prefix) = a.decided_by.reserved_prefix() {
                    return Err(InboundError::Permanent(format!(
                        "decidedBy may not start with {prefix:?}: Ferry names its own actors so"
                    )));
                }
                let Some(run_id) = a.provisioning_run_id else {
                    let Some(promotion) = a.promotion_id else {
                        return Err(InboundError::Permanent(
                            "an approval decision names neither a run nor a promotion".to_string(),
                        ));
                    };
                    let (decision, reason) = match a.decision {
                        ApprovalDecision::Approve => (Decision::Approve, a.reason.clone()),
                        ApprovalDecision::Reject => (Decision::Reject, a.reason.clone()),
                        ApprovalDecision::Expire => {
                            let expired = self
                                .promotions
                                .execute_linked(
                                    &tenant,
                                    &promotion.to_string(),
                                    PromotionCommand::ExpireApproval {
                                        at: a.decided_at.unwrap_or_else(Utc::now),
                                    },
                                    &metadata(&envelope, envelope.actor.clone()),
                                    false,
                                    Some(&envelope.mark),
                                )
                                .await
                                .map_err(classify)?;
                            observe(&expired.aggregate, &expired.events);
                            return Ok(Handled::Recorded);
                        }
                    };
                    // The decision must name the promotion's pending approval; the approver
                    // named in the payload is checked against the requester by the domain.
                    let decided = self
                        .promotions
                        .execute_linked(
                            &tenant,
                            &promotion.to_string(),
                            PromotionCommand::DecideApproval {
                                approval_id: Some(a.approval_id),
                                decision,
                                decided_by: a.decided_by.clone(),
                                reason,
                                at: a.decided_at.unwrap_or_else(Utc::now),
                            },
                            &metadata(&envelope, envelope.actor.clone()),
                            false,
                            Some(&envelope.mark),
                        )
                        .await
                        .map_err(classify)?;
                    observe(&decided.aggregate, &decided.events);
                    return Ok(Handled::Recorded);
                };
                // The same decision under another message id took effect already.
                if let Some((run, _)) = self
                    .runs
                    .load(&tenant, &run_id.to_string())
                    .await
                    .map_err(classify)?
                {
                    // A promotion's run is decided through the promotion, never directly.
                    if let Some(promotion) = run.request().and_then(|r| r.promotion_id) {
                        return Err(InboundError::Permanent(format!(
                            "run {run_id} applies promotion {promotion}: decide the promotion's approval"
                        )));
                    }
                    if run.approval().is_some_and(|recorded| {
                        recorded.approval_id == Some(a.approval_id)
                            && (recorded.decision == Decision::Approve)
                                == (a.decision == ApprovalDecision::Approve)
                    }) {
                        return Ok(Handled::AlreadyRecorded);
                    }
                }
                let (decision, reason) = match a.decision {
                    ApprovalDecision::Approve => (Decision::Approve, a.reason.clone()),
                    ApprovalDecision::Reject => (Decision::Reject, a.reason.clone()),
                    ApprovalDecision::Expire => (
                        Decision::Reject,
                        Some(
                            a.reason
                                .clone()
                                .unwrap_or_else(|| "the approval expired".to_string()),
                        ),
                    ),
                };
                let command = RunCommand::DecideApproval {
                    decision,
                    decided_by: a.decided_by.clone(),
                    reason,
                    approval_id: Some(a.approval_id),
                    at: a.decided_at.unwrap_or_else(Utc::now),
                };
                // The approver named in the payload is recorded on the decision; the event's
                // actor is the service that reported it.
                let done = self
                    .runs
                    .execute_linked(
                        &tenant,
                        &run_id.to_string(),
                        command,
                        &metadata(&envelope, envelope.actor.clone()),
                        false,
                        Some(&envelope.mark),
                    )
                    .await
                    .map_err(classify)?;
                if let (Some(r), Some(state)) = (done.aggregate.request(), done.aggregate.state()) {
                    self.metrics
                        .run_reached(tenant.as_str(), r.kind.as_str(), state.as_str());
                }
            }
            InboundEvent::ReleaseReady(r) => {
                if r.tenant_id != tenant {
                    return Err(InboundError::Permanent(
                        "payload tenantId differs from the CloudEvent's".to_string(),
                    ));
                }
                let (Some(program_ref), Some(program_version), Some(version)) =
                    (&r.program_ref, &r.program_version, &r.version)
                else {
                    return Err(InboundError::Permanent(
                        "a promotable release needs version, programRef and programVersion"
                            .to_string(),
                    ));
                };
                let version = ReleaseVersion::parse(version.clone())
                    .map_err(|e| InboundError::Permanent(format!("version: {e}")))?;
                for (i, check) in r.smoke_checks.iter().enumerate() {
                    self.confinement
                        .check_probe(&tenant, &check.url)
                        .map_err(|refusal| {
                            InboundError::Permanent(format!("smokeChecks[{i}].url: {refusal}"))
                        })?;
                }
                // The program is the tenant's reference like any other: confined.
                self.confinement
                    .check_program(&tenant, program_ref, program_version)
                    .map_err(|refusal| InboundError::Permanent(format!("programRef: {refusal}")))?;
                // A program that is not what the release says is recorded with the problem
                // (the release service's report is kept), and the release is not promotable.
                let program_problem = match self
                    .programs
                    .locate(&tenant, program_ref, program_version)
                    .await
                {
                    Err(
                        e @ (SourceError::CommitNotFound { .. }
                        | SourceError::FolderNotFound { .. }),
                    ) => {
                        tracing::warn!(release_id = %r.release_id, error = %e, "release recorded with a program that does not exist");
                        Some(e.to_string())
                    }
                    _ => None,
                };
                let record = ReleaseRecord {
                    program_problem,
                    release_id: r.release_id,
                    tenant_id: tenant.clone(),
                    project_id: r.project_id.clone(),
                    version,
                    program_ref: program_ref.clone(),
                    program_version: program_version.clone(),
                    pipeline: r.pipeline.clone(),
                    has_agent_generated_assets: r.has_agent_generated_assets.unwrap_or(false),
                    evaluation_evidence: r.evaluation_evidence.clone(),
                    smoke_checks: r.smoke_checks.clone(),
                    recorded_by: envelope.actor.clone(),
                    recorded_at: Utc::now(),
                };
                self.releases
                    .execute_linked(
                        &tenant,
                        &Release::aggregate_id(&tenant, r.release_id),
                        ReleaseCommand::Record(Box::new(record)),
                        &metadata(&envelope, envelope.actor.clone()),
                        true,
                        Some(&envelope.mark),
                    )
                    .await
                    .map_err(classify)?;
            }
            InboundEvent::ReleaseWithdrawn(w) => {
                if w.tenant_id != tenant {
                    return Err(InboundError::Permanent(
                        "payload tenantId differs from the CloudEvent's".to_string(),
                    ));
                }
                let result =
                    self.releases
                        .execute_linked(
                            &tenant,
                            &Release::aggregate_id(&tenant, w.release_id),
                            ReleaseCommand::Withdraw {
                                reason: w.reason.clone().unwrap_or_else(|| {
                                    "withdrawn by the release service".to_string()
                                }),
                                by: envelope.actor.clone(),
                                at: envelope.time.unwrap_or_else(Utc::now),
                            },
                            &metadata(&envelope, envelope.actor.clone()),
                            false,
                            Some(&envelope.mark),
                        )
                        .await;
                match result {
                    Ok(_) => {}
                    // It may arrive before ReleaseReady: try again later.
                    Err(CommandError::NotFound) => {
                        return Err(InboundError::Transient(format!(
                            "release {} is not recorded yet",
                            w.release_id
                        )))
                    }
                    Err(other) => return Err(classify(other)),
                }
            }
            other => {
                tracing::info!(event = other.name(), subject = %envelope.subject, id = %envelope.id, "heard; another service's promotions are not driven by Ferry");
                return Ok(Handled::NothingToDo);
            }
        }
        Ok(Handled::Recorded)
    }
}
