//! Test helpers: a real `nats-server` per test (killable, restartable), commands that
//! produce events, reading a JetStream stream back, and schema validation.
#![allow(dead_code, clippy::unwrap_used, missing_docs)]

use async_nats::jetstream;
use chrono::Utc;
use ferry_domain::receipts::{ApplyReceipt, ApplyResult, PlanReceipt, PlannedResource, ResourceOp};
use ferry_domain::run::{ProvisioningRun, RunCommand, RunRequest};
use ferry_domain::specification::{Declaration, DeploymentSpecification, SpecificationCommand};
use ferry_domain::*;
use ferry_store::{Database, EventMetadata, Repository};
use serde_json::Value;
use std::collections::BTreeMap;
use uuid::Uuid;

#[allow(unused_imports)] // each test binary uses its own part of the helpers
pub use ferry_messaging::testing::Nats;

/// One stored message of a stream.
#[derive(Debug, Clone)]
pub struct Stored {
    pub subject: String,
    pub msg_id: Option<String>,
    pub position: Option<String>,
    pub body: Value,
}

/// Every message of `stream` (empty when it does not exist).
pub async fn stream_messages(js: &jetstream::Context, stream: &str) -> Vec<Stored> {
    let Ok(mut s) = js.get_stream(stream).await else {
        return vec![];
    };
    let state = s.info().await.unwrap().state.clone();
    let mut out = vec![];
    if state.messages == 0 {
        return out;
    }
    for seq in state.first_sequence..=state.last_sequence {
        if let Ok(m) = s.get_raw_message(seq).await {
            out.push(Stored {
                subject: m.subject.to_string(),
                msg_id: m.headers.get("Nats-Msg-Id").map(|v| v.to_string()),
                position: m.headers.get("Ferry-Position").map(|v| v.to_string()),
                body: serde_json::from_slice(&m.payload).unwrap_or(Value::Null),
            });
        }
    }
    out
}

/// Waits until the global stream shows `n` events (on Postgres, a reader sees an event
/// only once every older transaction on the server ended: other tests' included).
pub async fn wait_events(db: &Database, n: usize) -> usize {
    wait_for(&format!("{n} events in the stream"), 30, || async move {
        ferry_store::stream::read_after(db, ferry_store::Position::default(), 100_000)
            .await
            .unwrap()
            .len()
            == n
    })
    .await;
    n
}

pub fn tenant(name: &str) -> TenantId {
    TenantId::parse(name).unwrap()
}

pub fn meta(t: &str) -> EventMetadata {
    EventMetadata::for_request(tenant(t), Actor::parse("alice").unwrap(), Uuid::new_v4())
}

pub fn run_request(t: &str, id: ProvisioningRunId, promotion: Option<PromotionId>) -> RunCommand {
    RunCommand::Request(Box::new(RunRequest {
        provisioning_run_id: id,
        tenant_id: tenant(t),
        project_id: ProjectId::parse("payments").unwrap(),
        environment_id: EnvironmentId::parse("payments-dev").unwrap(),
        environment_class: Some(EnvironmentClass::Development),
        specification_id: SpecificationId::new_random(),
        specification_version: 3,
        kind: ProvisioningKind::Release,
        promotion_id: promotion,
        approval_id: None,
        follows_failed_apply: None,
        requested_by: Actor::parse("alice").unwrap(),
        requested_at: Utc::now(),
    }))
}

pub fn plan_receipt() -> PlanReceipt {
    let r = |urn: &str, op| PlannedResource {
        urn: urn.to_string(),
        resource_type: "aws:s3/bucket:Bucket".to_string(),
        op,
        properties: Vec::new(),
    };
    PlanReceipt {
        ignored: Vec::new(),
        adds: 2,
        changes: 1,
        deletes: 0,
        replaces: 1,
        resources: vec![
            r("urn:a", ResourceOp::Create),
            r("urn:b", ResourceOp::Create),
            r("urn:c", ResourceOp::Update),
            r("urn:d", ResourceOp::Replace),
            r("urn:e", ResourceOp::Same),
        ],
        inputs_hash: "abc123".to_string(),
        program_version: "3f2a9c1".to_string(),
        runner: "simulated".to_string(),
        runner_version: "1.0.0".to_string(),
        policy: None,
        warnings: vec![],
    }
}

pub fn apply_receipt() -> ApplyReceipt {
    ApplyReceipt {
        outputs: BTreeMap::from([
            ("url".to_string(), serde_json::json!("https://payments.dev")),
            ("replicas".to_string(), serde_json::json!(3)),
        ]),
        duration_seconds: 12.5,
        result: ApplyResult::Succeeded,
        runner_version: "1.0.0".to_string(),
        failing_resource: None,
    }
}

/// Runs `commands` on run `id` of tenant `t`.
pub async fn on_run(db: &Database, t: &str, id: ProvisioningRunId, commands: Vec<RunCommand>) {
    let runs: Repository<ProvisioningRun> = Repository::new(db.clone(), ());
    for c in commands {
        runs.execute(&tenant(t), &id.to_string(), c, &meta(t), true)
            .await
            .unwrap();
    }
}

/// A run that plans and applies: Requested, Planned, ApplyStarted, Applied.
pub async fn applied_run(
    db: &Database,
    t: &str,
    promotion: Option<PromotionId>,
) -> ProvisioningRunId {
    let id = ProvisioningRunId::new_random();
    let now = Utc::now();
    on_run(
        db,
        t,
        id,
        vec![
            run_request(t, id, promotion),
            RunCommand::RecordPlan {
                receipt: Box::new(plan_receipt()),
                logs_ref: None,
                at: now,
            },
            RunCommand::StartApply { at: now },
            RunCommand::RecordApplySucceeded {
                receipt: Box::new(apply_receipt()),
                logs_ref: Some("logs/apply.txt".to_string()),
                at: now,
            },
        ],
    )
    .await;
    id
}

/// A run whose planning fails: Requested, Failed.
pub async fn failed_run(db: &Database, t: &str) -> ProvisioningRunId {
    let id = ProvisioningRunId::new_random();
    on_run(
        db,
        t,
        id,
        vec![
            run_request(t, id, None),
            RunCommand::FailPlanning {
                reason: "program version 3f2a9c1 not found".to_string(),
                at: Utc::now(),
            },
        ],
    )
    .await;
    id
}

/// A run cancelled before planning: Requested, Cancelled.
pub async fn cancelled_run(db: &Database, t: &str) -> ProvisioningRunId {
    let id = ProvisioningRunId::new_random();
    on_run(
        db,
        t,
        id,
        vec![
            run_request(t, id, None),
            RunCommand::Cancel {
                cancelled_by: Actor::parse("bob").unwrap(),
                reason: Some("not needed".to_string()),
                at: Utc::now(),
            },
        ],
    )
    .await;
    id
}

/// Declares a specification version for `payments-dev`.
pub async fn declare(db: &Database, t: &str) -> SpecificationId {
    let environment = EnvironmentId::parse("payments-dev").unwrap();
    let id =
        SpecificationId::for_environment(&tenant(t), &environment, SpecificationKind::Environment);
    let specs: Repository<DeploymentSpecification> = Repository::new(db.clone(), ());
    let declaration = Declaration {
        specification_id: id,
        tenant_id: tenant(t),
        project_id: ProjectId::parse("payments").unwrap(),
        environment_id: environment,
        kind: SpecificationKind::Environment,
        program_ref: ProgramRef::parse("https://git.example/infra.git#stacks/web").unwrap(),
        program_version: ProgramVersion::parse("3f2a9c1").unwrap(),
        release_id: None,
        strategy: None,
        config_refs: BTreeMap::new(),
        secret_refs: BTreeMap::new(),
        declared_by: Actor::parse("alice").unwrap(),
        declared_at: Utc::now(),
    };
    specs
        .execute(
            &tenant(t),
            &id.to_string(),
            SpecificationCommand::Declare(Box::new(declaration)),
            &meta(t),
            true,
        )
        .await
        .unwrap();
    id
}

/// Validates a published message: the envelope against the CloudEvent schema and `data`
/// against the schema of its subject. Panics with the errors otherwise.
pub fn assert_valid(message: &Stored) {
    static FILES: std::sync::OnceLock<BTreeMap<String, String>> = std::sync::OnceLock::new();
    let files = FILES.get_or_init(|| {
        ferry_messaging::published_schemas(
            &ferry_app::contexts::provisioning::events::publishers(),
            &ferry_app::Contexts::builtin().inbound_kinds().unwrap(),
        )
        .into_iter()
        .collect()
    });
    let check = |path: &str, instance: &Value| {
        let schema: Value = serde_json::from_str(&files[path]).unwrap();
        let validator = jsonschema::validator_for(&schema).unwrap();
        let errors: Vec<String> = validator
            .iter_errors(instance)
            .map(|e| e.to_string())
            .collect();
        assert!(
            errors.is_empty(),
            "{} invalid against {path}: {errors:?}\n{instance:#}",
            message.subject
        );
    };
    check("events/cloudevent.schema.json", &message.body);
    let doc = ferry_messaging::schemas::subject_docs(
        &ferry_app::contexts::provisioning::events::publishers(),
        &ferry_app::Contexts::builtin().inbound_kinds().unwrap(),
    )
    .into_iter()
    .find(|d| d.subject == message.subject)
    .unwrap_or_else(|| panic!("no schema documented for {}", message.subject));
    check(&doc.schema, &message.body["data"]);
}

/// Polls until `check` holds (at most `secs` seconds).
pub async fn wait_for<F, Fut>(what: &str, secs: u64, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    ferry_store::testing::eventually_within(what, secs, || {
        let done = check();
        async move { done.await.then_some(()) }
    })
    .await
}
