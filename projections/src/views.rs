//! The documents the API serves, folded from events. The projection and the command
//! responses use the same fold, so a POST returns exactly what a later GET shows.

use chrono::{DateTime, Utc};
use ferry_domain::receipts::{ApplyReceipt, PlanReceipt};
use ferry_domain::run::{ApplyAuthorization, ApprovalRecord, FailureStage, RunEvent};
use ferry_domain::*;
use serde::{Deserialize, Serialize};

/// The approval side of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalView {
    /// Why the run waits (or waited) for approval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub required_reason: Option<String>,
    /// When it started waiting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub required_at: Option<DateTime<Utc>>,
    /// The decision, once made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<ApprovalRecord>,
}

/// Why a run failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailureView {
    /// Planning or apply.
    pub stage: FailureStage,
    /// The reason, naming the reference or resource where known.
    pub reason: String,
}

/// Who cancelled a run and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CancellationView {
    /// Who.
    pub cancelled_by: Actor,
    /// Why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A provisioning run as the API shows it (its fields plus approval and failure detail).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunView {
    /// The run.
    pub provisioning_run_id: ProvisioningRunId,
    /// The owning tenant.
    pub tenant_id: TenantId,
    /// The project.
    pub project_id: ProjectId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// The environment class when requested (absent = unknown, treated as production).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment_class: Option<EnvironmentClass>,
    /// The specification planned.
    pub specification_id: SpecificationId,
    /// Its version.
    pub specification_version: u32,
    /// Baseline, Release, Reconciliation or Decommission.
    pub kind: ProvisioningKind,
    /// The promotion that asked for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promotion_id: Option<PromotionId>,
    /// The promotion's approval, or the run-control approval that decided it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_id: Option<ApprovalId>,
    /// The promotion's approval as Ferry verified it, when a promotion handed the run over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promotion_approval: Option<ferry_domain::run::PromotionApprovalRecord>,
    /// The rollback's verified authority, when a rollback promotion handed the run over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback_authority: Option<ferry_domain::run::RollbackAuthorityRecord>,
    /// The state.
    pub state: ProvisioningState,
    /// The plan receipt, once planned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_receipt: Option<PlanReceipt>,
    /// Approval detail, when approval was needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalView>,
    /// What authorised the apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authorization: Option<ApplyAuthorization>,
    /// The apply receipt, once applied or failed in apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apply_receipt: Option<ApplyReceipt>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<FailureView>,
    /// Who cancelled it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancellation: Option<CancellationView>,
    /// Why its plan went stale.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub superseded_reason: Option<String>,
    /// The latest log artifact (plan, then apply).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logs_ref: Option<String>,
    /// Who requested it.
    pub requested_by: Actor,
    /// When it was requested.
    pub started_at: DateTime<Utc>,
    /// When it reached a final state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<DateTime<Utc>>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// The run's event count: grows by one with every change.
    pub version: u64,
}

impl RunView {
    /// The view after the first event, if it is the request.
    pub fn start(event: &RunEvent) -> Option<Self> {
        let RunEvent::ProvisioningRequested(r) = event else {
            return None;
        };
        Some(Self {
            provisioning_run_id: r.provisioning_run_id,
            tenant_id: r.tenant_id.clone(),
            project_id: r.project_id.clone(),
            environment_id: r.environment_id.clone(),
            environment_class: r.environment_class,
            specification_id: r.specification_id,
            specification_version: r.specification_version,
            kind: r.kind,
            promotion_id: r.promotion_id,
            approval_id: r.approval_id,
            promotion_approval: None,
            rollback_authority: None,
            state: ProvisioningState::Requested,
            plan_receipt: None,
            approval: None,
            authorization: None,
            apply_receipt: None,
            failure: None,
            cancellation: None,
            superseded_reason: None,
            logs_ref: None,
            requested_by: r.requested_by.clone(),
            started_at: r.requested_at,
            completed_at: None,
            updated_at: r.requested_at,
            version: 1,
        })
    }

    /// Folds a whole history; `None` when it does not start with a request.
    pub fn from_events(events: &[RunEvent]) -> Option<Self> {
        let (first, rest) = events.split_first()?;
        let mut view = Self::start(first)?;
        for event in rest {
            view.apply(event);
        }
        Some(view)
    }

    /// Applies one later event.
    pub fn apply(&mut self, event: &RunEvent) {
        self.version += 1;
        let at = match event {
            RunEvent::ProvisioningRequested(r) => r.requested_at,
            RunEvent::PromotionApprovalVerified(record) => {
                self.promotion_approval = Some(record.clone());
                self.updated_at
            }
            RunEvent::RollbackAuthorityVerified(record) => {
                self.rollback_authority = Some(record.clone());
                self.updated_at
            }
            RunEvent::ProvisioningPlanned {
                plan_receipt,
                logs_ref,
                planned_at,
            } => {
                self.plan_receipt = Some((**plan_receipt).clone());
                self.state = ProvisioningState::Planned;
                self.keep_logs_ref(logs_ref);
                *planned_at
            }
            RunEvent::ApprovalRequired {
                reason,
                required_at,
            } => {
                self.state = ProvisioningState::AwaitingApproval;
                self.approval = Some(ApprovalView {
                    required_reason: Some(reason.clone()),
                    required_at: Some(*required_at),
                    decision: None,
                });
                *required_at
            }
            RunEvent::ApprovalGranted(record) => self.decided(record, true),
            RunEvent::ApprovalRejected(record) => self.decided(record, false),
            RunEvent::ApplyStarted {
                authorization,
                started_at,
            } => {
                self.state = ProvisioningState::Applying;
                self.authorization = Some(authorization.clone());
                *started_at
            }
            RunEvent::ProvisioningApplied {
                apply_receipt,
                logs_ref,
                applied_at,
            } => {
                self.state = ProvisioningState::Applied;
                self.apply_receipt = Some((**apply_receipt).clone());
                self.keep_logs_ref(logs_ref);
                *applied_at
            }
            RunEvent::ProvisioningFailed {
                stage,
                reason,
                apply_receipt,
                logs_ref,
                failed_at,
            } => {
                self.state = ProvisioningState::Failed;
                self.failure = Some(FailureView {
                    stage: *stage,
                    reason: reason.clone(),
                });
                self.apply_receipt = apply_receipt.as_deref().cloned();
                self.keep_logs_ref(logs_ref);
                *failed_at
            }
            RunEvent::ProvisioningCancelled {
                cancelled_by,
                reason,
                cancelled_at,
            } => {
                self.state = ProvisioningState::Cancelled;
                self.cancellation = Some(CancellationView {
                    cancelled_by: cancelled_by.clone(),
                    reason: reason.clone(),
                });
                *cancelled_at
            }
            RunEvent::PolicyDenied {
                evidence,
                denied_at,
            } => {
                self.state = ProvisioningState::Rejected;
                self.failure = Some(FailureView {
                    stage: FailureStage::Plan,
                    reason: format!("policy denied: {}", evidence.join("; ")),
                });
                *denied_at
            }
            RunEvent::ProvisioningSuperseded {
                reason,
                superseded_at,
            } => {
                self.state = ProvisioningState::Superseded;
                self.superseded_reason = Some(reason.clone());
                *superseded_at
            }
            RunEvent::ReconciliationInSync { in_sync_at } => {
                self.state = ProvisioningState::InSync;
                *in_sync_at
            }
        };
        self.updated_at = at;
        if self.state.is_terminal() {
            self.completed_at = Some(at);
        }
    }

    /// An approval decision: granted, the run applies under it; rejected, it ends.
    fn decided(&mut self, record: &ApprovalRecord, granted: bool) -> DateTime<Utc> {
        self.state = if granted {
            ProvisioningState::Applying
        } else {
            ProvisioningState::Rejected
        };
        if granted {
            self.authorization = Some(ApplyAuthorization::Approval {
                approved_by: record.decided_by.clone(),
                approval_id: record.approval_id,
            });
        }
        if record.approval_id.is_some() {
            self.approval_id = record.approval_id;
        }
        let view = self.approval.get_or_insert(ApprovalView {
            required_reason: None,
            required_at: None,
            decision: None,
        });
        view.decision = Some(record.clone());
        record.decided_at
    }

    /// The latest log (plan, then apply) replaces the one before; an event without one
    /// keeps it.
    fn keep_logs_ref(&mut self, logs_ref: &Option<String>) {
        if logs_ref.is_some() {
            self.logs_ref.clone_from(logs_ref);
        }
    }
}

/// One environment's specification of one kind: the newest declared version and the one
/// last applied there (what other services read as the environment's current specification).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvironmentSpecificationView {
    /// Environment or Workload.
    pub kind: SpecificationKind,
    /// The specification.
    pub specification_id: SpecificationId,
    /// The newest declared version.
    pub latest: specification::SpecificationVersion,
    /// The version last applied, with the run and time, if any run applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied: Option<AppliedSpecification>,
}

/// The specification version a run applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AppliedSpecification {
    /// The version.
    pub version: u32,
    /// The run that applied it.
    pub provisioning_run_id: ProvisioningRunId,
    /// When.
    pub applied_at: DateTime<Utc>,
}

/// `GET /factory/provisioning/environments/{environmentId}/current-specification`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CurrentSpecificationView {
    /// The environment.
    pub environment_id: EnvironmentId,
    /// One entry per specification kind declared for it.
    pub specifications: Vec<EnvironmentSpecificationView>,
}
