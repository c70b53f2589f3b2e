//! The delivery read models: releases, promotions, and the environments each release
//! completed in. One projection (`delivery`) writes all three, so that a release's
//! completions and its promotions never disagree.

use chrono::{DateTime, Utc};
use ferry_domain::promotion::gates::Completion;
use ferry_domain::promotion::{
    ApprovalRequest, ApprovalStatus, GateKind, GateResult, Hotfix, Measurement, Promotion,
    PromotionEvent, PromotionRequest, PromotionState, RollbackOf, Strategy, VerificationOutcome,
};
use ferry_domain::release::{Release, ReleaseEvent, ReleaseRecord, ReleaseVersion};
use ferry_domain::{
    Actor, ApprovalId, EnvironmentClass, EnvironmentId, FactoryRunId, ProjectId, PromotionId,
    ProvisioningRunId, ReleaseId, TenantId,
};
use ferry_projections::projection::{Folded, TableNames};
use ferry_projections::queries::{page, Page, QueryError};
use ferry_projections::{Projection, TableSpec};
use ferry_store::stream::{HandlerError, Param, Tx};
use ferry_store::{on_pool, Database, Subscriber, Subscription, Typed};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::types::Json;
use std::collections::{BTreeMap, BTreeSet};

/// A release's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ReleaseState {
    /// Promotable.
    Ready,
    /// Withdrawn: not promotable, pending promotions rejected.
    Withdrawn,
}

/// Why and when a release was withdrawn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Withdrawal {
    /// Why.
    pub reason: String,
    /// Who.
    pub withdrawn_by: Actor,
    /// When.
    pub withdrawn_at: DateTime<Utc>,
}

/// A release as `GET /factory/delivery/releases` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseView {
    /// What the release is.
    #[serde(flatten)]
    pub release: ReleaseRecord,
    /// Ready or withdrawn.
    pub state: ReleaseState,
    /// The withdrawal, if withdrawn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub withdrawal: Option<Withdrawal>,
    /// The environments it completed in (a rolled-back completion is gone).
    #[serde(default)]
    pub completed_in: Vec<Completion>,
}

/// An approval's decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalDecisionView {
    /// The approval.
    pub approval_id: ApprovalId,
    /// `approve` or `reject`.
    pub decision: String,
    /// Who.
    pub decided_by: Actor,
    /// Why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When.
    pub decided_at: DateTime<Utc>,
}

/// Verification so far.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VerificationView {
    /// When the window closes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_ends_at: Option<DateTime<Utc>>,
    /// Every measurement, in order.
    pub measurements: Vec<Measurement>,
    /// The outcome, once concluded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<VerificationOutcome>,
    /// Why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The Operator who decided a held verification.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concluded_by: Option<Actor>,
}

/// The rollback of a promotion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RollbackView {
    /// The rollback promotion.
    pub rollback_promotion_id: PromotionId,
    /// The release it restores.
    pub restored_release_id: ReleaseId,
    /// Started by failed verification rather than an Operator.
    pub automatic: bool,
    /// Who.
    pub started_by: Actor,
    /// Why.
    pub reason: String,
    /// When.
    pub started_at: DateTime<Utc>,
    /// How it stands.
    pub outcome: RollbackOutcome,
    /// Why it failed, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
}

/// How a rollback stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum RollbackOutcome {
    /// The rollback promotion is on its way.
    Running,
    /// The release before is running again.
    Completed,
    /// The rollback promotion ended without completing.
    Failed,
}

/// Why a promotion ended without completing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Outcome {
    /// Why.
    pub reason: String,
    /// The failing gate, for a rejection by a gate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate: Option<GateKind>,
    /// For a failure: whether the previous release was restored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolled_back: Option<bool>,
    /// When.
    pub at: DateTime<Utc>,
}

/// A promotion as the API shows it: gates, approval, desired state, plan, verification and
/// rollback evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PromotionView {
    /// The promotion.
    pub promotion_id: PromotionId,
    /// The tenant.
    pub tenant_id: TenantId,
    /// The release's project.
    pub project_id: ProjectId,
    /// The release.
    pub release_id: ReleaseId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// Its class when requested.
    pub environment_class: EnvironmentClass,
    /// How it rolls out.
    pub strategy: Strategy,
    /// The Factory run that asked for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<FactoryRunId>,
    /// Set for a hotfix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotfix: Option<Hotfix>,
    /// The asking run's receipt, as given (evidence only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt_ref: Option<ferry_domain::ReceiptRef>,
    /// The release completed in the environment before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_release_id: Option<ReleaseId>,
    /// Set for a rollback promotion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback_of: Option<RollbackOf>,
    /// Who asked.
    pub requested_by: Actor,
    /// When.
    pub requested_at: DateTime<Utc>,
    /// Where it is; `Requested` while queued behind another promotion of the environment.
    pub state: PromotionState,
    /// Each gate evaluated, in order, with its evidence.
    pub gates: Vec<GateResult>,
    /// Whether an approval is needed (once the gates passed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_required: Option<bool>,
    /// Where the approval stands: `Planning` until the plan it will cover is attached
    /// (not decidable yet), then `Pending`; `Approved`, `Rejected`, `Expired` or `Voided`
    /// (a stale plan: a new one asks anew). Absent while no approval is needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_status: Option<ApprovalStatus>,
    /// Who may decide it: a Reviewer or PlatformAdmin other than the requester.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approvable_by: Option<ApprovableBy>,
    /// The approval asked for, bound to its plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalRequest>,
    /// The plan the approval covers, as its run planned it: each resource with its
    /// operation and changed properties, the totals, the inputs hash, the program version
    /// and where its log is (readable with `factory.delivery.read`). Never stored: read
    /// from the run when the promotion is answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_plan: Option<ApprovalPlan>,
    /// Its decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_decision: Option<ApprovalDecisionView>,
    /// The desired state handed to provisioning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_state_ref: Option<String>,
    /// The provisioning run that plans and applies it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioning_run_id: Option<ProvisioningRunId>,
    /// Verification measurements and outcome.
    pub verification: VerificationView,
    /// The rollback, if one was started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback: Option<RollbackView>,
    /// Why it was rejected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejection: Option<Outcome>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<Outcome>,
    /// When it completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<DateTime<Utc>>,
    /// Why the promotions driver cannot move it on, while its steps keep failing (never
    /// stored: the answering instance's driver says it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stuck: Option<StuckView>,
    /// The aggregate's sequence this view reflects.
    pub version: u64,
}

/// Who may decide a promotion's approval.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovableBy {
    /// The roles that may decide it.
    pub roles: Vec<String>,
    /// Who may not, whatever their roles (the requester).
    pub except: Vec<Actor>,
}

/// The plan a promotion's approval covers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalPlan {
    /// The run that planned it.
    pub provisioning_run_id: ProvisioningRunId,
    /// The plan's inputs hash (the approval's `planInputsHash`).
    pub inputs_hash: String,
    /// The program's commit.
    pub program_version: String,
    /// Resources created.
    pub adds: u32,
    /// Resources changed in place.
    pub changes: u32,
    /// Resources deleted.
    pub deletes: u32,
    /// Resources replaced.
    pub replaces: u32,
    /// Each resource with its operation and changed properties.
    pub resources: Vec<ferry_domain::receipts::PlannedResource>,
    /// The plan log (`GET` it with `factory.delivery.read`).
    pub log: String,
}

/// A promotion whose driver steps keep failing: it alone is retried, with a growing delay,
/// while the driver goes on with every other promotion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StuckView {
    /// The last error.
    pub error: String,
    /// Consecutive failed attempts.
    pub attempts: u32,
    /// When the first of them failed.
    pub since: DateTime<Utc>,
    /// When the driver tries it again.
    pub next_attempt_at: DateTime<Utc>,
}

impl From<ferry_store::items::ItemProblem> for StuckView {
    fn from(p: ferry_store::items::ItemProblem) -> Self {
        Self {
            error: p.error,
            attempts: p.attempts,
            since: p.since,
            next_attempt_at: p.next_attempt_at,
        }
    }
}

impl PromotionView {
    /// The view of a promotion just requested.
    pub fn start(request: &PromotionRequest) -> Self {
        Self {
            promotion_id: request.promotion_id,
            tenant_id: request.tenant_id.clone(),
            project_id: request.project_id.clone(),
            release_id: request.release_id,
            environment_id: request.environment_id.clone(),
            environment_class: request.environment_class,
            strategy: request.strategy,
            run_id: request.run_id,
            hotfix: request.hotfix.clone(),
            receipt_ref: request.receipt_ref.clone(),
            previous_release_id: request.previous_release_id,
            rollback_of: request.rollback_of.clone(),
            requested_by: request.requested_by.clone(),
            requested_at: request.requested_at,
            state: PromotionState::Requested,
            gates: Vec::new(),
            approval_required: None,
            approval_status: None,
            approvable_by: None,
            approval: None,
            approval_plan: None,
            approval_decision: None,
            desired_state_ref: None,
            provisioning_run_id: None,
            verification: VerificationView::default(),
            rollback: None,
            rejection: None,
            failure: None,
            completed_at: None,
            stuck: None,
            version: 1,
        }
    }

    /// The view folded from a promotion's events, oldest first (`None` without a request).
    pub fn from_events(events: &[PromotionEvent]) -> Option<Self> {
        let PromotionEvent::PromotionRequested(request) = events.first()? else {
            return None;
        };
        let mut view = Self::start(request);
        for (sequence, event) in events.iter().enumerate().skip(1) {
            view.apply(event, sequence as u64 + 1);
        }
        Some(view)
    }

    /// The view after `event`, the aggregate's event number `sequence`.
    pub fn apply(&mut self, event: &PromotionEvent, sequence: u64) {
        use PromotionEvent as E;
        self.version = sequence;
        self.approval_status = ApprovalStatus::after(self.approval_status, event);
        if self.approval_status.is_some() && self.approvable_by.is_none() {
            self.approvable_by = Some(ApprovableBy {
                roles: vec!["Reviewer".to_string(), "PlatformAdmin".to_string()],
                except: vec![self.requested_by.clone()],
            });
        }
        match event {
            E::PromotionRequested(request) => *self = Self::start(request),
            E::ApprovalExpired { .. } => {}
            E::GatesEvaluationStarted { .. } => self.state = PromotionState::GatesEvaluating,
            E::GateEvaluated(gate) => self.gates.push((**gate).clone()),
            E::GatesPassed {
                approval_required, ..
            } => {
                self.approval_required = Some(*approval_required);
                self.state = if *approval_required {
                    PromotionState::AwaitingApproval
                } else {
                    PromotionState::Approved
                };
            }
            E::ApprovalRequested(_)
            | E::ApprovalVoided { .. }
            | E::ApprovalGranted { .. }
            | E::ApprovalRejected { .. } => self.apply_approval(event),
            E::PromotionRejected {
                reason,
                gate,
                rejected_at,
            } => {
                self.rejection = Some(Outcome {
                    reason: reason.clone(),
                    gate: *gate,
                    rolled_back: None,
                    at: *rejected_at,
                });
                self.state = PromotionState::Rejected;
            }
            E::PromotionApproved {
                desired_state_ref,
                provisioning_run_id,
                ..
            } => {
                self.desired_state_ref = Some(desired_state_ref.clone());
                self.provisioning_run_id = Some(*provisioning_run_id);
                self.state = PromotionState::Deploying;
            }
            E::DeploymentApplied {
                verification_ends_at,
                ..
            } => {
                self.verification.window_ends_at = Some(*verification_ends_at);
                self.state = PromotionState::Verifying;
            }
            E::DeploymentFailed { .. } => {}
            E::VerificationMeasured(m) => self.verification.measurements.push((**m).clone()),
            E::VerificationConcluded {
                outcome,
                reason,
                concluded_by,
                ..
            } => {
                self.verification.outcome = Some(*outcome);
                self.verification.reason = Some(reason.clone());
                self.verification.concluded_by = concluded_by.clone();
            }
            E::PromotionCompleted { completed_at } => {
                self.completed_at = Some(*completed_at);
                self.state = PromotionState::Completed;
            }
            E::RollbackStarted { .. } | E::RollbackFailed { .. } | E::RollbackCompleted { .. } => {
                self.apply_rollback(event)
            }
            E::PromotionFailed {
                reason,
                rolled_back,
                failed_at,
            } => {
                self.failure = Some(Outcome {
                    reason: reason.clone(),
                    gate: None,
                    rolled_back: Some(*rolled_back),
                    at: *failed_at,
                });
                if !rolled_back {
                    self.state = PromotionState::Failed;
                }
            }
        }
    }

    /// An approval asked for, voided or decided.
    fn apply_approval(&mut self, event: &PromotionEvent) {
        use PromotionEvent as E;
        match event {
            E::ApprovalRequested(approval) => {
                self.desired_state_ref = Some(approval.desired_state_ref.clone());
                self.provisioning_run_id = Some(approval.provisioning_run_id);
                self.approval = Some((**approval).clone());
                self.approval_decision = None;
            }
            E::ApprovalVoided { .. } => {
                self.approval = None;
                self.approval_decision = None;
                self.provisioning_run_id = None;
                self.state = PromotionState::AwaitingApproval;
            }
            E::ApprovalGranted {
                approval_id,
                decided_by,
                reason,
                decided_at,
            } => {
                self.approval_decision = Some(ApprovalDecisionView {
                    approval_id: *approval_id,
                    decision: "approve".to_string(),
                    decided_by: decided_by.clone(),
                    reason: reason.clone(),
                    decided_at: *decided_at,
                });
                self.state = PromotionState::Approved;
            }
            E::ApprovalRejected {
                approval_id,
                decided_by,
                reason,
                decided_at,
            } => {
                self.approval_decision = Some(ApprovalDecisionView {
                    approval_id: *approval_id,
                    decision: "reject".to_string(),
                    decided_by: decided_by.clone(),
                    reason: reason.clone(),
                    decided_at: *decided_at,
                });
            }
            _ => {}
        }
    }

    /// A rollback started, failed or completed.
    fn apply_rollback(&mut self, event: &PromotionEvent) {
        use PromotionEvent as E;
        match event {
            E::RollbackStarted {
                rollback_promotion_id,
                restored_release_id,
                automatic,
                started_by,
                reason,
                started_at,
            } => {
                self.rollback = Some(RollbackView {
                    rollback_promotion_id: *rollback_promotion_id,
                    restored_release_id: *restored_release_id,
                    automatic: *automatic,
                    started_by: started_by.clone(),
                    reason: reason.clone(),
                    started_at: *started_at,
                    outcome: RollbackOutcome::Running,
                    failure: None,
                });
            }
            E::RollbackFailed { reason, .. } => {
                if let Some(r) = self.rollback.as_mut() {
                    r.outcome = RollbackOutcome::Failed;
                    r.failure = Some(reason.clone());
                }
            }
            E::RollbackCompleted { .. } => {
                if let Some(r) = self.rollback.as_mut() {
                    r.outcome = RollbackOutcome::Completed;
                }
                self.state = PromotionState::RolledBack;
            }
            _ => {}
        }
    }
}

fn text(v: impl ToString) -> Param {
    Param::Text(Some(v.to_string()))
}

fn int(v: impl Into<i64>) -> Param {
    Param::Int(Some(v.into()))
}

fn json<T: Serialize>(v: &T) -> Result<Param, HandlerError> {
    serde_json::to_value(v)
        .map(|v| Param::Json(Some(v)))
        .map_err(|e| HandlerError::Record {
            what: "a delivery read-model document".to_string(),
            source: Box::new(e),
        })
}

fn document<T: serde::de::DeserializeOwned>(what: String, doc: Value) -> Result<T, HandlerError> {
    serde_json::from_value(doc).map_err(|e| HandlerError::Record {
        what,
        source: Box::new(e),
    })
}

const TABLES: &[TableSpec] = &[
    TableSpec {
        base: "rm_releases",
        ddl: &[
            "CREATE TABLE IF NOT EXISTS {t} (
                tenant_id text NOT NULL, release_id text NOT NULL, project_id text NOT NULL,
                state text NOT NULL, position bigint NOT NULL, document {json} NOT NULL,
                PRIMARY KEY (tenant_id, release_id))",
            "CREATE INDEX IF NOT EXISTS {i}_page ON {t} (tenant_id, position)",
        ],
    },
    TableSpec {
        base: "rm_promotions",
        ddl: &[
            "CREATE TABLE IF NOT EXISTS {t} (
                promotion_id text PRIMARY KEY, tenant_id text NOT NULL,
                environment_id text NOT NULL, release_id text NOT NULL,
                environment_class text NOT NULL, state text NOT NULL, rollback_of text,
                position bigint NOT NULL, version bigint NOT NULL, document {json} NOT NULL)",
            "CREATE INDEX IF NOT EXISTS {i}_page ON {t} (tenant_id, position)",
            "CREATE INDEX IF NOT EXISTS {i}_environment ON {t} (tenant_id, environment_id, state)",
            // The driver's looks at every pass: the promotions still open, and the
            // rollbacks; without them each pass read every promotion ever made.
            "CREATE INDEX IF NOT EXISTS {i}_open ON {t} (state, position)",
            "CREATE INDEX IF NOT EXISTS {i}_rollback ON {t} (rollback_of)",
        ],
    },
    TableSpec {
        base: "rm_release_completions",
        ddl: &[
            "CREATE TABLE IF NOT EXISTS {t} (
                promotion_id text PRIMARY KEY, tenant_id text NOT NULL,
                release_id text NOT NULL, environment_id text NOT NULL,
                environment_class text NOT NULL, position bigint NOT NULL,
                document {json} NOT NULL)",
            "CREATE INDEX IF NOT EXISTS {i}_release ON {t} (tenant_id, release_id)",
            "CREATE INDEX IF NOT EXISTS {i}_environment ON {t} (tenant_id, environment_id, position)",
        ],
    },
    TableSpec {
        base: "rm_quarantine_lifts",
        ddl: &["CREATE TABLE IF NOT EXISTS {t} (
                promotion_id text PRIMARY KEY, tenant_id text NOT NULL,
                environment_id text NOT NULL, reason text NOT NULL, lifted_by text NOT NULL,
                lifted_at text NOT NULL)"],
    },
];

/// The `delivery` projection: `rm_releases`, `rm_promotions`, `rm_release_completions`,
/// `rm_quarantine_lifts`.
pub struct DeliveryProjection;

impl DeliveryProjection {
    /// Its name (its checkpoint, and what a read-your-writes wait names).
    pub const NAME: &'static str = "delivery";
}

impl Projection for DeliveryProjection {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn tables(&self) -> &'static [TableSpec] {
        TABLES
    }
    fn subscribe(&self, subscription: Subscription, tables: &TableNames) -> Subscription {
        // Releases' rows and promotions' rows never read one another: any order will do.
        subscription
            .on::<Release>(ReleaseRows(tables.clone()))
            .on::<Promotion>(PromotionRows(tables.clone()))
            .by_aggregate()
    }
}

struct ReleaseRows(TableNames);

#[async_trait::async_trait]
impl Subscriber<Release> for ReleaseRows {
    async fn on(&self, tx: &mut Tx, event: &Typed<ReleaseEvent>) -> Result<(), HandlerError> {
        let table = self.0.get("rm_releases");
        match &event.event {
            ReleaseEvent::ReleaseRecorded(record) => {
                let row = recorded_row(record, event.position.global_position)?;
                insert_releases(tx, table, vec![row]).await?;
            }
            ReleaseEvent::ReleaseWithdrawn {
                reason,
                withdrawn_by,
                withdrawn_at,
            } => {
                let tenant = event.tenant_id().unwrap_or_default().to_string();
                let release_id = event
                    .aggregate_id
                    .rsplit_once('/')
                    .map_or(event.aggregate_id.as_str(), |(_, id)| id)
                    .to_string();
                let select = format!(
                    "SELECT document FROM {table} WHERE tenant_id = $1 AND release_id = $2"
                );
                let Some(doc) = tx
                    .fetch_json(&select, &[text(&tenant), text(&release_id)])
                    .await?
                else {
                    return Ok(());
                };
                let mut view: ReleaseView =
                    document(format!("the {table} row of release {release_id}"), doc)?;
                view.state = ReleaseState::Withdrawn;
                view.withdrawal = Some(Withdrawal {
                    reason: reason.clone(),
                    withdrawn_by: withdrawn_by.clone(),
                    withdrawn_at: *withdrawn_at,
                });
                let update = format!(
                    "UPDATE {table} SET state = 'Withdrawn', position = $3, document = $4
                     WHERE tenant_id = $1 AND release_id = $2"
                );
                tx.execute(
                    &update,
                    &[
                        text(&tenant),
                        text(&release_id),
                        int(event.position.global_position),
                        json(&view)?,
                    ],
                )
                .await?;
            }
            ReleaseEvent::QuarantineLifted {
                environment_id,
                promotion_id,
                reason,
                lifted_by,
                lifted_at,
            } => {
                let lifts = self.0.get("rm_quarantine_lifts");
                let tenant = event.tenant_id().unwrap_or_default().to_string();
                let sql = format!(
                    "INSERT INTO {lifts} (promotion_id, tenant_id, environment_id, reason, lifted_by, lifted_at)
                     VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING"
                );
                tx.execute(
                    &sql,
                    &[
                        text(promotion_id),
                        text(&tenant),
                        text(environment_id),
                        text(reason),
                        text(lifted_by),
                        text(lifted_at.to_rfc3339()),
                    ],
                )
                .await?;
            }
        }
        Ok(())
    }

    /// Recorded releases are inserted together; any other event first writes those
    /// gathered so far and is then handled on its own.
    async fn on_batch(
        &self,
        tx: &mut Tx,
        events: &[Typed<ReleaseEvent>],
    ) -> Result<(), HandlerError> {
        let table = self.0.get("rm_releases");
        let mut rows = Vec::new();
        for event in events {
            if let ReleaseEvent::ReleaseRecorded(record) = &event.event {
                rows.push(recorded_row(record, event.position.global_position)?);
            } else {
                insert_releases(tx, table, std::mem::take(&mut rows)).await?;
                self.on(tx, event).await?;
            }
        }
        insert_releases(tx, table, rows).await
    }
}

/// The `rm_releases` row of a release as recorded.
fn recorded_row(record: &ReleaseRecord, position: i64) -> Result<Vec<Param>, HandlerError> {
    let view = ReleaseView {
        release: record.clone(),
        state: ReleaseState::Ready,
        withdrawal: None,
        completed_in: Vec::new(),
    };
    Ok(vec![
        text(&record.tenant_id),
        text(record.release_id),
        text(&record.project_id),
        text("Ready"),
        int(position),
        json(&view)?,
    ])
}

async fn insert_releases(
    tx: &mut Tx,
    table: &str,
    rows: Vec<Vec<Param>>,
) -> Result<(), HandlerError> {
    let columns = [
        "tenant_id",
        "release_id",
        "project_id",
        "state",
        "position",
        "document",
    ];
    tx.insert_rows(table, &columns, rows, "ON CONFLICT DO NOTHING")
        .await?;
    Ok(())
}

struct PromotionRows(TableNames);

const PROMOTION_COLUMNS: [&str; 10] = [
    "promotion_id",
    "tenant_id",
    "environment_id",
    "release_id",
    "environment_class",
    "state",
    "position",
    "version",
    "document",
    "rollback_of",
];

/// A promotion's row is inserted with the event that starts it; later events change its
/// state, version and document.
const PROMOTION_UPSERT: &str = "ON CONFLICT (promotion_id) DO UPDATE SET state = excluded.state,
    version = excluded.version, document = excluded.document";

fn class_name(view: &PromotionView) -> String {
    serde_json::to_value(view.environment_class)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// The `rm_promotions` row of `view` after the event with `sequence` (`position`: where the
/// row starts, when it is inserted).
fn promotion_row(
    view: &PromotionView,
    position: i64,
    sequence: i64,
) -> Result<Vec<Param>, HandlerError> {
    Ok(vec![
        text(view.promotion_id),
        text(&view.tenant_id),
        text(&view.environment_id),
        text(view.release_id),
        text(class_name(view)),
        text(view.state.as_str()),
        int(position),
        int(sequence),
        json(view)?,
        Param::Text(
            view.rollback_of
                .as_ref()
                .map(|r| r.promotion_id.to_string()),
        ),
    ])
}

impl PromotionRows {
    /// What `event` does to the release completions, given the promotion after it.
    async fn completions(
        &self,
        tx: &mut Tx,
        view: &PromotionView,
        event: &Typed<PromotionEvent>,
    ) -> Result<(), HandlerError> {
        let completions = self.0.get("rm_release_completions");
        match &event.event {
            PromotionEvent::PromotionCompleted { completed_at } => {
                let completion = Completion {
                    environment_id: view.environment_id.clone(),
                    environment_class: view.environment_class,
                    promotion_id: view.promotion_id,
                    completed_at: *completed_at,
                };
                let sql = format!(
                    "INSERT INTO {completions} (promotion_id, tenant_id, release_id, environment_id, environment_class, position, document)
                     VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING"
                );
                tx.execute(
                    &sql,
                    &[
                        text(view.promotion_id),
                        text(&view.tenant_id),
                        text(view.release_id),
                        text(&view.environment_id),
                        text(class_name(view)),
                        int(event.position.global_position),
                        json(&completion)?,
                    ],
                )
                .await?;
            }
            // A rolled-back release is no longer there: it no longer counts as completed.
            PromotionEvent::RollbackCompleted { .. } => {
                let sql = format!("DELETE FROM {completions} WHERE promotion_id = $1");
                tx.execute(&sql, &[text(view.promotion_id)]).await?;
            }
            _ => {}
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Subscriber<Promotion> for PromotionRows {
    async fn on(&self, tx: &mut Tx, event: &Typed<PromotionEvent>) -> Result<(), HandlerError> {
        let promotions = self.0.get("rm_promotions");
        let sequence = u64::try_from(event.sequence).unwrap_or_default();
        let view = if let PromotionEvent::PromotionRequested(request) = &event.event {
            PromotionView::start(request)
        } else {
            let select = format!("SELECT document FROM {promotions} WHERE promotion_id = $1");
            let Some(doc) = tx.fetch_json(&select, &[text(&event.aggregate_id)]).await? else {
                return Ok(());
            };
            let mut view: PromotionView = document(
                format!("the {promotions} row of promotion {}", event.aggregate_id),
                doc,
            )?;
            if view.version >= sequence {
                return Ok(());
            }
            view.apply(&event.event, sequence);
            view
        };
        let row = promotion_row(&view, event.position.global_position, event.sequence)?;
        tx.insert_rows(promotions, &PROMOTION_COLUMNS, vec![row], PROMOTION_UPSERT)
            .await?;
        self.completions(tx, &view, event).await
    }

    /// Reads the stored documents of the batch's promotions at once, folds the events into
    /// them in memory (completions written as they come) and writes each changed
    /// promotion once: the same rows as event by event.
    async fn on_batch(
        &self,
        tx: &mut Tx,
        events: &[Typed<PromotionEvent>],
    ) -> Result<(), HandlerError> {
        let promotions = self.0.get("rm_promotions");
        let ids: BTreeSet<&str> = events
            .iter()
            .filter(|e| !matches!(e.event, PromotionEvent::PromotionRequested(_)))
            .map(|e| e.aggregate_id.as_str())
            .collect();
        let mut folded: BTreeMap<String, Folded<PromotionView>> = BTreeMap::new();
        if !ids.is_empty() {
            let select =
                format!("SELECT promotion_id, document FROM {promotions} WHERE promotion_id IN");
            let keys: Vec<Param> = ids.iter().map(text).collect();
            for (id, doc) in tx.fetch_documents(&select, &keys).await? {
                let view = document(format!("the {promotions} row of promotion {id}"), doc)?;
                folded.insert(id, Folded::stored(view));
            }
        }
        for event in events {
            let sequence = u64::try_from(event.sequence).unwrap_or_default();
            if let PromotionEvent::PromotionRequested(request) = &event.event {
                let view = PromotionView::start(request);
                match folded.get_mut(&event.aggregate_id) {
                    Some(promotion) => {
                        promotion.view = view;
                        promotion.changed(event.sequence);
                    }
                    None => {
                        let position = event.position.global_position;
                        let promotion = Folded::new(view, position, event.sequence);
                        folded.insert(event.aggregate_id.clone(), promotion);
                    }
                }
            } else {
                let Some(promotion) = folded.get_mut(&event.aggregate_id) else {
                    continue;
                };
                if promotion.view.version >= sequence {
                    continue;
                }
                promotion.view.apply(&event.event, sequence);
                promotion.changed(event.sequence);
            }
            if let Some(promotion) = folded.get(&event.aggregate_id) {
                self.completions(tx, &promotion.view, event).await?;
            }
        }
        let mut rows = Vec::new();
        for promotion in folded.into_values().filter(|p| p.changed) {
            rows.push(promotion_row(
                &promotion.view,
                promotion.position,
                promotion.sequence,
            )?);
        }
        tx.insert_rows(promotions, &PROMOTION_COLUMNS, rows, PROMOTION_UPSERT)
            .await?;
        Ok(())
    }
}

/// Filters of `GET /factory/delivery/releases`.
#[derive(Debug, Clone, Default)]
pub struct ReleaseFilter {
    /// Only this project's.
    pub project_id: Option<ProjectId>,
    /// Only this version (`shop@4.2.0` is `projectId=shop&version=4.2.0`).
    pub version: Option<ReleaseVersion>,
    /// Only in this state.
    pub state: Option<ReleaseState>,
}

/// Filters of `GET /factory/delivery/promotions`.
#[derive(Debug, Clone, Default)]
pub struct PromotionFilter {
    /// Only into this environment.
    pub environment_id: Option<EnvironmentId>,
    /// Only of this release.
    pub release_id: Option<ReleaseId>,
    /// Only in this state.
    pub state: Option<PromotionState>,
}

fn state_name<T: Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// Releases of `tenant` matching `filter`, newest first, with where each completed.
pub async fn list_releases(
    db: &Database,
    tenant: &TenantId,
    filter: &ReleaseFilter,
    limit: u32,
    cursor: Option<i64>,
) -> Result<Page<ReleaseView>, QueryError> {
    let mut clauses = vec!["tenant_id = $1".to_string()];
    let mut params = vec![text(tenant)];
    if let Some(project) = &filter.project_id {
        params.push(text(project));
        clauses.push(format!("project_id = ${}", params.len()));
    }
    if let Some(state) = &filter.state {
        params.push(text(state_name(state)));
        clauses.push(format!("state = ${}", params.len()));
    }
    if let Some(version) = &filter.version {
        params.push(text(version));
        // The version is in the document only (the table keeps no column for it).
        let field = match db.backend() {
            ferry_store::database::Backend::Postgres => "document->>'version'",
            ferry_store::database::Backend::Sqlite => "json_extract(document, '$.version')",
        };
        clauses.push(format!("{field} = ${}", params.len()));
    }
    let (docs, next_cursor) = page(db, "rm_releases", clauses, params, limit, cursor).await?;
    let mut items = Vec::with_capacity(docs.len());
    for doc in docs {
        let mut view: ReleaseView = serde_json::from_value(doc)?;
        view.completed_in = completions(db, tenant, view.release.release_id).await?;
        items.push(view);
    }
    Ok(Page { items, next_cursor })
}

/// One release of `tenant`, with where it completed.
pub async fn get_release(
    db: &Database,
    tenant: &TenantId,
    release: ReleaseId,
) -> Result<Option<ReleaseView>, QueryError> {
    let sql = db.sql("SELECT document FROM rm_releases WHERE tenant_id = $1 AND release_id = $2");
    let doc: Option<Json<Value>> = on_pool!(db, pool => sqlx::query_scalar(&sql)
        .bind(tenant.as_str()).bind(release.to_string()).fetch_optional(pool).await?);
    let Some(Json(doc)) = doc else {
        return Ok(None);
    };
    let mut view: ReleaseView = serde_json::from_value(doc)?;
    view.completed_in = completions(db, tenant, release).await?;
    Ok(Some(view))
}

/// Where `release` completed (and was not rolled back), oldest first.
pub async fn completions(
    db: &Database,
    tenant: &TenantId,
    release: ReleaseId,
) -> Result<Vec<Completion>, QueryError> {
    let sql = db.sql(
        "SELECT document FROM rm_release_completions WHERE tenant_id = $1 AND release_id = $2 ORDER BY position",
    );
    let docs: Vec<Json<Value>> = on_pool!(db, pool => sqlx::query_scalar(&sql)
        .bind(tenant.as_str()).bind(release.to_string()).fetch_all(pool).await?);
    docs.into_iter()
        .map(|Json(d)| serde_json::from_value(d).map_err(QueryError::from))
        .collect()
}

/// The release last completed in `environment` (and not rolled back), with its promotion.
pub async fn current_release(
    db: &Database,
    tenant: &TenantId,
    environment: &EnvironmentId,
) -> Result<Option<(ReleaseId, Completion)>, QueryError> {
    let sql = db.sql(
        "SELECT release_id, document FROM rm_release_completions WHERE tenant_id = $1 AND environment_id = $2 ORDER BY position DESC LIMIT 1",
    );
    let row: Option<(String, Json<Value>)> = on_pool!(db, pool => sqlx::query_as(&sql)
        .bind(tenant.as_str()).bind(environment.as_str()).fetch_optional(pool).await?);
    let Some((release, Json(doc))) = row else {
        return Ok(None);
    };
    let Ok(release) = ReleaseId::parse(&release) else {
        return Ok(None);
    };
    Ok(Some((release, serde_json::from_value(doc)?)))
}

/// Promotions of `tenant` matching `filter`, newest first.
pub async fn list_promotions(
    db: &Database,
    tenant: &TenantId,
    filter: &PromotionFilter,
    limit: u32,
    cursor: Option<i64>,
) -> Result<Page<PromotionView>, QueryError> {
    let mut clauses = vec!["tenant_id = $1".to_string()];
    let mut params = vec![text(tenant)];
    if let Some(environment) = &filter.environment_id {
        params.push(text(environment));
        clauses.push(format!("environment_id = ${}", params.len()));
    }
    if let Some(release) = &filter.release_id {
        params.push(text(release));
        clauses.push(format!("release_id = ${}", params.len()));
    }
    if let Some(state) = &filter.state {
        params.push(text(state.as_str()));
        clauses.push(format!("state = ${}", params.len()));
    }
    let (docs, next_cursor) = page(db, "rm_promotions", clauses, params, limit, cursor).await?;
    let items = docs
        .into_iter()
        .map(serde_json::from_value)
        .collect::<Result<_, _>>()?;
    Ok(Page { items, next_cursor })
}

/// One promotion of `tenant`.
pub async fn get_promotion(
    db: &Database,
    tenant: &TenantId,
    promotion: PromotionId,
) -> Result<Option<PromotionView>, QueryError> {
    let sql =
        db.sql("SELECT document FROM rm_promotions WHERE tenant_id = $1 AND promotion_id = $2");
    let doc: Option<Json<Value>> = on_pool!(db, pool => sqlx::query_scalar(&sql)
        .bind(tenant.as_str()).bind(promotion.to_string()).fetch_optional(pool).await?);
    doc.map(|Json(d)| serde_json::from_value(d).map_err(QueryError::from))
        .transpose()
}

/// The promotion's view version (to wait for a command's effect), if projected.
pub async fn promotion_version(
    db: &Database,
    tenant: &TenantId,
    promotion: PromotionId,
) -> Result<Option<u64>, QueryError> {
    let sql =
        db.sql("SELECT version FROM rm_promotions WHERE tenant_id = $1 AND promotion_id = $2");
    let version: Option<i64> = on_pool!(db, pool => sqlx::query_scalar(&sql)
        .bind(tenant.as_str()).bind(promotion.to_string()).fetch_optional(pool).await?);
    Ok(version.map(|v| u64::try_from(v).unwrap_or_default()))
}

/// Promotions the driver has work for (queued, evaluating gates, approved, deploying,
/// verifying): `(tenant, promotion, environment, state)`, oldest first.
pub async fn open_promotions(db: &Database) -> Result<Vec<OpenPromotion>, QueryError> {
    let sql = db.sql(OPEN_PROMOTIONS);
    let rows: Vec<(String, String, String, String)> =
        on_pool!(db, pool => sqlx::query_as(&sql).fetch_all(pool).await?);
    rows.into_iter()
        .map(|(tenant, promotion, environment, state)| {
            Ok(OpenPromotion {
                tenant: row_value("tenant_id", TenantId::parse(&tenant))?,
                promotion: row_value("promotion_id", PromotionId::parse(&promotion))?,
                environment: row_value("environment_id", EnvironmentId::parse(&environment))?,
                state: row_value("state", promotion_state(&state))?,
            })
        })
        .collect()
}

/// A promotion the driver has something to do for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenPromotion {
    /// Its tenant.
    pub tenant: TenantId,
    /// The promotion.
    pub promotion: PromotionId,
    /// The environment it goes into.
    pub environment: EnvironmentId,
    /// Its state.
    pub state: PromotionState,
}

/// A rollback promotion that ended while the promotion it rolls back still waits for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndedRollback {
    /// Its tenant.
    pub tenant: TenantId,
    /// The promotion rolled back.
    pub original: PromotionId,
    /// How the rollback promotion ended.
    pub state: PromotionState,
}

/// A column of a read-model row as its type: a row that does not parse is an error (a
/// rebuild or a bug), never skipped.
fn row_value<T, E: std::fmt::Display>(column: &str, parsed: Result<T, E>) -> Result<T, QueryError> {
    parsed.map_err(|e| QueryError::Row(format!("{column}: {e}")))
}

/// A stored promotion state.
fn promotion_state(stored: &str) -> Result<PromotionState, serde_json::Error> {
    serde_json::from_value(serde_json::Value::String(stored.to_string()))
}

/// [`open_promotions`]' statement (it reads the `_open` index).
pub const OPEN_PROMOTIONS: &str =
    "SELECT tenant_id, promotion_id, environment_id, state FROM rm_promotions
      WHERE state IN ('Requested', 'GatesEvaluating', 'AwaitingApproval', 'Approved',
                      'Deploying', 'Verifying')
      ORDER BY position";

/// Rollback promotions that ended while the promotion they roll back is still waiting for
/// them: `(tenant, original promotion, rollback's state)`.
pub async fn ended_rollbacks(db: &Database) -> Result<Vec<EndedRollback>, QueryError> {
    let sql = db.sql(ENDED_ROLLBACKS);
    let rows: Vec<(String, String, String)> =
        on_pool!(db, pool => sqlx::query_as(&sql).fetch_all(pool).await?);
    rows.into_iter()
        .map(|(tenant, original, state)| {
            Ok(EndedRollback {
                tenant: row_value("tenant_id", TenantId::parse(&tenant))?,
                original: row_value("rollback_of", PromotionId::parse(&original))?,
                state: row_value("state", promotion_state(&state))?,
            })
        })
        .collect()
}

/// [`ended_rollbacks`]' statement: it starts from the rollbacks (the `_rollback` index),
/// not from every ended promotion.
pub const ENDED_ROLLBACKS: &str = "SELECT r.tenant_id, r.rollback_of, r.state FROM rm_promotions r
       JOIN rm_promotions o ON o.promotion_id = r.rollback_of AND o.tenant_id = r.tenant_id
      WHERE r.rollback_of IS NOT NULL
        AND r.state IN ('Completed', 'Rejected', 'Failed', 'RolledBack')
        AND o.state IN ('Verifying', 'Failed', 'Completed')";

/// Promotions of withdrawn releases that are not deploying yet: `(tenant, promotion)`.
pub async fn withdrawn_open_promotions(
    db: &Database,
) -> Result<Vec<(TenantId, PromotionId)>, QueryError> {
    let sql = db.sql(WITHDRAWN_OPEN_PROMOTIONS);
    let rows: Vec<(String, String)> =
        on_pool!(db, pool => sqlx::query_as(&sql).fetch_all(pool).await?);
    rows.into_iter()
        .map(|(tenant, promotion)| {
            Ok((
                row_value("tenant_id", TenantId::parse(&tenant))?,
                row_value("promotion_id", PromotionId::parse(&promotion))?,
            ))
        })
        .collect()
}

/// [`withdrawn_open_promotions`]' statement: from the open promotions (the `_open` index)
/// to their releases (by key).
pub const WITHDRAWN_OPEN_PROMOTIONS: &str =
    "SELECT p.tenant_id, p.promotion_id FROM rm_promotions p
       JOIN rm_releases r ON r.tenant_id = p.tenant_id AND r.release_id = p.release_id
      WHERE r.state = 'Withdrawn'
        AND p.state IN ('Requested', 'GatesEvaluating', 'AwaitingApproval', 'Approved')";

/// The rolled-back promotion that keeps `release` quarantined in `environment`, if one does:
/// a rollback there whose quarantine no Operator has lifted.
pub async fn rolled_back_in(
    db: &Database,
    tenant: &TenantId,
    release: ReleaseId,
    environment: &EnvironmentId,
) -> Result<Option<PromotionId>, QueryError> {
    // One text for the quarantine lookup: the promotion request's statement reads it too.
    let (rolled_back, _) = quarantine_and_current_release(db, tenant, release, environment).await?;
    Ok(rolled_back)
}

/// What a promotion request reads of the read model, in one statement: the rolled-back
/// promotion that keeps `release` quarantined in `environment` (the promotion of
/// [`rolled_back_in`]) and the release completed there last (as [`current_release`]).
pub async fn quarantine_and_current_release(
    db: &Database,
    tenant: &TenantId,
    release: ReleaseId,
    environment: &EnvironmentId,
) -> Result<(Option<PromotionId>, Option<ReleaseId>), QueryError> {
    let sql = db.sql(
        "SELECT (SELECT p.promotion_id FROM rm_promotions p WHERE p.tenant_id = $1 AND p.release_id = $2
                    AND p.environment_id = $3 AND p.state = 'RolledBack'
                    AND NOT EXISTS (SELECT 1 FROM rm_quarantine_lifts l
                                     WHERE l.promotion_id = p.promotion_id AND l.tenant_id = p.tenant_id)
                  ORDER BY p.position DESC LIMIT 1),
                (SELECT c.release_id FROM rm_release_completions c
                  WHERE c.tenant_id = $1 AND c.environment_id = $3 ORDER BY c.position DESC LIMIT 1)",
    );
    let (rolled_back, current): (Option<String>, Option<String>) = on_pool!(db, pool => sqlx::query_as(&sql)
        .bind(tenant.as_str()).bind(release.to_string()).bind(environment.as_str())
        .fetch_one(pool).await?);
    Ok((
        rolled_back.and_then(|id| PromotionId::parse(&id).ok()),
        current.and_then(|id| ReleaseId::parse(&id).ok()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_store::database::Backend;
    use ferry_store::testing::TestDatabase;
    use std::sync::Arc;

    /// The scans of `table` in an `EXPLAIN (FORMAT JSON)` plan, by node type.
    fn scans_of(node: &Value, table: &str, found: &mut Vec<String>) {
        if node["Relation Name"] == table {
            found.push(node["Node Type"].as_str().unwrap_or_default().to_string());
        }
        for child in node["Plans"].as_array().into_iter().flatten() {
            scans_of(child, table, found);
        }
    }

    /// The driver runs these at every pass (after every commit): each reads the index made
    /// for it, not every promotion ever made (measured over 250,000 promotions: the
    /// rollbacks' look 140 ms by a scan, 0.14 ms by the index).
    #[tokio::test]
    async fn the_drivers_looks_read_their_indexes_not_the_history() {
        let t = TestDatabase::new(Backend::Postgres).await;
        ferry_projections::ProjectionRunner::live(Arc::new(DeliveryProjection))
            .ensure_tables(&t.db)
            .await
            .unwrap();
        let ferry_store::database::Pool::Postgres(pool) = t.db.pool().clone() else {
            unreachable!()
        };
        // A history as the planner meets it: many ended promotions, a few open ones, a few
        // rollbacks, a few releases (one withdrawn).
        for sql in [
            "INSERT INTO rm_promotions (promotion_id, tenant_id, environment_id, release_id,
               environment_class, state, rollback_of, position, version, document)
             SELECT 'p' || n, 't' || (n % 10), 'e' || (n % 40), 'r' || (n % 200), 'test',
                    CASE WHEN n % 1000 = 0 THEN 'Requested' WHEN n % 997 = 0 THEN 'Verifying'
                         ELSE 'Completed' END,
                    CASE WHEN n % 2000 = 1 THEN 'p' || (n - 1) END, n, 3, '{}'
               FROM generate_series(1, 20000) AS n",
            "INSERT INTO rm_releases (tenant_id, release_id, project_id, state, position, document)
             SELECT 't' || (n % 10), 'r' || n, 'shop',
                    CASE WHEN n = 7 THEN 'Withdrawn' ELSE 'Published' END, n, '{}'
               FROM generate_series(1, 200) AS n",
            "ANALYZE rm_promotions",
            "ANALYZE rm_releases",
        ] {
            sqlx::query(sql).execute(&pool).await.unwrap();
        }
        for (statement, index) in [
            (OPEN_PROMOTIONS, "_open"),
            (ENDED_ROLLBACKS, "_rollback"),
            (WITHDRAWN_OPEN_PROMOTIONS, "_open"),
        ] {
            let (plan,): (Value,) = sqlx::query_as(&format!("EXPLAIN (FORMAT JSON) {statement}"))
                .fetch_one(&pool)
                .await
                .unwrap();
            let mut scans = Vec::new();
            scans_of(&plan[0]["Plan"], "rm_promotions", &mut scans);
            assert!(!scans.is_empty(), "{plan}");
            assert!(
                !scans.iter().any(|s| s == "Seq Scan"),
                "{statement}: {scans:?} {plan}"
            );
            assert!(plan.to_string().contains(index), "{statement}: {plan}");
        }
        t.cleanup().await;
    }
}
