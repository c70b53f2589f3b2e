//! What the provisioning context does with the events Ferry hears: `EnvironmentCreated`
//! records the environment (class, health URL, baseline program), so its baseline is
//! planned; `EnvironmentStateChanged` records its readiness; an `ApprovalDecided` naming a
//! run approves or rejects it (expired = rejected). The rules every inbound effect follows
//! are in `crate::inbound`.

use crate::contexts::provisioning::work::metrics::Metrics;
use crate::inbound::{
    check_decider, classify, execute_marked, recorded_once_there, same_tenant, ApprovalDecided,
    ApprovalDecision, ContextInbound, InboundParts,
};
use chrono::Utc;
use ferry_domain::confinement::Confinement;
use ferry_domain::environment::{
    BaselineProgram, Environment, EnvironmentCommand, EnvironmentRegistration,
};
use ferry_domain::run::{Decision, ProvisioningRun, RunCommand};
use ferry_domain::{
    EnvironmentClass, EnvironmentId, ProgramRef, ProgramVersion, ProjectId, TenantId,
};
use ferry_messaging::inbound::{
    BrokenRule, Handled, InboundEnvelope, InboundError, InboundEvent, InboundKind,
};
use ferry_store::Repository;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// The events the provisioning context hears.
pub fn events() -> Vec<InboundKind> {
    vec![
        InboundKind::of::<EnvironmentCreated>(),
        InboundKind::of::<EnvironmentStateChanged>(),
        InboundKind::of::<ApprovalDecided>(),
    ]
}

/// `environments.v1.environment-created`: a new environment gets its baseline planned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvironmentCreated {
    /// The environment.
    pub environment_id: EnvironmentId,
    /// The tenant.
    pub tenant_id: TenantId,
    /// development | test | staging | production.
    pub environment_class: EnvironmentClass,
    /// Where its health can be probed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_url: Option<String>,
    /// The baseline program (`<repository>#<folder>`), if the environment has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program_ref: Option<ProgramRef>,
    /// The baseline program's commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program_version: Option<ProgramVersion>,
    /// The project the environment serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_id: Option<ProjectId>,
}

impl InboundEvent for EnvironmentCreated {
    const NAME: &'static str = "EnvironmentCreated";
    const SUBJECT: &'static str = "environments.v1.environment-created";
    const SUMMARY: &'static str = "A new environment gets its baseline specification planned.";

    fn tenant_id(&self) -> &TenantId {
        &self.tenant_id
    }

    fn check(&self) -> Result<(), BrokenRule> {
        if self.program_version.is_some() && self.program_ref.is_none() {
            return Err(BrokenRule(
                "has programVersion without programRef".to_string(),
            ));
        }
        Ok(())
    }
}

/// `environments.v1.environment-state-changed`: readiness for the EnvironmentReady gate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvironmentStateChanged {
    /// The environment.
    pub environment_id: EnvironmentId,
    /// The tenant.
    pub tenant_id: TenantId,
    /// The state as the environment service names it (`ready`, `degraded`, …).
    pub state: String,
    /// Where its health can be probed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_url: Option<String>,
}

impl InboundEvent for EnvironmentStateChanged {
    const NAME: &'static str = "EnvironmentStateChanged";
    const SUBJECT: &'static str = "environments.v1.environment-state-changed";
    const SUMMARY: &'static str = "An environment's readiness changed (EnvironmentReady gate).";

    fn tenant_id(&self) -> &TenantId {
        &self.tenant_id
    }

    fn check(&self) -> Result<(), BrokenRule> {
        if self.state.trim().is_empty() {
            return Err(BrokenRule("has an empty state".to_string()));
        }
        Ok(())
    }
}

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
    async fn handle(&self, envelope: &InboundEnvelope) -> Result<Handled, InboundError> {
        let event = &envelope.event;
        if let Some(e) = event.get::<EnvironmentCreated>() {
            self.environment_created(envelope, e).await
        } else if let Some(e) = event.get::<EnvironmentStateChanged>() {
            self.environment_state_changed(envelope, e).await
        } else if let Some(a) = event.get::<ApprovalDecided>() {
            self.run_approval(envelope, a).await
        } else {
            Ok(Handled::NothingToDo)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_environment_created_event_decodes_with_its_class() {
        let heard = InboundKind::of::<EnvironmentCreated>()
            .decode(json!({"environmentId": "payments-prod", "tenantId": "acme",
                           "environmentClass": "production", "healthUrl": "https://h/healthz",
                           "someNewField": 1}))
            .unwrap();
        let created = heard.get::<EnvironmentCreated>().unwrap();
        assert_eq!(created.environment_class, EnvironmentClass::Production);
    }

    #[test]
    fn invalid_payloads_are_refused_with_a_reason() {
        let err = InboundKind::of::<EnvironmentCreated>()
            .decode(json!({"environmentId": "e", "tenantId": "acme", "environmentClass": "moon"}))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("environmentClass") || err.contains("moon"),
            "{err}"
        );
        let err = InboundKind::of::<EnvironmentCreated>()
            .decode(json!({"environmentId": "e", "tenantId": "acme",
                           "environmentClass": "test", "programVersion": "3f2a9c1"}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("without programRef"), "{err}");
        let err = InboundKind::of::<EnvironmentStateChanged>()
            .decode(json!({"environmentId": "e", "tenantId": "acme", "state": " "}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("empty state"), "{err}");
    }
}
