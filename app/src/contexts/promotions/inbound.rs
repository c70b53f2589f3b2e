//! What the promotions context does with the events Ferry hears: `ReleaseReady` records
//! the release (it needs its program, commit and version to be promotable; a commit or
//! folder its repository does not hold is recorded as the release's problem, and its
//! promotions are rejected at the pipeline gate); `ReleaseWithdrawn` withdraws it (its
//! promotions not yet deploying are rejected); an `ApprovalDecided` naming a promotion
//! decides its pending approval (it must name that approval). The rules every inbound
//! effect follows are in `crate::inbound`.

use super::metrics::observe;
use crate::contexts::provisioning::payloads::{
    ProvisioningAppliedPayload, ProvisioningFailedPayload,
};
use crate::inbound::{
    check_decider, classify, execute_marked, recorded_once_there, same_tenant, ApprovalDecided,
    ApprovalDecision, ContextInbound, InboundParts,
};
use chrono::Utc;
use ferry_domain::confinement::Confinement;
use ferry_domain::ports::sources::{ProgramSource, SourceError};
use ferry_domain::promotion::{Promotion, PromotionCommand};
use ferry_domain::release::{EvaluationEvidence, PipelineResult, SmokeCheck};
use ferry_domain::release::{Release, ReleaseCommand, ReleaseRecord, ReleaseVersion};
use ferry_domain::run::Decision;
use ferry_domain::{ProgramRef, ProgramVersion, ProjectId, ReleaseId, TenantId};
use ferry_messaging::inbound::{Handled, InboundEnvelope, InboundError, InboundEvent, InboundKind};
use ferry_store::Repository;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// The events the promotions context hears. Ferry's own run outcomes may come back from an
/// operator's stream: they are accepted and only logged, as the driver follows runs in
/// process.
pub fn events() -> Vec<InboundKind> {
    vec![
        InboundKind::of::<ReleaseReady>(),
        InboundKind::of::<ReleaseWithdrawn>(),
        InboundKind::of::<ApprovalDecided>(),
        InboundKind::echo::<ProvisioningAppliedPayload>(),
        InboundKind::echo::<ProvisioningFailedPayload>(),
    ]
}

/// `releases.releases.v1.release-ready`: only ready releases are promotable.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseReady {
    /// The release.
    pub release_id: ReleaseId,
    /// The tenant.
    pub tenant_id: TenantId,
    /// The project.
    pub project_id: ProjectId,
    /// The release's version label (e.g. `2.3.0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// True when the release carries agent-generated assets (evaluation evidence gate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub has_agent_generated_assets: Option<bool>,
    /// The release's infrastructure program, `<repository>#<folder>` (needed to promote it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program_ref: Option<ProgramRef>,
    /// The program's commit (needed to promote it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program_version: Option<ProgramVersion>,
    /// The pipeline's stages and their results (the pipeline-results gate).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pipeline: Vec<PipelineResult>,
    /// The evaluation of its agent-generated assets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation_evidence: Option<EvaluationEvidence>,
    /// Its smoke suite (from the pipeline), run by verification after each apply.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub smoke_checks: Vec<SmokeCheck>,
}

impl InboundEvent for ReleaseReady {
    const NAME: &'static str = "ReleaseReady";
    const SUBJECT: &'static str = "releases.releases.v1.release-ready";
    const SUMMARY: &'static str = "A release is ready and may be promoted.";

    fn tenant_id(&self) -> &TenantId {
        &self.tenant_id
    }
}

/// `releases.releases.v1.release-withdrawn`: pending promotions of it are rejected.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseWithdrawn {
    /// The release.
    pub release_id: ReleaseId,
    /// The tenant.
    pub tenant_id: TenantId,
    /// The project.
    pub project_id: ProjectId,
    /// Why it was withdrawn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl InboundEvent for ReleaseWithdrawn {
    const NAME: &'static str = "ReleaseWithdrawn";
    const SUBJECT: &'static str = "releases.releases.v1.release-withdrawn";
    const SUMMARY: &'static str = "A release was withdrawn; pending promotions of it are rejected.";

    fn tenant_id(&self) -> &TenantId {
        &self.tenant_id
    }
}

/// The promotions context's inbound handler.
pub struct PromotionsInbound {
    releases: Repository<Release>,
    promotions: Repository<Promotion>,
    confinement: Arc<Confinement>,
    programs: Arc<dyn ProgramSource>,
}

impl PromotionsInbound {
    /// The handler over the process's parts.
    pub fn new(parts: &InboundParts) -> Self {
        Self {
            releases: Repository::new(parts.db.clone(), ()),
            promotions: Repository::new(parts.db.clone(), ()),
            confinement: parts.confinement.clone(),
            programs: parts.programs.clone(),
        }
    }

    /// Records the release a release service reports ready.
    async fn release_ready(
        &self,
        envelope: &InboundEnvelope,
        r: &ReleaseReady,
    ) -> Result<Handled, InboundError> {
        let tenant = envelope.tenant_id.clone();
        same_tenant(&r.tenant_id, &tenant)?;
        let (Some(program_ref), Some(program_version), Some(version)) =
            (&r.program_ref, &r.program_version, &r.version)
        else {
            return Err(InboundError::Permanent(
                "a promotable release needs version, programRef and programVersion".to_string(),
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
            Err(e @ (SourceError::CommitNotFound { .. } | SourceError::FolderNotFound { .. })) => {
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
        execute_marked(
            &self.releases,
            envelope,
            &Release::aggregate_id(&tenant, r.release_id),
            ReleaseCommand::Record(Box::new(record)),
            true,
        )
        .await
        .map_err(classify)?;
        Ok(Handled::Recorded)
    }

    /// Withdraws the release a release service withdrew.
    async fn release_withdrawn(
        &self,
        envelope: &InboundEnvelope,
        w: &ReleaseWithdrawn,
    ) -> Result<Handled, InboundError> {
        let tenant = envelope.tenant_id.clone();
        same_tenant(&w.tenant_id, &tenant)?;
        let result = execute_marked(
            &self.releases,
            envelope,
            &Release::aggregate_id(&tenant, w.release_id),
            ReleaseCommand::Withdraw {
                reason: w
                    .reason
                    .clone()
                    .unwrap_or_else(|| "withdrawn by the release service".to_string()),
                by: envelope.actor.clone(),
                at: envelope.time.unwrap_or_else(Utc::now),
            },
            false,
        )
        .await;
        // It may arrive before ReleaseReady: try again later.
        recorded_once_there(result, || {
            format!("release {} is not recorded yet", w.release_id)
        })
    }

    /// Decides the approval of the promotion a decision names (a run named: not this context's).
    async fn promotion_approval(
        &self,
        envelope: &InboundEnvelope,
        a: &ApprovalDecided,
    ) -> Result<Handled, InboundError> {
        if a.provisioning_run_id.is_some() {
            return Ok(Handled::NothingToDo);
        }
        check_decider(a)?;
        let Some(promotion) = a.promotion_id else {
            return Err(InboundError::Permanent(
                "an approval decision names neither a run nor a promotion".to_string(),
            ));
        };
        let (decision, reason) = match a.decision {
            ApprovalDecision::Approve => (Decision::Approve, a.reason.clone()),
            ApprovalDecision::Reject => (Decision::Reject, a.reason.clone()),
            ApprovalDecision::Expire => {
                let expired = execute_marked(
                    &self.promotions,
                    envelope,
                    &promotion.to_string(),
                    PromotionCommand::ExpireApproval {
                        at: a.decided_at.unwrap_or_else(Utc::now),
                    },
                    false,
                )
                .await
                .map_err(classify)?;
                observe(&expired.aggregate, &expired.events);
                return Ok(Handled::Recorded);
            }
        };
        // The decision must name the promotion's pending approval; the approver
        // named in the payload is checked against the requester by the domain.
        let decided = execute_marked(
            &self.promotions,
            envelope,
            &promotion.to_string(),
            PromotionCommand::DecideApproval {
                approval_id: Some(a.approval_id),
                decision,
                decided_by: a.decided_by.clone(),
                reason,
                at: a.decided_at.unwrap_or_else(Utc::now),
            },
            false,
        )
        .await
        .map_err(classify)?;
        observe(&decided.aggregate, &decided.events);
        Ok(Handled::Recorded)
    }
}

#[async_trait::async_trait]
impl ContextInbound for PromotionsInbound {
    async fn handle(&self, envelope: &InboundEnvelope) -> Result<Handled, InboundError> {
        let event = &envelope.event;
        if let Some(r) = event.get::<ReleaseReady>() {
            self.release_ready(envelope, r).await
        } else if let Some(w) = event.get::<ReleaseWithdrawn>() {
            self.release_withdrawn(envelope, w).await
        } else if let Some(a) = event.get::<ApprovalDecided>() {
            self.promotion_approval(envelope, a).await
        } else {
            // ProvisioningApplied and ProvisioningFailed: logged by the dispatcher.
            Ok(Handled::NothingToDo)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_release_needs_its_id() {
        let err = InboundKind::of::<ReleaseReady>()
            .decode(json!({"tenantId": "acme"}))
            .unwrap_err();
        assert!(err.to_string().contains("releaseId"), "{err}");
    }
}
