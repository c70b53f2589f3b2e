//! The provisioning context's read models: the views the API serves, folded from events
//! (the projection and the command responses use the same fold, so a POST returns exactly
//! what a later GET shows), the three projections that store them, and their queries.
//!
//! Three projections, each with its own tables and checkpoint so that each can be rebuilt
//! and swapped on its own:
//!
//! | projection | table | serves |
//! |---|---|---|
//! | `specifications` | `rm_specification_versions` | every declared version |
//! | `runs` | `rm_runs` | runs with state, receipts, approval, timestamps |
//! | `environments` | `rm_environment_specifications` | latest and last applied specification per environment |
//!
//! Each subscriber folds a batch into the stored documents in memory and writes each changed
//! row once (ARCHITECTURE.md, The global stream). [`ProvisioningReads`] reads them, with
//! the read-your-writes waits of runs and specifications.

use chrono::{DateTime, Utc};
use ferry_domain::receipts::{ApplyReceipt, PlanReceipt};
use ferry_domain::run::{
    ApplyAuthorization, ApprovalRecord, FailureStage, ProvisioningRun, RunEvent,
};
use ferry_domain::specification::{
    DeploymentSpecification, SpecificationEvent, SpecificationVersion,
};
use ferry_domain::*;
use ferry_projections::projection::{Folded, TableNames};
use ferry_projections::queries::{page, QueryError};
use ferry_projections::{Page, Projection, ReadModels, TableSpec};
use ferry_store::stream::{HandlerError, Param, Position, Tx};
use ferry_store::{on_pool, Subscriber, Subscription, Typed};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::types::Json;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

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

/// The provisioning context's projections (the process collects every context's).
pub fn provisioning_projections() -> Vec<Arc<dyn Projection>> {
    vec![
        Arc::new(SpecificationsProjection),
        Arc::new(RunsProjection),
        Arc::new(EnvironmentsProjection),
    ]
}

/// Reads a document the projection stored itself.
fn read_document<T: DeserializeOwned>(
    what: impl FnOnce() -> String,
    doc: serde_json::Value,
) -> Result<T, HandlerError> {
    serde_json::from_value(doc).map_err(|e| HandlerError::Record {
        what: what(),
        source: Box::new(e),
    })
}

fn text(v: impl ToString) -> Param {
    Param::Text(Some(v.to_string()))
}

fn int(v: impl Into<i64>) -> Param {
    Param::Int(Some(v.into()))
}

fn json<T: serde::Serialize>(v: &T) -> Result<Param, HandlerError> {
    serde_json::to_value(v)
        .map(|v| Param::Json(Some(v)))
        .map_err(|e| HandlerError::Record {
            what: "a read-model document".to_string(),
            source: Box::new(e),
        })
}

/// `rm_specification_versions`: every declared version.
pub struct SpecificationsProjection;

impl SpecificationsProjection {
    /// Its name (its checkpoint, and what a read-your-writes wait names).
    pub const NAME: &'static str = "specifications";
}

const SPEC_TABLES: &[TableSpec] = &[TableSpec {
    base: "rm_specification_versions",
    ddl: &[
        "CREATE TABLE IF NOT EXISTS {t} (
            tenant_id text NOT NULL, specification_id text NOT NULL, version bigint NOT NULL,
            environment_id text NOT NULL, project_id text NOT NULL, kind text NOT NULL,
            position bigint NOT NULL, declared_at {ts} NOT NULL, document {json} NOT NULL,
            PRIMARY KEY (tenant_id, specification_id, version))",
        "CREATE INDEX IF NOT EXISTS {i}_page ON {t} (tenant_id, position)",
    ],
}];

impl Projection for SpecificationsProjection {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn tables(&self) -> &'static [TableSpec] {
        SPEC_TABLES
    }
    fn subscribe(&self, subscription: Subscription, tables: &TableNames) -> Subscription {
        subscription.on::<DeploymentSpecification>(SpecificationRows(tables.clone()))
    }
}

/// Writes `rm_specification_versions` (or its rebuild copy).
struct SpecificationRows(TableNames);

#[async_trait::async_trait]
impl Subscriber<DeploymentSpecification> for SpecificationRows {
    async fn on(&self, tx: &mut Tx, event: &Typed<SpecificationEvent>) -> Result<(), HandlerError> {
        self.on_batch(tx, std::slice::from_ref(event)).await
    }

    async fn on_batch(
        &self,
        tx: &mut Tx,
        events: &[Typed<SpecificationEvent>],
    ) -> Result<(), HandlerError> {
        let mut rows = Vec::with_capacity(events.len());
        for event in events {
            let SpecificationEvent::SpecificationDeclared(v) = &event.event;
            rows.push(vec![
                text(&v.tenant_id),
                text(v.specification_id),
                int(v.version),
                text(&v.environment_id),
                text(&v.project_id),
                text(v.kind.as_str()),
                int(event.position.global_position),
                Param::Time(Some(v.declared_at)),
                json(v)?,
            ]);
        }
        tx.insert_rows(
            self.0.get("rm_specification_versions"),
            &[
                "tenant_id",
                "specification_id",
                "version",
                "environment_id",
                "project_id",
                "kind",
                "position",
                "declared_at",
                "document",
            ],
            rows,
            "ON CONFLICT DO NOTHING",
        )
        .await?;
        Ok(())
    }
}

/// `rm_runs`: one document per run, with columns to filter and page by.
pub struct RunsProjection;

impl RunsProjection {
    /// Its name (its checkpoint, and what a read-your-writes wait names).
    pub const NAME: &'static str = "runs";
}

const RUN_TABLES: &[TableSpec] = &[TableSpec {
    base: "rm_runs",
    ddl: &[
        "CREATE TABLE IF NOT EXISTS {t} (
            provisioning_run_id text PRIMARY KEY, tenant_id text NOT NULL,
            environment_id text NOT NULL, kind text NOT NULL, state text NOT NULL,
            position bigint NOT NULL, version bigint NOT NULL, updated_at {ts} NOT NULL,
            document {json} NOT NULL)",
        "CREATE INDEX IF NOT EXISTS {i}_page ON {t} (tenant_id, position)",
        // An environment's runs: its page of the list, the reconciler's look for a run in
        // flight there (without it, a scan of every run of the tenant).
        "CREATE INDEX IF NOT EXISTS {i}_environment ON {t} (tenant_id, environment_id, position)",
    ],
}];

impl Projection for RunsProjection {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn tables(&self) -> &'static [TableSpec] {
        RUN_TABLES
    }
    fn subscribe(&self, subscription: Subscription, tables: &TableNames) -> Subscription {
        subscription.on::<ProvisioningRun>(RunRows(tables.clone()))
    }
}

/// Writes `rm_runs` (or its rebuild copy).
struct RunRows(TableNames);

#[async_trait::async_trait]
impl Subscriber<ProvisioningRun> for RunRows {
    async fn on(&self, tx: &mut Tx, event: &Typed<RunEvent>) -> Result<(), HandlerError> {
        let table = self.0.get("rm_runs");
        if let Some(view) = RunView::start(&event.event) {
            let sql = format!(
                "INSERT INTO {table} (provisioning_run_id, tenant_id, environment_id, kind, state, position, version, updated_at, document)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT DO NOTHING"
            );
            tx.execute(
                &sql,
                &[
                    text(view.provisioning_run_id),
                    text(&view.tenant_id),
                    text(&view.environment_id),
                    text(view.kind.as_str()),
                    text(view.state.as_str()),
                    int(event.position.global_position),
                    int(event.sequence),
                    Param::Time(Some(view.updated_at)),
                    json(&view)?,
                ],
            )
            .await?;
            return Ok(());
        }
        let select = format!("SELECT document FROM {table} WHERE provisioning_run_id = $1");
        let what = || format!("the {table} row of run {}", event.aggregate_id);
        let Some(doc) = tx.fetch_json(&select, &[text(&event.aggregate_id)]).await? else {
            return Err(HandlerError::Record {
                what: what(),
                source: "missing: the run's ProvisioningRequested was not projected".into(),
            });
        };
        let mut view: RunView = read_document(what, doc)?;
        if view.version >= event.sequence as u64 {
            return Ok(()); // already applied
        }
        view.apply(&event.event);
        let update = format!(
            "UPDATE {table} SET state = $2, version = $3, updated_at = $4, document = $5 WHERE provisioning_run_id = $1"
        );
        tx.execute(
            &update,
            &[
                text(&event.aggregate_id),
                text(view.state.as_str()),
                int(event.sequence),
                Param::Time(Some(view.updated_at)),
                json(&view)?,
            ],
        )
        .await?;
        Ok(())
    }

    /// Reads the stored documents of every run in the batch at once, folds the events into
    /// them in memory and writes each changed run once: the same rows as event by event.
    async fn on_batch(&self, tx: &mut Tx, events: &[Typed<RunEvent>]) -> Result<(), HandlerError> {
        let table = self.0.get("rm_runs");
        let ids: BTreeSet<&str> = events.iter().map(|e| e.aggregate_id.as_str()).collect();
        let select = format!(
            "SELECT provisioning_run_id, document FROM {table} WHERE provisioning_run_id IN"
        );
        let keys: Vec<Param> = ids.iter().map(text).collect();
        let mut runs: BTreeMap<String, Folded<RunView>> = BTreeMap::new();
        for (id, doc) in tx.fetch_documents(&select, &keys).await? {
            let view = read_document(|| format!("the {table} row of run {id}"), doc)?;
            runs.insert(id, Folded::stored(view));
        }
        for event in events {
            let start = RunView::start(&event.event);
            match (runs.get_mut(&event.aggregate_id), start) {
                (Some(_), Some(_)) => {} // requested again: the row stays as it is
                (None, Some(view)) => {
                    let folded = Folded::new(view, event.position.global_position, event.sequence);
                    runs.insert(event.aggregate_id.clone(), folded);
                }
                (None, None) => {
                    return Err(HandlerError::Record {
                        what: format!("the {table} row of run {}", event.aggregate_id),
                        source: "missing: the run's ProvisioningRequested was not projected".into(),
                    })
                }
                (Some(run), None) => {
                    if run.view.version < event.sequence as u64 {
                        run.view.apply(&event.event);
                        run.changed(event.sequence);
                    }
                }
            }
        }
        let mut rows = Vec::new();
        for run in runs.into_values().filter(|r| r.changed) {
            let view = run.view;
            rows.push(vec![
                text(view.provisioning_run_id),
                text(&view.tenant_id),
                text(&view.environment_id),
                text(view.kind.as_str()),
                text(view.state.as_str()),
                int(run.position),
                int(run.sequence),
                Param::Time(Some(view.updated_at)),
                json(&view)?,
            ]);
        }
        tx.insert_rows(
            table,
            &[
                "provisioning_run_id",
                "tenant_id",
                "environment_id",
                "kind",
                "state",
                "position",
                "version",
                "updated_at",
                "document",
            ],
            rows,
            "ON CONFLICT (provisioning_run_id) DO UPDATE SET state = excluded.state,
             version = excluded.version, updated_at = excluded.updated_at, document = excluded.document",
        )
        .await?;
        Ok(())
    }
}

/// `rm_environment_specifications`: newest and last applied specification per environment
/// and kind, with `rm_environment_run_targets` to know which version a run applies.
pub struct EnvironmentsProjection;

impl EnvironmentsProjection {
    /// Its name (its checkpoint, and what a read-your-writes wait names).
    pub const NAME: &'static str = "environments";
}

const ENV_TABLES: &[TableSpec] = &[
    TableSpec {
        base: "rm_environment_specifications",
        ddl: &["CREATE TABLE IF NOT EXISTS {t} (
            tenant_id text NOT NULL, environment_id text NOT NULL, kind text NOT NULL,
            specification_id text NOT NULL, latest_version bigint NOT NULL, latest {json} NOT NULL,
            applied {json},
            PRIMARY KEY (tenant_id, environment_id, kind))"],
    },
    TableSpec {
        base: "rm_environment_run_targets",
        ddl: &["CREATE TABLE IF NOT EXISTS {t} (
            provisioning_run_id text PRIMARY KEY, tenant_id text NOT NULL,
            specification_id text NOT NULL, target {json} NOT NULL)"],
    },
];

impl Projection for EnvironmentsProjection {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn tables(&self) -> &'static [TableSpec] {
        ENV_TABLES
    }
    fn subscribe(&self, subscription: Subscription, tables: &TableNames) -> Subscription {
        let rows = Arc::new(EnvironmentRows(tables.clone()));
        // A run's apply updates the row its specification's declaration wrote, and nothing
        // else crosses: declarations first, then runs, is the stream's effect.
        subscription
            .on::<DeploymentSpecification>(rows.clone())
            .on::<ProvisioningRun>(rows)
            .by_aggregate()
    }
}

/// Writes `rm_environment_specifications` and `rm_environment_run_targets` (or their
/// rebuild copies): declarations set the latest version, runs the applied one.
struct EnvironmentRows(TableNames);

#[async_trait::async_trait]
impl Subscriber<DeploymentSpecification> for EnvironmentRows {
    async fn on(&self, tx: &mut Tx, event: &Typed<SpecificationEvent>) -> Result<(), HandlerError> {
        let specs = self.0.get("rm_environment_specifications");
        let SpecificationEvent::SpecificationDeclared(v) = &event.event;
        let sql = format!(
            "INSERT INTO {specs} (tenant_id, environment_id, kind, specification_id, latest_version, latest)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (tenant_id, environment_id, kind)
             DO UPDATE SET latest_version = excluded.latest_version, latest = excluded.latest
             WHERE {specs}.latest_version < excluded.latest_version"
        );
        tx.execute(&sql, &latest_row(v)?).await?;
        Ok(())
    }

    /// One row per environment and kind: the declaration that the event-by-event upserts
    /// would leave (the first of the highest version), written with the same upsert.
    async fn on_batch(
        &self,
        tx: &mut Tx,
        events: &[Typed<SpecificationEvent>],
    ) -> Result<(), HandlerError> {
        let specs = self.0.get("rm_environment_specifications");
        let mut latest: BTreeMap<(&str, &str, &str), &SpecificationVersion> = BTreeMap::new();
        for event in events {
            let SpecificationEvent::SpecificationDeclared(v) = &event.event;
            let key = (
                v.tenant_id.as_str(),
                v.environment_id.as_str(),
                v.kind.as_str(),
            );
            let entry = latest.entry(key).or_insert(&**v);
            if entry.version < v.version {
                *entry = &**v;
            }
        }
        let mut rows = Vec::with_capacity(latest.len());
        for v in latest.into_values() {
            rows.push(latest_row(v)?);
        }
        tx.insert_rows(
            specs,
            &[
                "tenant_id",
                "environment_id",
                "kind",
                "specification_id",
                "latest_version",
                "latest",
            ],
            rows,
            &format!(
                "ON CONFLICT (tenant_id, environment_id, kind)
                 DO UPDATE SET latest_version = excluded.latest_version, latest = excluded.latest
                 WHERE {specs}.latest_version < excluded.latest_version"
            ),
        )
        .await?;
        Ok(())
    }
}

/// The `rm_environment_specifications` row of a declaration as the latest.
fn latest_row(v: &SpecificationVersion) -> Result<Vec<Param>, HandlerError> {
    Ok(vec![
        text(&v.tenant_id),
        text(&v.environment_id),
        text(v.kind.as_str()),
        text(v.specification_id),
        int(v.version),
        json(v)?,
    ])
}

#[async_trait::async_trait]
impl Subscriber<ProvisioningRun> for EnvironmentRows {
    async fn on(&self, tx: &mut Tx, event: &Typed<RunEvent>) -> Result<(), HandlerError> {
        let specs = self.0.get("rm_environment_specifications");
        let targets = self.0.get("rm_environment_run_targets");
        match &event.event {
            RunEvent::ProvisioningRequested(r) => {
                let sql = format!(
                    "INSERT INTO {targets} (provisioning_run_id, tenant_id, specification_id, target)
                     VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING"
                );
                let target = RunTarget {
                    specification_id: r.specification_id,
                    specification_version: r.specification_version,
                };
                tx.execute(
                    &sql,
                    &[
                        text(r.provisioning_run_id),
                        text(&r.tenant_id),
                        text(r.specification_id),
                        json(&target)?,
                    ],
                )
                .await?;
            }
            RunEvent::ProvisioningApplied { applied_at, .. } => {
                let select = format!("SELECT target FROM {targets} WHERE provisioning_run_id = $1");
                let Some(target) = tx.fetch_json(&select, &[text(&event.aggregate_id)]).await?
                else {
                    return Ok(());
                };
                let target: RunTarget = read_document(
                    || format!("the {targets} row of run {}", event.aggregate_id),
                    target,
                )?;
                let applied = AppliedSpecification {
                    version: target.specification_version,
                    provisioning_run_id: ProvisioningRunId::parse(&event.aggregate_id).map_err(
                        |e| HandlerError::Record {
                            what: format!("run id {:?}", event.aggregate_id),
                            source: Box::new(e),
                        },
                    )?,
                    applied_at: *applied_at,
                };
                // The last apply wins; runs apply one at a time per environment.
                let sql = format!(
                    "UPDATE {specs} SET applied = $3 WHERE tenant_id = $1 AND specification_id = $2"
                );
                let tenant = event.tenant_id().unwrap_or_default().to_string();
                tx.execute(
                    &sql,
                    &[text(tenant), text(target.specification_id), json(&applied)?],
                )
                .await?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Requests' targets are inserted together; an apply, which reads them, first writes
    /// those gathered so far and is then handled on its own.
    async fn on_batch(&self, tx: &mut Tx, events: &[Typed<RunEvent>]) -> Result<(), HandlerError> {
        let targets = self.0.get("rm_environment_run_targets");
        let mut rows = Vec::new();
        for event in events {
            match &event.event {
                RunEvent::ProvisioningRequested(r) => {
                    let target = RunTarget {
                        specification_id: r.specification_id,
                        specification_version: r.specification_version,
                    };
                    rows.push(vec![
                        text(r.provisioning_run_id),
                        text(&r.tenant_id),
                        text(r.specification_id),
                        json(&target)?,
                    ]);
                }
                RunEvent::ProvisioningApplied { .. } => {
                    insert_targets(tx, targets, std::mem::take(&mut rows)).await?;
                    Subscriber::<ProvisioningRun>::on(self, tx, event).await?;
                }
                _ => {}
            }
        }
        insert_targets(tx, targets, rows).await
    }
}

async fn insert_targets(
    tx: &mut Tx,
    table: &str,
    rows: Vec<Vec<Param>>,
) -> Result<(), HandlerError> {
    let columns = [
        "provisioning_run_id",
        "tenant_id",
        "specification_id",
        "target",
    ];
    tx.insert_rows(table, &columns, rows, "ON CONFLICT DO NOTHING")
        .await?;
    Ok(())
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct RunTarget {
    specification_id: SpecificationId,
    specification_version: u32,
}

/// Filters of `GET /factory/provisioning/specifications`.
#[derive(Debug, Clone, Default)]
pub struct SpecificationFilter {
    /// Only this environment.
    pub environment_id: Option<EnvironmentId>,
    /// Only this project.
    pub project_id: Option<ProjectId>,
    /// Only this kind.
    pub kind: Option<SpecificationKind>,
    /// Only this specification's versions.
    pub specification_id: Option<SpecificationId>,
}

/// Filters of `GET /factory/provisioning/runs`.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    /// Only this environment.
    pub environment_id: Option<EnvironmentId>,
    /// Only this kind.
    pub kind: Option<ProvisioningKind>,
    /// Only this state.
    pub state: Option<ProvisioningState>,
    /// Only runs whose plan deletes or replaces something (`true`), or only the others.
    pub destructive: Option<bool>,
}

fn doc<T: DeserializeOwned>(v: Value) -> Result<T, QueryError> {
    Ok(serde_json::from_value(v)?)
}

/// The provisioning context's queries of the read side.
#[async_trait::async_trait]
pub trait ProvisioningReads {
    /// Every declared version matching `filter`, newest first.
    async fn list_specifications(
        &self,
        tenant: &TenantId,
        filter: &SpecificationFilter,
        limit: u32,
        cursor: Option<i64>,
    ) -> Result<Page<SpecificationVersion>, QueryError>;

    /// Runs matching `filter`, newest first.
    async fn list_runs(
        &self,
        tenant: &TenantId,
        filter: &RunFilter,
        limit: u32,
        cursor: Option<i64>,
    ) -> Result<Page<RunView>, QueryError>;

    /// One run of the tenant.
    async fn get_run(
        &self,
        tenant: &TenantId,
        id: ProvisioningRunId,
    ) -> Result<Option<RunView>, QueryError>;

    /// The newest and last applied specification of each kind for an environment.
    async fn current_specification(
        &self,
        tenant: &TenantId,
        environment: &EnvironmentId,
    ) -> Result<Option<CurrentSpecificationView>, QueryError>;

    /// Waits (at most `timeout`) until the run's view has reached `version`, the command's
    /// last event standing at `after` in the stream ([`ReadModels::wait_until`]).
    async fn wait_for_run(
        &self,
        tenant: &TenantId,
        id: ProvisioningRunId,
        version: u64,
        after: Option<Position>,
        timeout: Duration,
    ) -> Result<bool, QueryError>;

    /// Waits (at most `timeout`) until a specification version is visible in the lists
    /// and in the environment's current specification (`after` as in
    /// [`ReadModels::wait_until`]).
    async fn wait_for_specification(
        &self,
        tenant: &TenantId,
        id: SpecificationId,
        version: u32,
        after: Option<Position>,
        timeout: Duration,
    ) -> Result<bool, QueryError>;
}

#[async_trait::async_trait]
impl ProvisioningReads for ReadModels {
    async fn list_specifications(
        &self,
        tenant: &TenantId,
        filter: &SpecificationFilter,
        limit: u32,
        cursor: Option<i64>,
    ) -> Result<Page<SpecificationVersion>, QueryError> {
        let mut clauses = vec!["tenant_id = $1".to_string()];
        let mut params = vec![Param::Text(Some(tenant.to_string()))];
        let mut add = |column: &str, value: Option<String>| {
            if let Some(v) = value {
                params.push(Param::Text(Some(v)));
                clauses.push(format!("{column} = ${}", params.len()));
            }
        };
        add(
            "environment_id",
            filter.environment_id.as_ref().map(ToString::to_string),
        );
        add(
            "project_id",
            filter.project_id.as_ref().map(ToString::to_string),
        );
        add("kind", filter.kind.map(|k| k.as_str().to_string()));
        add(
            "specification_id",
            filter.specification_id.map(|s| s.to_string()),
        );
        let (docs, next_cursor) = page(
            self.db(),
            "rm_specification_versions",
            clauses,
            params,
            limit,
            cursor,
        )
        .await?;
        Ok(Page {
            items: docs.into_iter().map(doc).collect::<Result<_, _>>()?,
            next_cursor,
        })
    }

    async fn list_runs(
        &self,
        tenant: &TenantId,
        filter: &RunFilter,
        limit: u32,
        cursor: Option<i64>,
    ) -> Result<Page<RunView>, QueryError> {
        let mut clauses = vec!["tenant_id = $1".to_string()];
        let mut params = vec![Param::Text(Some(tenant.to_string()))];
        let mut add = |column: &str, value: Option<String>| {
            if let Some(v) = value {
                params.push(Param::Text(Some(v)));
                clauses.push(format!("{column} = ${}", params.len()));
            }
        };
        add(
            "environment_id",
            filter.environment_id.as_ref().map(ToString::to_string),
        );
        add("kind", filter.kind.map(|k| k.as_str().to_string()));
        add("state", filter.state.map(|s| s.as_str().to_string()));
        if let Some(destructive) = filter.destructive {
            // From the plan receipt in the document (no column of its own).
            let removes = match self.db().backend() {
                ferry_store::Backend::Postgres => {
                    "COALESCE((document->'planReceipt'->>'deletes')::int, 0) \
                     + COALESCE((document->'planReceipt'->>'replaces')::int, 0) > 0"
                }
                ferry_store::Backend::Sqlite => {
                    "COALESCE(json_extract(document, '$.planReceipt.deletes'), 0) \
                     + COALESCE(json_extract(document, '$.planReceipt.replaces'), 0) > 0"
                }
            };
            clauses.push(if destructive {
                format!("({removes})")
            } else {
                format!("NOT ({removes})")
            });
        }
        let (docs, next_cursor) =
            page(self.db(), "rm_runs", clauses, params, limit, cursor).await?;
        Ok(Page {
            items: docs.into_iter().map(doc).collect::<Result<_, _>>()?,
            next_cursor,
        })
    }

    async fn get_run(
        &self,
        tenant: &TenantId,
        id: ProvisioningRunId,
    ) -> Result<Option<RunView>, QueryError> {
        let sql = self
            .db()
            .sql("SELECT document FROM rm_runs WHERE tenant_id = $1 AND provisioning_run_id = $2");
        let row: Option<(Json<Value>,)> = on_pool!(self.db(), pool => sqlx::query_as(&sql)
            .bind(tenant.as_str()).bind(id.to_string()).fetch_optional(pool).await?);
        row.map(|(d,)| doc(d.0)).transpose()
    }

    async fn current_specification(
        &self,
        tenant: &TenantId,
        environment: &EnvironmentId,
    ) -> Result<Option<CurrentSpecificationView>, QueryError> {
        let sql = self.db().sql(
            "SELECT latest, applied FROM rm_environment_specifications
              WHERE tenant_id = $1 AND environment_id = $2 ORDER BY kind",
        );
        let rows: Vec<(Json<Value>, Option<Json<Value>>)> = on_pool!(self.db(), pool =>
            sqlx::query_as(&sql).bind(tenant.as_str()).bind(environment.as_str()).fetch_all(pool).await?);
        if rows.is_empty() {
            return Ok(None);
        }
        let specifications = rows
            .into_iter()
            .map(|(latest, applied)| {
                let latest: SpecificationVersion = doc(latest.0)?;
                Ok(EnvironmentSpecificationView {
                    kind: latest.kind,
                    specification_id: latest.specification_id,
                    applied: applied.map(|a| doc(a.0)).transpose()?,
                    latest,
                })
            })
            .collect::<Result<_, QueryError>>()?;
        Ok(Some(CurrentSpecificationView {
            environment_id: environment.clone(),
            specifications,
        }))
    }

    async fn wait_for_run(
        &self,
        tenant: &TenantId,
        id: ProvisioningRunId,
        version: u64,
        after: Option<Position>,
        timeout: Duration,
    ) -> Result<bool, QueryError> {
        let sql = self
            .db()
            .sql("SELECT version FROM rm_runs WHERE tenant_id = $1 AND provisioning_run_id = $2");
        self.wait_for_own_events(timeout, &[RunsProjection::NAME], after, || async {
            let v: Option<i64> = on_pool!(self.db(), pool => sqlx::query_scalar(&sql)
                .bind(tenant.as_str()).bind(id.to_string()).fetch_optional(pool).await?);
            Ok(v.is_some_and(|v| v as u64 >= version))
        })
        .await
    }

    async fn wait_for_specification(
        &self,
        tenant: &TenantId,
        id: SpecificationId,
        version: u32,
        after: Option<Position>,
        timeout: Duration,
    ) -> Result<bool, QueryError> {
        let sql = self.db().sql(
            "SELECT (SELECT count(*) FROM rm_specification_versions WHERE tenant_id = $1 AND specification_id = $2 AND version = $3)
                  + (SELECT count(*) FROM rm_environment_specifications WHERE tenant_id = $1 AND specification_id = $2 AND latest_version >= $3)",
        );
        let projections = [SpecificationsProjection::NAME, EnvironmentsProjection::NAME];
        self.wait_for_own_events(timeout, &projections, after, || async {
            let n: i64 = on_pool!(self.db(), pool => sqlx::query_scalar(&sql)
                .bind(tenant.as_str()).bind(id.to_string()).bind(i64::from(version)).fetch_one(pool).await?);
            Ok(n == 2)
        })
        .await
    }
}

#[cfg(test)]
mod tests;
