//! Ferry's workers (seed: Workers and jobs): the **planner** resolves the program version,
//! configuration and secrets, runs the IaC planner, evaluates policy, records the plan
//! receipt and routes the run to apply or approval; the **applier** runs the apply for
//! approved or allowed runs and records the outputs or the failure; the **baseline** step
//! declares and plans a new environment's baseline; **expiry** rejects approvals that wait
//! too long.
//!
//! Work comes from the global stream through the `workers` subscription ([`enqueuer`]) into
//! a durable queue ([`queue`]) keyed by the seed's idempotency keys. Retry: the planner
//! backs off exponentially up to a cap; the applier never retries. A process that dies
//! mid-apply leaves a running item whose lease expires: the run is then reported Failed
//! with the reason, never applied again blindly.
#![forbid(unsafe_code)]

pub mod enqueuer;
pub mod inputs;
pub mod metrics;
pub mod queue;
mod steps;

use ferry_domain::environment::{BaselineProgram, Environment};
use ferry_domain::ports::runner::Runner;
use ferry_domain::ports::sources::{
    ArtifactStore, ConfigSource, PolicyEngine, ProgramSource, SecretResolver,
};
use ferry_domain::run::ProvisioningRun;
use ferry_domain::specification::DeploymentSpecification;
use ferry_domain::EnvironmentClass;
use ferry_store::stream::run_subscription;
use ferry_store::{Database, Repository};
use metrics::Metrics;
use queue::{Queue, WorkItem};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Semaphore};

/// The adapters the workers use.
#[derive(Clone)]
pub struct Ports {
    /// Git.
    pub programs: Arc<dyn ProgramSource>,
    /// The IaC runner.
    pub runner: Arc<dyn Runner>,
    /// Secrets.
    pub secrets: Arc<dyn SecretResolver>,
    /// Configuration.
    pub config: Arc<dyn ConfigSource>,
    /// Policy.
    pub policy: Arc<dyn PolicyEngine>,
    /// Logs and snapshots.
    pub artifacts: Arc<dyn ArtifactStore>,
}

/// Worker settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where programs are checked out while a step runs (`<work_dir>/<tenant>/<run>/<step>`).
    pub work_dir: PathBuf,
    /// Runner timeout per apply (seed: ApplyTimeoutMinutes, default 45).
    pub apply_timeout: Duration,
    /// Runner timeout per plan.
    pub plan_timeout: Duration,
    /// Planner attempts before the run fails.
    pub plan_attempts: u32,
    /// First planner retry delay; doubles each time.
    pub plan_backoff: Duration,
    /// Longest planner retry delay.
    pub plan_backoff_cap: Duration,
    /// How long a claimed item is held without a heartbeat.
    pub lease: Duration,
    /// How long an approval may wait; `None` = forever.
    pub approval_expiry: Option<Duration>,
    /// Default baseline program per environment class.
    pub baseline_programs: HashMap<EnvironmentClass, BaselineProgram>,
    /// Steps run at once.
    pub concurrency: usize,
    /// Queue polling when nothing wakes the workers.
    pub poll: Duration,
    /// This process's name in `claimed_by`.
    pub instance: String,
}

impl Settings {
    /// Defaults for a data dir.
    pub fn new(data_dir: &std::path::Path) -> Self {
        Self {
            work_dir: data_dir.join("work"),
            apply_timeout: Duration::from_secs(45 * 60),
            plan_timeout: Duration::from_secs(15 * 60),
            plan_attempts: 5,
            plan_backoff: Duration::from_secs(2),
            plan_backoff_cap: Duration::from_secs(300),
            lease: Duration::from_secs(60),
            approval_expiry: Some(Duration::from_secs(24 * 3600)),
            baseline_programs: HashMap::new(),
            concurrency: 4,
            poll: Duration::from_millis(500),
            instance: format!("ferry-{}", uuid::Uuid::new_v4().simple()),
        }
    }
}

/// The workers.
pub struct Workers {
    db: Database,
    ports: Ports,
    settings: Settings,
    queue: Queue,
    runs: Repository<ProvisioningRun>,
    specifications: Repository<DeploymentSpecification>,
    environments: Repository<Environment>,
    metrics: Arc<Metrics>,
}

impl Workers {
    /// Workers over `db`.
    pub fn new(db: Database, ports: Ports, settings: Settings, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            queue: Queue::new(db.clone(), settings.instance.clone()),
            runs: Repository::new(db.clone(), ()),
            specifications: Repository::new(db.clone(), ()),
            environments: Repository::new(db.clone(), ()),
            db,
            ports,
            settings,
            metrics,
        })
    }

    /// The queue (for diagnostics and tests).
    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    /// Starts the `workers` subscription and the worker loop.
    pub fn start(self: &Arc<Self>, shutdown: watch::Receiver<bool>) {
        let enqueuer = Arc::new(enqueuer::Enqueuer {
            approval_expiry: self.settings.approval_expiry,
        });
        tokio::spawn(run_subscription(
            self.db.clone(),
            enqueuer,
            self.settings.poll,
            shutdown.clone(),
            None,
        ));
        let me = self.clone();
        tokio::spawn(async move { me.run(shutdown).await });
    }

    async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let permits = Arc::new(Semaphore::new(self.settings.concurrency.max(1)));
        let mut commits = self.db.subscribe_commits();
        loop {
            if *shutdown.borrow() {
                return;
            }
            if let Err(error) = self.recover().await {
                tracing::warn!(%error, "cannot look for interrupted work");
            }
            let mut claimed_any = false;
            while let Ok(permit) = permits.clone().try_acquire_owned() {
                match self.queue.claim(self.settings.lease).await {
                    Ok(Some(item)) => {
                        claimed_any = true;
                        let me = self.clone();
                        tokio::spawn(async move {
                            me.execute(item).await;
                            drop(permit);
                        });
                    }
                    Ok(None) => break,
                    Err(error) => {
                        tracing::warn!(%error, "cannot claim work");
                        break;
                    }
                }
            }
            if claimed_any {
                continue;
            }
            tokio::select! {
                _ = commits.changed() => {}
                _ = tokio::time::sleep(self.settings.poll) => {}
                _ = shutdown.changed() => {}
            }
        }
    }

    /// Runs one claimed item with a lease heartbeat, then records how it ended.
    async fn execute(self: Arc<Self>, item: WorkItem) {
        let span = tracing::info_span!("work", item = %item.item_id, step = item.step.as_str(), attempt = item.attempts);
        let _guard = span.enter();
        let heartbeat = {
            let queue = self.queue.clone();
            let item = item.clone();
            let lease = self.settings.lease;
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(lease / 3).await;
                    if let Err(error) = queue.renew(&item, lease).await {
                        tracing::warn!(%error, "cannot renew lease");
                    }
                }
            })
        };
        let outcome = self.step(&item).await;
        heartbeat.abort();
        let recorded = match &outcome {
            steps::Outcome::Done => self.queue.done(&item).await,
            steps::Outcome::Failed(reason) => {
                tracing::warn!(%reason, "step failed");
                self.queue.failed(&item, reason).await
            }
            steps::Outcome::Retry(reason) => {
                let delay = self.backoff(item.attempts);
                tracing::info!(%reason, retry_in_s = delay.as_secs_f64(), "step will be retried");
                self.queue.retry(&item, reason, delay).await
            }
        };
        if let Err(error) = recorded {
            tracing::error!(%error, "cannot record the step's outcome; its lease will expire");
        }
    }

    /// Exponential back-off with a cap.
    fn backoff(&self, attempts: i64) -> Duration {
        let factor = 2u32.saturating_pow(u32::try_from(attempts.max(1) - 1).unwrap_or(u32::MAX));
        self.settings
            .plan_backoff
            .saturating_mul(factor)
            .min(self.settings.plan_backoff_cap)
    }

    /// Items whose worker died: an apply is reported Failed (never re-run blindly); other
    /// steps are safe to run again.
    async fn recover(&self) -> Result<(), sqlx::Error> {
        for item in self.queue.expired().await? {
            match item.step {
                queue::Step::Apply => {
                    let reason = "apply interrupted: the Ferry process running it stopped before the runner reported; \
                                  the infrastructure may be partly changed; the apply is not re-run, plan a new run";
                    self.report_interrupted_apply(&item, reason).await;
                    self.queue.failed(&item, reason).await?;
                }
                _ => {
                    tracing::info!(item = %item.item_id, step = item.step.as_str(), "resuming interrupted step");
                    self.queue
                        .retry(&item, "interrupted; resumed", Duration::ZERO)
                        .await?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
