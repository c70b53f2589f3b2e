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

use super::views;
use chrono::Utc;
use ferry_domain::environment::Environment;
use ferry_domain::ports::sources::{DeploymentPolicy, DeploymentPolicyInput};
use ferry_domain::promotion::gates::{self, PromotionPath, Readiness};
use ferry_domain::promotion::{GateKind, GateOutcome, GateResult, Promotion, PromotionCommand};
use ferry_domain::release::Release;
use ferry_domain::{Actor, EnvironmentId, PromotionId, TenantId};
use ferry_store::stream::Param;
use ferry_store::{on_pool, CommandError, Database, EventMetadata, LinkedWrite, Repository};
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
    policy: Arc<dyn DeploymentPolicy>,
    path: PromotionPath,
    http: reqwest::Client,
    poll: Duration,
}

/// The driver's identity in the events it causes.
fn actor() -> Actor {
    Actor::parse("system:promotions").unwrap_or_else(|_| unreachable!("a valid actor"))
}

impl Driver {
    /// A driver over `db`.
    pub fn new(
        db: Database,
        policy: Arc<dyn DeploymentPolicy>,
        path: PromotionPath,
        poll: Duration,
    ) -> Self {
        Self {
            promotions: Repository::new(db.clone(), ()),
            releases: Repository::new(db.clone(), ()),
            environments: Repository::new(db.clone(), ()),
            db,
            policy,
            path,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap_or_default(),
            poll,
        }
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
                        _ = tokio::time::sleep(self.poll) => {}
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
            Ok(_) => Ok(true),
            Err(CommandError::Conflict | CommandError::Domain(_) | CommandError::NotFound) => {
                Ok(false)
            }
            Err(e) => Err(command_error(e)),
        }
    }

    /// One pass over every promotion with something to do.
    pub async fn pass(&self) -> Result<(), DriverError> {
        self.free_slots().await?;
        self.reject_withdrawn().await?;
        let mut started: Vec<(String, String)> = Vec::new();
        for (tenant, promotion, environment, state) in views::open_promotions(&self.db).await? {
            let (Ok(tenant), Ok(promotion)) =
                (TenantId::parse(&tenant), PromotionId::parse(&promotion))
            else {
                continue;
            };
            match state.as_str() {
                "Requested" => {
                    // Request order: only the oldest queued promotion of an environment tries.
                    let slot = (tenant.to_string(), environment.clone());
                    if started.contains(&slot) {
                        continue;
                    }
                    started.push(slot);
                    self.start_gates(&tenant, promotion, &environment).await?;
                }
                "GatesEvaluating" => self.evaluate_gates(&tenant, promotion).await?,
                _ => {}
            }
        }
        Ok(())
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
    async fn reject_withdrawn(&self) -> Result<(), DriverError> {
        let sql = self.db.sql(
            "SELECT p.tenant_id, p.promotion_id FROM rm_promotions p
               JOIN rm_releases r ON r.tenant_id = p.tenant_id AND r.release_id = p.release_id
              WHERE r.state = 'Withdrawn'
                AND p.state IN ('Requested', 'GatesEvaluating', 'AwaitingApproval', 'Approved')",
        );
        let rows: Vec<(String, String)> =
            on_pool!(self.db, pool => sqlx::query_as(&sql).fetch_all(pool).await?);
        for (tenant, promotion) in rows {
            let (Ok(tenant), Ok(promotion)) =
                (TenantId::parse(&tenant), PromotionId::parse(&promotion))
            else {
                continue;
            };
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
                .await?;
            if rejected {
                tracing::info!(promotion_id = %promotion, "promotion of a withdrawn release rejected");
            }
        }
        Ok(())
    }

    /// Starts the gates by taking the environment's slot in the same transaction.
    async fn start_gates(
        &self,
        tenant: &TenantId,
        promotion: PromotionId,
        environment: &str,
    ) -> Result<(), DriverError> {
        let slot = LinkedWrite {
            sql: "INSERT INTO promotion_slots (tenant_id, environment_id, promotion_id)
                  VALUES ($1, $2, $3) ON CONFLICT DO NOTHING"
                .to_string(),
            params: vec![
                Param::Text(Some(tenant.to_string())),
                Param::Text(Some(environment.to_string())),
                Param::Text(Some(promotion.to_string())),
            ],
            expect_rows: 1,
        };
        if self
            .command(
                tenant,
                promotion,
                PromotionCommand::StartGates { at: Utc::now() },
                Some(&slot),
            )
            .await?
        {
            tracing::info!(promotion_id = %promotion, environment, "gates started");
        }
        Ok(())
    }

    /// Records the promotion's next gates, in order, until one fails or all passed.
    async fn evaluate_gates(
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
        let Some(request) = aggregate.request().cloned() else {
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
            Some(record) => Some(
                self.policy
                    .evaluate_promotion(&DeploymentPolicyInput {
                        environment_id: request.environment_id.to_string(),
                        environment_class: Some(request.environment_class),
                        project_id: request.project_id.to_string(),
                        release_id: request.release_id.to_string(),
                        release_version: record.version.to_string(),
                        hotfix: request.hotfix.as_ref().map(|h| h.reason.clone()),
                        rollback: request.rollback_of.is_some(),
                        has_agent_generated_assets: record.has_agent_generated_assets,
                    })
                    .map_err(|e| e.to_string()),
            ),
            None => None,
        };
        for kind in GateKind::ORDER.iter().skip(recorded.len()) {
            let now = Utc::now();
            let gate = match (kind, &record) {
                (_, None) => GateResult {
                    kind: *kind,
                    outcome: GateOutcome::Failed,
                    reasons: vec![format!("release {} is not recorded", request.release_id)],
                    evidence: serde_json::json!({"releaseId": request.release_id}),
                    evaluated_at: now,
                },
                (GateKind::PipelineResults, Some(record)) => {
                    gates::pipeline_results(record, withdrawn, now)
                }
                (GateKind::Policy, Some(_)) => match &decision {
                    Some(Ok(decision)) => gates::policy(decision, now).0,
                    // Failing safe: a policy that cannot decide lets nothing through.
                    Some(Err(error)) => GateResult {
                        kind: *kind,
                        outcome: GateOutcome::Failed,
                        reasons: vec![format!("policy could not decide: {error}")],
                        evidence: serde_json::json!({"error": error}),
                        evaluated_at: now,
                    },
                    None => GateResult {
                        kind: *kind,
                        outcome: GateOutcome::Failed,
                        reasons: vec!["policy was not evaluated".to_string()],
                        evidence: serde_json::Value::Null,
                        evaluated_at: now,
                    },
                },
                (GateKind::PriorEnvironment, Some(_)) => {
                    let completions =
                        views::completions(&self.db, tenant, request.release_id).await?;
                    let hotfix_allowed = match &decision {
                        Some(Ok(d)) => d.hotfix_allowed.clone(),
                        _ => Vec::new(),
                    };
                    gates::prior_environment(
                        &self.path,
                        request.environment_class,
                        &completions,
                        request.hotfix.as_ref(),
                        &hotfix_allowed,
                        now,
                    )
                }
                (GateKind::EnvironmentReady, Some(_)) => {
                    let readiness = self.readiness(tenant, &request.environment_id).await?;
                    gates::environment_ready(&request.environment_id, &readiness, now)
                }
                (GateKind::EvaluationEvidence, Some(record)) => {
                    gates::evaluation_evidence(record, now)
                }
            };
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
        Ok(match self.http.get(&url).send().await {
            Ok(response) => Readiness::Probed {
                url,
                status: Some(response.status().as_u16()),
                error: None,
            },
            Err(e) => Readiness::Probed {
                url,
                status: None,
                error: Some(e.to_string()),
            },
        })
    }
}
