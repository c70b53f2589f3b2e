//! What the provisioning context does with the events Ferry hears: `EnvironmentCreated`
//! records the environment (class, health URL, baseline program), so its baseline is
//! planned; `EnvironmentStateChanged` records its readiness; an `ApprovalDecided` naming a
//! run approves or rejects it (expired = rejected). The rules every inbound effect follows
//! are in `crate::inbound`.

use crate::inbound::{
    check_decider, classify, execute_marked, recorded_once_there, same_tenant, ContextInbound,
    InboundParts,
};
use chrono::Utc;
use ferry_domain::confinement::Confinement;
use ferry_domain::environment::{
    BaselineProgram, Environment, EnvironmentCommand, EnvironmentRegistration,
};
use ferry_domain::run::{Decision, ProvisioningRun, RunCommand};
use ferry_messaging::inbound::{
    ApprovalDecided, ApprovalDecision, EnvironmentCreated, EnvironmentStateChanged, Handled,
    InboundEnvelope, InboundError, InboundEvent,
};
use ferry_store::Repository;
use ferry_workers::metrics::Metrics;
use std::sync::Arc;

/// The provisioning context's inbound handler.
pub struct ProvisioningInbound {
    environments: Repository<Environment>,
    runs: Repository<ProvisioningRun>,
    metrics: Arc<Metrics>,
    confinement: Arc<Confinement>,
}

impl ProvisioningInbound {
    /// The handler over the process's parts.
    pub fn new(parts: &InboundParts) -> Self {
        Self {
            environments: Repository::new(parts.db.clone(), ()),
            runs: Repository::new(parts.db.clone(), ()),
            metrics: parts.metrics.clone(),
            confinement: parts.confinement.clone(),
        }
    }

    /// Records the environment an environment service created.
    async fn environment_created(
        &self,
        envelope: &InboundEnvelope,
        e: &EnvironmentCreated,
    ) -> Result<Handled, InboundError> {
        let tenant = envelope.tenant_id.clone();
        same_tenant(&e.tenant_id, &tenant)?;
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
                .map_err(|refusal| InboundError::Permanent(format!("healthUrl: {refusal}")))?;
        }
        // The program is the tenant's reference like any other: confined.
        if let Some(program) = &baseline_program {
            self.confinement
                .check_baseline_program(&tenant, program)
                .map_err(|refusal| InboundError::Permanent(format!("programRef: {refusal}")))?;
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
        execute_marked(
            &self.environments,
            envelope,
            &Environment::aggregate_id(&tenant, &e.environment_id),
            EnvironmentCommand::Register(Box::new(registration)),
            true,
        )
        .await
        .map_err(classify)?;
        Ok(Handled::Recorded)
    }

    /// Records an environment's readiness.
    async fn environment_state_changed(
        &self,
        envelope: &InboundEnvelope,
        e: &EnvironmentStateChanged,
    ) -> Result<Handled, InboundError> {
        let tenant = envelope.tenant_id.clone();
        let command = EnvironmentCommand::ChangeState {
            ready: e.state.eq_ignore_ascii_case("ready"),
            state: e.state.clone(),
            by: envelope.actor.clone(),
            // Ordered by when the environment service observed it.
            at: envelope.time.unwrap_or_else(Utc::now),
        };
        let result = execute_marked(
            &self.environments,
            envelope,
            &Environment::aggregate_id(&tenant, &e.environment_id),
            command,
            false,
        )
        .await;
        // It may arrive before EnvironmentCreated: try again later.
        recorded_once_there(result, || {
            format!("environment {} is not recorded yet", e.environment_id)
        })
    }

    /// Decides the run an approval decision names (none named: not this context's).
    async fn run_approval(
        &self,
        envelope: &InboundEnvelope,
        a: &ApprovalDecided,
    ) -> Result<Handled, InboundError> {
        let tenant = envelope.tenant_id.clone();
        let Some(run_id) = a.provisioning_run_id else {
            return Ok(Handled::NothingToDo);
        };
        check_decider(a)?;
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
        let done = execute_marked(&self.runs, envelope, &run_id.to_string(), command, false)
            .await
            .map_err(classify)?;
        if let (Some(r), Some(state)) = (done.aggregate.request(), done.aggregate.state()) {
            self.metrics
                .run_reached(tenant.as_str(), r.kind.as_str(), state.as_str());
        }
        Ok(Handled::Recorded)
    }
}

#[async_trait::async_trait]
impl ContextInbound for ProvisioningInbound {
    fn events(&self) -> &'static [&'static str] {
        &[
            "EnvironmentCreated",
            "EnvironmentStateChanged",
            "ApprovalDecided",
        ]
    }

    async fn handle(&self, envelope: &InboundEnvelope) -> Result<Handled, InboundError> {
        match &envelope.event {
            InboundEvent::EnvironmentCreated(e) => self.environment_created(envelope, e).await,
            InboundEvent::EnvironmentStateChanged(e) => {
                self.environment_state_changed(envelope, e).await
            }
            InboundEvent::ApprovalDecided(a) => self.run_approval(envelope, a).await,
            _ => Ok(Handled::NothingToDo),
        }
    }
}
