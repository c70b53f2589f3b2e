//! The Promotion aggregate: one request to put a release into an environment, with its
//! gates and their evidence, the production approval, the hand-off of the desired state to
//! provisioning, the verification measurements, and the rollback.
//!
//! ```text
//! Requested ──start──▶ GatesEvaluating ──gate failed──▶ Rejected
//!                          │ gates passed
//!          approval needed ▼          no approval
//!                   AwaitingApproval ─────────────▶ Approved ──handed off──▶ Deploying
//!        (plan attached; │ granted ▲ voided when the        │ applied          │ failed
//!         rejected or    ▼         │ plan went stale)       ▼                  ▼
//!         expired:    Approved ────┘                    Verifying            Failed
//!         Rejected)                                  passed │ failed, rolled back
//!                                                           ▼        ▼
//!                                                      Completed ─▶ RolledBack (manual)
//! ```
//!
//! `Requested` is also "queued": a promotion waits there while another one holds its
//! environment. The gates are recorded one by one in their fixed order ([`GateKind::ORDER`]);
//! the first that fails rejects the promotion and is named in it. A production promotion
//! needs an approval bound to the plan it will apply, decided by someone other than the
//! requester; a rollback (a promotion of the release last completed in the environment)
//! needs none, since the Operator who asks for it holds that authority by role.

use crate::ids::{
    Actor, ApprovalId, EnvironmentId, FactoryRunId, ProjectId, PromotionId, ProvisioningRunId,
    ReleaseId, TenantId,
};
use crate::run::Decision;
use crate::values::EnvironmentClass;
use crate::{text, EventType, TenantOwned};
use chrono::{DateTime, Utc};
use cqrs_es::event_sink::EventSink;
use cqrs_es::{Aggregate, DomainEvent};
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub mod gates;
#[cfg(test)]
mod tests;

/// Where a promotion is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum PromotionState {
    /// Requested; queued while another promotion holds the environment.
    Requested,
    /// The gates are being evaluated.
    GatesEvaluating,
    /// Waiting for the production approval (with the plan attached once it exists).
    AwaitingApproval,
    /// Allowed to deploy.
    Approved,
    /// Handed to provisioning; the apply is under way.
    Deploying,
    /// Applied; verification is measuring.
    Verifying,
    /// Verified; the release is the environment's current one.
    Completed,
    /// A gate failed, the approval was rejected or expired, or the release was withdrawn.
    Rejected,
    /// Provisioning or verification failed, and nothing was rolled back.
    Failed,
    /// The previous release was restored after this one.
    RolledBack,
}

impl PromotionState {
    /// The name, as in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Requested => "Requested",
            Self::GatesEvaluating => "GatesEvaluating",
            Self::AwaitingApproval => "AwaitingApproval",
            Self::Approved => "Approved",
            Self::Deploying => "Deploying",
            Self::Verifying => "Verifying",
            Self::Completed => "Completed",
            Self::Rejected => "Rejected",
            Self::Failed => "Failed",
            Self::RolledBack => "RolledBack",
        }
    }

    /// True once nothing more happens to the promotion (a completed one may still be rolled
    /// back by hand).
    pub fn is_final(self) -> bool {
        matches!(self, Self::Rejected | Self::Failed | Self::RolledBack)
    }

    /// True while the promotion holds its environment (no other may start there).
    pub fn holds_environment(self) -> bool {
        matches!(
            self,
            Self::GatesEvaluating
                | Self::AwaitingApproval
                | Self::Approved
                | Self::Deploying
                | Self::Verifying
        )
    }
}

/// How the release is rolled out; handed to the program as configuration.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum Strategy {
    /// Everything at once.
    #[default]
    AllAtOnce,
    /// A second copy, then the switch.
    BlueGreen,
    /// A small share first.
    Canary,
}

impl Strategy {
    /// The name, as in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AllAtOnce => "AllAtOnce",
            Self::BlueGreen => "BlueGreen",
            Self::Canary => "Canary",
        }
    }
}

/// The gates, in the order they are evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum GateKind {
    /// Every pipeline stage passed and the release is not withdrawn.
    PipelineResults,
    /// The deployment-domain policy allows it (or requires an approval).
    Policy,
    /// The release completed in the prior class of the project's promotion path.
    PriorEnvironment,
    /// The environment is ready.
    EnvironmentReady,
    /// Agent-generated assets carry passing evaluation evidence.
    EvaluationEvidence,
}

impl GateKind {
    /// Every gate, in evaluation order.
    pub const ORDER: [GateKind; 5] = [
        GateKind::PipelineResults,
        GateKind::Policy,
        GateKind::PriorEnvironment,
        GateKind::EnvironmentReady,
        GateKind::EvaluationEvidence,
    ];

    /// The name, as in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PipelineResults => "PipelineResults",
            Self::Policy => "Policy",
            Self::PriorEnvironment => "PriorEnvironment",
            Self::EnvironmentReady => "EnvironmentReady",
            Self::EvaluationEvidence => "EvaluationEvidence",
        }
    }
}

/// A gate's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum GateOutcome {
    /// It passed.
    Passed,
    /// It failed: the promotion is rejected.
    Failed,
    /// It does not apply here (e.g. no prior class before development), which passes.
    NotApplicable,
}

/// One gate's evaluation, kept with its evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GateResult {
    /// Which gate.
    pub kind: GateKind,
    /// Its outcome.
    pub outcome: GateOutcome,
    /// Why, in words (a failing gate's reasons become the rejection's).
    pub reasons: Vec<String>,
    /// What it was decided on (pipeline stages, the policy decision, the prior promotion,
    /// the readiness report or probe, the evaluation).
    pub evidence: Value,
    /// When.
    pub evaluated_at: DateTime<Utc>,
}

/// Where a promotion's approval stands, so that a person or a program knows when a decision
/// can be made: `Planning` until the plan it will cover is attached, then `Pending`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ApprovalStatus {
    /// Needed; Ferry is planning the run the approval will cover: not decidable yet.
    Planning,
    /// Asked for, bound to its plan: a Reviewer or PlatformAdmin other than the requester
    /// may decide it.
    Pending,
    /// Granted.
    Approved,
    /// Refused.
    Rejected,
    /// Not decided in time.
    Expired,
    /// The plan it covered went stale; a new plan asks anew.
    Voided,
}

impl ApprovalStatus {
    /// Its name, as serialized.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Planning => "Planning",
            Self::Pending => "Pending",
            Self::Approved => "Approved",
            Self::Rejected => "Rejected",
            Self::Expired => "Expired",
            Self::Voided => "Voided",
        }
    }

    /// The status after `event`, from `self` (none before an approval is needed).
    pub fn after(status: Option<Self>, event: &PromotionEvent) -> Option<Self> {
        match event {
            PromotionEvent::GatesPassed {
                approval_required: true,
                ..
            } => Some(Self::Planning),
            PromotionEvent::ApprovalRequested(_) => Some(Self::Pending),
            PromotionEvent::ApprovalVoided { .. } => Some(Self::Voided),
            PromotionEvent::ApprovalGranted { .. } => Some(Self::Approved),
            PromotionEvent::ApprovalRejected { .. } => Some(Self::Rejected),
            PromotionEvent::ApprovalExpired { .. } => Some(Self::Expired),
            _ => status,
        }
    }
}

/// A hotfix request: may skip the prior-environment gate when policy allows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Hotfix {
    /// Why it cannot wait for the promotion path.
    pub reason: String,
}

/// What a rollback promotion restores, and after what.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RollbackOf {
    /// The promotion rolled back.
    pub promotion_id: PromotionId,
    /// The release rolled back (quarantined in the environment afterwards).
    pub release_id: ReleaseId,
    /// True when verification failure started it, false when an Operator did.
    pub automatic: bool,
    /// Why.
    pub reason: String,
}

/// The payload of `PromotionRequested`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PromotionRequest {
    /// The promotion.
    pub promotion_id: PromotionId,
    /// The owning tenant (from the caller's token).
    pub tenant_id: TenantId,
    /// The release's project.
    pub project_id: ProjectId,
    /// The release.
    pub release_id: ReleaseId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// The environment's class when requested.
    pub environment_class: EnvironmentClass,
    /// How to roll it out.
    pub strategy: Strategy,
    /// The Factory run that asked for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<FactoryRunId>,
    /// Set for a hotfix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotfix: Option<Hotfix>,
    /// A reference to the asking run's receipt (evidence only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt_ref: Option<crate::ReceiptRef>,
    /// The release completed in the environment before, if any (what a rollback restores).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_release_id: Option<ReleaseId>,
    /// Set when this promotion is a rollback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback_of: Option<RollbackOf>,
    /// Who asked (a token's subject).
    pub requested_by: Actor,
    /// When.
    pub requested_at: DateTime<Utc>,
}

/// The approval asked for, bound to the plan it allows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalRequest {
    /// The approval.
    pub approval_id: ApprovalId,
    /// The declared desired state (`<specificationId>@<version>`).
    pub desired_state_ref: String,
    /// The provisioning run whose plan it approves.
    pub provisioning_run_id: ProvisioningRunId,
    /// That plan's inputs hash: the approval covers exactly this plan.
    pub plan_inputs_hash: String,
    /// When asked.
    pub requested_at: DateTime<Utc>,
    /// When it expires undecided (never, when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime<Utc>>,
}

/// What verification measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum CheckKind {
    /// A probe of the environment's health URL.
    Health,
    /// An HTTP request with an expected status.
    Smoke,
    /// An SLO query and its threshold.
    Slo,
}

impl CheckKind {
    /// Its name in words, for reasons.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Health => "health",
            Self::Smoke => "smoke",
            Self::Slo => "SLO",
        }
    }
}

/// One measurement, kept with its threshold and time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Measurement {
    /// What kind of check.
    pub kind: CheckKind,
    /// Which check (a URL, a smoke check's name, an SLO expression).
    pub name: String,
    /// What was measured (a status, a value), as text.
    pub value: String,
    /// What it had to be.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<String>,
    /// Whether it met it. `None` when the check itself could not run (tooling failed).
    pub passed: Option<bool>,
    /// When.
    pub measured_at: DateTime<Utc>,
}

/// How verification ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum VerificationOutcome {
    /// Every check passed through the window.
    Passed,
    /// A check failed: the release is at fault.
    Failed,
    /// Not enough to decide: held for an Operator.
    Inconclusive,
    /// The checking failed, not the release: held for an Operator.
    Error,
}

/// Commands of the promotion aggregate.
#[derive(Debug, Clone, PartialEq)]
pub enum PromotionCommand {
    /// Request it (the first command).
    Request(Box<PromotionRequest>),
    /// Start evaluating the gates (when the environment is free).
    StartGates {
        /// When.
        at: DateTime<Utc>,
    },
    /// Record the next gate's evaluation; a failing gate rejects the promotion.
    RecordGate(Box<GateResult>),
    /// Every gate passed: ask for the approval, or go ahead.
    PassGates {
        /// The policy asked for an approval (production always needs one, a rollback never).
        policy_requires_approval: bool,
        /// When.
        at: DateTime<Utc>,
    },
    /// Ask for the approval, bound to the planned run.
    RequestApproval(Box<ApprovalRequest>),
    /// The planned run went stale before the apply: its approval no longer covers anything.
    VoidApproval {
        /// Why.
        reason: String,
        /// When.
        at: DateTime<Utc>,
    },
    /// Decide the approval (never by the requester).
    DecideApproval {
        /// The approval decided, when the decision names one (it must be the pending one).
        approval_id: Option<ApprovalId>,
        /// Approve or reject.
        decision: Decision,
        /// Who decided.
        decided_by: Actor,
        /// Why.
        reason: Option<String>,
        /// When.
        at: DateTime<Utc>,
    },
    /// The approval was not decided in time.
    ExpireApproval {
        /// When.
        at: DateTime<Utc>,
    },
    /// The desired state was handed to provisioning and its run may apply.
    HandOff {
        /// The declared desired state.
        desired_state_ref: String,
        /// The run that applies it.
        provisioning_run_id: ProvisioningRunId,
        /// When.
        at: DateTime<Utc>,
    },
    /// Provisioning applied the run.
    RecordApplied {
        /// The run.
        provisioning_run_id: ProvisioningRunId,
        /// When it applied.
        at: DateTime<Utc>,
        /// When the verification window closes.
        verification_ends_at: DateTime<Utc>,
    },
    /// Provisioning failed the run.
    RecordDeploymentFailed {
        /// The run.
        provisioning_run_id: ProvisioningRunId,
        /// Why, as provisioning said.
        reason: String,
        /// When.
        at: DateTime<Utc>,
    },
    /// Keep one verification measurement.
    Measure(Box<Measurement>),
    /// Conclude verification: passed completes; failed waits for a rollback or a failure;
    /// inconclusive or error holds it for an Operator.
    ConcludeVerification {
        /// The outcome.
        outcome: VerificationOutcome,
        /// Why.
        reason: String,
        /// An Operator deciding a held verification, or none for the verifier.
        by: Option<Actor>,
        /// When.
        at: DateTime<Utc>,
    },
    /// Fail the promotion without a rollback (none is possible or it is turned off).
    Fail {
        /// Why.
        reason: String,
        /// When.
        at: DateTime<Utc>,
    },
    /// Restore the previous release through a rollback promotion.
    StartRollback {
        /// The rollback promotion.
        rollback_promotion_id: PromotionId,
        /// The release it restores.
        restored_release_id: ReleaseId,
        /// Started by failed verification rather than an Operator.
        automatic: bool,
        /// Who.
        by: Actor,
        /// Why.
        reason: String,
        /// When.
        at: DateTime<Utc>,
    },
    /// The rollback promotion completed.
    CompleteRollback {
        /// When.
        at: DateTime<Utc>,
    },
    /// The rollback promotion did not complete.
    FailRollback {
        /// Why.
        reason: String,
        /// When.
        at: DateTime<Utc>,
    },
    /// Reject before deploying (e.g. the release was withdrawn).
    Reject {
        /// Why.
        reason: String,
        /// When.
        at: DateTime<Utc>,
    },
}

/// Events of the promotion aggregate (all version 1.0). `PromotionRequested`,
/// `PromotionApproved`, `PromotionCompleted`, `PromotionFailed` and `RollbackCompleted` are
/// also published as integration events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum PromotionEvent {
    /// A promotion was requested (queued until its environment is free).
    PromotionRequested(Box<PromotionRequest>),
    /// Gate evaluation started.
    #[serde(rename_all = "camelCase")]
    GatesEvaluationStarted {
        /// When.
        started_at: DateTime<Utc>,
    },
    /// One gate was evaluated.
    GateEvaluated(Box<GateResult>),
    /// Every gate passed.
    #[serde(rename_all = "camelCase")]
    GatesPassed {
        /// Whether an approval is needed before deploying.
        approval_required: bool,
        /// When.
        passed_at: DateTime<Utc>,
    },
    /// An approval was asked for, bound to a planned run.
    ApprovalRequested(Box<ApprovalRequest>),
    /// The approval no longer covers the plan (it went stale); a new plan asks anew.
    #[serde(rename_all = "camelCase")]
    ApprovalVoided {
        /// The voided approval.
        approval_id: ApprovalId,
        /// Why.
        reason: String,
        /// When.
        voided_at: DateTime<Utc>,
    },
    /// The approval was granted.
    #[serde(rename_all = "camelCase")]
    ApprovalGranted {
        /// The approval.
        approval_id: ApprovalId,
        /// Who.
        decided_by: Actor,
        /// Why.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        /// When.
        decided_at: DateTime<Utc>,
    },
    /// The approval was not decided in time (the promotion is rejected with it).
    #[serde(rename_all = "camelCase")]
    ApprovalExpired {
        /// The approval, once one was asked for with its plan.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        approval_id: Option<ApprovalId>,
        /// When.
        expired_at: DateTime<Utc>,
    },
    /// The approval was refused.
    #[serde(rename_all = "camelCase")]
    ApprovalRejected {
        /// The approval.
        approval_id: ApprovalId,
        /// Who.
        decided_by: Actor,
        /// Why.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        /// When.
        decided_at: DateTime<Utc>,
    },
    /// The promotion will not deploy.
    #[serde(rename_all = "camelCase")]
    PromotionRejected {
        /// Why.
        reason: String,
        /// The failing gate, when a gate rejected it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gate: Option<GateKind>,
        /// When.
        rejected_at: DateTime<Utc>,
    },
    /// The desired state was handed to provisioning (integration `PromotionApproved`).
    #[serde(rename_all = "camelCase")]
    PromotionApproved {
        /// The declared desired state.
        desired_state_ref: String,
        /// The run that applies it.
        provisioning_run_id: ProvisioningRunId,
        /// The approval, for production.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        approval_id: Option<ApprovalId>,
        /// How to roll it out.
        strategy: Strategy,
        /// When.
        approved_at: DateTime<Utc>,
    },
    /// Provisioning applied the desired state; verification runs until `verificationEndsAt`.
    #[serde(rename_all = "camelCase")]
    DeploymentApplied {
        /// The run.
        provisioning_run_id: ProvisioningRunId,
        /// When.
        applied_at: DateTime<Utc>,
        /// When the verification window closes.
        verification_ends_at: DateTime<Utc>,
    },
    /// Provisioning failed the run.
    #[serde(rename_all = "camelCase")]
    DeploymentFailed {
        /// The run.
        provisioning_run_id: ProvisioningRunId,
        /// Why.
        reason: String,
        /// When.
        failed_at: DateTime<Utc>,
    },
    /// One verification measurement.
    VerificationMeasured(Box<Measurement>),
    /// Verification ended (or was decided by an Operator).
    #[serde(rename_all = "camelCase")]
    VerificationConcluded {
        /// The outcome.
        outcome: VerificationOutcome,
        /// Why.
        reason: String,
        /// The Operator who decided a held verification.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        concluded_by: Option<Actor>,
        /// When.
        concluded_at: DateTime<Utc>,
    },
    /// The release runs and is verified (integration `PromotionCompleted`).
    #[serde(rename_all = "camelCase")]
    PromotionCompleted {
        /// When.
        completed_at: DateTime<Utc>,
    },
    /// A rollback promotion was started to restore the previous release.
    #[serde(rename_all = "camelCase")]
    RollbackStarted {
        /// The rollback promotion.
        rollback_promotion_id: PromotionId,
        /// The release it restores.
        restored_release_id: ReleaseId,
        /// Started by failed verification rather than an Operator.
        automatic: bool,
        /// Who.
        started_by: Actor,
        /// Why.
        reason: String,
        /// When.
        started_at: DateTime<Utc>,
    },
    /// The rollback did not complete.
    #[serde(rename_all = "camelCase")]
    RollbackFailed {
        /// Why.
        reason: String,
        /// When.
        failed_at: DateTime<Utc>,
    },
    /// The previous release is back (integration `RollbackCompleted`).
    #[serde(rename_all = "camelCase")]
    RollbackCompleted {
        /// The release restored.
        restored_release_id: ReleaseId,
        /// When.
        completed_at: DateTime<Utc>,
    },
    /// Provisioning or verification failed (integration `PromotionFailed`).
    #[serde(rename_all = "camelCase")]
    PromotionFailed {
        /// Why.
        reason: String,
        /// True when the previous release was restored.
        rolled_back: bool,
        /// When.
        failed_at: DateTime<Utc>,
    },
}

impl PromotionEvent {
    /// The name and version this event is stored under (see [`crate::event_type`]).
    pub fn stored_type(&self) -> EventType {
        EventType::first(match self {
            Self::PromotionRequested(_) => "PromotionRequested",
            Self::GatesEvaluationStarted { .. } => "GatesEvaluationStarted",
            Self::GateEvaluated(_) => "GateEvaluated",
            Self::GatesPassed { .. } => "GatesPassed",
            Self::ApprovalRequested(_) => "ApprovalRequested",
            Self::ApprovalVoided { .. } => "ApprovalVoided",
            Self::ApprovalGranted { .. } => "ApprovalGranted",
            Self::ApprovalRejected { .. } => "ApprovalRejected",
            Self::PromotionRejected { .. } => "PromotionRejected",
            Self::ApprovalExpired { .. } => "ApprovalExpired",
            Self::PromotionApproved { .. } => "PromotionApproved",
            Self::DeploymentApplied { .. } => "DeploymentApplied",
            Self::DeploymentFailed { .. } => "DeploymentFailed",
            Self::VerificationMeasured(_) => "VerificationMeasured",
            Self::VerificationConcluded { .. } => "VerificationConcluded",
            Self::PromotionCompleted { .. } => "PromotionCompleted",
            Self::RollbackStarted { .. } => "RollbackStarted",
            Self::RollbackFailed { .. } => "RollbackFailed",
            Self::RollbackCompleted { .. } => "RollbackCompleted",
            Self::PromotionFailed { .. } => "PromotionFailed",
        })
    }
}

impl DomainEvent for PromotionEvent {
    fn event_type(&self) -> String {
        self.stored_type().name.to_string()
    }
    fn event_version(&self) -> String {
        self.stored_type().version.to_string()
    }
}

/// Rules a promotion command can break.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromotionError {
    /// `Request` on a promotion that exists.
    #[error("the promotion was already requested")]
    AlreadyRequested,
    /// Any other command on a promotion that does not exist.
    #[error("no such promotion")]
    NotRequested,
    /// The command does not apply in the promotion's state.
    #[error("cannot {command} a promotion in state {}", state.as_str())]
    WrongState {
        /// What was asked.
        command: &'static str,
        /// Where the promotion is.
        state: PromotionState,
    },
    /// A gate recorded out of order.
    #[error("gate {} is next, not {}", expected.as_str(), got.as_str())]
    GateOutOfOrder {
        /// The gate due.
        expected: GateKind,
        /// The gate given.
        got: GateKind,
    },
    /// `PassGates` before every gate was recorded.
    #[error("gate {} was not evaluated yet", .0.as_str())]
    GatesIncomplete(GateKind),
    /// The requester tried to decide their own promotion's approval.
    #[error("{0} requested this promotion and cannot approve or reject it")]
    SelfApproval(Actor),
    /// No approval is pending (none asked yet, or it was voided).
    #[error("no approval is pending for this promotion")]
    NoPendingApproval,
    /// The approval cannot be decided in its status (`Planning` or `Voided`: the plan it
    /// will cover is not attached yet).
    #[error("the approval is {}: the plan it will cover is not attached yet; decide it once it is Pending", .0.as_str())]
    ApprovalNotPending(ApprovalStatus),
    /// A decision names another approval than the pending one.
    #[error("approval {0} is not this promotion's pending approval")]
    ApprovalMismatch(ApprovalId),
    /// A run reported that is not the promotion's.
    #[error("provisioning run {0} is not this promotion's")]
    RunMismatch(ProvisioningRunId),
    /// Measurements after verification passed, or a verdict on one not held.
    #[error("verification is not open")]
    VerificationClosed,
    /// An Operator verdict on a verification that is not held.
    #[error("verification is not held for an Operator (it is {0})")]
    NotHeld(&'static str),
    /// A rollback while one is under way, or none to complete.
    #[error("{0}")]
    Rollback(&'static str),
    /// A reason is required.
    #[error("a reason is required")]
    ReasonRequired,
    /// A reason a caller gave that a console could not render faithfully.
    #[error(transparent)]
    InvalidText(#[from] text::InvalidText),
}

/// The promotion as its events made it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Promotion {
    request: Option<PromotionRequest>,
    state: Option<PromotionState>,
    gates: Vec<GateResult>,
    approval: Option<ApprovalRequest>,
    approval_id: Option<ApprovalId>,
    desired_state_ref: Option<String>,
    provisioning_run_id: Option<ProvisioningRunId>,
    verification_outcome: Option<VerificationOutcome>,
    rollback_in_progress: Option<(PromotionId, ReleaseId)>,
    approvals_voided: u32,
    approved_by: Option<(Actor, Option<String>, DateTime<Utc>)>,
    #[serde(default)]
    approval_status: Option<ApprovalStatus>,
}

impl Promotion {
    /// The request, once requested.
    pub fn request(&self) -> Option<&PromotionRequest> {
        self.request.as_ref()
    }
    /// The state, once requested.
    pub fn state(&self) -> Option<PromotionState> {
        self.state
    }
    /// The gates recorded so far, in order.
    pub fn gates(&self) -> &[GateResult] {
        &self.gates
    }
    /// Where its approval stands (none while no approval is needed).
    pub fn approval_status(&self) -> Option<ApprovalStatus> {
        self.approval_status
    }
    /// The approval asked for and still pending or granted.
    pub fn approval(&self) -> Option<&ApprovalRequest> {
        self.approval.as_ref()
    }
    /// The provisioning run handling it (planned for the approval, or handed off).
    pub fn provisioning_run_id(&self) -> Option<ProvisioningRunId> {
        self.provisioning_run_id
    }
    /// The rollback under way, if any: (rollback promotion, restored release).
    pub fn rollback_in_progress(&self) -> Option<(PromotionId, ReleaseId)> {
        self.rollback_in_progress
    }
    /// How many approvals were voided by a stale plan: each new plan is a new attempt, with
    /// a run of its own.
    pub fn attempt(&self) -> u32 {
        self.approvals_voided
    }
    /// Who granted the approval, why and when (once granted).
    pub fn approved_by(&self) -> Option<&(Actor, Option<String>, DateTime<Utc>)> {
        self.approved_by.as_ref()
    }

    /// The granted approval as proof for the run it covers, with the inputs hash of the
    /// plan it was asked for: only a promotion Ferry holds, approved by someone other than
    /// its requester, can make one.
    pub fn verified_approval(&self) -> Option<(crate::run::VerifiedPromotionApproval, String)> {
        let request = self.request.as_ref()?;
        let approval = self.approval.as_ref()?;
        let approval_id = self.approval_id?;
        let (approved_by, _, approved_at) = self.approved_by.as_ref()?;
        let record = crate::run::PromotionApprovalRecord {
            promotion_id: request.promotion_id,
            approval_id,
            tenant_id: request.tenant_id.clone(),
            environment_id: request.environment_id.clone(),
            approved_by: approved_by.clone(),
            approved_at: *approved_at,
        };
        Some((
            crate::run::VerifiedPromotionApproval::new(record),
            approval.plan_inputs_hash.clone(),
        ))
    }
    /// The rollback's authority as proof for the run that restores the release: only a
    /// rollback promotion Ferry holds whose gates passed (it is `Approved` or further) can
    /// make one.
    pub fn verified_rollback(&self) -> Option<crate::run::VerifiedRollback> {
        let request = self.request.as_ref()?;
        let rollback = request.rollback_of.as_ref()?;
        if !matches!(
            self.state?,
            PromotionState::Approved | PromotionState::Deploying | PromotionState::Verifying
        ) {
            return None;
        }
        Some(crate::run::VerifiedRollback::new(
            crate::run::RollbackAuthorityRecord {
                promotion_id: request.promotion_id,
                rolls_back: rollback.promotion_id,
                release_id: request.release_id,
                tenant_id: request.tenant_id.clone(),
                environment_id: request.environment_id.clone(),
                automatic: rollback.automatic,
                authorised_by: request.requested_by.clone(),
                reason: rollback.reason.clone(),
            },
        ))
    }
    /// The desired state handed over or planned for the approval.
    pub fn desired_state_ref(&self) -> Option<&str> {
        self.desired_state_ref.as_deref()
    }
    /// The approval granted, if any.
    pub fn approval_id(&self) -> Option<ApprovalId> {
        self.approval_id
    }
    /// True for a rollback promotion.
    pub fn is_rollback(&self) -> bool {
        self.request
            .as_ref()
            .is_some_and(|r| r.rollback_of.is_some())
    }

    fn in_state(
        &self,
        command: &'static str,
        allowed: &[PromotionState],
    ) -> Result<PromotionState, PromotionError> {
        let state = self.state.ok_or(PromotionError::NotRequested)?;
        if allowed.contains(&state) {
            Ok(state)
        } else {
            Err(PromotionError::WrongState { command, state })
        }
    }

    fn requester(&self) -> Option<&Actor> {
        self.request.as_ref().map(|r| &r.requested_by)
    }

    fn check_run(&self, run: ProvisioningRunId) -> Result<(), PromotionError> {
        if self.provisioning_run_id == Some(run) {
            Ok(())
        } else {
            Err(PromotionError::RunMismatch(run))
        }
    }
}

impl TenantOwned for Promotion {
    fn tenant(&self) -> Option<&TenantId> {
        self.request.as_ref().map(|r| &r.tenant_id)
    }
}

/// Stored with no upcasters yet: every event type is at its first version.
impl crate::StoredAggregate for Promotion {}

/// A reason a person must give: present, and fit to show (see [`text::check_free_text`]).
fn required(reason: &str) -> Result<(), PromotionError> {
    if reason.trim().is_empty() {
        Err(PromotionError::ReasonRequired)
    } else {
        Ok(text::check_free_text("reason", reason)?)
    }
}

/// A reason Ferry writes from what others said (a withdrawal's reason, a run's failure):
/// kept inert and bounded rather than refused, so that no such text can stall the driver.
fn inert(reason: String) -> String {
    text::inert(&reason, text::MAX_REASON)
}

impl Aggregate for Promotion {
    const TYPE: &'static str = "Promotion";
    type Command = PromotionCommand;
    type Event = PromotionEvent;
    type Error = PromotionError;
    type Services = ();

    async fn handle(
        &mut self,
        command: Self::Command,
        _services: &(),
        sink: &EventSink<Self>,
    ) -> Result<(), Self::Error> {
        use PromotionState as S;
        let events = match command {
            PromotionCommand::Request(request) => {
                if self.request.is_some() {
                    return Err(PromotionError::AlreadyRequested);
                }
                if let Some(receipt) = &request.receipt_ref {
                    text::check_name_within("receiptRef", receipt.as_str(), 1024)?;
                }
                if let Some(hotfix) = &request.hotfix {
                    text::check_free_text("hotfix.reason", &hotfix.reason)?;
                }
                if let Some(rollback) = request.rollback_of.as_ref().filter(|r| !r.automatic) {
                    text::check_free_text("reason", &rollback.reason)?;
                }
                vec![PromotionEvent::PromotionRequested(request)]
            }
            PromotionCommand::StartGates { at } => {
                self.in_state("start the gates of", &[S::Requested])?;
                vec![PromotionEvent::GatesEvaluationStarted { started_at: at }]
            }
            PromotionCommand::RecordGate(mut gate) => {
                self.in_state("record a gate of", &[S::GatesEvaluating])?;
                // Reasons may quote what a probed service or a policy answered.
                for reason in &mut gate.reasons {
                    *reason = text::inert(reason, text::MAX_REASON);
                }
                let expected = GateKind::ORDER.get(self.gates.len()).copied().ok_or(
                    PromotionError::WrongState {
                        command: "record a gate of",
                        state: S::GatesEvaluating,
                    },
                )?;
                if gate.kind != expected {
                    return Err(PromotionError::GateOutOfOrder {
                        expected,
                        got: gate.kind,
                    });
                }
                let mut events = Vec::new();
                if gate.outcome == GateOutcome::Failed {
                    let reason = format!(
                        "gate {} failed: {}",
                        gate.kind.as_str(),
                        if gate.reasons.is_empty() {
                            "no reason given".to_string()
                        } else {
                            gate.reasons.join("; ")
                        }
                    );
                    let rejected_at = gate.evaluated_at;
                    events.push(PromotionEvent::GateEvaluated(gate));
                    events.push(PromotionEvent::PromotionRejected {
                        reason: inert(reason),
                        gate: Some(expected),
                        rejected_at,
                    });
                } else {
                    events.push(PromotionEvent::GateEvaluated(gate));
                }
                events
            }
            PromotionCommand::PassGates {
                policy_requires_approval,
                at,
            } => {
                self.in_state("pass the gates of", &[S::GatesEvaluating])?;
                if let Some(missing) = GateKind::ORDER.get(self.gates.len()) {
                    return Err(PromotionError::GatesIncomplete(*missing));
                }
                let request = self.request.as_ref().ok_or(PromotionError::NotRequested)?;
                // Production always needs its approval; a rollback never does (the Operator
                // holds it by role).
                let approval_required = request.rollback_of.is_none()
                    && (policy_requires_approval
                        || request.environment_class == EnvironmentClass::Production);
                vec![PromotionEvent::GatesPassed {
                    approval_required,
                    passed_at: at,
                }]
            }
            PromotionCommand::RequestApproval(approval) => {
                self.in_state("ask an approval for", &[S::AwaitingApproval])?;
                if self.approval.is_some() {
                    return Err(PromotionError::WrongState {
                        command: "ask a second approval for",
                        state: S::AwaitingApproval,
                    });
                }
                vec![PromotionEvent::ApprovalRequested(approval)]
            }
            PromotionCommand::VoidApproval { reason, at } => {
                self.in_state("void the approval of", &[S::AwaitingApproval, S::Approved])?;
                let approval = self
                    .approval
                    .as_ref()
                    .ok_or(PromotionError::NoPendingApproval)?;
                vec![PromotionEvent::ApprovalVoided {
                    approval_id: approval.approval_id,
                    reason: inert(reason),
                    voided_at: at,
                }]
            }
            PromotionCommand::DecideApproval {
                approval_id,
                decision,
                decided_by,
                reason,
                at,
            } => {
                self.in_state("decide the approval of", &[S::AwaitingApproval])?;
                text::check_optional_free_text("reason", reason.as_deref())?;
                let pending = self.approval.as_ref().ok_or(match self.approval_status {
                    Some(status @ (ApprovalStatus::Planning | ApprovalStatus::Voided)) => {
                        PromotionError::ApprovalNotPending(status)
                    }
                    _ => PromotionError::NoPendingApproval,
                })?;
                if let Some(named) = approval_id {
                    if named != pending.approval_id {
                        return Err(PromotionError::ApprovalMismatch(named));
                    }
                }
                // Compared as people are (`Actor::same_person`): `Alice` and `alice ` are one.
                if self.requester().is_some_and(|r| r.same_person(&decided_by)) {
                    return Err(PromotionError::SelfApproval(decided_by));
                }
                let approval_id = pending.approval_id;
                match decision {
                    Decision::Approve => vec![PromotionEvent::ApprovalGranted {
                        approval_id,
                        decided_by,
                        reason,
                        decided_at: at,
                    }],
                    Decision::Reject => vec![
                        PromotionEvent::ApprovalRejected {
                            approval_id,
                            decided_by: decided_by.clone(),
                            reason: reason.clone(),
                            decided_at: at,
                        },
                        PromotionEvent::PromotionRejected {
                            reason: format!(
                                "the approval was rejected by {decided_by}{}",
                                reason.map(|r| format!(": {r}")).unwrap_or_default()
                            ),
                            gate: None,
                            rejected_at: at,
                        },
                    ],
                }
            }
            PromotionCommand::ExpireApproval { at } => {
                self.in_state("expire the approval of", &[S::AwaitingApproval])?;
                vec![
                    PromotionEvent::ApprovalExpired {
                        approval_id: self.approval.as_ref().map(|a| a.approval_id),
                        expired_at: at,
                    },
                    PromotionEvent::PromotionRejected {
                        reason: "the approval expired undecided".to_string(),
                        gate: None,
                        rejected_at: at,
                    },
                ]
            }
            PromotionCommand::HandOff {
                desired_state_ref,
                provisioning_run_id,
                at,
            } => {
                self.in_state("hand off", &[S::Approved])?;
                // A production approval covers exactly the run it was asked for.
                if self.approval.is_some() {
                    self.check_run(provisioning_run_id)?;
                }
                let request = self.request.as_ref().ok_or(PromotionError::NotRequested)?;
                vec![PromotionEvent::PromotionApproved {
                    desired_state_ref,
                    provisioning_run_id,
                    approval_id: self.approval_id,
                    strategy: request.strategy,
                    approved_at: at,
                }]
            }
            PromotionCommand::RecordApplied {
                provisioning_run_id,
                at,
                verification_ends_at,
            } => {
                self.in_state("record the apply of", &[S::Deploying])?;
                self.check_run(provisioning_run_id)?;
                vec![PromotionEvent::DeploymentApplied {
                    provisioning_run_id,
                    applied_at: at,
                    verification_ends_at,
                }]
            }
            PromotionCommand::RecordDeploymentFailed {
                provisioning_run_id,
                reason,
                at,
            } => {
                self.in_state("record the failure of", &[S::Deploying])?;
                self.check_run(provisioning_run_id)?;
                vec![
                    PromotionEvent::DeploymentFailed {
                        provisioning_run_id,
                        reason: inert(reason.clone()),
                        failed_at: at,
                    },
                    PromotionEvent::PromotionFailed {
                        reason: inert(format!("provisioning failed: {reason}")),
                        rolled_back: false,
                        failed_at: at,
                    },
                ]
            }
            PromotionCommand::Measure(mut measurement) => {
                self.in_state("measure", &[S::Verifying])?;
                // What a probed service answered is the tenant's text.
                measurement.name = text::inert(&measurement.name, text::MAX_URL);
                measurement.value = text::inert(&measurement.value, text::MAX_REASON);
                if self.verification_outcome == Some(VerificationOutcome::Failed) {
                    return Err(PromotionError::VerificationClosed);
                }
                vec![PromotionEvent::VerificationMeasured(measurement)]
            }
            PromotionCommand::ConcludeVerification {
                outcome,
                mut reason,
                by,
                at,
            } => {
                self.in_state("conclude the verification of", &[S::Verifying])?;
                match (self.verification_outcome, &by) {
                    // The verifier concludes an open verification once (its reason may
                    // quote what a probed service answered).
                    (None, None) => reason = inert(reason),
                    // An Operator decides a held one, pass or fail, with a reason.
                    (
                        Some(VerificationOutcome::Inconclusive | VerificationOutcome::Error),
                        Some(_),
                    ) => {
                        required(&reason)?;
                        if !matches!(
                            outcome,
                            VerificationOutcome::Passed | VerificationOutcome::Failed
                        ) {
                            return Err(PromotionError::NotHeld("undecided by the Operator"));
                        }
                    }
                    (None, Some(_)) => return Err(PromotionError::NotHeld("still measuring")),
                    (Some(_), _) => return Err(PromotionError::VerificationClosed),
                }
                let mut events = vec![PromotionEvent::VerificationConcluded {
                    outcome,
                    reason,
                    concluded_by: by,
                    concluded_at: at,
                }];
                if outcome == VerificationOutcome::Passed {
                    events.push(PromotionEvent::PromotionCompleted { completed_at: at });
                }
                events
            }
            PromotionCommand::Fail { reason, at } => {
                self.in_state("fail", &[S::Verifying])?;
                if self.verification_outcome != Some(VerificationOutcome::Failed) {
                    return Err(PromotionError::WrongState {
                        command: "fail (verification has not failed)",
                        state: S::Verifying,
                    });
                }
                if self.rollback_in_progress.is_some() {
                    return Err(PromotionError::Rollback("a rollback is under way"));
                }
                vec![PromotionEvent::PromotionFailed {
                    reason: inert(reason),
                    rolled_back: false,
                    failed_at: at,
                }]
            }
            PromotionCommand::StartRollback {
                rollback_promotion_id,
                restored_release_id,
                automatic,
                by,
                mut reason,
                at,
            } => {
                if automatic {
                    reason = inert(reason);
                }
                required(&reason)?;
                let state = self.in_state("roll back", &[S::Verifying, S::Failed, S::Completed])?;
                if state == S::Verifying
                    && self.verification_outcome != Some(VerificationOutcome::Failed)
                {
                    return Err(PromotionError::WrongState {
                        command: "roll back (verification has not failed)",
                        state,
                    });
                }
                if self.rollback_in_progress.is_some() {
                    return Err(PromotionError::Rollback("a rollback is already under way"));
                }
                vec![PromotionEvent::RollbackStarted {
                    rollback_promotion_id,
                    restored_release_id,
                    automatic,
                    started_by: by,
                    reason,
                    started_at: at,
                }]
            }
            PromotionCommand::CompleteRollback { at } => {
                let state = self.in_state(
                    "complete the rollback of",
                    &[S::Verifying, S::Failed, S::Completed],
                )?;
                let (_, restored_release_id) = self
                    .rollback_in_progress
                    .ok_or(PromotionError::Rollback("no rollback is under way"))?;
                let mut events = Vec::new();
                if state == S::Verifying {
                    events.push(PromotionEvent::PromotionFailed {
                        reason: "verification failed; the previous release was restored"
                            .to_string(),
                        rolled_back: true,
                        failed_at: at,
                    });
                }
                events.push(PromotionEvent::RollbackCompleted {
                    restored_release_id,
                    completed_at: at,
                });
                events
            }
            PromotionCommand::FailRollback { reason, at } => {
                let state = self.in_state(
                    "fail the rollback of",
                    &[S::Verifying, S::Failed, S::Completed],
                )?;
                if self.rollback_in_progress.is_none() {
                    return Err(PromotionError::Rollback("no rollback is under way"));
                }
                let reason = inert(reason);
                let mut events = vec![PromotionEvent::RollbackFailed {
                    reason: reason.clone(),
                    failed_at: at,
                }];
                if state == S::Verifying {
                    events.push(PromotionEvent::PromotionFailed {
                        reason: inert(format!(
                            "verification failed and the rollback failed: {reason}"
                        )),
                        rolled_back: false,
                        failed_at: at,
                    });
                }
                events
            }
            PromotionCommand::Reject { reason, at } => {
                if reason.trim().is_empty() {
                    return Err(PromotionError::ReasonRequired);
                }
                let reason = inert(reason);
                self.in_state(
                    "reject",
                    &[
                        S::Requested,
                        S::GatesEvaluating,
                        S::AwaitingApproval,
                        S::Approved,
                    ],
                )?;
                vec![PromotionEvent::PromotionRejected {
                    reason,
                    gate: None,
                    rejected_at: at,
                }]
            }
        };
        for event in events {
            sink.write(event, self).await;
        }
        Ok(())
    }

    fn apply(&mut self, event: Self::Event) {
        self.approval_status = ApprovalStatus::after(self.approval_status, &event);
        use PromotionState as S;
        match event {
            PromotionEvent::PromotionRequested(request) => {
                self.request = Some(*request);
                self.state = Some(S::Requested);
            }
            PromotionEvent::GatesEvaluationStarted { .. } => {
                self.state = Some(S::GatesEvaluating);
            }
            PromotionEvent::GateEvaluated(gate) => self.gates.push(*gate),
            PromotionEvent::GatesPassed {
                approval_required, ..
            } => {
                self.state = Some(if approval_required {
                    S::AwaitingApproval
                } else {
                    S::Approved
                });
            }
            PromotionEvent::ApprovalRequested(approval) => {
                self.provisioning_run_id = Some(approval.provisioning_run_id);
                self.desired_state_ref = Some(approval.desired_state_ref.clone());
                self.approval = Some(*approval);
            }
            PromotionEvent::ApprovalVoided { .. } => {
                self.approval = None;
                self.approval_id = None;
                self.approved_by = None;
                self.provisioning_run_id = None;
                self.approvals_voided += 1;
                self.state = Some(S::AwaitingApproval);
            }
            PromotionEvent::ApprovalGranted {
                approval_id,
                decided_by,
                reason,
                decided_at,
            } => {
                self.approval_id = Some(approval_id);
                self.approved_by = Some((decided_by, reason, decided_at));
                self.state = Some(S::Approved);
            }
            PromotionEvent::ApprovalRejected { .. } | PromotionEvent::ApprovalExpired { .. } => {}
            PromotionEvent::PromotionRejected { .. } => self.state = Some(S::Rejected),
            PromotionEvent::PromotionApproved {
                desired_state_ref,
                provisioning_run_id,
                ..
            } => {
                self.desired_state_ref = Some(desired_state_ref);
                self.provisioning_run_id = Some(provisioning_run_id);
                self.state = Some(S::Deploying);
            }
            PromotionEvent::DeploymentApplied { .. } => self.state = Some(S::Verifying),
            PromotionEvent::DeploymentFailed { .. } => {}
            PromotionEvent::VerificationMeasured(_) => {}
            PromotionEvent::VerificationConcluded { outcome, .. } => {
                self.verification_outcome = Some(outcome);
            }
            PromotionEvent::PromotionCompleted { .. } => self.state = Some(S::Completed),
            PromotionEvent::RollbackStarted {
                rollback_promotion_id,
                restored_release_id,
                ..
            } => self.rollback_in_progress = Some((rollback_promotion_id, restored_release_id)),
            PromotionEvent::RollbackFailed { .. } => self.rollback_in_progress = None,
            PromotionEvent::RollbackCompleted { .. } => {
                self.rollback_in_progress = None;
                self.state = Some(S::RolledBack);
            }
            PromotionEvent::PromotionFailed { rolled_back, .. } => {
                if !rolled_back {
                    self.state = Some(S::Failed);
                }
            }
        }
    }
}
