//! Provisioning's work, run by the workers' queue (`ferry_workers`): the **planner**
//! resolves the program version, configuration and secrets, runs the IaC planner, evaluates
//! policy, records the plan receipt and routes the run to apply or approval; the
//! **applier** runs the apply for approved or allowed runs and records the outputs or the
//! failure; the **baseline** step declares and plans a new environment's baseline;
//! **expiry** rejects approvals that wait too long.
//!
//! Work comes from the global stream through the `workers` subscription ([`enqueuer`]),
//! keyed by the steps' idempotency keys (`<run> + plan`, `<run> + apply`). The planner is
//! retried with the workers' back-off up to [`Settings::plan_attempts`]; the applier never
//! runs a runner twice for one item (its result is stored on the item first, see
//! [`steps`]). The queue, leases, fencing and recovery are the workers crate's.

pub mod enqueuer;
pub mod inputs;
pub mod limits;
pub mod metrics;
mod steps;

pub use steps::ProvisioningSteps;

use ferry_domain::environment::BaselineProgram;
use ferry_domain::ports::runner::Runner;
use ferry_domain::ports::sources::{
    ArtifactStore, ConfigSource, PolicyEngine, ProgramSource, SecretResolver,
};
use ferry_domain::EnvironmentClass;
use ferry_store::Database;
use ferry_workers::clock::{Clock, SystemClock};
use ferry_workers::Workers;
use metrics::Metrics;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The adapters the steps use.
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

/// Settings of provisioning's work, and of the workers that run it.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where programs are checked out while a step runs (`<work_dir>/<tenant>/<run>/<step>`).
    pub work_dir: PathBuf,
    /// Runner timeout per apply (`ApplyTimeoutMinutes`, default 45).
    pub apply_timeout: Duration,
    /// Runner timeout per plan.
    pub plan_timeout: Duration,
    /// Planner attempts before the run fails.
    pub plan_attempts: u32,
    /// First planner retry delay; doubles each time.
    pub plan_backoff: Duration,
    /// Longest planner retry delay.
    pub plan_backoff_cap: Duration,
    /// How long a claimed item is held without a renewal (see `ferry_workers::Settings`).
    pub lease: Duration,
    /// How often the heartbeat looks at the clock.
    pub heartbeat: Duration,
    /// How long past its lease an apply whose owner is gone waits before it is settled.
    pub recovery_grace: Duration,
    /// The clock leases and the heartbeat go by.
    pub clock: Arc<dyn Clock>,
    /// How long an approval may wait; `None` = forever.
    pub approval_expiry: Option<Duration>,
    /// Default baseline program per environment class.
    pub baseline_programs: HashMap<EnvironmentClass, BaselineProgram>,
    /// Steps run at once.
    pub concurrency: usize,
    /// What one run may make Ferry hold (program, plan, receipts and logs).
    pub limits: limits::Limits,
    /// Queue polling when nothing wakes the workers.
    pub poll: Duration,
    /// This process's name in `claimed_by`.
    pub instance: String,
    /// `AutoApplyNonDestructive`: a reconciliation's adds and in-place changes outside
    /// production apply without a proposal. Read at each plan (reloadable).
    pub auto_apply_non_destructive: tokio::sync::watch::Receiver<bool>,
    /// Each tenant's runner identity (`FERRY_RUNNER_IDENTITIES`, and the shared one if
    /// declared): resolved for every run of a runner that needs one. None by default.
    pub runner_identities: Arc<ferry_domain::ports::identity::RunnerIdentities>,
}

impl Settings {
    /// Defaults for a data dir.
    pub fn new(data_dir: &std::path::Path) -> Self {
        let workers = ferry_workers::Settings::default();
        Self {
            work_dir: data_dir.join("work"),
            apply_timeout: Duration::from_secs(45 * 60),
            plan_timeout: Duration::from_secs(15 * 60),
            plan_attempts: 5,
            plan_backoff: workers.backoff,
            plan_backoff_cap: workers.backoff_cap,
            lease: workers.lease,
            heartbeat: workers.heartbeat,
            recovery_grace: workers.recovery_grace,
            clock: Arc::new(SystemClock),
            approval_expiry: Some(Duration::from_secs(24 * 3600)),
            baseline_programs: HashMap::new(),
            concurrency: workers.concurrency,
            limits: limits::Limits::default(),
            poll: workers.poll,
            instance: workers.instance,
            auto_apply_non_destructive: tokio::sync::watch::channel(true).1,
            runner_identities: Arc::default(),
        }
    }

    /// What the workers that run the steps go by.
    fn workers(&self) -> ferry_workers::Settings {
        ferry_workers::Settings {
            backoff: self.plan_backoff,
            backoff_cap: self.plan_backoff_cap,
            lease: self.lease,
            heartbeat: self.heartbeat,
            recovery_grace: self.recovery_grace,
            clock: self.clock.clone(),
            concurrency: self.concurrency,
            poll: self.poll,
            instance: self.instance.clone(),
        }
    }
}

/// The workers running provisioning's steps.
pub type ProvisioningWorkers = Workers<ProvisioningSteps>;

/// Provisioning's workers over `db` (not started: see [`Workers::start`]).
pub fn workers(
    db: Database,
    ports: Ports,
    settings: Settings,
    metrics: Arc<Metrics>,
) -> Arc<ProvisioningWorkers> {
    let queue_settings = settings.workers();
    Workers::new(db.clone(), queue_settings, |queue| {
        ProvisioningSteps::new(db, queue, ports, settings, metrics)
    })
}

#[cfg(test)]
mod tests;
