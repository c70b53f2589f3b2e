//! The ProvisioningRun aggregate: one plan-and-apply of one specification version.
//!
//! ```text
//! Requested ─plan─▶ Planned ─start apply─▶ Applying ─▶ Applied | Failed
//!     │                │  └─require approval─▶ AwaitingApproval ─grant─▶ Applying
//!     │                │                             └─reject─▶ Rejected
//!     └─fail planning─▶ Failed     cancel (before apply) ─▶ Cancelled
//!                                  supersede (stale plan) ─▶ Superseded
//!  Planned (a reconciliation whose plan changes nothing) ─▶ InSync
//! ```
//!
//! Rules kept here: a plan is recorded before any apply; receipts are written once; a
//! production apply needs the promotion's approval, a person's approval, or (baseline and
//! reconciliation only) a policy allow with evidence; the approver is not the requester.
//!
//! A run carries a promotion's approval only when Ferry created it from an approved
//! promotion it holds ([`RunCommand::RequestForPromotion`] with a
//! [`VerifiedPromotionApproval`], which only this crate can make, from the promotion's own
//! recorded approval), or when that approval is given to the run awaiting approval with the
//! plan it was asked for ([`RunCommand::ApproveForPromotion`]: the plan's inputs hash must
//! be the one approved). An approval id in a plain request grants nothing and is refused, and
//! a promotion's run cannot be approved as a plain run.

use crate::ids::{
    Actor, ApprovalId, EnvironmentId, ProjectId, PromotionId, ProvisioningRunId, ReleaseId,
    SpecificationId, TenantId,
};
use crate::receipts::{ApplyReceipt, ApplyResult, PlanReceipt, PolicyOutcome};
use crate::values::{is_production, EnvironmentClass, ProvisioningKind, ProvisioningState};
use crate::{text, EventType, TenantOwned};
use chrono::{DateTime, Utc};
use cqrs_es::event_sink::EventSink;
use cqrs_es::{Aggregate, DomainEvent};
use serde::{Deserialize, Serialize};

/// What a run was asked to do: the payload of `ProvisioningRequested`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunRequest {
    /// The run.
    pub provisioning_run_id: ProvisioningRunId,
    /// The owning tenant.
    pub tenant_id: TenantId,
    /// The project of the specification.
    pub project_id: ProjectId,
    /// The environment the run changes.
    pub environment_id: EnvironmentId,
    /// The environment's class when the run was requested; `None` = unknown = production.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment_class: Option<EnvironmentClass>,
    /// The specification planned.
    pub specification_id: SpecificationId,
    /// Its version.
    pub specification_version: u32,
    /// Why the run exists.
    pub kind: ProvisioningKind,
    /// The promotion that asked for it, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promotion_id: Option<PromotionId>,
    /// The promotion's approval, reused for a production apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_id: Option<ApprovalId>,
    /// For a reconciliation: the run whose apply failed there last (set by the reconciler
    /// from the runs Ferry holds). Its fix is proposed, never applied blindly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follows_failed_apply: Option<ProvisioningRunId>,
    /// Who asked.
    pub requested_by: Actor,
    /// When.
    pub requested_at: DateTime<Utc>,
}

/// Proof that a promotion Ferry holds was approved, by someone other than its requester, for
/// exactly this tenant, release and environment. Only this crate constructs it (from the
/// promotion's own recorded approval), so no caller can make one up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedPromotionApproval {
    record: PromotionApprovalRecord,
}

impl VerifiedPromotionApproval {
    /// Built by the promotion that holds the approval.
    pub(crate) fn new(record: PromotionApprovalRecord) -> Self {
        Self { record }
    }

    /// What is recorded on the run.
    pub fn record(&self) -> &PromotionApprovalRecord {
        &self.record
    }
}

/// A promotion's approval as recorded on the run it authorises.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PromotionApprovalRecord {
    /// The promotion.
    pub promotion_id: PromotionId,
    /// Its approval.
    pub approval_id: ApprovalId,
    /// The tenant it was approved for.
    pub tenant_id: TenantId,
    /// The environment it was approved for.
    pub environment_id: EnvironmentId,
    /// Who approved it.
    pub approved_by: Actor,
    /// When.
    pub approved_at: DateTime<Utc>,
}

/// Proof that a rollback promotion Ferry holds restores a release in exactly this tenant and
/// environment, under the rollback's own authority: an Operator's by role (a manual
/// rollback) or the failed verification it answers (an automatic one). Only this crate
/// constructs it (from the rollback promotion's own request, once its gates passed), so no
/// caller can make one up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedRollback {
    record: RollbackAuthorityRecord,
}

impl VerifiedRollback {
    /// Built by the rollback promotion.
    pub(crate) fn new(record: RollbackAuthorityRecord) -> Self {
        Self { record }
    }

    /// What is recorded on the run.
    pub fn record(&self) -> &RollbackAuthorityRecord {
        &self.record
    }
}

impl PromotionApprovalRecord {
    /// The tenant, environment and promotion the run it hands over must name.
    fn proof(&self) -> (&TenantId, &EnvironmentId, PromotionId) {
        (&self.tenant_id, &self.environment_id, self.promotion_id)
    }
}

/// A rollback's authority as recorded on the run that restores the release.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RollbackAuthorityRecord {
    /// The rollback promotion.
    pub promotion_id: PromotionId,
    /// The promotion it rolls back.
    pub rolls_back: PromotionId,
    /// The release it restores.
    pub release_id: ReleaseId,
    /// The tenant.
    pub tenant_id: TenantId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// True when failed verification started it; false when an Operator did.
    pub automatic: bool,
    /// The Operator who asked for it (by role), or the verifier.
    pub authorised_by: Actor,
    /// Why.
    pub reason: String,
}

impl RollbackAuthorityRecord {
    /// The tenant, environment and promotion the run it hands over must name.
    fn proof(&self) -> (&TenantId, &EnvironmentId, PromotionId) {
        (&self.tenant_id, &self.environment_id, self.promotion_id)
    }
}

/// A person's decision on a run awaiting approval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Decision {
    /// Let the run apply.
    Approve,
    /// Refuse it.
    Reject,
}

/// A recorded approval decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalRecord {
    /// The decision.
    pub decision: Decision,
    /// The approval's id in run control, when the decision came from there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_id: Option<ApprovalId>,
    /// Who decided.
    pub decided_by: Actor,
    /// Why, as they said it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When.
    pub decided_at: DateTime<Utc>,
}

/// What allowed a run to apply; kept on the run as evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum ApplyAuthorization {
    /// Outside production, and policy did not ask for approval.
    NotRequired,
    /// The promotion's production-class approval, carried by the run.
    #[serde(rename_all = "camelCase")]
    PromotionApproval {
        /// The promotion.
        promotion_id: PromotionId,
        /// Its approval.
        approval_id: ApprovalId,
    },
    /// A rollback restoring the previous release, under its own authority (an Operator's
    /// by role, or the failed verification it answers), carried by the run.
    #[serde(rename_all = "camelCase")]
    Rollback {
        /// The rollback promotion.
        promotion_id: PromotionId,
        /// The promotion it rolls back.
        rolls_back: PromotionId,
        /// True when failed verification started it.
        automatic: bool,
        /// The Operator who asked for it, or the verifier.
        authorised_by: Actor,
    },
    /// Policy allowed a baseline or reconciliation apply, with this evidence.
    #[serde(rename_all = "camelCase")]
    PolicyAllow {
        /// The reasons policy gave.
        evidence: Vec<String>,
    },
    /// A person (not the requester) approved.
    #[serde(rename_all = "camelCase")]
    Approval {
        /// Who approved.
        approved_by: Actor,
        /// The approval's id, if it came from run control.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        approval_id: Option<ApprovalId>,
    },
}

/// Which step failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum FailureStage {
    /// Planning failed (e.g. the program version does not exist).
    Plan,
    /// The apply failed.
    Apply,
}

/// Commands of the run aggregate.
#[derive(Debug, Clone, PartialEq)]
pub enum RunCommand {
    /// PlanProvisioning: record the run in `Requested`. Refused when the request carries an
    /// approval id: only [`RunCommand::RequestForPromotion`] attaches one.
    Request(Box<RunRequest>),
    /// A promotion's hand-off: record the run in `Requested` with the promotion's verified
    /// approval, which must name the request's tenant, environment, promotion and approval.
    RequestForPromotion {
        /// The run; its `promotion_id` and `approval_id` must be the approval's.
        request: Box<RunRequest>,
        /// The proof.
        approval: Box<VerifiedPromotionApproval>,
    },
    /// A rollback promotion's hand-off: record the run in `Requested` with the rollback's
    /// verified authority, which must name the request's tenant, environment and promotion.
    RequestForRollback {
        /// The run; its `promotion_id` must be the rollback promotion's, and no approval id.
        request: Box<RunRequest>,
        /// The proof.
        authority: Box<VerifiedRollback>,
    },
    /// A promotion's approval, verified, for the plan this run awaits approval with: it
    /// covers exactly that plan (the inputs hash the approval was asked with).
    ApproveForPromotion {
        /// The proof.
        approval: Box<VerifiedPromotionApproval>,
        /// The inputs hash of the plan the approval was asked with.
        plan_inputs_hash: String,
        /// When.
        at: DateTime<Utc>,
    },
    /// The planner's receipt.
    RecordPlan {
        /// The receipt.
        receipt: Box<PlanReceipt>,
        /// Where the plan log is kept.
        logs_ref: Option<String>,
        /// When.
        at: DateTime<Utc>,
    },
    /// Planning failed; the reason names the reference that could not be used.
    FailPlanning {
        /// Why.
        reason: String,
        /// When.
        at: DateTime<Utc>,
    },
    /// A production apply without approval must wait for one.
    RequireApproval {
        /// Why approval is needed.
        reason: String,
        /// When.
        at: DateTime<Utc>,
    },
    /// Approve or reject a run awaiting approval.
    DecideApproval {
        /// The decision.
        decision: Decision,
        /// Who decides.
        decided_by: Actor,
        /// Why.
        reason: Option<String>,
        /// The run-control approval, when the decision came from there.
        approval_id: Option<ApprovalId>,
        /// When.
        at: DateTime<Utc>,
    },
    /// Begin applying a planned run that is approved or allowed.
    StartApply {
        /// When.
        at: DateTime<Utc>,
    },
    /// The runner succeeded.
    RecordApplySucceeded {
        /// Its receipt (result `Succeeded`).
        receipt: Box<ApplyReceipt>,
        /// Where the apply log is kept.
        logs_ref: Option<String>,
        /// When.
        at: DateTime<Utc>,
    },
    /// The runner failed.
    RecordApplyFailed {
        /// Its receipt (result `Failed`), naming the failing resource where it can.
        receipt: Box<ApplyReceipt>,
        /// Why.
        reason: String,
        /// Where the apply log is kept.
        logs_ref: Option<String>,
        /// When.
        at: DateTime<Utc>,
    },
    /// Cancel before apply.
    Cancel {
        /// Who cancels.
        cancelled_by: Actor,
        /// Why.
        reason: Option<String>,
        /// When.
        at: DateTime<Utc>,
    },
    /// Policy denied the plan: the run ends `Rejected` and is never applied.
    RejectByPolicy {
        /// The policy's reasons.
        evidence: Vec<String>,
        /// When.
        at: DateTime<Utc>,
    },
    /// The plan went stale (the environment changed after it was made). Allowed until the
    /// runner starts: the applier checks staleness in `Applying` before it runs anything.
    Supersede {
        /// What changed.
        reason: String,
        /// When.
        at: DateTime<Utc>,
    },
    /// A reconciliation's plan changes nothing: the run ends `InSync`, never applied.
    RecordInSync {
        /// When.
        at: DateTime<Utc>,
    },
}

impl RunCommand {
    /// The command's name, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Request(_) => "Request",
            Self::RequestForPromotion { .. } => "RequestForPromotion",
            Self::RequestForRollback { .. } => "RequestForRollback",
            Self::ApproveForPromotion { .. } => "ApproveForPromotion",
            Self::RecordPlan { .. } => "RecordPlan",
            Self::FailPlanning { .. } => "FailPlanning",
            Self::RequireApproval { .. } => "RequireApproval",
            Self::DecideApproval { .. } => "DecideApproval",
            Self::StartApply { .. } => "StartApply",
            Self::RecordApplySucceeded { .. } => "RecordApplySucceeded",
            Self::RecordApplyFailed { .. } => "RecordApplyFailed",
            Self::Cancel { .. } => "Cancel",
            Self::RejectByPolicy { .. } => "RejectByPolicy",
            Self::Supersede { .. } => "Supersede",
            Self::RecordInSync { .. } => "RecordInSync",
        }
    }
}

/// Events of the run aggregate. Type strings are the variant names; all are version 1.0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum RunEvent {
    /// The run exists, in `Requested`.
    ProvisioningRequested(Box<RunRequest>),
    /// The promotion's verified approval is attached to the run (right after the request).
    PromotionApprovalVerified(PromotionApprovalRecord),
    /// The rollback's verified authority is attached to the run (right after the request).
    RollbackAuthorityVerified(RollbackAuthorityRecord),
    /// The plan receipt is recorded; the run is `Planned`.
    #[serde(rename_all = "camelCase")]
    ProvisioningPlanned {
        /// The receipt.
        plan_receipt: Box<PlanReceipt>,
        /// The plan log.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logs_ref: Option<String>,
        /// When.
        planned_at: DateTime<Utc>,
    },
    /// The run waits for a person's decision.
    #[serde(rename_all = "camelCase")]
    ApprovalRequired {
        /// Why.
        reason: String,
        /// When.
        required_at: DateTime<Utc>,
    },
    /// Approved: the run moves to `Applying`.
    ApprovalGranted(ApprovalRecord),
    /// Rejected: the run is `Rejected`.
    ApprovalRejected(ApprovalRecord),
    /// Authorised and handed to the runner: `Applying`.
    #[serde(rename_all = "camelCase")]
    ApplyStarted {
        /// What authorised it.
        authorization: ApplyAuthorization,
        /// When.
        started_at: DateTime<Utc>,
    },
    /// The apply succeeded: `Applied`.
    #[serde(rename_all = "camelCase")]
    ProvisioningApplied {
        /// The receipt.
        apply_receipt: Box<ApplyReceipt>,
        /// The apply log.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logs_ref: Option<String>,
        /// When.
        applied_at: DateTime<Utc>,
    },
    /// Planning or apply failed: `Failed`.
    #[serde(rename_all = "camelCase")]
    ProvisioningFailed {
        /// Which step.
        stage: FailureStage,
        /// Why.
        reason: String,
        /// The apply receipt, for an apply failure.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        apply_receipt: Option<Box<ApplyReceipt>>,
        /// The log.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logs_ref: Option<String>,
        /// When.
        failed_at: DateTime<Utc>,
    },
    /// Cancelled before apply.
    #[serde(rename_all = "camelCase")]
    ProvisioningCancelled {
        /// Who.
        cancelled_by: Actor,
        /// Why.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        /// When.
        cancelled_at: DateTime<Utc>,
    },
    /// Policy denied the plan: `Rejected`.
    #[serde(rename_all = "camelCase")]
    PolicyDenied {
        /// The policy's reasons.
        evidence: Vec<String>,
        /// When.
        denied_at: DateTime<Utc>,
    },
    /// The plan went stale and will never be applied.
    #[serde(rename_all = "camelCase")]
    ProvisioningSuperseded {
        /// What changed.
        reason: String,
        /// When.
        superseded_at: DateTime<Utc>,
    },
    /// A reconciliation found the environment as declared: `InSync`.
    #[serde(rename_all = "camelCase")]
    ReconciliationInSync {
        /// When.
        in_sync_at: DateTime<Utc>,
    },
}

impl RunEvent {
    /// The name and version this event is stored under (see [`crate::event_type`]).
    pub fn stored_type(&self) -> EventType {
        match self {
            Self::ProvisioningRequested(_) => EventType::first("ProvisioningRequested"),
            Self::PromotionApprovalVerified(_) => EventType::first("PromotionApprovalVerified"),
            Self::RollbackAuthorityVerified(_) => EventType::first("RollbackAuthorityVerified"),
            Self::ProvisioningPlanned { .. } => EventType::first("ProvisioningPlanned"),
            Self::ApprovalRequired { .. } => EventType::first("ApprovalRequired"),
            Self::ApprovalGranted(_) => EventType::first("ApprovalGranted"),
            Self::ApprovalRejected(_) => EventType::first("ApprovalRejected"),
            Self::ApplyStarted { .. } => EventType::first("ApplyStarted"),
            Self::ProvisioningApplied { .. } => EventType::first("ProvisioningApplied"),
            Self::ProvisioningFailed { .. } => EventType::first("ProvisioningFailed"),
            Self::ProvisioningCancelled { .. } => EventType::first("ProvisioningCancelled"),
            Self::ProvisioningSuperseded { .. } => EventType::first("ProvisioningSuperseded"),
            Self::PolicyDenied { .. } => EventType::first("PolicyDenied"),
            Self::ReconciliationInSync { .. } => EventType::first("ReconciliationInSync"),
        }
    }
}

impl DomainEvent for RunEvent {
    fn event_type(&self) -> String {
        self.stored_type().name.to_string()
    }
    fn event_version(&self) -> String {
        self.stored_type().version.to_string()
    }
}

/// Rules a run command can break. Each maps to one HTTP status in the API.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunError {
    /// `Request` on a run that exists.
    #[error("provisioning run already exists")]
    AlreadyRequested,
    /// Any other command on a run that does not exist.
    #[error("provisioning run does not exist")]
    NotRequested,
    /// The command is not allowed in the run's state.
    #[error("{command} is not allowed when the run is {state}")]
    InvalidTransition {
        /// The command.
        command: &'static str,
        /// The run's state.
        state: ProvisioningState,
    },
    /// Receipts are immutable: a plan receipt exists.
    #[error("the plan receipt is already recorded and cannot be replaced")]
    PlanReceiptAlreadyRecorded,
    /// Receipts are immutable: an apply receipt exists.
    #[error("the apply receipt is already recorded and cannot be replaced")]
    ApplyReceiptAlreadyRecorded,
    /// A production apply without an approval or a policy allow.
    #[error("this apply needs an approval: {0}")]
    ApprovalRequired(String),
    /// Policy denied the plan; it is never applied.
    #[error("policy denied this plan: {0}")]
    PolicyDenied(String),
    /// The approver is the requester.
    #[error("{0} requested this run and cannot approve it")]
    ApproverIsRequester(Actor),
    /// A promotion's run is approved only through the promotion's own approval.
    #[error("this run applies promotion {0}: approve the promotion, not the run")]
    PromotionApprovalRequired(PromotionId),
    /// A receipt whose result contradicts the command (a failed receipt recorded as success).
    #[error("the apply receipt's result is {found:?}, expected {expected:?}")]
    ReceiptResultMismatch {
        /// What the command needed.
        expected: ApplyResult,
        /// What the receipt said.
        found: ApplyResult,
    },
    /// A reason was required and was empty.
    #[error("a reason is required")]
    ReasonRequired,
    /// A request named a promotion's approval that Ferry did not verify.
    #[error("a run carries a promotion's approval only when Ferry creates it from an approved promotion it holds")]
    UnverifiedPromotionApproval,
    /// The verified approval is for another tenant, environment, promotion or approval.
    #[error("the promotion's approval does not match the run: {0}")]
    PromotionApprovalMismatch(&'static str),
    /// Only a reconciliation whose plan changes nothing ends in sync.
    #[error("only a reconciliation whose plan changes nothing is in sync")]
    NotInSync,
    /// A reason a caller gave that a console could not render faithfully.
    #[error(transparent)]
    InvalidText(#[from] crate::text::InvalidText),
}

/// The run's state, rebuilt from its events.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProvisioningRun {
    request: Option<RunRequest>,
    promotion_approval: Option<PromotionApprovalRecord>,
    #[serde(default)]
    rollback_authority: Option<RollbackAuthorityRecord>,
    state: Option<ProvisioningState>,
    plan_receipt: Option<PlanReceipt>,
    approval: Option<ApprovalRecord>,
    authorization: Option<ApplyAuthorization>,
    apply_receipt: Option<ApplyReceipt>,
}

/// The worker that rejects a run whose approval was not decided in time: its approval
/// decision names it, so that whoever reads the run knows the approval expired.
pub const APPROVAL_EXPIRY_WORKER: &str = "approval-expiry";

impl ProvisioningRun {
    /// What was requested, if the run exists.
    pub fn request(&self) -> Option<&RunRequest> {
        self.request.as_ref()
    }
    /// The current state, if the run exists.
    pub fn state(&self) -> Option<ProvisioningState> {
        self.state
    }
    /// The plan receipt, once recorded.
    pub fn plan_receipt(&self) -> Option<&PlanReceipt> {
        self.plan_receipt.as_ref()
    }
    /// The promotion's verified approval, when a promotion handed the run over.
    pub fn promotion_approval(&self) -> Option<&PromotionApprovalRecord> {
        self.promotion_approval.as_ref()
    }
    /// The rollback's verified authority, when a rollback promotion handed the run over.
    pub fn rollback_authority(&self) -> Option<&RollbackAuthorityRecord> {
        self.rollback_authority.as_ref()
    }
    /// The approval decision, if any.
    pub fn approval(&self) -> Option<&ApprovalRecord> {
        self.approval.as_ref()
    }
    /// What authorised the apply, once applying.
    pub fn authorization(&self) -> Option<&ApplyAuthorization> {
        self.authorization.as_ref()
    }
    /// The apply receipt, once recorded.
    pub fn apply_receipt(&self) -> Option<&ApplyReceipt> {
        self.apply_receipt.as_ref()
    }

    fn expect_state(
        &self,
        command: &RunCommand,
        allowed: &[ProvisioningState],
    ) -> Result<(&RunRequest, ProvisioningState), RunError> {
        let (Some(request), Some(state)) = (self.request.as_ref(), self.state) else {
            return Err(RunError::NotRequested);
        };
        if allowed.contains(&state) {
            Ok((request, state))
        } else {
            Err(RunError::InvalidTransition {
                command: command.name(),
                state,
            })
        }
    }

    /// Decides whether a planned run may apply without a person's approval, and on what
    /// grounds. `Err(ApprovalRequired)` means it must wait in `AwaitingApproval`.
    pub fn authorize_apply(&self) -> Result<ApplyAuthorization, RunError> {
        // An environment Ferry has not heard of counts as production; the reason says so,
        // and how to record it, so that nobody waits for an approval by mistake.
        self.authorize_apply_by_class().map_err(|e| match (e, &self.request) {
            (RunError::ApprovalRequired(reason), Some(request))
                if request.environment_class.is_none() =>
            {
                RunError::ApprovalRequired(format!(
                    "environment {env} is not recorded, so it is treated as production (record it with PUT /factory/environments/{env} or the environment service's EnvironmentCreated): {reason}",
                    env = request.environment_id
                ))
            }
            (e, _) => e,
        })
    }

    fn authorize_apply_by_class(&self) -> Result<ApplyAuthorization, RunError> {
        let request = self.request.as_ref().ok_or(RunError::NotRequested)?;
        let plan = self
            .plan_receipt
            .as_ref()
            .ok_or(RunError::InvalidTransition {
                command: "StartApply",
                state: self.state.unwrap_or(ProvisioningState::Requested),
            })?;
        let policy = plan.policy.as_ref();
        if let Some(p) = policy.filter(|p| p.decision == PolicyOutcome::Deny) {
            return Err(RunError::PolicyDenied(p.evidence.join("; ")));
        }
        let policy_wants_approval =
            policy.is_some_and(|p| p.decision == PolicyOutcome::RequireApproval);
        // Only an approval Ferry verified counts; ids in the request alone grant nothing.
        if let Some(verified) = &self.promotion_approval {
            if request.kind == ProvisioningKind::Release {
                return Ok(ApplyAuthorization::PromotionApproval {
                    promotion_id: verified.promotion_id,
                    approval_id: verified.approval_id,
                });
            }
        }
        // A rollback restores what ran before under its own authority, even when its plan
        // deletes what the failed release added: waiting for a person here would hold the
        // environment on the release that failed. Policy may still deny it (above).
        if let Some(rollback) = &self.rollback_authority {
            if request.kind == ProvisioningKind::Release {
                return Ok(ApplyAuthorization::Rollback {
                    promotion_id: rollback.promotion_id,
                    rolls_back: rollback.rolls_back,
                    automatic: rollback.automatic,
                    authorised_by: rollback.authorised_by.clone(),
                });
            }
        }
        if policy_wants_approval {
            return Err(RunError::ApprovalRequired(
                "policy requires approval for this plan".to_string(),
            ));
        }
        // After a failed apply the infrastructure is partly changed: what would put it right
        // is shown to a person, not retried blindly.
        if let (ProvisioningKind::Reconciliation, Some(failed)) =
            (request.kind, request.follows_failed_apply)
        {
            return Err(RunError::ApprovalRequired(format!(
                "the last apply here (run {failed}) failed and left the environment partly changed: the fix is a proposal an Operator approves exactly as planned"
            )));
        }
        // Drift that deletes or replaces is never repaired behind anyone's back, in any class.
        if request.kind == ProvisioningKind::Reconciliation && plan.is_destructive() {
            return Err(RunError::ApprovalRequired(
                "a reconciliation that deletes or replaces resources is a proposal: an Operator approves exactly this plan"
                    .to_string(),
            ));
        }
        if !is_production(request.environment_class) {
            return Ok(ApplyAuthorization::NotRequired);
        }
        match request.kind {
            ProvisioningKind::Reconciliation => Err(RunError::ApprovalRequired(
                "drift in production is a proposal: an Operator approves exactly this plan"
                    .to_string(),
            )),
            ProvisioningKind::Baseline => match policy {
                Some(p) if p.decision == PolicyOutcome::Allow && !p.evidence.is_empty() => {
                    if plan.is_destructive() {
                        Err(RunError::ApprovalRequired(
                            "a production plan that deletes or replaces resources is never applied automatically"
                                .to_string(),
                        ))
                    } else {
                        Ok(ApplyAuthorization::PolicyAllow {
                            evidence: p.evidence.clone(),
                        })
                    }
                }
                _ => Err(RunError::ApprovalRequired(format!(
                    "a production {} apply needs a policy allow with evidence",
                    request.kind.as_str()
                ))),
            },
            ProvisioningKind::Release => Err(RunError::ApprovalRequired(
                "a production release apply needs the promotion's approval".to_string(),
            )),
            ProvisioningKind::Decommission => Err(RunError::ApprovalRequired(
                "a production decommission needs a person's approval".to_string(),
            )),
        }
    }
}

impl TenantOwned for ProvisioningRun {
    fn tenant(&self) -> Option<&TenantId> {
        self.request.as_ref().map(|r| &r.tenant_id)
    }
}

use ProvisioningState as S;

/// What of a promotion's hand-off `request` does not match the tenant, environment and
/// promotion its proof (an approval, a rollback's authority) names, if anything; a
/// promotion hands over a `Release` run only.
fn hand_off_mismatch(
    request: &RunRequest,
    (tenant, environment, promotion): (&TenantId, &EnvironmentId, PromotionId),
) -> Option<&'static str> {
    if *tenant != request.tenant_id {
        Some("tenant")
    } else if *environment != request.environment_id {
        Some("environment")
    } else if request.promotion_id != Some(promotion) {
        Some("promotion")
    } else if request.kind != ProvisioningKind::Release {
        Some("kind (a promotion hands over a Release)")
    } else {
        None
    }
}

fn non_empty(reason: &str) -> Result<(), RunError> {
    if reason.trim().is_empty() {
        Err(RunError::ReasonRequired)
    } else {
        Ok(())
    }
}

/// The command handlers longer than a few lines, one per command; [`Aggregate::handle`]
/// dispatches to them and writes the event each returns.
impl ProvisioningRun {
    fn request_provisioning(&self, request: &RunRequest) -> Result<RunEvent, RunError> {
        if self.request.is_some() {
            return Err(RunError::AlreadyRequested);
        }
        if request.approval_id.is_some() {
            return Err(RunError::UnverifiedPromotionApproval);
        }
        Ok(RunEvent::ProvisioningRequested(Box::new(request.clone())))
    }

    /// A promotion's hand-off: the run is requested, then `verified` (the proof) follows,
    /// unless the run exists, or the proof names another tenant, environment or promotion
    /// (`proof`), or something else of the request does not match it (`other`).
    async fn hand_off(
        &mut self,
        request: &RunRequest,
        proof: (&TenantId, &EnvironmentId, PromotionId),
        other: Option<&'static str>,
        verified: RunEvent,
        sink: &EventSink<Self>,
    ) -> Result<RunEvent, RunError> {
        if self.request.is_some() {
            return Err(RunError::AlreadyRequested);
        }
        if let Some(what) = hand_off_mismatch(request, proof).or(other) {
            return Err(RunError::PromotionApprovalMismatch(what));
        }
        let requested = RunEvent::ProvisioningRequested(Box::new(request.clone()));
        sink.write(requested, self).await;
        Ok(verified)
    }

    async fn approve_for_promotion(
        &mut self,
        command: &RunCommand,
        record: &PromotionApprovalRecord,
        plan_inputs_hash: &str,
        at: DateTime<Utc>,
        sink: &EventSink<Self>,
    ) -> Result<RunEvent, RunError> {
        let (request, _) = self.expect_state(command, &[S::AwaitingApproval])?;
        let planned = self.plan_receipt.as_ref().map(|p| p.inputs_hash.as_str());
        let mismatch = if record.tenant_id != request.tenant_id {
            Some("tenant")
        } else if record.environment_id != request.environment_id {
            Some("environment")
        } else if request.promotion_id != Some(record.promotion_id) {
            Some("promotion")
        } else if planned != Some(plan_inputs_hash) {
            Some("plan (the approval was asked for another plan)")
        } else {
            None
        };
        if let Some(what) = mismatch {
            return Err(RunError::PromotionApprovalMismatch(what));
        }
        self.refuse_if_policy_denied()?;
        let granted = ApprovalRecord {
            decision: Decision::Approve,
            approval_id: Some(record.approval_id),
            decided_by: record.approved_by.clone(),
            reason: Some(format!("promotion {} approved", record.promotion_id)),
            decided_at: at,
        };
        sink.write(RunEvent::PromotionApprovalVerified(record.clone()), self)
            .await;
        Ok(RunEvent::ApprovalGranted(granted))
    }

    /// `PolicyDenied` when the plan's policy decision denies it: nobody approves that plan.
    fn refuse_if_policy_denied(&self) -> Result<(), RunError> {
        match self
            .plan_receipt
            .as_ref()
            .and_then(|p| p.policy.as_ref())
            .filter(|p| p.decision == PolicyOutcome::Deny)
        {
            Some(p) => Err(RunError::PolicyDenied(p.evidence.join("; "))),
            None => Ok(()),
        }
    }

    fn fail_planning(
        &self,
        command: &RunCommand,
        reason: &str,
        at: DateTime<Utc>,
    ) -> Result<RunEvent, RunError> {
        self.expect_state(command, &[S::Requested])?;
        non_empty(reason)?;
        Ok(RunEvent::ProvisioningFailed {
            stage: FailureStage::Plan,
            // It may quote what the tenant's program printed.
            reason: text::inert(reason, text::MAX_REASON),
            apply_receipt: None,
            logs_ref: None,
            failed_at: at,
        })
    }

    fn record_plan(
        &self,
        command: &RunCommand,
        receipt: &PlanReceipt,
        logs_ref: &Option<String>,
        at: DateTime<Utc>,
    ) -> Result<RunEvent, RunError> {
        if self.request.is_some() && self.plan_receipt.is_some() {
            return Err(RunError::PlanReceiptAlreadyRecorded);
        }
        self.expect_state(command, &[S::Requested])?;
        Ok(RunEvent::ProvisioningPlanned {
            plan_receipt: Box::new(receipt.clone()),
            logs_ref: logs_ref.clone(),
            planned_at: at,
        })
    }

    /// A person's (or run control's) decision on a run awaiting approval, as `record`.
    fn decide_approval(
        &self,
        command: &RunCommand,
        record: ApprovalRecord,
    ) -> Result<RunEvent, RunError> {
        let (request, _) = self.expect_state(command, &[S::AwaitingApproval])?;
        text::check_optional_free_text("reason", record.reason.as_deref())?;
        let approve = record.decision == Decision::Approve;
        // Compared as people are (`Actor::same_person`): `Alice` and `alice ` are one.
        if approve && request.requested_by.same_person(&record.decided_by) {
            return Err(RunError::ApproverIsRequester(record.decided_by));
        }
        // A promotion's run is approved only with the promotion's verified approval
        // (`ApproveForPromotion`): approving the run itself would skip the promotion's.
        if let Some(promotion) = request.promotion_id.filter(|_| approve) {
            return Err(RunError::PromotionApprovalRequired(promotion));
        }
        if approve {
            self.refuse_if_policy_denied()?;
        }
        Ok(match record.decision {
            Decision::Approve => RunEvent::ApprovalGranted(record),
            Decision::Reject => RunEvent::ApprovalRejected(record),
        })
    }

    /// The checks before an apply's receipt is recorded: none yet, the run applying, a
    /// failure's `reason` given, and the receipt's result the command's.
    fn check_apply_receipt(
        &self,
        command: &RunCommand,
        receipt: &ApplyReceipt,
        failure_reason: Option<&str>,
    ) -> Result<(), RunError> {
        if self.apply_receipt.is_some() {
            return Err(RunError::ApplyReceiptAlreadyRecorded);
        }
        self.expect_state(command, &[S::Applying])?;
        let expected = match failure_reason {
            Some(reason) => {
                non_empty(reason)?;
                ApplyResult::Failed
            }
            None => ApplyResult::Succeeded,
        };
        if receipt.result != expected {
            return Err(RunError::ReceiptResultMismatch {
                expected,
                found: receipt.result,
            });
        }
        Ok(())
    }

    fn cancel(
        &self,
        command: &RunCommand,
        cancelled_by: &Actor,
        reason: &Option<String>,
        at: DateTime<Utc>,
    ) -> Result<RunEvent, RunError> {
        self.expect_state(command, &[S::Requested, S::Planned, S::AwaitingApproval])?;
        text::check_optional_free_text("reason", reason.as_deref())?;
        Ok(RunEvent::ProvisioningCancelled {
            cancelled_by: cancelled_by.clone(),
            reason: reason.clone(),
            cancelled_at: at,
        })
    }

    fn reject_by_policy(
        &self,
        command: &RunCommand,
        evidence: &[String],
        at: DateTime<Utc>,
    ) -> Result<RunEvent, RunError> {
        self.expect_state(command, &[S::Planned])?;
        if evidence.iter().all(|e| e.trim().is_empty()) {
            return Err(RunError::ReasonRequired);
        }
        Ok(RunEvent::PolicyDenied {
            evidence: evidence.to_vec(),
            denied_at: at,
        })
    }

    fn supersede(
        &self,
        command: &RunCommand,
        reason: &str,
        at: DateTime<Utc>,
    ) -> Result<RunEvent, RunError> {
        if self.apply_receipt.is_some() {
            return Err(RunError::ApplyReceiptAlreadyRecorded);
        }
        self.expect_state(command, &[S::Planned, S::AwaitingApproval, S::Applying])?;
        non_empty(reason)?;
        Ok(RunEvent::ProvisioningSuperseded {
            reason: reason.to_string(),
            superseded_at: at,
        })
    }

    fn record_in_sync(
        &self,
        command: &RunCommand,
        at: DateTime<Utc>,
    ) -> Result<RunEvent, RunError> {
        let (request, _) = self.expect_state(command, &[S::Planned])?;
        let changes = self.plan_receipt.as_ref().map(PlanReceipt::change_count);
        if request.kind != ProvisioningKind::Reconciliation || changes != Some(0) {
            return Err(RunError::NotInSync);
        }
        Ok(RunEvent::ReconciliationInSync { in_sync_at: at })
    }
}

/// Stored with no upcasters yet: every event type is at its first version.
impl crate::StoredAggregate for ProvisioningRun {}

impl Aggregate for ProvisioningRun {
    const TYPE: &'static str = "ProvisioningRun";
    type Command = RunCommand;
    type Event = RunEvent;
    type Error = RunError;
    type Services = ();

    async fn handle(
        &mut self,
        command: Self::Command,
        _services: &(),
        sink: &EventSink<Self>,
    ) -> Result<(), Self::Error> {
        let event = match &command {
            RunCommand::Request(request) => self.request_provisioning(request)?,
            RunCommand::RequestForPromotion { request, approval } => {
                let record = approval.record();
                let other = (request.approval_id != Some(record.approval_id)).then_some("approval");
                let verified = RunEvent::PromotionApprovalVerified(record.clone());
                self.hand_off(request, record.proof(), other, verified, sink)
                    .await?
            }
            RunCommand::RequestForRollback { request, authority } => {
                let record = authority.record();
                let other = request
                    .approval_id
                    .is_some()
                    .then_some("approval (a rollback carries none)");
                let verified = RunEvent::RollbackAuthorityVerified(record.clone());
                self.hand_off(request, record.proof(), other, verified, sink)
                    .await?
            }
            RunCommand::ApproveForPromotion {
                approval,
                plan_inputs_hash,
                at,
            } => {
                let record = approval.record();
                self.approve_for_promotion(&command, record, plan_inputs_hash, *at, sink)
                    .await?
            }
            RunCommand::RecordPlan {
                receipt,
                logs_ref,
                at,
            } => self.record_plan(&command, receipt, logs_ref, *at)?,
            RunCommand::FailPlanning { reason, at } => self.fail_planning(&command, reason, *at)?,
            RunCommand::RequireApproval { reason, at } => {
                self.expect_state(&command, &[S::Planned])?;
                non_empty(reason)?;
                RunEvent::ApprovalRequired {
                    reason: reason.clone(),
                    required_at: *at,
                }
            }
            RunCommand::DecideApproval {
                decision,
                decided_by,
                reason,
                approval_id,
                at,
            } => {
                let record = ApprovalRecord {
                    decision: *decision,
                    approval_id: *approval_id,
                    decided_by: decided_by.clone(),
                    reason: reason.clone(),
                    decided_at: *at,
                };
                self.decide_approval(&command, record)?
            }
            RunCommand::StartApply { at } => {
                self.expect_state(&command, &[S::Planned])?;
                RunEvent::ApplyStarted {
                    authorization: self.authorize_apply()?,
                    started_at: *at,
                }
            }
            RunCommand::RecordApplySucceeded {
                receipt,
                logs_ref,
                at,
            } => {
                self.check_apply_receipt(&command, receipt, None)?;
                RunEvent::ProvisioningApplied {
                    apply_receipt: receipt.clone(),
                    logs_ref: logs_ref.clone(),
                    applied_at: *at,
                }
            }
            RunCommand::RecordApplyFailed {
                receipt,
                reason,
                logs_ref,
                at,
            } => {
                self.check_apply_receipt(&command, receipt, Some(reason.as_str()))?;
                RunEvent::ProvisioningFailed {
                    stage: FailureStage::Apply,
                    reason: text::inert(reason, text::MAX_REASON),
                    apply_receipt: Some(receipt.clone()),
                    logs_ref: logs_ref.clone(),
                    failed_at: *at,
                }
            }
            RunCommand::Cancel {
                cancelled_by,
                reason,
                at,
            } => self.cancel(&command, cancelled_by, reason, *at)?,
            RunCommand::RejectByPolicy { evidence, at } => {
                self.reject_by_policy(&command, evidence, *at)?
            }
            RunCommand::Supersede { reason, at } => self.supersede(&command, reason, *at)?,
            RunCommand::RecordInSync { at } => self.record_in_sync(&command, *at)?,
        };
        sink.write(event, self).await;
        Ok(())
    }

    fn apply(&mut self, event: Self::Event) {
        match event {
            RunEvent::ProvisioningRequested(request) => {
                self.request = Some(*request);
                self.state = Some(S::Requested);
            }
            RunEvent::PromotionApprovalVerified(record) => self.promotion_approval = Some(record),
            RunEvent::RollbackAuthorityVerified(record) => self.rollback_authority = Some(record),
            RunEvent::ProvisioningPlanned { plan_receipt, .. } => {
                self.plan_receipt = Some(*plan_receipt);
                self.state = Some(S::Planned);
            }
            RunEvent::ApprovalRequired { .. } => self.state = Some(S::AwaitingApproval),
            RunEvent::ApprovalGranted(record) => {
                self.authorization = Some(ApplyAuthorization::Approval {
                    approved_by: record.decided_by.clone(),
                    approval_id: record.approval_id,
                });
                self.approval = Some(record);
                self.state = Some(S::Applying);
            }
            RunEvent::ApprovalRejected(record) => {
                self.approval = Some(record);
                self.state = Some(S::Rejected);
            }
            RunEvent::ApplyStarted { authorization, .. } => {
                self.authorization = Some(authorization);
                self.state = Some(S::Applying);
            }
            RunEvent::ProvisioningApplied { apply_receipt, .. } => {
                self.apply_receipt = Some(*apply_receipt);
                self.state = Some(S::Applied);
            }
            RunEvent::ProvisioningFailed { apply_receipt, .. } => {
                self.apply_receipt = apply_receipt.map(|r| *r);
                self.state = Some(S::Failed);
            }
            RunEvent::ProvisioningCancelled { .. } => self.state = Some(S::Cancelled),
            RunEvent::ProvisioningSuperseded { .. } => self.state = Some(S::Superseded),
            RunEvent::PolicyDenied { .. } => self.state = Some(S::Rejected),
            RunEvent::ReconciliationInSync { .. } => self.state = Some(S::InSync),
        }
    }
}

#[cfg(test)]
mod tests;
