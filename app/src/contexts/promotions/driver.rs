//! The promotion driver: moves promotions through their queue and gates.
//!
//! It works from the `delivery` read model and commands on the aggregates, so each step is
//! safe to repeat and to race: a command in the wrong state is refused, a concurrent one is
//! a conflict, and the next pass reads again.
//!
//! * **One promotion per environment.** A queued promotion starts (`StartGates`) only by
//!   taking its environment's slot, a row in `promotion_slots` inserted in the same
//!   transaction as the event (a second start finds the row and conflicts). The slot is let
//!   go once the promotion no longer holds the environment (completed, rejected, failed or
//!   rolled back). Queued promotions start in request order.
//! * **Gates** are evaluated in order, one command each, from evidence gathered now: the
//!   release, the deployment policy, the release's completions, the environment's readiness
//!   (reported, else a probe of its health URL), the evaluation evidence. The first failing
//!   gate rejects the promotion.
//! * **Withdrawn releases**: promotions of them not yet deploying are rejected.
//! * **Hand-off**: an approved promotion declares the environment's `Workload`
//!   specification from the release and requests a `Release` run of it (named after the
//!   promotion, so a repeated hand-off finds it); provisioning's workers plan and apply it.
//!   The run applied starts verification; a run failed, rejected, cancelled or superseded
//!   fails the promotion with the reason.
//! * **Production approval**: the promotion plans first (its run awaits approval), then
//!   asks for an approval bound to that plan's inputs hash; once a Reviewer other than the
//!   requester grants it, the run is approved with it and handed over. An expired approval
//!   rejects the promotion; a plan that ended first voids the approval and plans anew.
//! * **Rollback**: when verification fails (and `AutoRollbackOnVerificationFailure`), a
//!   rollback promotion of the release last completed in the environment takes over the
//!   environment's slot, goes through the same gates except the approval, is handed off and
//!   verified; its completion ends the original rolled back, its failure leaves it failed.
//! * **Verification** measures the health URL and the SLO through the window and the smoke
//!   suite once ([`super::verification`]), keeping every measurement; passing completes the
//!   promotion, a failed check fails it, a check that cannot run holds it for an Operator.

use super::metrics::observe;
use super::{verification, views};
use chrono::Utc;
use ferry_domain::environment::{Environment, SloObjective};
use ferry_domain::ports::sources::{DeploymentPolicy, DeploymentPolicyInput};
use ferry_domain::promotion::gates::{self, Readiness};
use ferry_domain::promotion::{
    ApprovalRequest, CheckKind, GateKind, GateOutcome, GateResult, Measurement, Promotion,
    PromotionCommand, PromotionState, VerificationOutcome,
};
use ferry_domain::release::Release;
use ferry_domain::run::{ProvisioningRun, RunCommand, RunError, RunEvent, RunRequest};
use ferry_domain::specification::{Declaration, DeploymentSpecification, SpecificationCommand};
use ferry_domain::values::Strategy as SpecStrategy;
use ferry_domain::{Actor, EnvironmentId, PromotionId, TenantId};
use ferry_domain::{
    ApprovalId, ProvisioningKind, ProvisioningRunId, ProvisioningState, SpecificationId,
    SpecificationKind,
};
use ferry_store::stream::Param;
use ferry_store::{on_pool, CommandError, Database, EventMetadata, LinkedWrite, Repository};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tracing::Instrument;

/// Why a pass of the driver stopped (it tries again on the next one).
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The read model could not be read.
    #[error(transparent)]
    Query(#[from] ferry_projections::queries::QueryError),
    /// The store failed.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    /// A command failed for a reason other than a refusal or a conflict.
    #[error("{0}")]
    Command(String),
}

fn command_error<E: std::error::Error + 'static>(e: CommandError<E>) -> DriverError {
    DriverError::Command(ferry_store::error_chain(&e))
}

/// The driver of promotions.
pub struct Driver {
    db: Database,
    promotions: Repository<Promotion>,
    releases: Repository<Release>,
    environments: Repository<Environment>,
    specifications: Repository<DeploymentSpecification>,
    runs: Repository<ProvisioningRun>,
    policy: Arc<dyn DeploymentPolicy>,
    settings: DriverSettings,
    /// Reaches Prometheus (the operator's).
    http: reqwest::Client,
    /// Reaches tenants' health URLs and smoke checks: public addresses only
    /// ([`super::probe`]); `Err` says why there is none.
    probes: Result<reqwest::Client, super::probe::NoProbeClient>,
}

/// What a promotion's gates are decided on.
struct GateFacts<'a> {
    tenant: &'a TenantId,
    request: &'a ferry_domain::promotion::PromotionRequest,
    /// The release as recorded (none: it is not).
    record: Option<&'a ferry_domain::release::ReleaseRecord>,
    withdrawn: bool,
    /// The policy's decision (none when the release is not recorded).
    decision: Option<
        &'a Result<
            ferry_domain::ports::sources::DeploymentDecision,
            ferry_domain::ports::sources::PolicyError,
        >,
    >,
}

/// How the driver behaves.
#[derive(Debug, Clone)]
pub struct DriverSettings {
    /// The promotion path, verification window and automatic rollback, as they are now:
    /// read at each use, so that a reload takes effect without a restart.
    pub options: watch::Receiver<crate::config::Reloadable>,
    /// The Prometheus HTTP API environments' SLO queries go to (`FERRY_PROMETHEUS_URL`).
    pub prometheus_url: Option<String>,
    /// What each tenant's probe URLs may reach.
    pub confinement: Arc<ferry_domain::confinement::Confinement>,
    /// How long a production approval may wait (never expires when unset).
    pub approval_expiry: Option<Duration>,
    /// How often to look when nothing wakes the driver.
    pub poll: Duration,
}

/// What a promotion awaiting (or holding) its approval does when the planned run stopped
/// waiting before it applied: a plan that went stale voids the approval, so that a new plan
/// asks anew; a run rejected (its own approval expired or refused), cancelled or failed ends
/// the promotion too, rather than planning again behind the Operator's back.
fn after_run_ended(
    state: ProvisioningState,
    at: chrono::DateTime<Utc>,
) -> Option<PromotionCommand> {
    match state {
        ProvisioningState::Superseded => Some(PromotionCommand::VoidApproval {
            reason: "the planned run was superseded: its inputs changed".to_string(),
            at,
        }),
        ProvisioningState::Rejected | ProvisioningState::Cancelled | ProvisioningState::Failed => {
            Some(PromotionCommand::Reject {
                reason: format!(
                    "the run planned for the approval was {} (its approval expired or was refused, or it was stopped)",
                    state.as_str()
                ),
                at,
            })
        }
        // Still on its way, or applied (the hand-off follows an applied run on its own).
        ProvisioningState::Requested
        | ProvisioningState::Planned
        | ProvisioningState::AwaitingApproval
        | ProvisioningState::Applying
        | ProvisioningState::Applied
        | ProvisioningState::InSync => None,
    }
}

/// Starts restoring `previous` in the environment of `request`'s promotion, the release
/// last completed there: requests the rollback promotion (named after the original, so a
/// repeat finds it; same gates, no approval), then records the rollback on the original.
/// Used by the driver (automatic) and the rollback endpoint (an Operator).
pub async fn start_rollback(
    promotions: &Repository<Promotion>,
    metadata: &EventMetadata,
    request: &ferry_domain::promotion::PromotionRequest,
    previous: ferry_domain::ReleaseId,
    automatic: bool,
    by: Actor,
    reason: String,
) -> Result<(), CommandError<ferry_domain::promotion::PromotionError>> {
    let tenant = &request.tenant_id;
    let original = request.promotion_id;
    let rollback = rollback_id(promotions, tenant, original).await?;
    let now = Utc::now();
    let rollback_request = ferry_domain::promotion::PromotionRequest {
        promotion_id: rollback,
        tenant_id: tenant.clone(),
        project_id: request.project_id.clone(),
        release_id: previous,
        environment_id: request.environment_id.clone(),
        environment_class: request.environment_class,
        strategy: request.strategy,
        run_id: None,
        hotfix: None,
        receipt_ref: None,
        previous_release_id: Some(request.release_id),
        rollback_of: Some(ferry_domain::promotion::RollbackOf {
            promotion_id: original,
            release_id: request.release_id,
            automatic,
            reason: reason.clone(),
        }),
        requested_by: by.clone(),
        requested_at: now,
    };
    match promotions
        .execute(
            tenant,
            &rollback.to_string(),
            PromotionCommand::Request(Box::new(rollback_request)),
            metadata,
            true,
        )
        .await
    {
        Ok(requested) => observe(&requested.aggregate, &requested.events),
        Err(CommandError::Domain(ferry_domain::promotion::PromotionError::AlreadyRequested)) => {}
        Err(e) => return Err(e),
    }
    let started = promotions
        .execute(
            tenant,
            &original.to_string(),
            PromotionCommand::StartRollback {
                rollback_promotion_id: rollback,
                restored_release_id: previous,
                automatic,
                by,
                reason,
                at: now,
            },
            metadata,
            false,
        )
        .await?;
    observe(&started.aggregate, &started.events);
    tracing::info!(promotion_id = %original, rollback = %rollback, automatic, "rollback started");
    Ok(())
}

/// The rollback promotion of `original`: the one a version before issue 37 named
/// ([`PromotionId::legacy_for_rollback`]) when it exists in this tenant and rolls `original`
/// back (a rollback under way across the upgrade), else the unambiguous name.
pub async fn rollback_id(
    promotions: &Repository<Promotion>,
    tenant: &TenantId,
    original: PromotionId,
) -> Result<PromotionId, CommandError<ferry_domain::promotion::PromotionError>> {
    let legacy = PromotionId::legacy_for_rollback(original);
    let found = promotions.load(tenant, &legacy.to_string()).await?;
    let rolls_back_original = found.is_some_and(|(p, _)| {
        p.request()
            .and_then(|r| r.rollback_of.as_ref())
            .is_some_and(|r| r.promotion_id == original)
    });
    Ok(if rolls_back_original {
        legacy
    } else {
        PromotionId::for_rollback(tenant, original)
    })
}

/// The hand-off run of `promotion`'s `attempt`: the one a version before issue 37 named
/// ([`ProvisioningRunId::legacy_for_promotion`]) when it exists in this tenant and is this
/// promotion's (a hand-off under way across the upgrade), else the unambiguous name.
pub async fn hand_off_run_id(
    runs: &Repository<ProvisioningRun>,
    tenant: &TenantId,
    promotion: PromotionId,
    attempt: u32,
) -> Result<ProvisioningRunId, DriverError> {
    let legacy = ProvisioningRunId::legacy_for_promotion(promotion, attempt);
    let found = runs
        .load(tenant, &legacy.to_string())
        .await
        .map_err(command_error)?;
    let ours = found.is_some_and(|(run, _)| {
        run.request()
            .is_some_and(|r| r.promotion_id == Some(promotion))
    });
    Ok(if ours {
        legacy
    } else {
        ProvisioningRunId::for_promotion(tenant, promotion, attempt)
    })
}

/// The promotions a pass had something to do with (failing ones among them stay reported).
type Live = std::collections::HashSet<(TenantId, PromotionId)>;

/// The driver's name among the loops whose failing items are reported
/// (`ferry_store::items`).
pub const LOOP: &str = "promotions";

/// The driver's identity in the events it causes.
fn actor() -> Actor {
    Actor::parse("system:promotions").unwrap_or_else(|_| unreachable!("a valid actor"))
}

impl Driver {
    /// A driver over `db`.
    pub fn new(db: Database, policy: Arc<dyn DeploymentPolicy>, settings: DriverSettings) -> Self {
        Self {
            promotions: Repository::new(db.clone(), ()),
            releases: Repository::new(db.clone(), ()),
            environments: Repository::new(db.clone(), ()),
            specifications: Repository::new(db.clone(), ()),
            runs: Repository::new(db.clone(), ()),
            db,
            policy,
            settings,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap_or_default(),
            probes: super::probe::client(Duration::from_secs(5)).inspect_err(|error| {
                tracing::error!(%error, "no URL will be probed");
            }),
        }
    }

    /// The verification window now.
    fn verification_window(&self) -> Duration {
        self.settings.options.borrow().verification_window
    }

    /// Runs passes until shutdown: after every commit to the store, and on the poll.
    pub fn start(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        tokio::spawn(
            async move {
                let mut commits = self.db.subscribe_commits();
                loop {
                    if *shutdown.borrow() {
                        break;
                    }
                    if let Err(error) = self.pass().await {
                        tracing::warn!(%error, "promotion pass failed; retrying");
                    }
                    tokio::select! {
                        _ = shutdown.changed() => {}
                        _ = commits.changed() => {}
                        _ = tokio::time::sleep(self.settings.poll) => {}
                    }
                }
            }
            .instrument(tracing::info_span!("promotions")),
        );
    }

    fn metadata(&self, tenant: &TenantId, promotion: PromotionId) -> EventMetadata {
        EventMetadata {
            tenant_id: tenant.clone(),
            actor: actor(),
            correlation_id: promotion.as_uuid(),
            causation_id: promotion.as_uuid(),
            request_id: uuid::Uuid::new_v4(),
        }
    }

    /// Runs `command` on the promotion. A refusal (it moved on) or a conflict (someone else
    /// moved it) is not an error: the next pass reads again.
    async fn command(
        &self,
        tenant: &TenantId,
        promotion: PromotionId,
        command: PromotionCommand,
        linked: Option<&LinkedWrite>,
    ) -> Result<bool, DriverError> {
        match self
            .promotions
            .execute_linked(
                tenant,
                &promotion.to_string(),
                command,
                &self.metadata(tenant, promotion),
                false,
                linked,
            )
            .await
        {
            Ok(executed) => {
                observe(&executed.aggregate, &executed.events);
                Ok(true)
            }
            Err(CommandError::Conflict | CommandError::Domain(_) | CommandError::NotFound) => {
                Ok(false)
            }
            Err(e) => Err(command_error(e)),
        }
    }

    /// Starts restoring `previous` (see [`start_rollback`]).
    async fn start_rollback(
        &self,
        tenant: &TenantId,
        request: &ferry_domain::promotion::PromotionRequest,
        previous: ferry_domain::ReleaseId,
        automatic: bool,
        by: Actor,
        reason: String,
    ) -> Result<(), DriverError> {
        let metadata = self.metadata(tenant, request.promotion_id);
        match start_rollback(
            &self.promotions,
            &metadata,
            request,
            previous,
            automatic,
            by,
            reason,
        )
        .await
        {
            Ok(()) | Err(CommandError::Conflict | CommandError::Domain(_)) => Ok(()),
            Err(e) => Err(command_error(e)),
        }
    }

    /// Tells the promotions being rolled back how their rollback ended: completed restores
    /// (the original ends rolled back), rejected or failed leaves the original failed (or,
    /// rolled back by hand, completed).
    async fn follow_rollbacks(&self, live: &mut Live) -> Result<(), DriverError> {
        for ended in views::ended_rollbacks(&self.db).await? {
            let views::EndedRollback {
                tenant,
                original,
                state,
            } = ended;
            if !self.due(&tenant, original) {
                live.insert((tenant, original));
                continue;
            }
            let view = match views::get_promotion(&self.db, &tenant, original).await {
                Ok(Some(view)) => view,
                Ok(None) => continue,
                Err(error) => {
                    live.insert((tenant.clone(), original));
                    self.settle(&tenant, original, Err(error.into()));
                    continue;
                }
            };
            if view
                .rollback
                .as_ref()
                .is_none_or(|r| r.outcome != views::RollbackOutcome::Running)
            {
                continue;
            }
            live.insert((tenant.clone(), original));
            let now = Utc::now();
            let command = if state == PromotionState::Completed {
                PromotionCommand::CompleteRollback { at: now }
            } else {
                PromotionCommand::FailRollback {
                    reason: format!("the rollback promotion ended {}", state.as_str()),
                    at: now,
                }
            };
            let ended = self.command(&tenant, original, command, None).await;
            if let Ok(true) = ended {
                tracing::info!(promotion_id = %original, rollback = state.as_str(), "rollback ended");
            }
            self.settle(&tenant, original, ended.map(|_| ()));
        }
        Ok(())
    }

    /// The promotion and its request, if it exists.
    async fn load(
        &self,
        tenant: &TenantId,
        promotion: PromotionId,
    ) -> Result<Option<(Promotion, ferry_domain::promotion::PromotionRequest)>, DriverError> {
        let loaded = self
            .promotions
            .load(tenant, &promotion.to_string())
            .await
            .map_err(command_error)?;
        Ok(loaded.and_then(|(aggregate, _)| {
            let request = aggregate.request().cloned()?;
            Some((aggregate, request))
        }))
    }

    /// One pass over every promotion with something to do. Promotions are independent, so
    /// each is taken on its own: one that fails is retried alone with a growing delay and
    /// says why (its view, the log, `/readyz`, `/metrics`), while the pass goes on with every
    /// other promotion (ARCHITECTURE.md, Invariants). Only a read of the whole list failing
    /// ends the pass.
    pub async fn pass(&self) -> Result<(), DriverError> {
        if let Err(error) = self.free_slots().await {
            tracing::warn!(%error, "freeing promotion slots failed; retrying on the next pass");
        }
        let mut live = Live::new();
        self.reject_withdrawn(&mut live).await?;
        self.follow_rollbacks(&mut live).await?;
        let mut started: HashSet<(TenantId, EnvironmentId)> = HashSet::new();
        for open in views::open_promotions(&self.db).await? {
            let views::OpenPromotion {
                tenant,
                promotion,
                environment,
                state,
            } = open;
            live.insert((tenant.clone(), promotion));
            if !self.due(&tenant, promotion) {
                continue;
            }
            let step = match state {
                PromotionState::Requested => {
                    // Request order: the oldest queued promotion that can take the
                    // environment does; once one did, the others wait for the next pass.
                    let slot = (tenant.clone(), environment.clone());
                    if started.contains(&slot) {
                        continue;
                    }
                    self.start_gates(&tenant, promotion, &environment)
                        .await
                        .map(|took| {
                            if took {
                                started.insert(slot);
                            }
                        })
                }
                PromotionState::GatesEvaluating => self.evaluate_gates(&tenant, promotion).await,
                PromotionState::AwaitingApproval => self.await_approval(&tenant, promotion).await,
                PromotionState::Approved => self.hand_off(&tenant, promotion).await,
                PromotionState::Deploying => self.follow_run(&tenant, promotion).await,
                PromotionState::Verifying => self.verify(&tenant, promotion).await,
                // Ended: nothing for the driver (the open list holds none of these).
                PromotionState::Completed
                | PromotionState::Rejected
                | PromotionState::Failed
                | PromotionState::RolledBack => Ok(()),
            };
            self.settle(&tenant, promotion, step);
        }
        // A promotion that failed and then ended another way (cancelled, rejected, decided
        // elsewhere) is no longer the driver's: it is not stuck.
        let gone = self.db.item_health().retain_live(LOOP, |tenant, item| {
            let (Ok(tenant), Ok(item)) = (TenantId::parse(tenant), PromotionId::parse(item)) else {
                return false;
            };
            live.contains(&(tenant, item))
        });
        for problem in gone {
            tracing::info!(
                tenant = %problem.tenant, promotion_id = %problem.item, attempts = problem.attempts,
                "promotion left the driver while failing; no longer reported as stuck"
            );
        }
        Ok(())
    }

    /// Whether `promotion` may be tried now: it is not failing, or its delay has passed.
    fn due(&self, tenant: &TenantId, promotion: PromotionId) -> bool {
        self.db
            .item_health()
            .due(LOOP, tenant.as_str(), &promotion.to_string())
    }

    /// Records how a step of `promotion` went: a failure is the promotion's own (retried
    /// alone, with a growing delay), a success clears it.
    fn settle(&self, tenant: &TenantId, promotion: PromotionId, step: Result<(), DriverError>) {
        let health = self.db.item_health();
        let item = promotion.to_string();
        match step {
            Ok(()) => {
                if let Some(problem) = health.succeeded(LOOP, tenant.as_str(), &item) {
                    tracing::info!(
                        %tenant, promotion_id = %promotion, attempts = problem.attempts,
                        "promotion no longer fails"
                    );
                }
            }
            Err(error) => {
                let problem = health.failed(LOOP, tenant.as_str(), &item, &error.to_string());
                tracing::warn!(
                    %tenant, promotion_id = %promotion, %error, attempts = problem.attempts,
                    next_attempt_at = %problem.next_attempt_at,
                    "promotion step failed; it alone is retried later"
                );
            }
        }
    }

    /// Lets go of the environment slots of promotions that no longer hold them.
    async fn free_slots(&self) -> Result<(), DriverError> {
        let sql = self.db.sql(
            "DELETE FROM promotion_slots WHERE promotion_id IN (
                 SELECT promotion_id FROM rm_promotions
                  WHERE state IN ('Completed', 'Rejected', 'Failed', 'RolledBack'))",
        );
        on_pool!(self.db, pool => sqlx::query(&sql).execute(pool).await.map(|_| ())?);
        Ok(())
    }

    /// Rejects promotions of withdrawn releases that are not deploying yet.
    async fn reject_withdrawn(&self, live: &mut Live) -> Result<(), DriverError> {
        for (tenant, promotion) in views::withdrawn_open_promotions(&self.db).await? {
            live.insert((tenant.clone(), promotion));
            if !self.due(&tenant, promotion) {
                continue;
            }
            let rejected = self
                .command(
                    &tenant,
                    promotion,
                    PromotionCommand::Reject {
                        reason: "the release was withdrawn".to_string(),
                        at: Utc::now(),
                    },
                    None,
                )
                .await;
            if let Ok(true) = rejected {
                tracing::info!(promotion_id = %promotion, "promotion of a withdrawn release rejected");
            }
            self.settle(&tenant, promotion, rejected.map(|_| ()));
        }
        Ok(())
    }

    /// Starts the gates by taking the environment's slot in the same transaction; a
    /// rollback takes over the slot of the promotion it rolls back. True when it started.
    async fn start_gates(
        &self,
        tenant: &TenantId,
        promotion: PromotionId,
        environment: &EnvironmentId,
    ) -> Result<bool, DriverError> {
        let Some((_, request)) = self.load(tenant, promotion).await? else {
            return Ok(false);
        };
        let holder = request
            .rollback_of
            .as_ref()
            .map_or(promotion, |r| r.promotion_id);
        let slot = LinkedWrite {
            sql: "INSERT INTO promotion_slots (tenant_id, environment_id, promotion_id)
                  VALUES ($1, $2, $3)
                  ON CONFLICT (tenant_id, environment_id)
                  DO UPDATE SET promotion_id = excluded.promotion_id
                  WHERE promotion_slots.promotion_id = $4"
                .to_string(),
            params: vec![
                Param::Text(Some(tenant.to_string())),
                Param::Text(Some(environment.to_string())),
                Param::Text(Some(promotion.to_string())),
                Param::Text(Some(holder.to_string())),
            ],
            expect_rows: 1,
        };
        let started = self
            .command(
                tenant,
                promotion,
                PromotionCommand::StartGates { at: Utc::now() },
                Some(&slot),
            )
            .await?;
        if started {
            tracing::info!(promotion_id = %promotion, %environment, "gates started");
        }
        Ok(started)
    }

    /// Records the promotion's next gates, in order, until one fails or all passed.
    async fn evaluate_gates(
        &self,
        tenant: &TenantId,
        promotion: PromotionId,
    ) -> Result<(), DriverError> {
        let Some((aggregate, request)) = self.load(tenant, promotion).await? else {
            return Ok(());
        };
        let mut recorded: Vec<GateResult> = aggregate.gates().to_vec();
        let release = self
            .releases
            .load(tenant, &Release::aggregate_id(tenant, request.release_id))
            .await
            .map_err(command_error)?;
        let record = release.as_ref().and_then(|(r, _)| r.record().cloned());
        let withdrawn = release.as_ref().is_some_and(|(r, _)| r.is_withdrawn());
        let decision = match &record {
            Some(record) => Some(self.policy.evaluate_promotion(&DeploymentPolicyInput {
                environment_id: request.environment_id.to_string(),
                environment_class: Some(request.environment_class),
                project_id: request.project_id.to_string(),
                release_id: request.release_id.to_string(),
                release_version: record.version.to_string(),
                hotfix: request.hotfix.as_ref().map(|h| h.reason.clone()),
                rollback: request.rollback_of.is_some(),
                has_agent_generated_assets: record.has_agent_generated_assets,
            })),
            None => None,
        };
        for kind in GateKind::ORDER.iter().skip(recorded.len()) {
            let now = Utc::now();
            let facts = GateFacts {
                tenant,
                request: &request,
                record: record.as_ref(),
                withdrawn,
                decision: decision.as_ref(),
            };
            let gate = self.gate(*kind, &facts, now).await?;
            let failed = gate.outcome == GateOutcome::Failed;
            recorded.push(gate.clone());
            let applied = self
                .command(
                    tenant,
                    promotion,
                    PromotionCommand::RecordGate(Box::new(gate)),
                    None,
                )
                .await?;
            if !applied {
                // Someone else moved it; read again on the next pass.
                return Ok(());
            }
            if failed {
                tracing::info!(promotion_id = %promotion, gate = kind.as_str(), "gate failed; promotion rejected");
                return Ok(());
            }
        }
        let approval = recorded
            .iter()
            .find(|g| g.kind == GateKind::Policy)
            .is_some_and(|g| g.evidence["decision"] == "require_approval");
        if self
            .command(
                tenant,
                promotion,
                PromotionCommand::PassGates {
                    policy_requires_approval: approval,
                    at: Utc::now(),
                },
                None,
            )
            .await?
        {
            tracing::info!(promotion_id = %promotion, "gates passed");
        }
        Ok(())
    }

    /// The result of gate `kind` now.
    async fn gate(
        &self,
        kind: GateKind,
        facts: &GateFacts<'_>,
        now: chrono::DateTime<Utc>,
    ) -> Result<GateResult, DriverError> {
        Ok(match (kind, facts.record) {
            (_, None) => GateResult {
                kind,
                outcome: GateOutcome::Failed,
                reasons: vec![format!(
                    "release {} is not recorded",
                    facts.request.release_id
                )],
                evidence: serde_json::json!({"releaseId": facts.request.release_id}),
                evaluated_at: now,
            },
            (GateKind::PipelineResults, Some(record)) => {
                gates::pipeline_results(record, facts.withdrawn, now)
            }
            (GateKind::Policy, Some(_)) => match facts.decision {
                Some(Ok(decision)) => gates::policy(decision, now).0,
                // Failing safe: a policy that cannot decide lets nothing through.
                Some(Err(error)) => GateResult {
                    kind,
                    outcome: GateOutcome::Failed,
                    reasons: vec![format!("policy could not decide: {error}")],
                    evidence: serde_json::json!({"error": error.to_string()}),
                    evaluated_at: now,
                },
                None => GateResult {
                    kind,
                    outcome: GateOutcome::Failed,
                    reasons: vec!["policy was not evaluated".to_string()],
                    evidence: serde_json::Value::Null,
                    evaluated_at: now,
                },
            },
            (GateKind::PriorEnvironment, Some(_)) => {
                let completions =
                    views::completions(&self.db, facts.tenant, facts.request.release_id).await?;
                let hotfix_allowed = match facts.decision {
                    Some(Ok(d)) => d.hotfix_allowed.clone(),
                    _ => Vec::new(),
                };
                gates::prior_environment(
                    &self.settings.options.borrow().promotion_path.clone(),
                    facts.request.environment_class,
                    &completions,
                    facts.request.hotfix.as_ref(),
                    &hotfix_allowed,
                    now,
                )
            }
            (GateKind::EnvironmentReady, Some(_)) => {
                let readiness = self
                    .readiness(facts.tenant, &facts.request.environment_id)
                    .await?;
                match (&facts.request.rollback_of, &readiness) {
                    // A rollback restores an environment whose health failed; only the
                    // environment service saying it cannot take changes stops it.
                    (Some(rollback), Readiness::Probed { .. }) => GateResult {
                        kind,
                        outcome: GateOutcome::NotApplicable,
                        reasons: vec![format!(
                            "a rollback of release {} restores the environment whose health failed; verification measures it after",
                            rollback.release_id
                        )],
                        evidence: serde_json::json!(readiness),
                        evaluated_at: now,
                    },
                    _ => gates::environment_ready(&facts.request.environment_id, &readiness, now),
                }
            }
            (GateKind::EvaluationEvidence, Some(record)) => gates::evaluation_evidence(record, now),
        })
    }

    /// The promotion's run of this attempt, requested now if it does not exist yet: a new
    /// version of the environment's `Workload` specification from the release (program,
    /// commit, release, strategy), and a `Release` run of it carrying the promotion's id.
    /// `None` when someone else is creating it (the next pass finds it).
    async fn ensure_run(
        &self,
        tenant: &TenantId,
        promotion: PromotionId,
        request: &ferry_domain::promotion::PromotionRequest,
        run_id: ProvisioningRunId,
        rollback: Option<ferry_domain::run::VerifiedRollback>,
    ) -> Result<Option<(ProvisioningRun, String)>, DriverError> {
        if let Some((run, _)) = self
            .runs
            .load(tenant, &run_id.to_string())
            .await
            .map_err(command_error)?
        {
            // Only this promotion's own run is ever handed its approval.
            if run
                .request()
                .is_none_or(|r| r.promotion_id != Some(promotion))
            {
                return Err(DriverError::Command(format!(
                    "run {run_id} is not this promotion's hand-off run"
                )));
            }
            let desired = run
                .request()
                .map(|r| format!("{}@{}", r.specification_id, r.specification_version))
                .unwrap_or_default();
            return Ok(Some((run, desired)));
        }
        let Some((release, _)) = self
            .releases
            .load(tenant, &Release::aggregate_id(tenant, request.release_id))
            .await
            .map_err(command_error)?
        else {
            return Ok(None);
        };
        let Some(record) = release.record().cloned() else {
            return Ok(None);
        };
        let specification_id = SpecificationId::for_environment(
            tenant,
            &request.environment_id,
            SpecificationKind::Workload,
        );
        let metadata = self.metadata(tenant, promotion);
        let declared = self
            .specifications
            .execute(
                tenant,
                &specification_id.to_string(),
                SpecificationCommand::Declare(Box::new(Declaration {
                    specification_id,
                    tenant_id: tenant.clone(),
                    project_id: request.project_id.clone(),
                    environment_id: request.environment_id.clone(),
                    kind: SpecificationKind::Workload,
                    program_ref: record.program_ref.clone(),
                    program_version: record.program_version.clone(),
                    release_id: Some(request.release_id),
                    strategy: SpecStrategy::parse(request.strategy.as_str()).ok(),
                    config_refs: Default::default(),
                    secret_refs: Default::default(),
                    declared_by: actor(),
                    declared_at: Utc::now(),
                })),
                &metadata,
                true,
            )
            .await;
        let version = match declared {
            Ok(done) => done.aggregate.latest().map_or(1, |v| v.version),
            Err(CommandError::Conflict) => return Ok(None),
            Err(e) => return Err(command_error(e)),
        };
        let run = RunRequest {
            provisioning_run_id: run_id,
            tenant_id: tenant.clone(),
            project_id: request.project_id.clone(),
            environment_id: request.environment_id.clone(),
            environment_class: Some(request.environment_class),
            specification_id,
            specification_version: version,
            kind: ProvisioningKind::Release,
            promotion_id: Some(promotion),
            approval_id: None,
            follows_failed_apply: None,
            requested_by: actor(),
            requested_at: Utc::now(),
        };
        // A rollback's run carries the rollback's own authority, so that it applies in
        // production without an approval nobody could give.
        let command = match rollback {
            Some(authority) => RunCommand::RequestForRollback {
                request: Box::new(run),
                authority: Box::new(authority),
            },
            None => RunCommand::Request(Box::new(run)),
        };
        match self
            .runs
            .execute(tenant, &run_id.to_string(), command, &metadata, true)
            .await
        {
            Ok(done) => Ok(Some((
                done.aggregate,
                format!("{specification_id}@{version}"),
            ))),
            Err(CommandError::Domain(RunError::AlreadyRequested) | CommandError::Conflict) => {
                Ok(None)
            }
            Err(e) => Err(command_error(e)),
        }
    }

    /// Hands an approved promotion's desired state to provisioning. Without an approval
    /// (below production) the run is requested now and applies as policy allows; with one,
    /// the run planned for the approval is approved with the promotion's approval (its id
    /// and approver, which Ferry holds) and handed over.
    async fn hand_off(&self, tenant: &TenantId, promotion: PromotionId) -> Result<(), DriverError> {
        let Some((aggregate, request)) = self.load(tenant, promotion).await? else {
            return Ok(());
        };
        let run_id = match aggregate.provisioning_run_id() {
            Some(run_id) => run_id,
            None => hand_off_run_id(&self.runs, tenant, promotion, aggregate.attempt()).await?,
        };
        let Some((run, desired)) = self
            .ensure_run(
                tenant,
                promotion,
                &request,
                run_id,
                aggregate.verified_rollback(),
            )
            .await?
        else {
            return Ok(());
        };
        if let Some((approval, plan_inputs_hash)) = aggregate.verified_approval() {
            match run.state() {
                Some(ProvisioningState::AwaitingApproval) => {
                    let granted = self
                        .runs
                        .execute(
                            tenant,
                            &run_id.to_string(),
                            RunCommand::ApproveForPromotion {
                                approval: Box::new(approval),
                                plan_inputs_hash,
                                at: Utc::now(),
                            },
                            &self.metadata(tenant, promotion),
                            false,
                        )
                        .await;
                    match granted {
                        Ok(_) => {}
                        Err(CommandError::Conflict) => return Ok(()),
                        // The plan is not the one approved: ask anew.
                        Err(CommandError::Domain(RunError::PromotionApprovalMismatch(what))) => {
                            self.command(
                                tenant,
                                promotion,
                                PromotionCommand::VoidApproval {
                                    reason: format!("the approval does not match the run's {what}"),
                                    at: Utc::now(),
                                },
                                None,
                            )
                            .await?;
                            return Ok(());
                        }
                        Err(e) => return Err(command_error(e)),
                    }
                }
                Some(
                    ProvisioningState::Applying
                    | ProvisioningState::Applied
                    | ProvisioningState::Failed,
                ) => {}
                Some(other) => {
                    if let Some(command) = after_run_ended(other, Utc::now()) {
                        self.command(tenant, promotion, command, None).await?;
                    }
                    return Ok(());
                }
                None => return Ok(()),
            }
        }
        let desired = aggregate
            .desired_state_ref()
            .map(str::to_string)
            .unwrap_or(desired);
        if self
            .command(
                tenant,
                promotion,
                PromotionCommand::HandOff {
                    desired_state_ref: desired,
                    provisioning_run_id: run_id,
                    at: Utc::now(),
                },
                None,
            )
            .await?
        {
            tracing::info!(promotion_id = %promotion, provisioning_run_id = %run_id, "desired state handed to provisioning");
        }
        Ok(())
    }

    /// A promotion waiting for its production approval: plans first (its run of this
    /// attempt), then asks for the approval bound to that plan's inputs hash. While it
    /// waits, an expired approval rejects it, and a plan that ended (superseded by changed
    /// inputs, say) voids the approval so that a new plan asks anew.
    async fn await_approval(
        &self,
        tenant: &TenantId,
        promotion: PromotionId,
    ) -> Result<(), DriverError> {
        let Some((aggregate, request)) = self.load(tenant, promotion).await? else {
            return Ok(());
        };
        let now = Utc::now();
        if let Some(pending) = aggregate.approval().cloned() {
            if pending.expires_at.is_some_and(|at| now >= at) {
                self.command(
                    tenant,
                    promotion,
                    PromotionCommand::ExpireApproval { at: now },
                    None,
                )
                .await?;
                return Ok(());
            }
            let run = self
                .runs
                .load(tenant, &pending.provisioning_run_id.to_string())
                .await
                .map_err(command_error)?;
            let state = run.as_ref().and_then(|(r, _)| r.state());
            // The run's own approval expired first (both expiries are set from one setting
            // a few milliseconds apart): the promotion's approval expired too.
            let expired = run.as_ref().is_some_and(|(r, _)| {
                r.approval().is_some_and(|a| {
                    a.decided_by.as_str()
                        == format!("system:{}", ferry_domain::run::APPROVAL_EXPIRY_WORKER)
                })
            });
            if expired && state == Some(ProvisioningState::Rejected) {
                let command = PromotionCommand::ExpireApproval { at: now };
                self.command(tenant, promotion, command, None).await?;
                return Ok(());
            }
            if let Some(command) = state.and_then(|state| after_run_ended(state, now)) {
                self.command(tenant, promotion, command, None).await?;
            }
            return Ok(());
        }
        let run_id = hand_off_run_id(&self.runs, tenant, promotion, aggregate.attempt()).await?;
        let Some((run, desired)) = self
            .ensure_run(tenant, promotion, &request, run_id, None)
            .await?
        else {
            return Ok(());
        };
        match (run.state(), run.plan_receipt()) {
            (Some(ProvisioningState::AwaitingApproval), Some(plan)) => {
                let approval = ApprovalRequest {
                    approval_id: ApprovalId::new_random(),
                    desired_state_ref: desired,
                    provisioning_run_id: run_id,
                    plan_inputs_hash: plan.inputs_hash.clone(),
                    requested_at: now,
                    expires_at: self
                        .settings
                        .approval_expiry
                        .and_then(|d| chrono::Duration::from_std(d).ok())
                        .map(|d| now + d),
                };
                if self
                    .command(
                        tenant,
                        promotion,
                        PromotionCommand::RequestApproval(Box::new(approval)),
                        None,
                    )
                    .await?
                {
                    tracing::info!(promotion_id = %promotion, provisioning_run_id = %run_id, "approval asked for, with the plan");
                }
            }
            (
                Some(
                    state @ (ProvisioningState::Failed
                    | ProvisioningState::Rejected
                    | ProvisioningState::Cancelled
                    | ProvisioningState::Superseded),
                ),
                _,
            ) => {
                self.command(
                    tenant,
                    promotion,
                    PromotionCommand::Reject {
                        reason: format!("the plan for the approval ended {}", state.as_str()),
                        at: now,
                    },
                    None,
                )
                .await?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Follows a deploying promotion's run: applied starts verification, a run that ended
    /// otherwise fails the promotion with provisioning's reason.
    async fn follow_run(
        &self,
        tenant: &TenantId,
        promotion: PromotionId,
    ) -> Result<(), DriverError> {
        let Some((aggregate, _)) = self
            .promotions
            .load(tenant, &promotion.to_string())
            .await
            .map_err(command_error)?
        else {
            return Ok(());
        };
        let Some(run_id) = aggregate.provisioning_run_id() else {
            return Ok(());
        };
        let Some(events) = self
            .runs
            .load_events(tenant, &run_id.to_string())
            .await
            .map_err(command_error)?
        else {
            return Ok(());
        };
        let mut state = None;
        let mut reason = None;
        for event in &events {
            match event {
                RunEvent::ProvisioningApplied { .. } => state = Some(true),
                RunEvent::ProvisioningFailed { reason: r, .. } => {
                    state = Some(false);
                    reason = Some(r.clone());
                }
                RunEvent::ApprovalRejected { .. } => {
                    state = Some(false);
                    reason = Some("the run's approval was rejected".to_string());
                }
                RunEvent::ProvisioningCancelled { .. } => {
                    state = Some(false);
                    reason = Some("the run was cancelled".to_string());
                }
                RunEvent::ProvisioningSuperseded { .. } => {
                    state = Some(false);
                    reason = Some("the run's plan went stale and was superseded".to_string());
                }
                _ => {}
            }
        }
        let now = Utc::now();
        let command = match state {
            None => return Ok(()),
            Some(true) => PromotionCommand::RecordApplied {
                provisioning_run_id: run_id,
                at: now,
                verification_ends_at: now
                    + chrono::Duration::from_std(self.verification_window()).unwrap_or_default(),
            },
            Some(false) => PromotionCommand::RecordDeploymentFailed {
                provisioning_run_id: run_id,
                reason: reason.unwrap_or_else(|| "provisioning failed".to_string()),
                at: now,
            },
        };
        if self.command(tenant, promotion, command, None).await? {
            tracing::info!(promotion_id = %promotion, applied = ?state, "provisioning reported");
        }
        Ok(())
    }

    /// Verification: a round of checks every tenth of the window (at least every second, at
    /// most every minute), each measurement kept; a check the release fails fails
    /// verification, one that cannot run holds it (error), a window of passing rounds
    /// completes the promotion, and nothing to check holds it (inconclusive).
    async fn verify(&self, tenant: &TenantId, promotion: PromotionId) -> Result<(), DriverError> {
        // From the aggregate, not the read model: a pass woken by this driver's own last
        // measurement must see it, or it would measure (and run the smoke suite) again.
        let Some(view) = self
            .promotions
            .load_events(tenant, &promotion.to_string())
            .await
            .map_err(command_error)?
            .and_then(|events| views::PromotionView::from_events(&events))
        else {
            return Ok(());
        };
        let now = Utc::now();
        match view.verification.outcome {
            Some(VerificationOutcome::Failed) => {
                return self.verification_failed(tenant, promotion, &view).await;
            }
            Some(_) => return Ok(()),
            None => {}
        }
        let ends = view.verification.window_ends_at.unwrap_or(now);
        let every = (self.verification_window() / 10)
            .clamp(Duration::from_secs(1), Duration::from_secs(60));
        let last = view.verification.measurements.last().map(|m| m.measured_at);
        let due =
            last.is_none_or(|t| now.signed_duration_since(t).to_std().unwrap_or_default() >= every);
        let conclude = |outcome, reason: String| PromotionCommand::ConcludeVerification {
            outcome,
            reason,
            by: None,
            at: now,
        };
        let mut taken = 0;
        if due {
            let checks = self.checks(tenant, &view).await?;
            if checks.is_empty() {
                self.command(
                    tenant,
                    promotion,
                    conclude(
                        VerificationOutcome::Inconclusive,
                        "nothing to check: the environment has no health URL or SLO and the release no smoke checks; an Operator decides"
                            .to_string(),
                    ),
                    None,
                )
                .await?;
                return Ok(());
            }
            let first_round = view.verification.measurements.is_empty();
            let measurements = checks
                .measure(
                    self.probes.as_ref(),
                    &self.http,
                    self.settings.prometheus_url.as_deref(),
                    first_round,
                    now,
                )
                .await;
            for measurement in &measurements {
                if !self
                    .command(
                        tenant,
                        promotion,
                        PromotionCommand::Measure(Box::new(measurement.clone())),
                        None,
                    )
                    .await?
                {
                    return Ok(());
                }
                taken += 1;
            }
            let verdict = verdict(&measurements);
            if let Some((outcome, reason)) = verdict {
                self.command(tenant, promotion, conclude(outcome, reason), None)
                    .await?;
                return Ok(());
            }
        }
        let count = view.verification.measurements.len() + taken;
        if now < ends || count == 0 {
            return Ok(());
        }
        let passed = conclude(
            VerificationOutcome::Passed,
            format!("{count} measurements passed through the window"),
        );
        if self.command(tenant, promotion, passed, None).await? {
            tracing::info!(promotion_id = %promotion, "verified; promotion completed");
        }
        Ok(())
    }

    /// After a failed verification: a rollback to the release completed here before
    /// (automatic rollback on, and this is no rollback itself), or the promotion fails.
    async fn verification_failed(
        &self,
        tenant: &TenantId,
        promotion: PromotionId,
        view: &views::PromotionView,
    ) -> Result<(), DriverError> {
        let reason = format!(
            "verification failed: {}",
            view.verification.reason.as_deref().unwrap_or("no reason")
        );
        // A rollback under way is followed from the rollback promotion's side.
        if view.rollback.is_some() {
            return Ok(());
        }
        let Some((_, request)) = self.load(tenant, promotion).await? else {
            return Ok(());
        };
        match request.previous_release_id {
            // Restore the release that completed here before, through a promotion of its
            // own (same gates, no approval), unless this is a rollback.
            Some(previous)
                if self.settings.options.borrow().auto_rollback
                    && request.rollback_of.is_none() =>
            {
                self.start_rollback(tenant, &request, previous, true, actor(), reason)
                    .await?;
            }
            _ => {
                let fail = PromotionCommand::Fail {
                    reason,
                    at: Utc::now(),
                };
                self.command(tenant, promotion, fail, None).await?;
            }
        }
        Ok(())
    }

    /// What verification checks for `view`: the environment's health URL and objective, the
    /// release's smoke suite.
    async fn checks(
        &self,
        tenant: &TenantId,
        view: &views::PromotionView,
    ) -> Result<verification::Checks, DriverError> {
        let environment = self
            .environments
            .load(
                tenant,
                &Environment::aggregate_id(tenant, &view.environment_id),
            )
            .await
            .map_err(command_error)?;
        let registration = environment.as_ref().and_then(|(e, _)| e.registration());
        let release = self
            .releases
            .load(tenant, &Release::aggregate_id(tenant, view.release_id))
            .await
            .map_err(command_error)?;
        let mut checks = verification::Checks::default();
        // The query sent is the tenant's confined one, checked with the rules as they are now.
        if let Some(objective) = registration.and_then(|r| r.slo.clone()) {
            match self
                .settings
                .confinement
                .confine_query(tenant, &objective.query)
            {
                Ok(query) => checks.slo = Some(SloObjective { query, ..objective }),
                Err(refusal) => {
                    checks
                        .refused
                        .push((CheckKind::Slo, objective.query, refusal.to_string()))
                }
            }
        }
        // Checked again before each request: the prefixes may have narrowed since.
        let confined = |url: &str| {
            ferry_domain::ProbeUrl::parse(url.to_string())
                .map_err(|e| e.to_string())
                .and_then(|u| {
                    self.settings
                        .confinement
                        .check_probe(tenant, &u)
                        .map_err(|r| r.to_string())
                })
        };
        if let Some(url) = registration.and_then(|r| r.health_url.clone()) {
            match confined(&url) {
                Ok(()) => checks.health_url = Some(url),
                Err(reason) => checks.refused.push((CheckKind::Health, url, reason)),
            }
        }
        let smoke = release
            .as_ref()
            .and_then(|(r, _)| r.record())
            .map(|r| r.smoke_checks.clone())
            .unwrap_or_default();
        for check in smoke {
            match confined(check.url.as_str()) {
                Ok(()) => checks.smoke.push(check),
                Err(reason) => checks.refused.push((CheckKind::Smoke, check.name, reason)),
            }
        }
        Ok(checks)
    }

    /// The environment's readiness: the environment service's last report, else a probe
    /// of its health URL.
    async fn readiness(
        &self,
        tenant: &TenantId,
        environment: &EnvironmentId,
    ) -> Result<Readiness, DriverError> {
        let loaded = self
            .environments
            .load(tenant, &Environment::aggregate_id(tenant, environment))
            .await
            .map_err(command_error)?;
        let Some((environment, _)) = loaded else {
            return Ok(Readiness::Unknown {
                reason: "the environment is not recorded".to_string(),
            });
        };
        if let Some((state, observed_at)) = environment.reported_state() {
            return Ok(Readiness::Reported {
                ready: environment.is_ready(),
                state: state.to_string(),
                observed_at,
            });
        }
        let Some(url) = environment
            .registration()
            .and_then(|r| r.health_url.clone())
        else {
            return Ok(Readiness::Unknown {
                reason: "no readiness was reported and it has no health URL to probe".to_string(),
            });
        };
        // The same rules as verification's probes: the URL as recorded may no longer pass.
        let confined = ferry_domain::ProbeUrl::parse(url.clone())
            .map_err(|e| e.to_string())
            .and_then(|u| {
                self.settings
                    .confinement
                    .check_probe(tenant, &u)
                    .map_err(|r| r.to_string())
            });
        let not_probed = |reason: &str| Readiness::Unknown {
            reason: format!("its health URL is not probed: {reason}"),
        };
        let client = match (confined, &self.probes) {
            (Ok(()), Ok(client)) => client,
            (Err(reason), _) => return Ok(not_probed(&reason)),
            (_, Err(reason)) => return Ok(not_probed(&reason.to_string())),
        };
        Ok(match client.get(&url).send().await {
            Ok(response) => Readiness::Probed {
                url,
                status: Some(response.status().as_u16()),
                error: None,
            },
            Err(e) => match super::probe::refused(&e) {
                Some(reason) => not_probed(&reason),
                None => Readiness::Probed {
                    url,
                    status: None,
                    error: Some(e.to_string()),
                },
            },
        })
    }
}

/// The verdict a round of measurements gives, if any: the release's fault first; then a
/// check that could not run holds it for an Operator.
fn verdict(measurements: &[Measurement]) -> Option<(VerificationOutcome, String)> {
    let failed = measurements.iter().find(|m| m.passed == Some(false));
    let broken = measurements.iter().find(|m| m.passed.is_none());
    match (failed, broken) {
        (Some(m), _) => Some((
            VerificationOutcome::Failed,
            format!(
                "the {} check {} measured {} (must be {})",
                m.kind.as_str(),
                m.name,
                m.value,
                m.threshold.as_deref().unwrap_or("met")
            ),
        )),
        (None, Some(m)) => Some((
            VerificationOutcome::Error,
            format!(
                "the {} check {} could not run ({}); an Operator decides",
                m.kind.as_str(),
                m.name,
                m.value
            ),
        )),
        (None, None) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_domain::promotion::{PromotionRequest, RollbackOf};
    use ferry_domain::{EnvironmentClass, ProjectId, ReleaseId};
    use ferry_store::testing::TestDatabase;

    fn metadata(tenant: &TenantId, id: uuid::Uuid) -> EventMetadata {
        EventMetadata {
            tenant_id: tenant.clone(),
            actor: actor(),
            correlation_id: id,
            causation_id: id,
            request_id: uuid::Uuid::new_v4(),
        }
    }

    /// A `Release` run of `tenant` stored under `id`, carrying `promotion`.
    async fn run_under(
        runs: &Repository<ProvisioningRun>,
        tenant: &TenantId,
        id: ProvisioningRunId,
        promotion: Option<PromotionId>,
    ) {
        let request = RunRequest {
            provisioning_run_id: id,
            tenant_id: tenant.clone(),
            project_id: ProjectId::parse("payments").unwrap(),
            environment_id: EnvironmentId::parse("payments-dev").unwrap(),
            environment_class: Some(EnvironmentClass::Development),
            specification_id: SpecificationId::new_random(),
            specification_version: 1,
            kind: ProvisioningKind::Release,
            promotion_id: promotion,
            approval_id: None,
            follows_failed_apply: None,
            requested_by: actor(),
            requested_at: Utc::now(),
        };
        runs.execute(
            tenant,
            &id.to_string(),
            RunCommand::Request(Box::new(request)),
            &metadata(tenant, id.as_uuid()),
            true,
        )
        .await
        .unwrap();
    }

    ferry_store::test_on_both_engines! {
        async fn a_hand_off_under_way_across_the_upgrade_finds_its_old_named_run(backend) {
            let t = TestDatabase::new(backend).await;
            let runs: Repository<ProvisioningRun> = Repository::new(t.db.clone(), ());
            let acme = TenantId::parse("acme").unwrap();
            let (p, q, r) = (PromotionId::new_random(), PromotionId::new_random(), PromotionId::new_random());
            // Nothing stored under the old name: the new one.
            assert_eq!(
                hand_off_run_id(&runs, &acme, p, 0).await.unwrap(),
                ProvisioningRunId::for_promotion(&acme, p, 0)
            );
            // The old driver made p's hand-off run: its events are found under the old id.
            let old = ProvisioningRunId::legacy_for_promotion(p, 0);
            run_under(&runs, &acme, old, Some(p)).await;
            assert_eq!(hand_off_run_id(&runs, &acme, p, 0).await.unwrap(), old, "{backend:?}");
            assert_eq!(
                hand_off_run_id(&runs, &acme, p, 1).await.unwrap(),
                ProvisioningRunId::for_promotion(&acme, p, 1)
            );
            // A run another tenant took under q's old name (tenant `promotion`, key
            // `<q>/0`) is never acme's hand-off, nor one of acme's that is not q's.
            let promotion = TenantId::parse("promotion").unwrap();
            run_under(&runs, &promotion, ProvisioningRunId::legacy_for_promotion(q, 0), None).await;
            assert_eq!(
                hand_off_run_id(&runs, &acme, q, 0).await.unwrap(),
                ProvisioningRunId::for_promotion(&acme, q, 0)
            );
            run_under(&runs, &acme, ProvisioningRunId::legacy_for_promotion(r, 0), Some(p)).await;
            assert_eq!(
                hand_off_run_id(&runs, &acme, r, 0).await.unwrap(),
                ProvisioningRunId::for_promotion(&acme, r, 0)
            );
            t.cleanup().await;
        }
    }

    ferry_store::test_on_both_engines! {
        async fn a_rollback_under_way_across_the_upgrade_finds_its_old_named_promotion(backend) {
            let t = TestDatabase::new(backend).await;
            let promotions: Repository<Promotion> = Repository::new(t.db.clone(), ());
            let acme = TenantId::parse("acme").unwrap();
            let (original, other) = (PromotionId::new_random(), PromotionId::new_random());
            assert_eq!(
                rollback_id(&promotions, &acme, original).await.unwrap(),
                PromotionId::for_rollback(&acme, original)
            );
            let old = PromotionId::legacy_for_rollback(original);
            let request = |rolls_back: PromotionId| PromotionRequest {
                promotion_id: old,
                tenant_id: acme.clone(),
                project_id: ProjectId::parse("payments").unwrap(),
                release_id: ReleaseId::new_random(),
                environment_id: EnvironmentId::parse("payments-dev").unwrap(),
                environment_class: EnvironmentClass::Development,
                strategy: Default::default(),
                run_id: None,
                hotfix: None,
                receipt_ref: None,
                previous_release_id: None,
                rollback_of: Some(RollbackOf {
                    promotion_id: rolls_back,
                    release_id: ReleaseId::new_random(),
                    automatic: true,
                    reason: "verification failed".to_string(),
                }),
                requested_by: actor(),
                requested_at: Utc::now(),
            };
            promotions
                .execute(
                    &acme,
                    &old.to_string(),
                    PromotionCommand::Request(Box::new(request(original))),
                    &metadata(&acme, old.as_uuid()),
                    true,
                )
                .await
                .unwrap();
            assert_eq!(rollback_id(&promotions, &acme, original).await.unwrap(), old, "{backend:?}");
            // Another tenant never finds it.
            let globex = TenantId::parse("globex").unwrap();
            assert_eq!(
                rollback_id(&promotions, &globex, original).await.unwrap(),
                PromotionId::for_rollback(&globex, original)
            );
            assert_eq!(
                rollback_id(&promotions, &acme, other).await.unwrap(),
                PromotionId::for_rollback(&acme, other)
            );
            t.cleanup().await;
        }
    }
}
