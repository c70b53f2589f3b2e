//! The events Ferry reacts to, typed, with the subjects they arrive on.
//!
//! Payloads follow what the producing services send; fields Ferry needs beyond those
//! are optional. Inbound payloads tolerate unknown fields (producers may add some), but
//! every field Ferry reads is validated by its domain type (ids, classes, refs).

use crate::payloads::{ProvisioningAppliedPayload, ProvisioningFailedPayload};
use crate::subjects;
use chrono::{DateTime, Utc};
use ferry_domain::{
    Actor, ApprovalId, EnvironmentClass, EnvironmentId, ProgramRef, ProgramVersion, ProjectId,
    PromotionId, ProvisioningRunId, ReleaseId, TenantId,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;

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

/// The decision carried by `ApprovalDecided`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ApprovalDecision {
    /// Approved.
    #[serde(alias = "approved")]
    Approve,
    /// Rejected.
    #[serde(alias = "rejected")]
    Reject,
    /// Expired without a decision (treat as a rejection).
    #[serde(alias = "expired")]
    Expire,
}

/// `runcontrol.approvals.v1.approval-decided`: a person decided an approval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalDecided {
    /// The approval.
    pub approval_id: ApprovalId,
    /// The tenant.
    pub tenant_id: TenantId,
    /// The run waiting for it (baseline and reconciliation applies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioning_run_id: Option<ProvisioningRunId>,
    /// The promotion waiting for it (production promotions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promotion_id: Option<PromotionId>,
    /// approve | reject | expire.
    pub decision: ApprovalDecision,
    /// Who decided.
    pub decided_by: Actor,
    /// Why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_at: Option<DateTime<Utc>>,
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
    pub program_ref: Option<ferry_domain::ProgramRef>,
    /// The program's commit (needed to promote it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program_version: Option<ferry_domain::ProgramVersion>,
    /// The pipeline's stages and their results (the pipeline-results gate).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pipeline: Vec<ferry_domain::release::PipelineResult>,
    /// The evaluation of its agent-generated assets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation_evidence: Option<ferry_domain::release::EvaluationEvidence>,
    /// Its smoke suite (from the pipeline), run by verification after each apply.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub smoke_checks: Vec<ferry_domain::release::SmokeCheck>,
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

/// Every event Ferry accepts, typed.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "event", content = "data")]
pub enum InboundEvent {
    /// See [`EnvironmentCreated`].
    EnvironmentCreated(EnvironmentCreated),
    /// See [`EnvironmentStateChanged`].
    EnvironmentStateChanged(EnvironmentStateChanged),
    /// See [`ApprovalDecided`].
    ApprovalDecided(ApprovalDecided),
    /// See [`ReleaseReady`].
    ReleaseReady(ReleaseReady),
    /// See [`ReleaseWithdrawn`].
    ReleaseWithdrawn(ReleaseWithdrawn),
    /// Provisioning reports the desired state applied (promotions start verification).
    ProvisioningApplied(ProvisioningAppliedPayload),
    /// Provisioning reports failure (promotions fail).
    ProvisioningFailed(ProvisioningFailedPayload),
}

/// The inbound events: name, subject. Both are accepted as the CloudEvent `type`.
pub const INBOUND: [(&str, &str); 7] = [
    ("EnvironmentCreated", subjects::ENVIRONMENT_CREATED),
    (
        "EnvironmentStateChanged",
        subjects::ENVIRONMENT_STATE_CHANGED,
    ),
    ("ApprovalDecided", subjects::APPROVAL_DECIDED),
    ("ReleaseReady", subjects::RELEASE_READY),
    ("ReleaseWithdrawn", subjects::RELEASE_WITHDRAWN),
    ("ProvisioningApplied", subjects::PROVISIONING_APPLIED),
    ("ProvisioningFailed", subjects::PROVISIONING_FAILED),
];

/// The event name for a subject or a CloudEvent `type` (subject or event name).
pub fn inbound_name(subject_or_type: &str) -> Option<&'static str> {
    INBOUND
        .iter()
        .find(|(name, subject)| *subject == subject_or_type || *name == subject_or_type)
        .map(|(name, _)| *name)
}

fn typed<T: serde::de::DeserializeOwned>(name: &str, data: Value) -> Result<T, String> {
    serde_json::from_value(data).map_err(|e| format!("{name} payload is invalid: {e}"))
}

impl InboundEvent {
    /// Decodes the `data` of event `name` (one of [`INBOUND`]) and checks its rules.
    pub fn decode(name: &str, data: Value) -> Result<Self, String> {
        let event = match name {
            "EnvironmentCreated" => Self::EnvironmentCreated(typed(name, data)?),
            "EnvironmentStateChanged" => Self::EnvironmentStateChanged(typed(name, data)?),
            "ApprovalDecided" => Self::ApprovalDecided(typed(name, data)?),
            "ReleaseReady" => Self::ReleaseReady(typed(name, data)?),
            "ReleaseWithdrawn" => Self::ReleaseWithdrawn(typed(name, data)?),
            "ProvisioningApplied" => Self::ProvisioningApplied(typed(name, data)?),
            "ProvisioningFailed" => Self::ProvisioningFailed(typed(name, data)?),
            other => return Err(format!("unknown event {other}")),
        };
        match &event {
            Self::ApprovalDecided(a)
                if a.provisioning_run_id.is_none() && a.promotion_id.is_none() =>
            {
                Err("ApprovalDecided names neither provisioningRunId nor promotionId".to_string())
            }
            Self::EnvironmentCreated(e)
                if e.program_version.is_some() && e.program_ref.is_none() =>
            {
                Err("EnvironmentCreated has programVersion without programRef".to_string())
            }
            // Deserialising takes an actor's name as stored events hold it; one that
            // arrives must not hide what it is (`Actor::parse`).
            Self::ApprovalDecided(a) => match Actor::parse(a.decided_by.as_str()) {
                Ok(_) => Ok(event),
                Err(e) => Err(format!("ApprovalDecided decidedBy: {e}")),
            },
            Self::EnvironmentStateChanged(e) if e.state.trim().is_empty() => {
                Err("EnvironmentStateChanged has an empty state".to_string())
            }
            _ => Ok(event),
        }
    }

    /// The event's name (`ReleaseReady`, …).
    pub fn name(&self) -> &'static str {
        match self {
            Self::EnvironmentCreated(_) => "EnvironmentCreated",
            Self::EnvironmentStateChanged(_) => "EnvironmentStateChanged",
            Self::ApprovalDecided(_) => "ApprovalDecided",
            Self::ReleaseReady(_) => "ReleaseReady",
            Self::ReleaseWithdrawn(_) => "ReleaseWithdrawn",
            Self::ProvisioningApplied(_) => "ProvisioningApplied",
            Self::ProvisioningFailed(_) => "ProvisioningFailed",
        }
    }

    /// The tenant named in the payload.
    pub fn tenant_id(&self) -> &TenantId {
        match self {
            Self::EnvironmentCreated(e) => &e.tenant_id,
            Self::EnvironmentStateChanged(e) => &e.tenant_id,
            Self::ApprovalDecided(e) => &e.tenant_id,
            Self::ReleaseReady(e) => &e.tenant_id,
            Self::ReleaseWithdrawn(e) => &e.tenant_id,
            Self::ProvisioningApplied(e) => &e.tenant_id,
            Self::ProvisioningFailed(e) => &e.tenant_id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_and_subjects_both_identify_an_event() {
        assert_eq!(
            inbound_name("releases.releases.v1.release-ready"),
            Some("ReleaseReady")
        );
        assert_eq!(inbound_name("ApprovalDecided"), Some("ApprovalDecided"));
        assert_eq!(inbound_name("releases.releases.v1.release-burned"), None);
    }

    #[test]
    fn an_environment_created_event_decodes_with_its_class() {
        let e = InboundEvent::decode(
            "EnvironmentCreated",
            json!({"environmentId": "payments-prod", "tenantId": "acme",
                   "environmentClass": "production", "healthUrl": "https://h/healthz",
                   "someNewField": 1}),
        )
        .unwrap();
        let InboundEvent::EnvironmentCreated(c) = e else {
            panic!("wrong variant")
        };
        assert_eq!(c.environment_class, EnvironmentClass::Production);
    }

    #[test]
    fn invalid_payloads_are_refused_with_a_reason() {
        let err = InboundEvent::decode(
            "EnvironmentCreated",
            json!({"environmentId": "e", "tenantId": "acme", "environmentClass": "moon"}),
        )
        .unwrap_err();
        assert!(
            err.contains("environmentClass") || err.contains("moon"),
            "{err}"
        );
        let err = InboundEvent::decode(
            "ApprovalDecided",
            json!({"approvalId": "6f1b5c2e-7d7a-4f0e-9c3b-2a1d0e5f4a11", "tenantId": "acme",
                   "decision": "approve", "decidedBy": "bob"}),
        )
        .unwrap_err();
        assert!(err.contains("neither"), "{err}");
        // Issue 37: an approver's name that hides characters is refused when it arrives.
        for hidden in ["alice\u{200B}", "\u{202E}ecila", "alice\u{061C}"] {
            let err = InboundEvent::decode(
                "ApprovalDecided",
                json!({"approvalId": "6f1b5c2e-7d7a-4f0e-9c3b-2a1d0e5f4a11", "tenantId": "acme",
                       "promotionId": "6f1b5c2e-7d7a-4f0e-9c3b-2a1d0e5f4a12",
                       "decision": "approve", "decidedBy": hidden}),
            )
            .unwrap_err();
            assert!(err.contains("decidedBy"), "{hidden:?}: {err}");
        }
        let err = InboundEvent::decode("ReleaseReady", json!({"tenantId": "acme"})).unwrap_err();
        assert!(err.contains("releaseId"), "{err}");
    }
}
