//! Worker tests on real databases, with in-test doubles for the ports (the real adapters are
//! tested in their crates and end to end).

use crate::metrics::Metrics;
use crate::queue::{enqueue, now_ms, Step};
use crate::{Ports, Settings, Workers};
use chrono::Utc;
use ferry_domain::environment::{
    BaselineProgram, Environment, EnvironmentCommand, EnvironmentRegistration,
};
use ferry_domain::ports::runner::*;
use ferry_domain::ports::sources::*;
use ferry_domain::ports::SecretValue;
use ferry_domain::receipts::{PlannedResource, PolicyDecision, PolicyOutcome, ResourceOp};
use ferry_domain::run::{Decision, ProvisioningRun, RunCommand, RunRequest};
use ferry_domain::specification::{Declaration, DeploymentSpecification, SpecificationCommand};
use ferry_domain::*;
use ferry_store::database::Backend;
use ferry_store::stream::Tx;
use ferry_store::testing::{eventually, TestDatabase};
use ferry_store::{EventMetadata, Repository};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
}

#[derive(Default)]
struct FakeRunner {
    deletes: u32,
    unavailable_previews: AtomicUsize,
    fail_apply: Option<String>,
    apply_delay: Duration,
    applies: AtomicUsize,
    running: Mutex<HashMap<String, usize>>,
    max_parallel_in_env: AtomicUsize,
}

#[async_trait::async_trait]
impl Runner for FakeRunner {
    fn name(&self) -> &'static str {
        "fake"
    }
    async fn version(&self) -> Result<String, RunnerError> {
        Ok("1.0-test".to_string())
    }
    async fn preview(&self, input: &RunnerInput) -> Result<PreviewOutcome, RunnerError> {
        if self.unavailable_previews.load(Ordering::SeqCst) > 0 {
            self.unavailable_previews.fetch_sub(1, Ordering::SeqCst);
            return Err(RunnerError::Unavailable("runner busy".to_string()));
        }
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
                resources: vec![PlannedResource {
                    urn: "urn:pulumi:e::p::test:Thing::a".into(),
                    resource_type: "test:Thing".into(),
                    op: ResourceOp::Create,
                }],
            },
            log: format!("previewing with password {secret}"),
        })
    }
    async fn apply(&self, input: &RunnerInput) -> Result<ApplyOutcome, RunnerError> {
        let env = input.environment_id.clone();
        {
            let mut running = self.running.lock().unwrap();
            let n = running.entry(env.clone()).or_default();
            *n += 1;
            self.max_parallel_in_env.fetch_max(*n, Ordering::SeqCst);
        }
        tokio::time::sleep(self.apply_delay).await;
        *self.running.lock().unwrap().entry(env).or_default() -= 1;
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
    workers: Arc<Workers>,
    runner: Arc<FakeRunner>,
    config: Arc<Config>,
    artifacts: Arc<Artifacts>,
    stop: tokio::sync::watch::Sender<bool>,
    _dir: tempfile::TempDir,
}

fn tenant() -> TenantId {
    TenantId::parse("acme").unwrap()
}

fn meta(actor: &str) -> EventMetadata {
    EventMetadata::for_request(tenant(), Actor::parse(actor).unwrap(), uuid::Uuid::new_v4())
}

impl World {
    async fn new(backend: Backend, runner: FakeRunner, tune: impl FnOnce(&mut Settings)) -> Self {
        let tdb = TestDatabase::new(backend).await;
        let dir = tempfile::tempdir().unwrap();
        let runner = Arc::new(runner);
        let config = Arc::new(Config::default());
        let artifacts = Arc::new(Artifacts::default());
        let ports = Ports {
            programs: Arc::new(Programs),
            runner: runner.clone(),
            secrets: Arc::new(Secrets),
            config: config.clone(),
            policy: Arc::new(Policy),
            artifacts: artifacts.clone(),
        };
        let mut settings = Settings::new(dir.path());
        settings.poll = Duration::from_millis(20);
        settings.plan_backoff = Duration::from_millis(10);
        tune(&mut settings);
        let workers = Workers::new(
            tdb.db.clone(),
            ports,
            settings,
            Arc::new(Metrics::default()),
        );
        let (stop, rx) = tokio::sync::watch::channel(false);
        workers.start(rx);
        Self {
            tdb,
            workers,
            runner,
            config,
            artifacts,
            stop,
            _dir: dir,
        }
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

#[tokio::test]
async fn a_non_production_run_plans_applies_and_keeps_both_receipts() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
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
        let metrics = w.workers.metrics.render();
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
    let (status, error, _) = w
        .workers
        .queue()
        .status(&id.to_string(), Step::Plan)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status, "failed");
    assert!(error
        .unwrap()
        .contains("commit deadbeef not found in /srv/infra#env"));
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
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(w.runner.applies.load(Ordering::SeqCst), 1);
    w.stop().await;
}

#[tokio::test]
async fn an_interrupted_apply_is_reported_failed_and_never_rerun() {
    let w = World::new(Backend::Postgres, FakeRunner::default(), |_| {}).await;
    // Stop the workers' effect by putting a run in Applying with an apply item whose lease
    // expired: what a process killed mid-apply leaves behind.
    let _ = w.stop.send(true);
    let id = w
        .request("prod", Some(EnvironmentClass::Development), "abcdef1")
        .await;
    let runs = w.runs();
    let key = id.to_string();
    // Play the planner by hand (the workers are stopped).
    let plan = ferry_domain::receipts::PlanReceipt {
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
    let mut tx = Tx::begin(&w.tdb.db).await.unwrap();
    enqueue(
        &mut tx,
        &key,
        Step::Apply,
        "acme",
        "acme/prod",
        now_ms(),
        None,
        None,
    )
    .await
    .unwrap();
    tx.execute(
        "UPDATE work_items SET status = 'running', lease_until = $2, attempts = 1 WHERE item_id = $1 AND step = 'apply'",
        &[ferry_store::stream::Param::Text(Some(key.clone())), ferry_store::stream::Param::Int(Some(now_ms() - 1000))],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    // A new process starts.
    let ports = Ports {
        programs: Arc::new(Programs),
        runner: w.runner.clone(),
        secrets: Arc::new(Secrets),
        config: w.config.clone(),
        policy: Arc::new(Policy),
        artifacts: w.artifacts.clone(),
    };
    let dir = tempfile::tempdir().unwrap();
    let mut settings = Settings::new(dir.path());
    settings.poll = Duration::from_millis(20);
    let restarted = Workers::new(
        w.tdb.db.clone(),
        ports,
        settings,
        Arc::new(Metrics::default()),
    );
    let (stop, rx) = tokio::sync::watch::channel(false);
    restarted.start(rx);
    let run = w.wait_state(id, ProvisioningState::Failed).await;
    assert_eq!(
        run.apply_receipt().unwrap().result,
        ferry_domain::receipts::ApplyResult::Failed
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        w.runner.applies.load(Ordering::SeqCst),
        0,
        "never re-run blindly"
    );
    let (status, error, _) = restarted
        .queue()
        .status(&key, Step::Apply)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status, "failed");
    assert!(error.unwrap().contains("interrupted"));
    let _ = stop.send(true);
    w.stop().await;
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
    let run_id = ProvisioningRunId::for_idempotency_key(&tenant(), "baseline/payments-stg/v1");
    let run = w.wait_state(run_id, ProvisioningState::Applied).await;
    assert_eq!(run.request().unwrap().kind, ProvisioningKind::Baseline);
    assert_eq!(
        run.plan_receipt().unwrap().program_version,
        format!("abcdef9{}", "0".repeat(33))
    );
    w.stop().await;
}
