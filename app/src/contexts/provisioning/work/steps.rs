//! What each step does. A step ends `Done`, `Failed` (for good) or `Retry`. Domain refusals
//! (the run was cancelled meanwhile, a receipt already exists) end the step: the aggregate is
//! the judge, so a step run twice never has a second effect.
//!
//! An apply first plans again and compares: a target that changed since the plan (drift, a
//! hand edit) supersedes the run, so an approval covers exactly the plan it was shown.
//!
//! An apply runs its runner at most once per item: when the runner returns, its result is
//! stored on the item (a fenced write) before the outcome is recorded, and an item with a
//! stored result only records it. So a `Retry` after a store error while recording never
//! runs the runner again.

use super::inputs::Inputs;
use super::metrics::Metrics;
use super::{Ports, Settings};
use chrono::Utc;
use ferry_domain::drift::{self, DriftIgnoreRules};
use ferry_domain::environment::Environment;
use ferry_domain::environment::{BaselineProgram, EnvironmentRegistration};
use ferry_domain::ports::redact;
use ferry_domain::ports::runner::{PlanSummary, PreviewOutcome, RunnerError};
use ferry_domain::ports::sources::PolicyInput;
use ferry_domain::receipts::{
    ApplyReceipt, ApplyResult, IgnoredDifference, PlanReceipt, PolicyOutcome,
};
use ferry_domain::run::{Decision, ProvisioningRun, RunCommand, RunError, RunRequest};
use ferry_domain::specification::DeploymentSpecification;
use ferry_domain::specification::{Declaration, SpecificationCommand, SpecificationVersion};
use ferry_domain::*;
use ferry_store::{CommandError, EventMetadata};
use ferry_store::{Database, Repository, Subscription};
use ferry_workers::clock::ms;
use ferry_workers::queue::{Queue, QueueError, RunnerResult, Step, WorkItem};
use ferry_workers::{Outcome, SettleError};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why an interrupted apply's run is reported Failed by recovery.
pub(crate) const INTERRUPTED: &str = "apply interrupted: the Ferry instance running it stopped, \
    or stopped its runner after losing its lease, before the runner's result was stored; \
    the infrastructure may be partly changed; the apply is not re-run, plan a new run";

/// The one output of an apply receipt whose outputs were too large to store: why.
pub(crate) const OUTPUTS_LEFT_OUT: &str = "ferry:outputsLeftOut";

/// Provisioning's steps: plan, apply, baseline and expiry (see the module doc).
pub struct ProvisioningSteps {
    pub(super) ports: Ports,
    pub(super) settings: Settings,
    queue: Queue,
    runs: Repository<ProvisioningRun>,
    specifications: Repository<DeploymentSpecification>,
    environments: Repository<Environment>,
    drift_rules: Repository<DriftIgnoreRules>,
    /// The runs' counters.
    pub metrics: Arc<Metrics>,
}

#[async_trait::async_trait]
impl ferry_workers::Steps for ProvisioningSteps {
    fn subscription(&self) -> Subscription {
        super::enqueuer::Enqueuer {
            approval_expiry: self.settings.approval_expiry,
        }
        .subscription()
    }

    async fn run(&self, item: &WorkItem) -> Outcome {
        self.step(item).await
    }

    async fn settle_interrupted(&self, item: &WorkItem) -> Result<(), SettleError> {
        self.settle_interrupted_apply(item).await
    }
}

/// The actor recorded for a worker's commands: `system:<worker>`.
fn system(worker: &'static str) -> Actor {
    Actor::parse(format!("system:{worker}")).expect("a constant worker name is a valid actor")
}

/// What policy sees of `plan` (after the ignore rules left out what they accept).
fn policy_input(run: &ProvisioningRun, request: &RunRequest, plan: &PlanSummary) -> PolicyInput {
    PolicyInput {
        environment_id: request.environment_id.to_string(),
        environment_class: request.environment_class,
        kind: request.kind,
        // Only an approval Ferry verified counts (ids in the request grant nothing).
        has_promotion_approval: run.promotion_approval().is_some(),
        rollback: run.rollback_authority().is_some(),
        adds: plan.adds,
        changes: plan.changes,
        deletes: plan.deletes,
        replaces: plan.replaces,
        resources: plan.resources.clone(),
    }
}

impl ProvisioningSteps {
    /// The steps over `db`, writing their items through `queue`.
    pub(super) fn new(
        db: Database,
        queue: Queue,
        ports: Ports,
        settings: Settings,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            queue,
            runs: Repository::new(db.clone(), ()),
            specifications: Repository::new(db.clone(), ()),
            environments: Repository::new(db.clone(), ()),
            drift_rules: Repository::new(db, ()),
            ports,
            settings,
            metrics,
        }
    }

    fn metadata(&self, item: &WorkItem, tenant: &TenantId, worker: &'static str) -> EventMetadata {
        let parse = |v: &Option<String>| v.as_deref().and_then(|s| uuid::Uuid::parse_str(s).ok());
        let request_id = uuid::Uuid::new_v4();
        EventMetadata {
            tenant_id: tenant.clone(),
            actor: system(worker),
            correlation_id: parse(&item.correlation_id).unwrap_or(request_id),
            causation_id: parse(&item.causation_id).unwrap_or(request_id),
            request_id,
        }
    }

    /// The folder a step of an item checks its program out into.
    fn work_dir(&self, tenant: &TenantId, item: &WorkItem, step: &str) -> PathBuf {
        self.settings
            .work_dir
            .join(tenant.path_component())
            .join(item.item_id.as_str())
            .join(step)
    }

    /// Runs a command on the run and counts the state it reaches.
    async fn command(
        &self,
        item: &WorkItem,
        tenant: &TenantId,
        worker: &'static str,
        command: RunCommand,
    ) -> Result<ProvisioningRun, CommandError<RunError>> {
        let done = self
            .runs
            .execute(
                tenant,
                &item.item_id,
                command,
                &self.metadata(item, tenant, worker),
                false,
            )
            .await?;
        if let (Some(request), Some(state)) = (done.aggregate.request(), done.aggregate.state()) {
            if !done.events.is_empty() {
                self.metrics
                    .run_reached(tenant.as_str(), request.kind.as_str(), state.as_str());
            }
        }
        Ok(done.aggregate)
    }

    async fn step(&self, item: &WorkItem) -> Outcome {
        let Ok(tenant) = TenantId::parse(item.tenant_id.clone()) else {
            return Outcome::Failed(format!("bad tenant {:?}", item.tenant_id));
        };
        let result = match item.step {
            Step::Plan => self.plan(item, &tenant).await,
            Step::Apply => self.apply(item, &tenant).await,
            Step::Baseline => self.baseline(item, &tenant).await,
            Step::Expiry => self.expire(item, &tenant).await,
        };
        match result {
            Ok(outcome) => outcome,
            // Someone changed the run first: look again shortly.
            Err(CommandError::Conflict | CommandError::Moved) => {
                Outcome::Retry("concurrent change".to_string())
            }
            Err(CommandError::Unavailable(e)) => Outcome::Retry(format!("store unavailable: {e}")),
            // The aggregate refused: the work is moot (cancelled, already recorded, …).
            Err(CommandError::Domain(e)) => {
                tracing::info!(reason = %e, "nothing to do");
                Outcome::Done
            }
            Err(CommandError::NotFound) => Outcome::Done,
            Err(CommandError::Store(e)) => Outcome::Retry(format!("store error: {e}")),
        }
    }

    async fn load(
        &self,
        item: &WorkItem,
        tenant: &TenantId,
    ) -> Result<Option<(ProvisioningRun, RunRequest, SpecificationVersion)>, CommandError<RunError>>
    {
        let Some((run, _)) = self.runs.load(tenant, &item.item_id).await? else {
            return Ok(None);
        };
        let Some(request) = run.request().cloned() else {
            return Ok(None);
        };
        let spec = self
            .specifications
            .load(tenant, &request.specification_id.to_string())
            .await
            .map_err(CommandError::into_other)?
            .and_then(|(s, _)| s.version(request.specification_version).cloned());
        Ok(spec.map(|s| (run, request, s)))
    }

    async fn fail_planning(
        &self,
        item: &WorkItem,
        tenant: &TenantId,
        reason: String,
    ) -> Result<Outcome, CommandError<RunError>> {
        self.command(
            item,
            tenant,
            "planner",
            RunCommand::FailPlanning {
                reason: reason.clone(),
                at: Utc::now(),
            },
        )
        .await?;
        Ok(Outcome::Failed(reason))
    }

    async fn plan(
        &self,
        item: &WorkItem,
        tenant: &TenantId,
    ) -> Result<Outcome, CommandError<RunError>> {
        let Some((run, request, spec)) = self.load(item, tenant).await? else {
            return Ok(Outcome::Done);
        };
        if run.state() == Some(ProvisioningState::Planned) {
            // The plan was recorded and the process died before the next step: take that
            // step now, from the receipt (planning again could show another plan).
            let next = self.after_plan(&run, request.kind)?;
            self.command(item, tenant, "planner", next).await?;
            return Ok(Outcome::Done);
        }
        if run.state() != Some(ProvisioningState::Requested) {
            return Ok(Outcome::Done);
        }
        let reconciliation = request.kind == ProvisioningKind::Reconciliation;
        let (inputs, runner_version, preview) =
            match self.preview(item, tenant, &spec, reconciliation).await? {
                ControlFlow::Continue(previewed) => previewed,
                ControlFlow::Break(outcome) => return Ok(outcome),
            };
        let limits = self.settings.limits;
        if let Err(reason) = limits.check_resources(preview.plan.resources.len()) {
            return self.fail_planning(item, tenant, reason.to_string()).await;
        }
        let log = limits.cut_log(redact(&preview.log, inputs.secrets()));
        let logs_ref = match self
            .ports
            .artifacts
            .put(&format!("runs/{}/plan.log", item.item_id), log.into_bytes())
            .await
        {
            Ok(r) => Some(r),
            Err(e) => return Ok(Outcome::Retry(e.to_string())),
        };
        let mut plan = preview.plan;
        let mut warnings = inputs.warnings.clone();
        let ignored = if reconciliation {
            self.ignore_accepted_drift(tenant, &request.environment_id, &mut plan, &mut warnings)
                .await?
        } else {
            Vec::new()
        };
        let decision = match self
            .ports
            .policy
            .evaluate(&policy_input(&run, &request, &plan))
        {
            Ok(d) => d,
            Err(e) => return self.fail_planning(item, tenant, e.to_string()).await,
        };
        let receipt = PlanReceipt {
            adds: plan.adds,
            changes: plan.changes,
            deletes: plan.deletes,
            replaces: plan.replaces,
            resources: plan.resources,
            ignored,
            inputs_hash: inputs.hash.clone(),
            program_version: inputs.commit.clone(),
            runner: self.ports.runner.name().to_string(),
            runner_version,
            policy: Some(decision.clone()),
            warnings,
        };
        // The receipt goes into an event that every reader of the stream loads.
        let receipt_bytes = serde_json::to_vec(&receipt).map_or(usize::MAX, |json| json.len());
        if let Err(reason) = limits.check_receipt("plan receipt", receipt_bytes) {
            return self.fail_planning(item, tenant, reason.to_string()).await;
        }
        let planned = self
            .command(
                item,
                tenant,
                "planner",
                RunCommand::RecordPlan {
                    receipt: Box::new(receipt),
                    logs_ref,
                    at: Utc::now(),
                },
            )
            .await?;
        tracing::info!(adds = plan.adds, changes = plan.changes, deletes = plan.deletes, decision = ?decision.decision, "planned");
        if reconciliation {
            let tenant = tenant.as_str();
            self.metrics
                .diffs_found(tenant, false, plan.adds + plan.changes);
            self.metrics
                .diffs_found(tenant, true, plan.deletes + plan.replaces);
        }
        let next = self.after_plan(&planned, request.kind)?;
        self.command(item, tenant, "planner", next).await?;
        Ok(Outcome::Done)
    }

    /// Gathers a plan's inputs and previews them (refreshing first for a reconciliation:
    /// drift made outside Ferry shows only against the resources' real state). `Break` is
    /// how the step ends when that fails: a retry while the runner is away (until the
    /// attempts are spent), else the planning failed.
    async fn preview(
        &self,
        item: &WorkItem,
        tenant: &TenantId,
        spec: &SpecificationVersion,
        refresh: bool,
    ) -> Result<ControlFlow<Outcome, (Inputs, String, PreviewOutcome)>, CommandError<RunError>>
    {
        let dir = self.work_dir(tenant, item, "plan");
        let mut inputs = match self
            .gather(tenant, spec, &dir, self.settings.plan_timeout)
            .await
        {
            Ok(i) => i,
            Err(reason) => {
                let failed = self.fail_planning(item, tenant, reason.to_string()).await;
                return failed.map(ControlFlow::Break);
            }
        };
        inputs.runner.refresh = refresh;
        let runner = &self.ports.runner;
        let preview = async {
            let version = runner.version().await?;
            Ok::<_, RunnerError>((version, runner.preview(&inputs.runner).await?))
        }
        .await;
        let _ = tokio::fs::remove_dir_all(&dir).await;
        let reason = match preview {
            Ok((version, preview)) => return Ok(ControlFlow::Continue((inputs, version, preview))),
            Err(e @ (RunnerError::Unavailable(_) | RunnerError::TimedOut(_))) => {
                let reason = redact(&e.to_string(), inputs.secrets());
                if item.attempts < i64::from(self.settings.plan_attempts) {
                    return Ok(ControlFlow::Break(Outcome::Retry(reason)));
                }
                format!("{reason} (gave up after {} attempts)", item.attempts)
            }
            Err(e) => redact(&e.to_string(), inputs.secrets()),
        };
        self.fail_planning(item, tenant, reason)
            .await
            .map(ControlFlow::Break)
    }

    /// Leaves out of a reconciliation's plan the differences the environment's team accepts
    /// (before triage, policy and counting); returns them, to be listed on the receipt with
    /// the rules that did it, and adds the rules' notes to `warnings`.
    async fn ignore_accepted_drift(
        &self,
        tenant: &TenantId,
        environment: &EnvironmentId,
        plan: &mut PlanSummary,
        warnings: &mut Vec<String>,
    ) -> Result<Vec<IgnoredDifference>, CommandError<RunError>> {
        let rules = self
            .drift_rules
            .load(tenant, &DriftIgnoreRules::aggregate_id(tenant, environment))
            .await
            .map_err(CommandError::into_other)?
            .map(|(rules, _)| rules.active().to_vec())
            .unwrap_or_default();
        if rules.is_empty() {
            return Ok(Vec::new());
        }
        let triaged = drift::triage(&rules, std::mem::take(&mut plan.resources));
        (plan.adds, plan.changes, plan.deletes, plan.replaces) = triaged.counts();
        plan.resources = triaged.kept;
        warnings.extend(triaged.notes);
        Ok(triaged.ignored)
    }

    /// The step that follows a recorded plan: rejected by policy, in sync, a proposal, or
    /// the apply (when the run may be applied without an approval).
    fn after_plan(
        &self,
        planned: &ProvisioningRun,
        kind: ProvisioningKind,
    ) -> Result<RunCommand, CommandError<RunError>> {
        let at = Utc::now();
        let reconciliation = kind == ProvisioningKind::Reconciliation;
        let receipt = planned
            .plan_receipt()
            .ok_or_else(|| CommandError::store("a planned run has no plan receipt"))?;
        let changes = receipt.adds + receipt.changes + receipt.deletes + receipt.replaces;
        if let Some(decision) = receipt
            .policy
            .as_ref()
            .filter(|d| d.decision == PolicyOutcome::Deny)
        {
            return Ok(RunCommand::RejectByPolicy {
                evidence: decision.evidence.clone(),
                at,
            });
        }
        Ok(if reconciliation && changes == 0 {
            RunCommand::RecordInSync { at }
        } else if reconciliation && !*self.settings.auto_apply_non_destructive.borrow() {
            RunCommand::RequireApproval {
                reason: "AutoApplyNonDestructive is off: every difference is a proposal"
                    .to_string(),
                at,
            }
        } else {
            match planned.authorize_apply() {
                Ok(_) => RunCommand::StartApply { at },
                Err(RunError::ApprovalRequired(reason)) => {
                    RunCommand::RequireApproval { reason, at }
                }
                Err(RunError::PolicyDenied(reason)) => RunCommand::RejectByPolicy {
                    evidence: vec![reason],
                    at,
                },
                Err(e) => return Err(CommandError::Domain(e)),
            }
        })
    }

    async fn fail_apply(
        &self,
        item: &WorkItem,
        tenant: &TenantId,
        reason: String,
        resource: Option<String>,
        seconds: f64,
        runner_version: String,
    ) -> Result<Outcome, CommandError<RunError>> {
        let receipt = ApplyReceipt {
            outputs: Default::default(),
            duration_seconds: seconds,
            result: ApplyResult::Failed,
            runner_version,
            failing_resource: resource,
        };
        self.command(
            item,
            tenant,
            "applier",
            RunCommand::RecordApplyFailed {
                receipt: Box::new(receipt),
                reason: reason.clone(),
                logs_ref: None,
                at: Utc::now(),
            },
        )
        .await?;
        Ok(Outcome::Failed(reason))
    }

    /// The plan went stale before the runner started: the run is never applied.
    async fn supersede(
        &self,
        item: &WorkItem,
        tenant: &TenantId,
        reason: String,
    ) -> Result<Outcome, CommandError<RunError>> {
        self.command(
            item,
            tenant,
            "applier",
            RunCommand::Supersede {
                reason: reason.clone(),
                at: Utc::now(),
            },
        )
        .await?;
        Ok(Outcome::Failed(reason))
    }

    async fn apply(
        &self,
        item: &WorkItem,
        tenant: &TenantId,
    ) -> Result<Outcome, CommandError<RunError>> {
        let stored = self
            .queue
            .stored_result(item)
            .await
            .map_err(CommandError::store)?;
        if let Some(stored) = stored {
            tracing::info!("the runner already ran for this item: recording its stored result");
            return self.record_result(item, tenant, &stored).await;
        }
        let Some((run, request, spec)) = self.load(item, tenant).await? else {
            return Ok(Outcome::Done);
        };
        if run.state() != Some(ProvisioningState::Applying) || run.apply_receipt().is_some() {
            return Ok(Outcome::Done);
        }
        let Some(plan) = run.plan_receipt().cloned() else {
            return Ok(Outcome::Done);
        };
        if let Some(reason) = self.applied_since_plan(item, &request).await? {
            return self.supersede(item, tenant, reason).await;
        }
        let dir = self.work_dir(tenant, item, "apply");
        let mut inputs = match self
            .gather(tenant, &spec, &dir, self.settings.apply_timeout)
            .await
        {
            Ok(i) => i,
            Err(reason) => {
                let reason = reason.to_string();
                return self
                    .fail_apply(item, tenant, reason, None, 0.0, plan.runner_version.clone())
                    .await;
            }
        };
        if inputs.hash != plan.inputs_hash {
            let _ = tokio::fs::remove_dir_all(&dir).await;
            let reason = format!(
                "the inputs changed after the plan (inputs hash {} is now {}): configuration, secrets or program differ",
                &plan.inputs_hash[..plan.inputs_hash.len().min(12)],
                &inputs.hash[..12]
            );
            return self.supersede(item, tenant, reason).await;
        }
        inputs.runner.refresh = request.kind == ProvisioningKind::Reconciliation;
        inputs.runner.exclude = plan.excluded_urns();
        if let ControlFlow::Break(outcome) = self
            .check_plan_holds(item, tenant, &plan, &inputs, &dir)
            .await?
        {
            return Ok(outcome);
        }
        let stored = self
            .run_apply(item, request.kind, &plan, &inputs, &dir)
            .await;
        if let Err(outcome) = self.store_result(item, &stored).await {
            return Ok(outcome);
        }
        tracing::info!(seconds = stored.receipt.duration_seconds, result = ?stored.receipt.result, "the runner finished; its result is stored");
        self.record_result(item, tenant, &stored).await
    }

    /// Whether another run applied to this environment after this plan was made (the plan
    /// is stale then): the reason, if so.
    async fn applied_since_plan(
        &self,
        item: &WorkItem,
        request: &RunRequest,
    ) -> Result<Option<String>, CommandError<RunError>> {
        let planned_at = self
            .queue
            .finished_at(&item.item_id, Step::Plan)
            .await
            .map_err(CommandError::store)?;
        let last = self
            .queue
            .last_apply(&item.environment_key)
            .await
            .map_err(CommandError::store)?;
        Ok(match (planned_at, last) {
            (Some(planned_at), Some((other, applied_at)))
                if other != item.item_id && applied_at > planned_at =>
            {
                Some(format!(
                    "run {other} applied to {} after this plan was made",
                    request.environment_id
                ))
            }
            _ => None,
        })
    }

    /// Exactly the plan shown: the target is planned again, and a change since (drift, a
    /// hand edit) makes the plan stale rather than applying something nobody saw. `Break`
    /// is how the step ends otherwise (the work folder removed).
    async fn check_plan_holds(
        &self,
        item: &WorkItem,
        tenant: &TenantId,
        plan: &PlanReceipt,
        inputs: &Inputs,
        dir: &Path,
    ) -> Result<ControlFlow<Outcome>, CommandError<RunError>> {
        let outcome = match self.ports.runner.preview(&inputs.runner).await {
            Ok(now) => match plan.differs_from(&now.plan.resources) {
                None => return Ok(ControlFlow::Continue(())),
                Some(reason) => {
                    let _ = tokio::fs::remove_dir_all(dir).await;
                    self.supersede(item, tenant, reason).await?
                }
            },
            Err(e @ (RunnerError::Unavailable(_) | RunnerError::TimedOut(_)))
                if item.attempts < i64::from(self.settings.plan_attempts) =>
            {
                let _ = tokio::fs::remove_dir_all(dir).await;
                Outcome::Retry(redact(&e.to_string(), inputs.secrets()))
            }
            Err(e) => {
                let _ = tokio::fs::remove_dir_all(dir).await;
                let reason = format!(
                    "the plan could not be checked against the target before the apply (nothing was applied; attempt {}): {}",
                    item.attempts,
                    redact(&e.to_string(), inputs.secrets())
                );
                let version = plan.runner_version.clone();
                self.fail_apply(item, tenant, reason, None, 0.0, version)
                    .await?
            }
        };
        Ok(ControlFlow::Break(outcome))
    }

    /// Runs the runner's apply (once: the caller stores the result before recording it) and
    /// makes its result what is stored: redacted, cut to the limits, the log kept as an
    /// artifact, outputs too large to store left out saying so.
    async fn run_apply(
        &self,
        item: &WorkItem,
        kind: ProvisioningKind,
        plan: &PlanReceipt,
        inputs: &Inputs,
        dir: &Path,
    ) -> RunnerResult {
        let runner = &self.ports.runner;
        let runner_version = runner
            .version()
            .await
            .unwrap_or_else(|_| plan.runner_version.clone());
        let started = Instant::now();
        let result = runner.apply(&inputs.runner).await;
        let seconds = started.elapsed().as_secs_f64();
        let _ = tokio::fs::remove_dir_all(dir).await;
        self.metrics.apply_took(kind.as_str(), seconds);
        let (outputs, apply_result, reason, resource, log) = match result {
            Ok(outcome) => (
                outcome.outputs,
                ApplyResult::Succeeded,
                None,
                None,
                outcome.log,
            ),
            Err(error) => {
                let (reason, resource, log) = match error {
                    RunnerError::ProgramFailed {
                        reason,
                        resource,
                        log,
                    } => (reason, resource, log),
                    other => (other.to_string(), None, String::new()),
                };
                (
                    Default::default(),
                    ApplyResult::Failed,
                    Some(redact(&reason, inputs.secrets())),
                    resource,
                    log,
                )
            }
        };
        // A failure without output has no log to keep (as a success always has one).
        let limits = self.settings.limits;
        let reason = reason.map(|r| limits.cut_log(r));
        let resource = resource.map(|r| limits.cut_log(r));
        let logs_ref = if log.is_empty() && apply_result == ApplyResult::Failed {
            None
        } else {
            let log = limits.cut_log(redact(&log, inputs.secrets()));
            self.ports
                .artifacts
                .put(
                    &format!("runs/{}/apply.log", item.item_id),
                    log.into_bytes(),
                )
                .await
                .ok()
        };
        let mut stored = RunnerResult {
            receipt: ApplyReceipt {
                outputs,
                duration_seconds: seconds,
                result: apply_result,
                runner_version,
                failing_resource: resource,
            },
            reason,
            logs_ref,
        };
        // What was applied stays applied: outputs too large to store are left out, saying so.
        let receipt_bytes =
            serde_json::to_vec(&stored.receipt).map_or(usize::MAX, |json| json.len());
        if let Err(why) = limits.check_receipt("apply receipt", receipt_bytes) {
            tracing::warn!(%why, "the apply's outputs are left out of its receipt");
            stored.receipt.outputs = std::collections::BTreeMap::from([(
                OUTPUTS_LEFT_OUT.to_string(),
                serde_json::Value::String(why.to_string()),
            )]);
        }
        stored
    }

    /// Stores the runner's result on the item, retrying a store error for up to a lease
    /// (the heartbeat stops the step first if the store stays away): `Err` is the outcome
    /// when it cannot be stored.
    async fn store_result(&self, item: &WorkItem, stored: &RunnerResult) -> Result<(), Outcome> {
        let clock = self.queue.clock().clone();
        let give_up_at = clock.now_ms().saturating_add(ms(self.settings.lease));
        let mut delay = Duration::from_millis(100);
        loop {
            let error = match self.queue.store_result(item, stored).await {
                Ok(()) => return Ok(()),
                Err(QueueError::ClaimLost { .. }) => {
                    tracing::error!(result = ?stored, "lost the claim before the runner's result was stored");
                    return Err(Outcome::ClaimLost);
                }
                Err(e @ QueueError::Result { .. }) => e,
                Err(e) if clock.now_ms() >= give_up_at => e,
                Err(error) => {
                    tracing::warn!(%error, "cannot store the runner's result yet; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            // Logged in full so that an operator still learns what the runner did.
            tracing::error!(%error, result = ?stored, "cannot store the runner's result");
            return Err(Outcome::Abandoned(format!(
                "the runner's result could not be stored: {error}"
            )));
        }
    }

    /// Records a stored runner result on the run.
    async fn record_result(
        &self,
        item: &WorkItem,
        tenant: &TenantId,
        stored: &RunnerResult,
    ) -> Result<Outcome, CommandError<RunError>> {
        let receipt = Box::new(stored.receipt.clone());
        let logs_ref = stored.logs_ref.clone();
        match stored.receipt.result {
            ApplyResult::Succeeded => {
                self.command(
                    item,
                    tenant,
                    "applier",
                    RunCommand::RecordApplySucceeded {
                        receipt,
                        logs_ref,
                        at: Utc::now(),
                    },
                )
                .await?;
                tracing::info!("applied");
                Ok(Outcome::Done)
            }
            ApplyResult::Failed => {
                let reason = stored
                    .reason
                    .clone()
                    .unwrap_or_else(|| "the apply failed".to_string());
                self.command(
                    item,
                    tenant,
                    "applier",
                    RunCommand::RecordApplyFailed {
                        receipt,
                        reason: reason.clone(),
                        logs_ref,
                        at: Utc::now(),
                    },
                )
                .await?;
                Ok(Outcome::Failed(reason))
            }
        }
    }

    /// Settles a running apply whose owner is known gone: records its stored result if the
    /// runner had returned, else reports the run Failed as interrupted. The item is marked
    /// only once that is recorded (or the run is no longer Applying); otherwise the error is
    /// returned and the item stays for the next recovery round.
    async fn settle_interrupted_apply(&self, item: &WorkItem) -> Result<(), SettleError> {
        let Ok(tenant) = TenantId::parse(item.tenant_id.clone()) else {
            self.queue
                .failed(item, &format!("bad tenant {:?}", item.tenant_id))
                .await?;
            return Ok(());
        };
        if let Some(stored) = self.queue.stored_result(item).await? {
            tracing::info!("recording the stored result of an apply whose owner stopped");
            let outcome = match self.record_result(item, &tenant, &stored).await {
                Ok(outcome) => outcome,
                Err(e @ (CommandError::Domain(_) | CommandError::NotFound)) => {
                    tracing::info!(reason = %e, "the stored result needs no recording");
                    match stored.receipt.result {
                        ApplyResult::Succeeded => Outcome::Done,
                        ApplyResult::Failed => Outcome::Failed(stored.reason.unwrap_or_default()),
                    }
                }
                Err(e) => return Err(SettleError::Record(Box::new(e))),
            };
            match outcome {
                Outcome::Failed(reason) => self.queue.failed(item, &reason).await?,
                _ => self.queue.done(item).await?,
            }
            return Ok(());
        }
        let reported = self
            .fail_apply(
                item,
                &tenant,
                INTERRUPTED.to_string(),
                None,
                0.0,
                "unknown".to_string(),
            )
            .await;
        let reason = match reported {
            Ok(_) => {
                tracing::error!("an interrupted apply was reported: the run is Failed");
                INTERRUPTED.to_string()
            }
            Err(e @ (CommandError::Domain(_) | CommandError::NotFound)) => {
                format!("{INTERRUPTED} (the run was no longer applying: {e})")
            }
            Err(e) => return Err(SettleError::Record(Box::new(e))),
        };
        self.queue.failed(item, &reason).await?;
        Ok(())
    }

    async fn baseline(
        &self,
        item: &WorkItem,
        tenant: &TenantId,
    ) -> Result<Outcome, CommandError<RunError>> {
        let Some((environment, _)) = self
            .environments
            .load(tenant, &item.item_id)
            .await
            .map_err(CommandError::into_other)?
        else {
            return Ok(Outcome::Done);
        };
        let Some(registration) = environment.registration().cloned() else {
            return Ok(Outcome::Done);
        };
        let class = registration.environment_class;
        let Some(program) = registration
            .baseline_program
            .clone()
            .or_else(|| self.settings.baseline_programs.get(&class).cloned())
        else {
            return Ok(Outcome::Failed(format!(
                "no baseline program for {} (class {class:?}): the creation carried none and none is configured for the class",
                registration.environment_id
            )));
        };
        let spec_id = SpecificationId::for_environment(
            tenant,
            &registration.environment_id,
            SpecificationKind::Environment,
        );
        let metadata = self.metadata(item, tenant, "baseline");
        let version = match self
            .baseline_version(tenant, &registration, &program, spec_id, &metadata)
            .await?
        {
            ControlFlow::Continue(version) => version,
            ControlFlow::Break(outcome) => return Ok(outcome),
        };
        let run_id = self
            .baseline_run_id(
                tenant,
                &registration.environment_id,
                spec_id,
                version.version,
            )
            .await?;
        let request = RunRequest {
            provisioning_run_id: run_id,
            tenant_id: tenant.clone(),
            project_id: version.project_id.clone(),
            environment_id: registration.environment_id.clone(),
            environment_class: Some(class),
            specification_id: spec_id,
            specification_version: version.version,
            kind: ProvisioningKind::Baseline,
            promotion_id: None,
            approval_id: None,
            follows_failed_apply: None,
            requested_by: system("baseline"),
            requested_at: Utc::now(),
        };
        match self
            .runs
            .execute(
                tenant,
                &run_id.to_string(),
                RunCommand::Request(Box::new(request)),
                &metadata,
                true,
            )
            .await
        {
            Ok(_) => {
                self.metrics
                    .run_reached(tenant.as_str(), "Baseline", "Requested");
                tracing::info!(run = %run_id, "baseline planned");
                Ok(Outcome::Done)
            }
            Err(CommandError::Domain(RunError::AlreadyRequested)) => Ok(Outcome::Done),
            Err(e) => Err(e),
        }
    }

    /// The specification version the baseline plans: one already declared for this program
    /// (a retried step declares once), else a new one declared. `Break` is how the step ends
    /// when none can be had.
    async fn baseline_version(
        &self,
        tenant: &TenantId,
        registration: &EnvironmentRegistration,
        program: &BaselineProgram,
        spec_id: SpecificationId,
        metadata: &EventMetadata,
    ) -> Result<ControlFlow<Outcome, SpecificationVersion>, CommandError<RunError>> {
        // Reuse a version already declared for this program (a retried step declares once).
        let existing = self
            .specifications
            .load(tenant, &spec_id.to_string())
            .await
            .map_err(CommandError::into_other)?;
        let reusable = existing.as_ref().and_then(|(s, _)| {
            s.latest()
                .filter(|v| {
                    v.program_ref == program.program_ref
                        && v.program_version == program.program_version
                })
                .cloned()
        });
        if let Some(version) = reusable {
            return Ok(ControlFlow::Continue(version));
        }
        let project = existing
            .as_ref()
            .and_then(|(s, _)| s.latest().map(|v| v.project_id.clone()))
            .or_else(|| ProjectId::parse(registration.environment_id.as_str()).ok());
        let Some(project_id) = project else {
            return Ok(ControlFlow::Break(Outcome::Failed(
                "cannot name a project for the baseline".to_string(),
            )));
        };
        let declaration = Declaration {
            specification_id: spec_id,
            tenant_id: tenant.clone(),
            project_id,
            environment_id: registration.environment_id.clone(),
            kind: SpecificationKind::Environment,
            program_ref: program.program_ref.clone(),
            program_version: program.program_version.clone(),
            release_id: None,
            strategy: None,
            config_refs: Default::default(),
            secret_refs: Default::default(),
            declared_by: system("baseline"),
            declared_at: Utc::now(),
        };
        let done = self
            .specifications
            .execute(
                tenant,
                &spec_id.to_string(),
                SpecificationCommand::Declare(Box::new(declaration)),
                metadata,
                true,
            )
            .await
            .map_err(CommandError::into_other)?;
        Ok(match done.aggregate.latest().cloned() {
            Some(version) => ControlFlow::Continue(version),
            None => ControlFlow::Break(Outcome::Failed(
                "declared baseline has no version".to_string(),
            )),
        })
    }

    /// The baseline run of this version: the one a version before issue 37 named (as if
    /// requested with an `Idempotency-Key`, which a tenant could also send) when it exists
    /// and is this baseline, so a baseline under way across the upgrade is not planned
    /// twice; else the unambiguous name.
    async fn baseline_run_id(
        &self,
        tenant: &TenantId,
        environment: &EnvironmentId,
        spec_id: SpecificationId,
        version: u32,
    ) -> Result<ProvisioningRunId, CommandError<RunError>> {
        let legacy = ProvisioningRunId::legacy_for_baseline(tenant, environment, version);
        let is_this_baseline = self
            .runs
            .load(tenant, &legacy.to_string())
            .await?
            .is_some_and(|(run, _)| {
                run.request().is_some_and(|r| {
                    r.kind == ProvisioningKind::Baseline
                        && r.specification_id == spec_id
                        && r.specification_version == version
                })
            });
        Ok(if is_this_baseline {
            legacy
        } else {
            ProvisioningRunId::for_baseline(tenant, environment, version)
        })
    }

    async fn expire(
        &self,
        item: &WorkItem,
        tenant: &TenantId,
    ) -> Result<Outcome, CommandError<RunError>> {
        let Some((run, _)) = self.runs.load(tenant, &item.item_id).await? else {
            return Ok(Outcome::Done);
        };
        if run.state() != Some(ProvisioningState::AwaitingApproval) {
            return Ok(Outcome::Done);
        }
        let minutes = self
            .settings
            .approval_expiry
            .map_or(0, |d| d.as_secs() / 60);
        self.command(
            item,
            tenant,
            ferry_domain::run::APPROVAL_EXPIRY_WORKER,
            RunCommand::DecideApproval {
                decision: Decision::Reject,
                decided_by: system(ferry_domain::run::APPROVAL_EXPIRY_WORKER),
                reason: Some(format!(
                    "no decision within {minutes} minutes: the approval expired"
                )),
                approval_id: None,
                at: Utc::now(),
            },
        )
        .await?;
        Ok(Outcome::Done)
    }
}
