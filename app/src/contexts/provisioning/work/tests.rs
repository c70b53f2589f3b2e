//! Worker tests on real databases, with in-test doubles for the ports (the real adapters are
//! tested in their crates and end to end). Faults are injected, not reasoned about: a clock
//! the test moves ([`ShiftedClock`]), triggers that make the real store refuse writes, a
//! claim taken over in the database.

use super::metrics::Metrics;
use super::{workers, Ports, ProvisioningWorkers, Settings};
use chrono::Utc;
use ferry_domain::environment::{
    BaselineProgram, Environment, EnvironmentCommand, EnvironmentRegistration,
};
use ferry_domain::ports::identity::{RunnerIdentities, RunnerIdentity};
use ferry_domain::ports::runner::*;
use ferry_domain::ports::sources::*;
use ferry_domain::ports::SecretValue;
use ferry_domain::receipts::{
    PlanReceipt, PlannedResource, PolicyDecision, PolicyOutcome, ResourceOp,
};
use ferry_domain::run::{Decision, ProvisioningRun, RunCommand, RunRequest};
use ferry_domain::specification::{Declaration, DeploymentSpecification, SpecificationCommand};
use ferry_domain::*;
use ferry_store::database::Backend;
use ferry_store::stream::Tx;
use ferry_store::testing::{eventually, TestDatabase};
use ferry_store::{on_pool, Database, EventMetadata, Repository};
use ferry_workers::clock::{Clock, ShiftedClock};
use ferry_workers::queue::{enqueue, now_ms, QueueError, Step, WorkItem};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;

struct Programs;

#[async_trait::async_trait]
impl ProgramSource for Programs {
    async fn checkout(
        &self,
        tenant: &TenantId,
        program: &ProgramRef,
        version: &ProgramVersion,
        into: &Path,
    ) -> Result<Checkout, SourceError> {
        // Work folders are per tenant: <work>/<tenant>/<run>/<step>.
        let tenant_dir = into
            .parent()
            .and_then(Path::parent)
            .and_then(Path::file_name);
        if tenant_dir.and_then(|n| n.to_str()) != Some(tenant.path_component().as_str()) {
            return Err(SourceError::Repository {
                repository: program.to_string(),
                reason: format!("{} is not a work folder of {tenant}", into.display()),
            });
        }
        if version.as_str() == "deadbeef" {
            return Err(SourceError::CommitNotFound {
                repository: program.to_string(),
                commit: version.to_string(),
            });
        }
        std::fs::write(into.join("Pulumi.yaml"), "name: test").map_err(|e| {
            SourceError::Repository {
                repository: program.to_string(),
                reason: e.to_string(),
            }
        })?;
        Ok(Checkout {
            program_dir: into.to_path_buf(),
            commit: format!("{}{}", version, "0".repeat(40 - version.as_str().len())),
        })
    }

    async fn locate(
        &self,
        _tenant: &TenantId,
        program: &ProgramRef,
        version: &ProgramVersion,
    ) -> Result<(), SourceError> {
        if version.as_str() == "deadbeef" {
            return Err(SourceError::CommitNotFound {
                repository: program.to_string(),
                commit: version.to_string(),
            });
        }
        Ok(())
    }
}

/// A check run when an apply starts.
type Hook = Box<dyn Fn() + Send + Sync>;

#[derive(Default)]
struct FakeRunner {
    deletes: u32,
    unavailable_previews: AtomicUsize,
    fail_apply: Option<String>,
    apply_delay: Duration,
    /// When set, an apply waits for a permit before it finishes.
    gate: Option<Arc<Semaphore>>,
    before_apply: Option<Hook>,
    /// Applies called.
    apply_calls: AtomicUsize,
    /// Applies that finished.
    applies: AtomicUsize,
    /// Applies whose future was dropped before they finished.
    cancelled: AtomicUsize,
    running: Mutex<HashMap<String, usize>>,
    max_parallel_in_env: AtomicUsize,
    /// Resources the plan lists besides the first.
    more_resources: usize,
    /// Bytes of padding added to the preview's log.
    log_padding: usize,
    /// Runs with a tenant's identity, as the Pulumi and HTTP runners do.
    needs_identity: bool,
    /// The identity of each preview, as its variables' names and values.
    identities: Mutex<Vec<Option<BTreeMap<String, String>>>>,
}

/// Leaves the running count when an apply ends or is dropped, counting a drop as cancelled.
struct Running<'a> {
    runner: &'a FakeRunner,
    env: String,
    finished: bool,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        *self
            .runner
            .running
            .lock()
            .unwrap()
            .entry(self.env.clone())
            .or_default() -= 1;
        if !self.finished {
            self.runner.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[async_trait::async_trait]
impl Runner for FakeRunner {
    fn name(&self) -> &'static str {
        "fake"
    }
    fn needs_identity(&self) -> bool {
        self.needs_identity
    }
    async fn version(&self) -> Result<String, RunnerError> {
        Ok("1.0-test".to_string())
    }
    async fn preview(&self, input: &RunnerInput) -> Result<PreviewOutcome, RunnerError> {
        if self.unavailable_previews.load(Ordering::SeqCst) > 0 {
            self.unavailable_previews.fetch_sub(1, Ordering::SeqCst);
            return Err(RunnerError::Unavailable("runner busy".to_string()));
        }
        self.identities
            .lock()
            .unwrap()
            .push(input.identity.as_ref().map(|i| {
                i.vars()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.expose().to_string()))
                    .collect()
            }));
        let secret = input
            .secrets
            .values()
            .next()
            .map(|s| s.expose().to_string())
            .unwrap_or_default();
        Ok(PreviewOutcome {
            plan: PlanSummary {
                adds: 1,
                changes: 0,
                deletes: self.deletes,
                replaces: 0,
                resources: (0..=self.more_resources)
                    .map(|i| PlannedResource {
                        urn: if i == 0 {
                            "urn:pulumi:e::p::test:Thing::a".into()
                        } else {
                            format!("urn:pulumi:e::p::test:Thing::a{i}")
                        },
                        resource_type: "test:Thing".into(),
                        op: if i == 0 {
                            ResourceOp::Create
                        } else {
                            ResourceOp::Same
                        },
                        properties: Vec::new(),
                    })
                    .collect(),
            },
            log: format!(
                "previewing with password {secret}{}",
                ".".repeat(self.log_padding)
            ),
        })
    }
    async fn apply(&self, input: &RunnerInput) -> Result<ApplyOutcome, RunnerError> {
        self.apply_calls.fetch_add(1, Ordering::SeqCst);
        if let Some(check) = &self.before_apply {
            check();
        }
        let env = input.environment_id.clone();
        {
            let mut running = self.running.lock().unwrap();
            let n = running.entry(env.clone()).or_default();
            *n += 1;
            self.max_parallel_in_env.fetch_max(*n, Ordering::SeqCst);
        }
        let mut guard = Running {
            runner: self,
            env,
            finished: false,
        };
        tokio::time::sleep(self.apply_delay).await;
        if let Some(gate) = &self.gate {
            gate.acquire().await.unwrap().forget();
        }
        guard.finished = true;
        drop(guard);
        self.applies.fetch_add(1, Ordering::SeqCst);
        match &self.fail_apply {
            Some(resource) => Err(RunnerError::ProgramFailed {
                reason: format!("{resource}: quota exceeded"),
                resource: Some(resource.clone()),
                log: "boom".into(),
            }),
            None => Ok(ApplyOutcome {
                outputs: BTreeMap::from([("url".to_string(), serde_json::json!("https://x"))]),
                log: "applied".into(),
            }),
        }
    }
}

struct Secrets;

#[async_trait::async_trait]
impl SecretResolver for Secrets {
    async fn resolve(
        &self,
        _tenant: &TenantId,
        reference: &SecretRef,
    ) -> Result<ResolvedSecret, SecretError> {
        Ok(ResolvedSecret {
            value: SecretValue::new("s3cr3t-value"),
            version: format!("v1:{reference}"),
        })
    }
}

#[derive(Default)]
struct Config(Mutex<BTreeMap<String, serde_json::Value>>);

#[async_trait::async_trait]
impl ConfigSource for Config {
    async fn resolve(
        &self,
        _tenant: &TenantId,
        _env: &str,
        _refs: &BTreeMap<String, ConfigRef>,
    ) -> Result<ResolvedConfig, ConfigError> {
        Ok(ResolvedConfig {
            values: self.0.lock().unwrap().clone(),
            warnings: vec![],
        })
    }
}

/// Production needs approval unless the promotion approved; a `deny` environment is denied.
struct Policy;

impl PolicyEngine for Policy {
    fn evaluate(&self, input: &PolicyInput) -> Result<PolicyDecision, PolicyError> {
        let (decision, why) = if input.environment_id.contains("deny") {
            (PolicyOutcome::Deny, "denied by test policy")
        } else if is_production(input.environment_class) && !input.has_promotion_approval {
            (PolicyOutcome::RequireApproval, "production")
        } else {
            (PolicyOutcome::Allow, "allowed")
        };
        Ok(PolicyDecision {
            decision,
            evidence: vec![why.to_string()],
        })
    }
}

#[derive(Default)]
struct Artifacts(Mutex<HashMap<String, Vec<u8>>>);

#[async_trait::async_trait]
impl ArtifactStore for Artifacts {
    async fn put(&self, key: &str, bytes: Vec<u8>) -> Result<String, ArtifactError> {
        self.0.lock().unwrap().insert(key.to_string(), bytes);
        Ok(format!("artifacts:{key}"))
    }
    async fn get(&self, reference: &str) -> Result<Vec<u8>, ArtifactError> {
        self.0
            .lock()
            .unwrap()
            .get(reference.trim_start_matches("artifacts:"))
            .cloned()
            .ok_or(ArtifactError {
                key: reference.into(),
                reason: "missing".into(),
            })
    }
}

struct World {
    tdb: TestDatabase,
    workers: Arc<ProvisioningWorkers>,
    runner: Arc<FakeRunner>,
    config: Arc<Config>,
    artifacts: Arc<Artifacts>,
    /// The clock of the world's workers (and of instances given it).
    clock: Arc<ShiftedClock>,
    stop: tokio::sync::watch::Sender<bool>,
    _dir: tempfile::TempDir,
}

/// Another Ferry instance on the world's database.
struct Instance {
    workers: Arc<ProvisioningWorkers>,
    stop: tokio::sync::watch::Sender<bool>,
    _dir: tempfile::TempDir,
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

fn tenant() -> TenantId {
    TenantId::parse("acme").unwrap()
}

fn meta(actor: &str) -> EventMetadata {
    EventMetadata::for_request(tenant(), Actor::parse(actor).unwrap(), uuid::Uuid::new_v4())
}

/// The settings of test workers: fast polls and heartbeat ticks, leases on `clock`.
fn test_settings(dir: &Path, clock: Arc<dyn Clock>) -> Settings {
    let mut settings = Settings::new(dir);
    settings.poll = Duration::from_millis(20);
    settings.plan_backoff = Duration::from_millis(10);
    settings.heartbeat = Duration::from_millis(10);
    settings.clock = clock;
    // A runner that needs an identity (the Pulumi CLI below) gets an empty shared one.
    settings.runner_identities = Arc::new(RunnerIdentities::shared(RunnerIdentity::default()));
    settings
}

/// Runs one statement outside any transaction (test setup and fault injection).
async fn exec(db: &Database, sql: &str) {
    on_pool!(db, pool => sqlx::query(sql).execute(pool).await.unwrap().rows_affected());
}

impl World {
    async fn new(backend: Backend, runner: FakeRunner, tune: impl FnOnce(&mut Settings)) -> Self {
        Self::build(backend, runner, None, true, tune).await
    }

    /// A world whose workers are not started: tests drive recovery and the queue by hand.
    async fn idle(backend: Backend) -> Self {
        Self::build(backend, FakeRunner::default(), None, false, |_| {}).await
    }

    /// A world whose workers use `runner` instead of the fake (still kept for others).
    async fn build(
        backend: Backend,
        fake: FakeRunner,
        runner: Option<Arc<dyn Runner>>,
        start: bool,
        tune: impl FnOnce(&mut Settings),
    ) -> Self {
        let tdb = TestDatabase::new(backend).await;
        let dir = tempfile::tempdir().unwrap();
        let fake = Arc::new(fake);
        let clock = Arc::new(ShiftedClock::new());
        let config = Arc::new(Config::default());
        let artifacts = Arc::new(Artifacts::default());
        let ports = Ports {
            programs: Arc::new(Programs),
            runner: runner.unwrap_or_else(|| fake.clone()),
            secrets: Arc::new(Secrets),
            config: config.clone(),
            policy: Arc::new(Policy),
            artifacts: artifacts.clone(),
        };
        let mut settings = test_settings(dir.path(), clock.clone());
        tune(&mut settings);
        let workers = workers(
            tdb.db.clone(),
            ports,
            settings,
            Arc::new(Metrics::new().unwrap()),
        );
        let (stop, rx) = tokio::sync::watch::channel(false);
        if start {
            workers.start(rx);
        }
        Self {
            tdb,
            workers,
            runner: fake,
            config,
            artifacts,
            clock,
            stop,
            _dir: dir,
        }
    }

    fn ports(&self, runner: Arc<dyn Runner>) -> Ports {
        Ports {
            programs: Arc::new(Programs),
            runner,
            secrets: Arc::new(Secrets),
            config: self.config.clone(),
            policy: Arc::new(Policy),
            artifacts: self.artifacts.clone(),
        }
    }

    /// Another instance on the same database (on Postgres with a pool of its own), with its
    /// own runner and clock; started or not.
    async fn instance(
        &self,
        runner: Arc<dyn Runner>,
        clock: Arc<dyn Clock>,
        start: bool,
    ) -> Instance {
        let db = match self.tdb.db.backend() {
            Backend::Postgres => Database::connect_postgres(&self.tdb.location)
                .await
                .unwrap(),
            Backend::Sqlite => self.tdb.db.clone(),
        };
        let dir = tempfile::tempdir().unwrap();
        let workers = workers(
            db,
            self.ports(runner),
            test_settings(dir.path(), clock),
            Arc::new(Metrics::new().unwrap()),
        );
        let (stop, rx) = tokio::sync::watch::channel(false);
        if start {
            workers.start(rx);
        }
        Instance {
            workers,
            stop,
            _dir: dir,
        }
    }

    /// Makes the store refuse to record events (any command fails) until [`Self::heal`].
    async fn refuse_events(&self) {
        let db = &self.tdb.db;
        match db.backend() {
            Backend::Postgres => {
                self.refusal_function().await;
                exec(db, "CREATE TRIGGER test_refuse_events BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION test_refuse()").await;
            }
            Backend::Sqlite => exec(db, "CREATE TRIGGER test_refuse_events BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, 'store failure injected by the test'); END").await,
        }
    }

    /// Makes the store refuse every write that keeps an item running (lease renewals,
    /// storing a result) until [`Self::heal`].
    async fn refuse_renewals(&self) {
        let db = &self.tdb.db;
        match db.backend() {
            Backend::Postgres => {
                self.refusal_function().await;
                exec(db, "CREATE TRIGGER test_refuse_renewals BEFORE UPDATE ON work_items FOR EACH ROW WHEN (OLD.status = 'running' AND NEW.status = 'running') EXECUTE FUNCTION test_refuse()").await;
            }
            Backend::Sqlite => exec(db, "CREATE TRIGGER test_refuse_renewals BEFORE UPDATE ON work_items WHEN OLD.status = 'running' AND NEW.status = 'running' BEGIN SELECT RAISE(ABORT, 'store failure injected by the test'); END").await,
        }
    }

    async fn refusal_function(&self) {
        exec(&self.tdb.db, "CREATE OR REPLACE FUNCTION test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'store failure injected by the test'; END $$").await;
    }

    /// Removes the injected failures.
    async fn heal(&self) {
        let db = &self.tdb.db;
        match db.backend() {
            Backend::Postgres => {
                exec(db, "DROP TRIGGER IF EXISTS test_refuse_events ON events").await;
                exec(
                    db,
                    "DROP TRIGGER IF EXISTS test_refuse_renewals ON work_items",
                )
                .await;
            }
            Backend::Sqlite => {
                exec(db, "DROP TRIGGER IF EXISTS test_refuse_events").await;
                exec(db, "DROP TRIGGER IF EXISTS test_refuse_renewals").await;
            }
        }
    }

    /// The running apply item of a run.
    async fn running_apply(&self, id: ProvisioningRunId) -> Option<WorkItem> {
        let running = self.workers.queue().running().await.unwrap();
        running
            .into_iter()
            .find(|i| i.item_id == id.to_string() && i.step == Step::Apply)
    }

    /// The status, last error and attempts of one of a run's items.
    async fn status(
        &self,
        id: ProvisioningRunId,
        step: Step,
    ) -> Option<(String, Option<String>, i64)> {
        self.workers
            .queue()
            .status(&id.to_string(), step)
            .await
            .unwrap()
    }

    async fn state(&self, id: ProvisioningRunId) -> Option<ProvisioningState> {
        let (run, _) = self
            .runs()
            .load(&tenant(), &id.to_string())
            .await
            .unwrap()?;
        run.state()
    }

    /// A run in `Applying` whose apply item is running, claimed with `token` and a lease
    /// ending at `lease_until`: what an owner leaves behind (the workers are not started).
    async fn orphaned_apply(&self, env: &str, token: &str, lease_until: i64) -> ProvisioningRunId {
        let id = self
            .request(env, Some(EnvironmentClass::Development), "abcdef1")
            .await;
        let runs = self.runs();
        let key = id.to_string();
        // Play the planner by hand.
        let plan = ferry_domain::receipts::PlanReceipt {
            ignored: Vec::new(),
            adds: 1,
            changes: 0,
            deletes: 0,
            replaces: 0,
            resources: vec![],
            inputs_hash: "x".into(),
            program_version: "abcdef1".into(),
            runner: "fake".into(),
            runner_version: "1".into(),
            policy: None,
            warnings: vec![],
        };
        runs.execute(
            &tenant(),
            &key,
            RunCommand::RecordPlan {
                receipt: Box::new(plan),
                logs_ref: None,
                at: Utc::now(),
            },
            &meta("system:planner"),
            false,
        )
        .await
        .unwrap();
        runs.execute(
            &tenant(),
            &key,
            RunCommand::StartApply { at: Utc::now() },
            &meta("system:planner"),
            false,
        )
        .await
        .unwrap();
        let mut tx = Tx::begin(&self.tdb.db).await.unwrap();
        enqueue(
            &mut tx,
            &key,
            Step::Apply,
            "acme",
            &format!("acme/{env}"),
            now_ms(),
            None,
            None,
        )
        .await
        .unwrap();
        tx.execute(
            "UPDATE work_items SET status = 'running', lease_until = $2, attempts = 1, claim_token = $3 WHERE item_id = $1 AND step = 'apply'",
            &[
                ferry_store::stream::Param::Text(Some(key.clone())),
                ferry_store::stream::Param::Int(Some(lease_until)),
                ferry_store::stream::Param::Text(Some(token.to_string())),
            ],
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        id
    }

    fn runs(&self) -> Repository<ProvisioningRun> {
        Repository::new(self.tdb.db.clone(), ())
    }

    async fn declare(&self, env: &str, commit: &str) -> (SpecificationId, u32) {
        let environment = EnvironmentId::parse(env).unwrap();
        let id = SpecificationId::for_environment(
            &tenant(),
            &environment,
            SpecificationKind::Environment,
        );
        let d = Declaration {
            specification_id: id,
            tenant_id: tenant(),
            project_id: ProjectId::parse("payments").unwrap(),
            environment_id: environment,
            kind: SpecificationKind::Environment,
            program_ref: ProgramRef::parse("/srv/infra#env").unwrap(),
            program_version: ProgramVersion::parse(commit).unwrap(),
            release_id: None,
            strategy: None,
            config_refs: BTreeMap::new(),
            secret_refs: BTreeMap::from([(
                "db".to_string(),
                SecretRef::parse("env://DB").unwrap(),
            )]),
            declared_by: Actor::parse("alice").unwrap(),
            declared_at: Utc::now(),
        };
        let specs: Repository<DeploymentSpecification> = Repository::new(self.tdb.db.clone(), ());
        let done = specs
            .execute(
                &tenant(),
                &id.to_string(),
                SpecificationCommand::Declare(Box::new(d)),
                &meta("alice"),
                true,
            )
            .await
            .unwrap();
        (id, done.aggregate.latest().unwrap().version)
    }

    async fn request(
        &self,
        env: &str,
        class: Option<EnvironmentClass>,
        commit: &str,
    ) -> ProvisioningRunId {
        let spec = self.declare(env, commit).await;
        let id = ProvisioningRunId::new_random();
        let r = RunRequest {
            provisioning_run_id: id,
            tenant_id: tenant(),
            project_id: ProjectId::parse("payments").unwrap(),
            environment_id: EnvironmentId::parse(env).unwrap(),
            environment_class: class,
            specification_id: spec.0,
            specification_version: spec.1,
            kind: ProvisioningKind::Release,
            promotion_id: None,
            approval_id: None,
            follows_failed_apply: None,
            requested_by: Actor::parse("alice").unwrap(),
            requested_at: Utc::now(),
        };
        self.runs()
            .execute(
                &tenant(),
                &id.to_string(),
                RunCommand::Request(Box::new(r)),
                &meta("alice"),
                true,
            )
            .await
            .unwrap();
        id
    }

    async fn wait_state(&self, id: ProvisioningRunId, state: ProvisioningState) -> ProvisioningRun {
        let runs = self.runs();
        eventually(&format!("run {id} {state}"), || async {
            let (run, _) = runs.load(&tenant(), &id.to_string()).await.unwrap()?;
            (run.state() == Some(state)).then_some(run)
        })
        .await
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        self.tdb.cleanup().await;
    }
}

ferry_store::test_on_both_engines! {
    async fn a_non_production_run_plans_applies_and_keeps_both_receipts(backend) {
        let w = World::new(backend, FakeRunner::default(), |_| {}).await;
        let id = w
            .request("dev", Some(EnvironmentClass::Development), "abcdef1")
            .await;
        let run = w.wait_state(id, ProvisioningState::Applied).await;
        let plan = run.plan_receipt().unwrap();
        assert_eq!((plan.adds, plan.runner.as_str()), (1, "fake"));
        assert_eq!(plan.program_version, format!("abcdef1{}", "0".repeat(33)));
        assert_eq!(plan.policy.as_ref().unwrap().decision, PolicyOutcome::Allow);
        assert_eq!(run.apply_receipt().unwrap().outputs["url"], "https://x");
        // The plan log is stored, with the secret redacted.
        let log = w
            .artifacts
            .get(&format!("artifacts:runs/{id}/plan.log"))
            .await
            .unwrap();
        assert_eq!(
            String::from_utf8(log).unwrap(),
            "previewing with password ***"
        );
        // The run is Applied in the store a moment before the applier counts it.
        let metrics = eventually("the Applied transition counted", || async {
            let text = w.workers.steps().metrics.render();
            text.contains("state=\"Applied\"} 1").then_some(text)
        })
        .await;
        assert!(metrics.contains("state=\"Applied\"} 1"), "{metrics}");
        w.stop().await;
    }
}

#[tokio::test]
async fn a_production_run_waits_for_approval_then_applies() {
    let w = World::new(Backend::Postgres, FakeRunner::default(), |_| {}).await;
    let id = w
        .request("prod", Some(EnvironmentClass::Production), "abcdef1")
        .await;
    w.wait_state(id, ProvisioningState::AwaitingApproval).await;
    assert_eq!(w.runner.applies.load(Ordering::SeqCst), 0);
    let approve = |by: &str| RunCommand::DecideApproval {
        decision: Decision::Approve,
        decided_by: Actor::parse(by).unwrap(),
        reason: None,
        approval_id: None,
        at: Utc::now(),
    };
    assert!(w
        .runs()
        .execute(
            &tenant(),
            &id.to_string(),
            approve("alice"),
            &meta("alice"),
            false
        )
        .await
        .is_err());
    w.runs()
        .execute(
            &tenant(),
            &id.to_string(),
            approve("bob"),
            &meta("bob"),
            false,
        )
        .await
        .unwrap();
    w.wait_state(id, ProvisioningState::Applied).await;
    w.stop().await;
}

#[tokio::test]
async fn a_missing_commit_fails_planning_naming_it() {
    let w = World::new(Backend::Sqlite, FakeRunner::default(), |_| {}).await;
    let id = w
        .request("dev", Some(EnvironmentClass::Development), "deadbeef")
        .await;
    w.wait_state(id, ProvisioningState::Failed).await;
    // The run is Failed in the store a moment before the planner marks its item.
    let (status, error, _) = eventually("the plan item finished", || async {
        let s = w.status(id, Step::Plan).await?;
        (s.0 != "running" && s.0 != "pending").then_some(s)
    })
    .await;
    assert_eq!(status, "failed");
    assert!(error
        .unwrap()
        .contains("commit deadbeef not found in /srv/infra#env"));
    w.stop().await;
}

/// A runner that runs with a tenant's identity: a tenant without one fails planning naming
/// the setting (nothing is checked out or previewed), and with a shared identity declared
/// the run goes on with it.
#[tokio::test]
async fn a_tenant_without_a_runner_identity_fails_planning_naming_the_setting() {
    use ferry_domain::ports::identity::IDENTITIES_SETTING;
    let runner = FakeRunner {
        needs_identity: true,
        ..Default::default()
    };
    let w = World::new(Backend::Sqlite, runner, |s| {
        s.runner_identities = Arc::default();
    })
    .await;
    let id = w
        .request("dev", Some(EnvironmentClass::Development), "abcdef1")
        .await;
    w.wait_state(id, ProvisioningState::Failed).await;
    let (status, error, _) = eventually("the plan item finished", || async {
        let s = w.status(id, Step::Plan).await?;
        (s.0 != "running" && s.0 != "pending").then_some(s)
    })
    .await;
    assert_eq!(status, "failed");
    let error = error.unwrap();
    assert!(error.contains(IDENTITIES_SETTING), "{error}");
    assert!(error.contains(tenant().as_str()), "{error}");
    assert!(w.runner.identities.lock().unwrap().is_empty());
    w.stop().await;

    let runner = FakeRunner {
        needs_identity: true,
        ..Default::default()
    };
    let w = World::new(Backend::Sqlite, runner, |s| {
        s.runner_identities = Arc::new(RunnerIdentities::shared(RunnerIdentity::new(
            BTreeMap::from([(
                "PULUMI_BACKEND_URL".to_string(),
                SecretValue::new("file:///srv/state"),
            )]),
        )));
    })
    .await;
    let id = w
        .request("dev", Some(EnvironmentClass::Development), "abcdef1")
        .await;
    w.wait_state(id, ProvisioningState::Applied).await;
    let seen = w.runner.identities.lock().unwrap().clone();
    assert_eq!(
        seen.first().cloned().flatten(),
        Some(BTreeMap::from([(
            "PULUMI_BACKEND_URL".to_string(),
            "file:///srv/state".to_string()
        )]))
    );
    w.stop().await;
}

#[tokio::test]
async fn the_planner_retries_an_unavailable_runner_with_backoff() {
    let runner = FakeRunner {
        unavailable_previews: AtomicUsize::new(2),
        ..Default::default()
    };
    let w = World::new(Backend::Sqlite, runner, |_| {}).await;
    let id = w
        .request("dev", Some(EnvironmentClass::Development), "abcdef1")
        .await;
    w.wait_state(id, ProvisioningState::Applied).await;
    let (_, _, attempts) = w
        .workers
        .queue()
        .status(&id.to_string(), Step::Plan)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(attempts, 3);

    let runner = FakeRunner {
        unavailable_previews: AtomicUsize::new(10),
        ..Default::default()
    };
    let w2 = World::new(Backend::Sqlite, runner, |s| s.plan_attempts = 2).await;
    let id = w2
        .request("dev", Some(EnvironmentClass::Development), "abcdef1")
        .await;
    let _ = w2.wait_state(id, ProvisioningState::Failed).await;
    w.stop().await;
    w2.stop().await;
}

#[tokio::test]
async fn a_plan_recorded_before_a_crash_is_taken_to_its_next_step_on_retry() {
    // The planner's first attempt finds the runner away and is retried later; meanwhile the
    // plan is recorded as a planner that then died would leave it (receipt, no next step).
    let runner = FakeRunner {
        unavailable_previews: AtomicUsize::new(1),
        ..Default::default()
    };
    let w = World::new(Backend::Sqlite, runner, |s| {
        s.plan_backoff = Duration::from_secs(2)
    })
    .await;
    let id = w
        .request("dev", Some(EnvironmentClass::Development), "abcdef1")
        .await;
    eventually("the first plan attempt retried", || async {
        let (status, _, attempts) = w.status(id, Step::Plan).await?;
        (status == "pending" && attempts == 1).then_some(())
    })
    .await;
    let receipt = PlanReceipt {
        adds: 1,
        changes: 0,
        deletes: 0,
        replaces: 0,
        resources: vec![],
        ignored: vec![],
        inputs_hash: "h".repeat(64),
        program_version: format!("abcdef1{}", "0".repeat(33)),
        runner: "fake".to_string(),
        runner_version: "1".to_string(),
        policy: Some(PolicyDecision {
            decision: PolicyOutcome::Allow,
            evidence: vec!["non-production".to_string()],
        }),
        warnings: vec![],
    };
    w.runs()
        .execute(
            &tenant(),
            &id.to_string(),
            RunCommand::RecordPlan {
                receipt: Box::new(receipt),
                logs_ref: None,
                at: Utc::now(),
            },
            &meta("planner"),
            false,
        )
        .await
        .unwrap();
    // The retry does not plan again: it takes the recorded plan's next step, the apply (whose
    // check before the runner finds this hand-made receipt stale: nothing is applied).
    let (status, _, _) = eventually("the apply step taken and finished", || async {
        let s = w.status(id, Step::Apply).await?;
        (s.0 != "running" && s.0 != "pending").then_some(s)
    })
    .await;
    assert_eq!(status, "failed");
    let run = w.wait_state(id, ProvisioningState::Superseded).await;
    assert_eq!(run.plan_receipt().unwrap().inputs_hash, "h".repeat(64));
    assert_eq!(w.runner.applies.load(Ordering::SeqCst), 0);
    w.stop().await;
}

#[tokio::test]
async fn a_failed_apply_names_the_failing_resource_and_is_not_retried() {
    let runner = FakeRunner {
        fail_apply: Some("bucket".to_string()),
        ..Default::default()
    };
    let w = World::new(Backend::Sqlite, runner, |_| {}).await;
    let id = w
        .request("dev", Some(EnvironmentClass::Development), "abcdef1")
        .await;
    let run = w.wait_state(id, ProvisioningState::Failed).await;
    assert_eq!(
        run.apply_receipt().unwrap().failing_resource.as_deref(),
        Some("bucket")
    );
    // The apply item ends terminal (not pending for a retry), after exactly one apply.
    let (status, _, attempts) = eventually("the apply item finished", || async {
        let s = w
            .workers
            .queue()
            .status(&id.to_string(), Step::Apply)
            .await
            .unwrap()?;
        (s.0 != "pending" && s.0 != "running").then_some(s)
    })
    .await;
    assert_eq!((status.as_str(), attempts), ("failed", 1));
    assert_eq!(w.runner.applies.load(Ordering::SeqCst), 1);
    w.stop().await;
}

ferry_store::test_on_both_engines! {
    async fn an_interrupted_apply_is_reported_failed_and_never_rerun(backend) {
        let w = World::idle(backend).await;
        // A process killed mid-apply long ago (its lease and the grace period are over).
        let id = w
            .orphaned_apply("prod", "killed-process", now_ms() - 600_000)
            .await;
        // A new process starts.
        let restarted = w.instance(w.runner.clone(), w.clock.clone(), true).await;
        let run = w.wait_state(id, ProvisioningState::Failed).await;
        assert_eq!(
            run.apply_receipt().unwrap().result,
            ferry_domain::receipts::ApplyResult::Failed
        );
        let (status, error, _) = eventually("the item settled", || async {
            w.status(id, Step::Apply).await.filter(|s| s.0 != "running")
        })
        .await;
        assert_eq!(status, "failed");
        assert!(error.unwrap().contains("interrupted"));
        assert_eq!(
            w.runner.apply_calls.load(Ordering::SeqCst),
            0,
            "never re-run blindly"
        );
        drop(restarted);
        w.stop().await;
    }
}

#[tokio::test]
async fn applies_in_one_environment_never_overlap_and_a_stale_plan_is_superseded() {
    let runner = FakeRunner {
        apply_delay: Duration::from_millis(300),
        ..Default::default()
    };
    let w = World::new(Backend::Postgres, runner, |_| {}).await;
    let first = w
        .request("dev", Some(EnvironmentClass::Development), "abcdef1")
        .await;
    let second = w
        .request("dev", Some(EnvironmentClass::Development), "abcdef2")
        .await;
    let other = w
        .request("test", Some(EnvironmentClass::Test), "abcdef3")
        .await;
    let mut states = Vec::new();
    for id in [first, second] {
        let runs = w.runs();
        let state = eventually("a final state", || async {
            let (run, _) = runs.load(&tenant(), &id.to_string()).await.unwrap()?;
            run.state().filter(|s| s.is_terminal())
        })
        .await;
        states.push(state);
    }
    w.wait_state(other, ProvisioningState::Applied).await;
    states.sort_by_key(|s| s.as_str());
    assert_eq!(
        states,
        [ProvisioningState::Applied, ProvisioningState::Superseded]
    );
    assert_eq!(w.runner.max_parallel_in_env.load(Ordering::SeqCst), 1);
    w.stop().await;
}

#[tokio::test]
async fn changed_inputs_supersede_the_plan() {
    let w = World::new(Backend::Sqlite, FakeRunner::default(), |_| {}).await;
    let id = w
        .request("prod", Some(EnvironmentClass::Production), "abcdef1")
        .await;
    w.wait_state(id, ProvisioningState::AwaitingApproval).await;
    w.config
        .0
        .lock()
        .unwrap()
        .insert("replicas".to_string(), serde_json::json!(3));
    let approve = RunCommand::DecideApproval {
        decision: Decision::Approve,
        decided_by: Actor::parse("bob").unwrap(),
        reason: None,
        approval_id: None,
        at: Utc::now(),
    };
    w.runs()
        .execute(&tenant(), &id.to_string(), approve, &meta("bob"), false)
        .await
        .unwrap();
    w.wait_state(id, ProvisioningState::Superseded).await;
    assert_eq!(w.runner.applies.load(Ordering::SeqCst), 0);
    w.stop().await;
}

#[tokio::test]
async fn policy_deny_rejects_and_expiry_rejects() {
    let w = World::new(Backend::Sqlite, FakeRunner::default(), |s| {
        s.approval_expiry = Some(Duration::from_millis(50))
    })
    .await;
    let denied = w
        .request("deny-me", Some(EnvironmentClass::Development), "abcdef1")
        .await;
    w.wait_state(denied, ProvisioningState::Rejected).await;
    let waiting = w
        .request("prod", Some(EnvironmentClass::Production), "abcdef1")
        .await;
    w.wait_state(waiting, ProvisioningState::Rejected).await;
    let run = w
        .runs()
        .load(&tenant(), &waiting.to_string())
        .await
        .unwrap()
        .unwrap()
        .0;
    assert_eq!(
        run.approval().unwrap().decided_by.as_str(),
        "system:approval-expiry"
    );
    w.stop().await;
}

#[tokio::test]
async fn a_new_environment_gets_its_baseline_planned() {
    let w = World::new(Backend::Sqlite, FakeRunner::default(), |s| {
        s.baseline_programs.insert(
            EnvironmentClass::Staging,
            BaselineProgram {
                program_ref: ProgramRef::parse("/srv/baselines#staging").unwrap(),
                program_version: ProgramVersion::parse("abcdef9").unwrap(),
            },
        );
    })
    .await;
    let envs: Repository<Environment> = Repository::new(w.tdb.db.clone(), ());
    let env = EnvironmentId::parse("payments-stg").unwrap();
    let register = EnvironmentCommand::Register(Box::new(EnvironmentRegistration {
        environment_id: env.clone(),
        tenant_id: tenant(),
        environment_class: EnvironmentClass::Staging,
        health_url: None,
        baseline_program: None,
        slo: None,
        recorded_by: Actor::parse("admin").unwrap(),
        recorded_at: Utc::now(),
    }));
    envs.execute(
        &tenant(),
        &Environment::aggregate_id(&tenant(), &env),
        register,
        &meta("admin"),
        true,
    )
    .await
    .unwrap();
    let run_id = ProvisioningRunId::for_baseline(&tenant(), &env, 1);
    let run = w.wait_state(run_id, ProvisioningState::Applied).await;
    assert_eq!(run.request().unwrap().kind, ProvisioningKind::Baseline);
    assert_eq!(
        run.plan_receipt().unwrap().program_version,
        format!("abcdef9{}", "0".repeat(33))
    );
    w.stop().await;
}

/// The state letter of a process, `None` once it no longer exists.
fn process_state(pid: &str) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit(')').next()?.trim_start().chars().next()
}

/// Alive: neither gone nor a zombie waiting to be reaped.
fn alive(pid: &str) -> bool {
    !matches!(process_state(pid), None | Some('Z') | Some('X'))
}

/// A stand-in `pulumi`: previews nothing; the first `up` starts a child, records its own
/// and the child's pid, and waits for ever; a later `up` succeeds at once.
const FAKE_PULUMI: &str = r#"#!/bin/sh
case "$1" in
  version) echo v3.0.0-test ;;
  preview) cat > /dev/null; echo '{"steps": []}' ;;
  up)
    cat > /dev/null
    if [ -e "$FAKE_DIR/child" ]; then echo '{}'; exit 0; fi
    sleep 300 &
    echo $! > "$FAKE_DIR/child.tmp"; mv "$FAKE_DIR/child.tmp" "$FAKE_DIR/child"
    echo $$ > "$FAKE_DIR/leader.tmp"; mv "$FAKE_DIR/leader.tmp" "$FAKE_DIR/leader"
    wait ;;
  stack) echo '{}' ;;
esac
"#;

async fn pid_in(dir: &Path, name: &str) -> String {
    eventually(&format!("a pid in {name}"), || async {
        let pid = std::fs::read_to_string(dir.join(name)).ok()?;
        pid.ends_with('\n').then(|| pid.trim().to_string())
    })
    .await
}

ferry_store::test_on_both_engines! {
    async fn losing_renewals_past_the_margin_kills_the_runners_process_group_before_the_lease_ends(backend) {
        use std::os::unix::fs::PermissionsExt;
        let fake = tempfile::tempdir().unwrap();
        let bin = fake.path().join("pulumi");
        // The child's environment has no room for the folder: the script names it.
        let script = FAKE_PULUMI.replacen(
            "#!/bin/sh\n",
            &format!("#!/bin/sh\nFAKE_DIR='{}'\n", fake.path().display()),
            1,
        );
        std::fs::write(&bin, script).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let pulumi = ferry_runners::PulumiRunner::new(&bin, fake.path().join("homes"));
        let w = World::build(
            backend,
            FakeRunner::default(),
            Some(Arc::new(pulumi)),
            true,
            |_| {},
        )
        .await;
        let first = w
            .request("dev", Some(EnvironmentClass::Development), "abcdef1")
            .await;
        let leader = pid_in(fake.path(), "leader").await;
        let child = pid_in(fake.path(), "child").await;
        assert!(alive(&leader) && alive(&child));

        // A second instance, whose runner notes whether it ever starts while the first
        // apply's processes still run; and a second run for the same environment.
        let pids = [leader.clone(), child.clone()];
        let overlapped = Arc::new(AtomicBool::new(false));
        let flag = overlapped.clone();
        let other = Arc::new(FakeRunner {
            before_apply: Some(Box::new(move || {
                if pids.iter().any(|p| alive(p)) {
                    flag.store(true, Ordering::SeqCst);
                }
            })),
            ..Default::default()
        });
        let b = w.instance(other.clone(), w.clock.clone(), true).await;
        let second = w
            .request("dev", Some(EnvironmentClass::Development), "abcdef2")
            .await;
        eventually("the second apply waits", || async {
            w.status(second, Step::Apply)
                .await
                .filter(|s| s.0 == "pending")
        })
        .await;

        // Renewals work: a sixth of the lease later, the lease is extended.
        let claimed = w.running_apply(first).await.unwrap();
        w.clock.advance(Duration::from_secs(15));
        let renewed = eventually("a renewal", || async {
            let item = w.running_apply(first).await?;
            (item.lease_until > claimed.lease_until).then_some(item)
        })
        .await;

        // Then the store refuses them, for longer than two thirds of the lease.
        w.refuse_renewals().await;
        for step in [15, 15, 11] {
            w.clock.advance(Duration::from_secs(step));
        }
        eventually("the runner's processes killed", || async {
            (!alive(&leader) && !alive(&child)).then_some(())
        })
        .await;
        assert!(
            w.clock.now_ms() < renewed.lease_until,
            "killed before the lease ends"
        );
        if backend == Backend::Postgres {
            // Another instance waits for the lease and the grace period to pass. (On SQLite
            // the stopped claim is known gone at once; `overlapped` checks it waited for
            // the processes to die.)
            assert_eq!(w.state(first).await, Some(ProvisioningState::Applying));
            assert_eq!(other.apply_calls.load(Ordering::SeqCst), 0);
        }

        // Once the claim is known gone the run is reported Failed, and only then does the
        // environment's next apply run.
        w.heal().await;
        w.clock.advance(Duration::from_secs(60 + 31));
        w.wait_state(first, ProvisioningState::Failed).await;
        let (status, error, _) = eventually("the first item settled", || async {
            w.status(first, Step::Apply)
                .await
                .filter(|s| s.0 != "running")
        })
        .await;
        assert_eq!(status, "failed");
        assert!(error.unwrap().contains("interrupted"));
        let runs = w.runs();
        eventually("the second run ends", || async {
            let (run, _) = runs.load(&tenant(), &second.to_string()).await.unwrap()?;
            run.state().filter(|s| s.is_terminal())
        })
        .await;
        assert!(
            !overlapped.load(Ordering::SeqCst),
            "two runners in one environment"
        );
        drop(b);
        w.stop().await;
    }
}

ferry_store::test_on_both_engines! {
    async fn a_lapsed_lease_with_a_live_owner_is_neither_reported_nor_frees_the_environment(backend) {
        let gate = Arc::new(Semaphore::new(0));
        let runner = FakeRunner {
            gate: Some(gate.clone()),
            ..Default::default()
        };
        let w = World::new(backend, runner, |_| {}).await;
        let first = w
            .request("dev", Some(EnvironmentClass::Development), "abcdef1")
            .await;
        eventually("the apply runs", || async {
            (w.runner.apply_calls.load(Ordering::SeqCst) == 1).then_some(())
        })
        .await;
        let second = w
            .request("dev", Some(EnvironmentClass::Development), "abcdef2")
            .await;
        eventually("the second apply waits", || async {
            w.status(second, Step::Apply)
                .await
                .filter(|s| s.0 == "pending")
        })
        .await;
        // Its plan item is marked done just after the plan is recorded: wait for that too, or
        // recovery below would rightly settle a plan item it finds running with a lapsed lease.
        eventually("the second plan item is done", || async {
            w.status(second, Step::Plan).await.filter(|s| s.0 == "done")
        })
        .await;

        // To another instance whose clock is ten minutes ahead, the lease lapsed long ago.
        let ahead = Arc::new(ShiftedClock::new());
        ahead.advance(Duration::from_secs(600));
        let b = w
            .instance(Arc::new(FakeRunner::default()), ahead, false)
            .await;
        assert_eq!(b.workers.recover().await.unwrap(), 0, "nothing settled");
        assert_eq!(w.state(first).await, Some(ProvisioningState::Applying));
        assert_eq!(w.status(first, Step::Apply).await.unwrap().0, "running");
        let claimed = b
            .workers
            .queue()
            .claim("instance-b", Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(claimed, None, "the environment's next apply is not claimed");

        // The owner finishes and records its outcome.
        gate.add_permits(2);
        w.wait_state(first, ProvisioningState::Applied).await;
        drop(b);
        w.stop().await;
    }
}

ferry_store::test_on_both_engines! {
    async fn an_old_owners_late_writes_after_losing_its_claim_are_refused(backend) {
        let w = World::idle(backend).await;
        let queue = w.workers.queue();
        let lease = Duration::from_secs(60);

        // An apply whose owner stopped renewing: recovery reports it and marks it failed.
        let id = w
            .orphaned_apply("dev", "old-owner", w.clock.now_ms() + 60_000)
            .await;
        let old = w.running_apply(id).await.unwrap();
        w.clock.advance(Duration::from_secs(60 + 31));
        assert_eq!(w.workers.recover().await.unwrap(), 1);
        assert_eq!(w.state(id).await, Some(ProvisioningState::Failed));
        // The old owner comes back and reports success: refused, nothing overwritten.
        assert!(matches!(
            queue.done(&old).await,
            Err(QueueError::ClaimLost { .. })
        ));
        assert!(matches!(
            queue.renew(&old, lease).await,
            Err(QueueError::ClaimLost { .. })
        ));
        assert!(matches!(
            queue.retry(&old, "again", Duration::ZERO).await,
            Err(QueueError::ClaimLost { .. })
        ));
        let (status, error, _) = w.status(id, Step::Apply).await.unwrap();
        assert_eq!(status, "failed");
        assert!(error.unwrap().contains("interrupted"));

        // A plan re-claimed by a new owner after the old one's lease lapsed: the old owner
        // can no longer finish it; the new one can, once.
        let plan_id = ProvisioningRunId::new_random();
        let mut tx = Tx::begin(&w.tdb.db).await.unwrap();
        enqueue(
            &mut tx,
            &plan_id.to_string(),
            Step::Plan,
            "acme",
            "acme/dev",
            now_ms(),
            None,
            None,
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let first = queue.claim("first-owner", lease).await.unwrap().unwrap();
        w.clock.advance(Duration::from_secs(61));
        assert_eq!(w.workers.recover().await.unwrap(), 1);
        let second = queue.claim("second-owner", lease).await.unwrap().unwrap();
        assert_eq!(
            (second.item_id.as_str(), second.attempts),
            (first.item_id.as_str(), 2)
        );
        assert!(matches!(
            queue.done(&first).await,
            Err(QueueError::ClaimLost { .. })
        ));
        assert!(matches!(
            queue.failed(&first, "late").await,
            Err(QueueError::ClaimLost { .. })
        ));
        assert_eq!(w.status(plan_id, Step::Plan).await.unwrap().0, "running");
        queue.done(&second).await.unwrap();
        assert_eq!(w.status(plan_id, Step::Plan).await.unwrap().0, "done");
        assert!(matches!(
            queue.done(&second).await,
            Err(QueueError::ClaimLost { .. })
        ));
        w.stop().await;
    }
}

ferry_store::test_on_both_engines! {
    async fn a_store_error_while_recording_the_outcome_is_retried_without_running_the_runner_again(backend) {
        let gate = Arc::new(Semaphore::new(0));
        let runner = FakeRunner {
            gate: Some(gate.clone()),
            ..Default::default()
        };
        let w = World::new(backend, runner, |_| {}).await;
        let id = w
            .request("dev", Some(EnvironmentClass::Development), "abcdef1")
            .await;
        eventually("the apply runs", || async {
            (w.runner.apply_calls.load(Ordering::SeqCst) == 1).then_some(())
        })
        .await;
        // The store refuses the outcome when the runner returns (and a runner called again
        // would not be held up).
        w.refuse_events().await;
        gate.add_permits(100);
        eventually("recording retried", || async {
            w.status(id, Step::Apply)
                .await
                .filter(|(_, error, attempts)| {
                    *attempts >= 3 && error.as_deref().is_some_and(|e| e.contains("store"))
                })
        })
        .await;
        assert_eq!(w.state(id).await, Some(ProvisioningState::Applying));
        w.heal().await;
        let run = w.wait_state(id, ProvisioningState::Applied).await;
        assert_eq!(run.apply_receipt().unwrap().outputs["url"], "https://x");
        let (status, _, _) = eventually("the item done", || async {
            w.status(id, Step::Apply).await.filter(|s| s.0 == "done")
        })
        .await;
        assert_eq!(status, "done");
        assert_eq!(
            w.runner.apply_calls.load(Ordering::SeqCst),
            1,
            "the runner ran once"
        );
        // The environment's last apply was recorded with the result.
        let last = w.workers.queue().last_apply("acme/dev").await.unwrap();
        assert_eq!(last.unwrap().0, id.to_string());
        w.stop().await;
    }
}

ferry_store::test_on_both_engines! {
    async fn a_failed_interruption_report_keeps_the_item_for_the_next_recovery_round(backend) {
        let w = World::idle(backend).await;
        let id = w
            .orphaned_apply("dev", "previous-process", w.clock.now_ms() - 1_000)
            .await;
        // Past the grace period too (it matters on Postgres only).
        w.clock.advance(Duration::from_secs(31));
        w.refuse_events().await;
        assert_eq!(w.workers.recover().await.unwrap(), 0, "nothing settled");
        assert_eq!(w.status(id, Step::Apply).await.unwrap().0, "running");
        assert_eq!(w.state(id).await, Some(ProvisioningState::Applying));
        w.heal().await;
        assert_eq!(w.workers.recover().await.unwrap(), 1);
        assert_eq!(w.state(id).await, Some(ProvisioningState::Failed));
        let (status, error, _) = w.status(id, Step::Apply).await.unwrap();
        assert_eq!(status, "failed");
        assert!(error.unwrap().contains("interrupted"));
        w.stop().await;
    }
}

ferry_store::test_on_both_engines! {
    async fn a_renewal_that_finds_the_claim_taken_over_cancels_the_step(backend) {
        let gate = Arc::new(Semaphore::new(0));
        let runner = FakeRunner {
            gate: Some(gate.clone()),
            ..Default::default()
        };
        let w = World::new(backend, runner, |_| {}).await;
        let id = w
            .request("dev", Some(EnvironmentClass::Development), "abcdef1")
            .await;
        eventually("the apply runs", || async {
            (w.runner.apply_calls.load(Ordering::SeqCst) == 1).then_some(())
        })
        .await;
        // Someone else holds the claim now.
        exec(
            &w.tdb.db,
            &format!("UPDATE work_items SET claim_token = 'taken-over' WHERE item_id = '{id}' AND step = 'apply'"),
        )
        .await;
        w.clock.advance(Duration::from_secs(11));
        eventually("the runner cancelled", || async {
            (w.runner.cancelled.load(Ordering::SeqCst) == 1).then_some(())
        })
        .await;
        // The old owner wrote nothing over the new claim: it is still running under the new
        // token, unless recovery already settled it (on SQLite a claim no process holds is
        // settled at once) as interrupted.
        match w.running_apply(id).await {
            Some(item) => assert_eq!(item.claim_token, "taken-over"),
            None => {
                let (status, error, _) = w.status(id, Step::Apply).await.unwrap();
                assert_eq!(status, "failed");
                assert!(error.unwrap().contains("interrupted"));
            }
        }
        assert_eq!(w.runner.applies.load(Ordering::SeqCst), 0);
        w.stop().await;
    }
}

/// The backend pids holding advisory locks in the world's (Postgres) database.
async fn advisory_holders(w: &World) -> Vec<i32> {
    let ferry_store::database::Pool::Postgres(pool) = w.tdb.db.pool() else {
        unreachable!("Postgres only")
    };
    sqlx::query_scalar(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted
            AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_terminated_liveness_connection_is_replaced_and_keeps_recovery_away() {
    let gate = Arc::new(Semaphore::new(0));
    let runner = FakeRunner {
        gate: Some(gate.clone()),
        ..Default::default()
    };
    let w = World::new(Backend::Postgres, runner, |_| {}).await;
    let id = w
        .request("dev", Some(EnvironmentClass::Development), "abcdef1")
        .await;
    eventually("the apply runs", || async {
        (w.runner.apply_calls.load(Ordering::SeqCst) == 1).then_some(())
    })
    .await;
    let holders = advisory_holders(&w).await;
    assert_eq!(holders.len(), 1, "the owner holds its liveness lock");
    // The server ends the owner's lock session.
    exec(
        &w.tdb.db,
        &format!("SELECT pg_terminate_backend({})", holders[0]),
    )
    .await;
    eventually("the lock freed", || async {
        advisory_holders(&w).await.is_empty().then_some(())
    })
    .await;
    // With the next renewal the owner takes it again, on a new connection.
    w.clock.advance(Duration::from_secs(11));
    let again = eventually("the lock taken again", || async {
        let h = advisory_holders(&w).await;
        (h.len() == 1).then(|| h[0])
    })
    .await;
    assert_ne!(again, holders[0]);
    // So an instance that sees the lease lapsed still finds the owner alive.
    let ahead = Arc::new(ShiftedClock::new());
    ahead.advance(Duration::from_secs(600));
    let b = w
        .instance(Arc::new(FakeRunner::default()), ahead, false)
        .await;
    assert_eq!(b.workers.recover().await.unwrap(), 0);
    assert_eq!(w.runner.cancelled.load(Ordering::SeqCst), 0);
    gate.add_permits(1);
    w.wait_state(id, ProvisioningState::Applied).await;
    drop(b);
    w.stop().await;
}

#[tokio::test]
async fn a_renewal_that_hangs_does_not_delay_the_fence() {
    let gate = Arc::new(Semaphore::new(0));
    let runner = FakeRunner {
        gate: Some(gate.clone()),
        ..Default::default()
    };
    let w = World::new(Backend::Postgres, runner, |_| {}).await;
    let id = w
        .request("dev", Some(EnvironmentClass::Development), "abcdef1")
        .await;
    eventually("the apply runs", || async {
        (w.runner.apply_calls.load(Ordering::SeqCst) == 1).then_some(())
    })
    .await;
    let claimed = w.running_apply(id).await.unwrap();
    // Another session locks the item's row: every renewal waits on it.
    let mut blocker = Tx::begin(&w.tdb.db).await.unwrap();
    blocker
        .execute(
            "SELECT 1 FROM work_items WHERE item_id = $1 AND step = 'apply' FOR UPDATE",
            &[ferry_store::stream::Param::Text(Some(id.to_string()))],
        )
        .await
        .unwrap();
    for step in [15, 15, 11] {
        w.clock.advance(Duration::from_secs(step));
    }
    eventually("the runner cancelled", || async {
        (w.runner.cancelled.load(Ordering::SeqCst) == 1).then_some(())
    })
    .await;
    assert!(
        w.clock.now_ms() < claimed.lease_until,
        "before the lease ends"
    );
    drop(blocker);
    assert_eq!(w.runner.applies.load(Ordering::SeqCst), 0);
    w.stop().await;
}

/// Stores a run event as a buggy or newer version of Ferry could have.
async fn insert_run_event(db: &Database, run: &str, sequence: i64, payload: serde_json::Value) {
    let event_type = payload.as_object().unwrap().keys().next().unwrap().clone();
    let sql = db.sql(
        "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata)
         VALUES ('ProvisioningRun', $1, $2, $3, '1.0', $4, $5)",
    );
    let metadata = serde_json::json!({"tenantId": "acme", "correlationId": "c-1"});
    on_pool!(db, pool => sqlx::query(&sql)
        .bind(run).bind(sequence).bind(event_type)
        .bind(sqlx::types::Json(payload)).bind(sqlx::types::Json(metadata))
        .execute(pool).await.unwrap().rows_affected());
}

async fn work_items(db: &Database) -> i64 {
    on_pool!(db, pool => sqlx::query_scalar("SELECT count(*) FROM work_items").fetch_one(pool).await.unwrap())
}

ferry_store::test_on_both_engines! {
    async fn a_request_that_does_not_decode_stops_the_enqueuer_instead_of_planning_nothing(backend) {
        let tdb = TestDatabase::new(backend).await;
        let db = &tdb.db;
        insert_run_event(db, "broken-run", 1,
            serde_json::json!({"ProvisioningRequested": {"not": "a request"}})).await;
        let workers = crate::contexts::provisioning::work::enqueuer::Enqueuer { approval_expiry: None }.subscription();
        let error = eventually("the decode error", || async {
            ferry_store::stream::catch_up(db, &workers).await.err()
        })
        .await;
        let ferry_store::HandlerError::AtEvent { position, source, .. } = &error else {
            panic!("not tied to the event: {error:?}")
        };
        assert!(
            matches!(source.as_ref(), ferry_store::HandlerError::Decode(ferry_store::DecodeError::Payload { .. })),
            "{error:?}"
        );
        assert_eq!(position.global_position, 1);
        assert_eq!(work_items(db).await, 0);
        // It stays stopped on the event: retried, never skipped.
        assert!(ferry_store::stream::catch_up(db, &workers).await.is_err());
        let status = ferry_store::stream::subscription_status(db).await.unwrap();
        assert!(status.iter().all(|s| s.position.global_position == 0), "{status:?}");
        tdb.cleanup().await;
    }
}

ferry_store::test_on_both_engines! {
    async fn an_apply_of_a_run_without_its_request_stops_the_enqueuer(backend) {
        let tdb = TestDatabase::new(backend).await;
        let db = &tdb.db;
        // A run whose history does not start with its request (impossible through the
        // aggregate): the apply cannot be keyed to an environment, so nothing is enqueued.
        insert_run_event(db, "headless-run", 1,
            serde_json::json!({"ApplyStarted": {"authorization": {"type": "notRequired"}, "startedAt": "2026-12-02T10:00:00Z"}})).await;
        let workers = crate::contexts::provisioning::work::enqueuer::Enqueuer { approval_expiry: None }.subscription();
        let error = eventually("the missing request", || async {
            ferry_store::stream::catch_up(db, &workers).await.err()
        })
        .await;
        let ferry_store::HandlerError::AtEvent { source, .. } = &error else {
            panic!("not tied to the event: {error:?}")
        };
        assert!(
            matches!(source.as_ref(), ferry_store::HandlerError::Record { what, .. } if what.contains("headless-run")),
            "{error:?}"
        );
        assert!(error.to_string().contains("ApplyStarted"), "{error}");
        assert_eq!(work_items(db).await, 0);
        tdb.cleanup().await;
    }
}

/// Why a run's plan item failed, once it has.
async fn plan_failure(w: &World, id: ProvisioningRunId) -> String {
    w.wait_state(id, ProvisioningState::Failed).await;
    let (status, error, _) = eventually("the plan item finished", || async {
        let s = w.status(id, Step::Plan).await?;
        (s.0 != "running" && s.0 != "pending").then_some(s)
    })
    .await;
    assert_eq!(status, "failed");
    error.unwrap_or_default()
}

ferry_store::test_on_both_engines! {
    async fn a_program_over_the_size_limit_fails_its_plan_naming_the_setting(backend) {
        // The checkout writes a 10-byte Pulumi.yaml; nothing reaches the runner.
        let w = World::new(backend, FakeRunner::default(), |s| s.limits.program_bytes = 9).await;
        let id = w.request("dev", Some(EnvironmentClass::Development), "abcdef1").await;
        let reason = plan_failure(&w, id).await;
        assert!(reason.contains("FERRY_MAX_PROGRAM_BYTES"), "{reason}");
        assert!(reason.contains("more than 9 bytes"), "{reason}");
        assert!(w.runs().load(&tenant(), &id.to_string()).await.unwrap().unwrap().0.plan_receipt().is_none());
        w.stop().await;
    }
}

ferry_store::test_on_both_engines! {
    async fn a_plan_over_the_resource_limit_fails_naming_the_setting(backend) {
        let runner = FakeRunner { more_resources: 3, ..Default::default() };
        let w = World::new(backend, runner, |s| s.limits.plan_resources = 3).await;
        let id = w.request("dev", Some(EnvironmentClass::Development), "abcdef1").await;
        let reason = plan_failure(&w, id).await;
        assert!(reason.contains("the plan lists 4 resources"), "{reason}");
        assert!(reason.contains("FERRY_MAX_PLAN_RESOURCES"), "{reason}");
        w.stop().await;

        // At the limit, the plan goes through.
        let runner = FakeRunner { more_resources: 2, ..Default::default() };
        let w = World::new(backend, runner, |s| s.limits.plan_resources = 3).await;
        let id = w.request("dev", Some(EnvironmentClass::Development), "abcdef1").await;
        let run = w.wait_state(id, ProvisioningState::Applied).await;
        assert_eq!(run.plan_receipt().unwrap().resources.len(), 3);
        w.stop().await;
    }
}

ferry_store::test_on_both_engines! {
    async fn a_receipt_over_the_size_limit_fails_its_plan_and_a_long_log_is_cut(backend) {
        // Forty resources make a receipt of a few kilobytes.
        let runner = FakeRunner { more_resources: 40, ..Default::default() };
        let w = World::new(backend, runner, |s| s.limits.receipt_bytes = 2_000).await;
        let id = w.request("dev", Some(EnvironmentClass::Development), "abcdef1").await;
        let reason = plan_failure(&w, id).await;
        assert!(reason.contains("plan receipt"), "{reason}");
        assert!(reason.contains("FERRY_MAX_RECEIPT_BYTES"), "{reason}");
        assert!(w.runs().load(&tenant(), &id.to_string()).await.unwrap().unwrap().0.plan_receipt().is_none());
        w.stop().await;

        // A small receipt with a long log: the plan goes on, its stored log is cut.
        let runner = FakeRunner { log_padding: 100_000, ..Default::default() };
        let w = World::new(backend, runner, |s| s.limits.receipt_bytes = 2_000).await;
        let id = w.request("dev", Some(EnvironmentClass::Development), "abcdef1").await;
        w.wait_state(id, ProvisioningState::Applied).await;
        let log = w.artifacts.get(&format!("artifacts:runs/{id}/plan.log")).await.unwrap();
        let log = String::from_utf8(log).unwrap();
        assert!(log.len() < 2_200, "{} bytes", log.len());
        assert!(log.starts_with("previewing with password ***"), "{log}");
        assert!(log.contains("FERRY_MAX_RECEIPT_BYTES"), "{log}");
        w.stop().await;
    }
}

ferry_store::test_on_both_engines! {
    async fn a_tenants_backlog_does_not_keep_another_tenants_item_from_the_next_slot(backend) {
        let w = World::idle(backend).await;
        let now = now_ms();
        let mut tx = Tx::begin(&w.tdb.db).await.unwrap();
        // The hog asked first, for many plans; the calm tenant's one plan comes last.
        for i in 0..6 {
            let item = format!("hog-{i}");
            enqueue(&mut tx, &item, Step::Plan, "hog", "hog/dev", now - 1_000 + i, None, None)
                .await
                .unwrap();
        }
        enqueue(&mut tx, "calm-0", Step::Plan, "calm", "calm/dev", now, None, None)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let queue = w.workers.queue();
        let lease = Duration::from_secs(60);
        // Two slots: the first goes to the oldest item, the second to the tenant with
        // nothing running, though five of the hog's items are older.
        let first = queue.claim("t1", lease).await.unwrap().unwrap();
        assert_eq!(first.item_id, "hog-0");
        let second = queue.claim("t2", lease).await.unwrap().unwrap();
        assert_eq!(second.item_id, "calm-0");
        // With one each running, the hog's backlog goes on in order.
        let third = queue.claim("t3", lease).await.unwrap().unwrap();
        assert_eq!(third.item_id, "hog-1");
        w.stop().await;
    }
}
