//! The simulated runner end to end, against a simulated cloud in a temporary folder.
// Test helpers outside #[test] functions unwrap too: a failed setup is a failed test.
#![allow(clippy::unwrap_used)]

use ferry_domain::ports::runner::{Runner, RunnerError, RunnerInput, StackName};
use ferry_domain::ports::SecretValue;
use ferry_domain::receipts::ResourceOp;
use ferry_domain::{EnvironmentId, TenantId};
use ferry_runners::simulated::cloud::CloudState;
use ferry_runners::{PreviewDocument, SimulatedRunner};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;
use tempfile::TempDir;

struct Fixture {
    _data: TempDir,
    program: TempDir,
    runner: SimulatedRunner,
}

impl Fixture {
    fn new(program: &str) -> Self {
        let data = tempfile::tempdir().unwrap();
        let runner = SimulatedRunner::new(data.path());
        let f = Self {
            _data: data,
            program: tempfile::tempdir().unwrap(),
            runner,
        };
        f.write(program);
        f
    }
    fn write(&self, program: &str) {
        std::fs::write(self.program.path().join("Pulumi.yaml"), program).unwrap();
    }
    fn input(&self) -> RunnerInput {
        self.input_for("acme", "dev")
    }
    fn input_for(&self, tenant: &str, environment: &str) -> RunnerInput {
        let tenant = TenantId::parse(tenant).unwrap();
        let stack =
            StackName::for_environment(&tenant, &EnvironmentId::parse(environment).unwrap());
        RunnerInput {
            tenant,
            environment_id: environment.into(),
            stack,
            program_dir: self.program.path().to_path_buf(),
            config: BTreeMap::from([("region".into(), json!("eu-west-1"))]),
            secrets: BTreeMap::from([(
                "dbPassword".into(),
                SecretValue::new("hunter2-very-secret"),
            )]),
            timeout: Duration::from_secs(10),
            refresh: false,
            exclude: Vec::new(),
            identity: None,
        }
    }
    fn state_file(&self) -> std::path::PathBuf {
        self.runner
            .state_path(&TenantId::parse("acme").unwrap(), "dev")
            .unwrap()
    }
    fn state(&self) -> CloudState {
        serde_json::from_slice(&std::fs::read(self.state_file()).unwrap()).unwrap()
    }
    async fn counts(&self) -> (u32, u32, u32, u32) {
        let p = self.runner.preview(&self.input()).await.unwrap().plan;
        (p.adds, p.changes, p.deletes, p.replaces)
    }
}

const BASE: &str = r#"
name: shop
runtime: yaml
config:
  region:
    type: string
variables:
  prefix: shop-${region}
resources:
  bucket:
    type: aws:s3/bucket:Bucket
    properties:
      bucketName: ${prefix}-assets
      versioning: true
    options:
      replaceOnChanges: [bucketName]
  db:
    type: aws:rds/instance:Instance
    properties:
      size: small
      password: ${dbPassword}
      url: postgres://admin:${dbPassword}@db
  site:
    type: aws:s3/bucketWebsite:BucketWebsite
    properties:
      bucket: ${bucket.id}
      index: index.html
outputs:
  bucketId: ${bucket.id}
  bucketName: ${bucket.bucketName}
  dbUrl: ${db.url}
"#;

fn urn(t: &str, name: &str) -> String {
    format!("urn:pulumi:acme.dev::shop::{t}::{name}")
}

#[tokio::test]
async fn name_and_version() {
    let f = Fixture::new(BASE);
    assert_eq!(f.runner.name(), "simulated");
    assert_eq!(
        f.runner.version().await.unwrap(),
        format!("{}-simulated", env!("CARGO_PKG_VERSION"))
    );
}

#[tokio::test]
async fn creates_then_same_after_apply() {
    let f = Fixture::new(BASE);
    let preview = f.runner.preview(&f.input()).await.unwrap();
    assert_eq!((preview.plan.adds, preview.plan.resources.len()), (3, 3));
    assert!(preview
        .plan
        .resources
        .iter()
        .all(|r| r.op == ResourceOp::Create));
    assert_eq!(
        preview.plan.resources[0].urn,
        urn("aws:s3/bucket:Bucket", "bucket")
    );
    assert_eq!(
        preview.plan.resources[0].resource_type,
        "aws:s3/bucket:Bucket"
    );
    // The log is a pulumi preview document that parses with the shared parser.
    let doc: PreviewDocument = serde_json::from_str(&preview.log).unwrap();
    assert_eq!(
        doc.change_summary,
        BTreeMap::from([("create".to_string(), 3)])
    );
    assert_eq!(
        ferry_runners::parse_preview(preview.log.as_bytes()).unwrap(),
        preview.plan
    );
    assert!(!f.state_file().exists(), "preview does not touch the cloud");

    let applied = f.runner.apply(&f.input()).await.unwrap();
    let state = f.state();
    let bucket = &state.resources[&urn("aws:s3/bucket:Bucket", "bucket")];
    assert_eq!(applied.outputs["bucketId"], json!(bucket.id));
    assert!(bucket.id.starts_with("bucket-"));
    assert_eq!(
        applied.outputs["bucketName"],
        json!("shop-eu-west-1-assets")
    );
    let site = &state.resources[&urn("aws:s3/bucketWebsite:BucketWebsite", "site")];
    assert_eq!(site.inputs["bucket"], json!(bucket.id));
    assert_eq!(
        site.dependencies,
        vec![urn("aws:s3/bucket:Bucket", "bucket")]
    );
    assert_eq!(state.outputs, applied.outputs);

    let again = f.runner.preview(&f.input()).await.unwrap().plan;
    assert_eq!(
        (again.adds, again.changes, again.deletes, again.replaces),
        (0, 0, 0, 0)
    );
    assert_eq!(again.resources.len(), 3);
    assert!(again.resources.iter().all(|r| r.op == ResourceOp::Same));
    // Applying an unchanged program changes nothing, ids included.
    f.runner.apply(&f.input()).await.unwrap();
    assert_eq!(f.state().resources, state.resources);
}

#[tokio::test]
async fn a_plan_names_the_properties_that_differ_and_an_excluded_resource_is_left_alone() {
    let f = Fixture::new(BASE);
    f.runner.apply(&f.input()).await.unwrap();
    let before = f.state();
    f.write(
        &BASE
            .replace("size: small", "size: large")
            .replace("index.html", "home.html"),
    );
    let db = urn("aws:rds/instance:Instance", "db");
    let site = urn("aws:s3/bucketWebsite:BucketWebsite", "site");
    let plan = f.runner.preview(&f.input()).await.unwrap().plan;
    let changed: Vec<(&str, Vec<String>)> = plan
        .resources
        .iter()
        .filter(|r| r.op == ResourceOp::Update)
        .map(|r| (r.urn.as_str(), r.properties.clone()))
        .collect();
    assert_eq!(
        changed,
        [
            (db.as_str(), vec!["size".to_string()]),
            (site.as_str(), vec!["index".to_string()])
        ]
    );
    // `exclude` (pulumi up --exclude): the preview and the apply leave the database alone.
    let mut input = f.input();
    input.exclude = vec![db.clone()];
    let plan = f.runner.preview(&input).await.unwrap().plan;
    assert_eq!(plan.changes, 1);
    assert!(plan
        .resources
        .iter()
        .all(|r| r.urn != db || r.op == ResourceOp::Same));
    f.runner.apply(&input).await.unwrap();
    let after = f.state();
    assert_eq!(
        after.resources[&db], before.resources[&db],
        "the database was left alone"
    );
    assert_eq!(after.resources[&site].inputs["index"], "home.html");
}

#[tokio::test]
async fn update_in_place_keeps_the_id() {
    let f = Fixture::new(BASE);
    f.runner.apply(&f.input()).await.unwrap();
    let before = f.state();
    f.write(&BASE.replace("size: small", "size: large"));
    let preview = f.runner.preview(&f.input()).await.unwrap();
    assert_eq!(preview.plan.changes, 1);
    assert_eq!(
        (
            preview.plan.adds,
            preview.plan.deletes,
            preview.plan.replaces
        ),
        (0, 0, 0)
    );
    let db_urn = urn("aws:rds/instance:Instance", "db");
    assert!(preview
        .plan
        .resources
        .iter()
        .any(|r| r.urn == db_urn && r.op == ResourceOp::Update));
    let doc: PreviewDocument = serde_json::from_str(&preview.log).unwrap();
    let step = doc.steps.iter().find(|s| s.urn == db_urn).unwrap();
    assert_eq!(step.diff_reasons, vec!["size"]);
    f.runner.apply(&f.input()).await.unwrap();
    let after = f.state();
    assert_eq!(after.resources[&db_urn].inputs["size"], json!("large"));
    assert_eq!(after.resources[&db_urn].id, before.resources[&db_urn].id);
}

#[tokio::test]
async fn replace_on_changes_replaces_with_a_new_id() {
    let f = Fixture::new(BASE);
    f.runner.apply(&f.input()).await.unwrap();
    let old_id = f.state().resources[&urn("aws:s3/bucket:Bucket", "bucket")]
        .id
        .clone();
    f.write(&BASE.replace("${prefix}-assets", "${prefix}-media"));
    let plan = f.runner.preview(&f.input()).await.unwrap().plan;
    // The bucket is replaced; the site refers to its new id, so it is updated.
    assert_eq!(
        (plan.adds, plan.changes, plan.deletes, plan.replaces),
        (0, 1, 0, 1)
    );
    let applied = f.runner.apply(&f.input()).await.unwrap();
    let state = f.state();
    let new_id = &state.resources[&urn("aws:s3/bucket:Bucket", "bucket")].id;
    assert_ne!(new_id, &old_id);
    assert_eq!(applied.outputs["bucketId"], json!(new_id));
    assert_eq!(
        state.resources[&urn("aws:s3/bucketWebsite:BucketWebsite", "site")].inputs["bucket"],
        json!(new_id)
    );
}

#[tokio::test]
async fn delete_removes_from_the_cloud() {
    let f = Fixture::new(BASE);
    f.runner.apply(&f.input()).await.unwrap();
    let without_site =
        BASE.split("  site:").next().unwrap().to_string() + "outputs:\n  bucketId: ${bucket.id}\n";
    f.write(&without_site);
    let plan = f.runner.preview(&f.input()).await.unwrap().plan;
    assert_eq!(
        (plan.adds, plan.changes, plan.deletes, plan.replaces),
        (0, 0, 1, 0)
    );
    let site_urn = urn("aws:s3/bucketWebsite:BucketWebsite", "site");
    assert!(plan.resources.iter().any(|r| r.urn == site_urn
        && r.op == ResourceOp::Delete
        && r.resource_type == "aws:s3/bucketWebsite:BucketWebsite"));
    let applied = f.runner.apply(&f.input()).await.unwrap();
    assert!(!f.state().resources.contains_key(&site_urn));
    assert_eq!(f.state().resources.len(), 2);
    assert_eq!(applied.outputs.keys().collect::<Vec<_>>(), vec!["bucketId"]);
}

#[tokio::test]
async fn protected_resources_are_not_deleted_or_replaced() {
    let protected = BASE.replace(
        "    options:\n      replaceOnChanges: [bucketName]",
        "    options:\n      protect: true\n      replaceOnChanges: [bucketName]",
    );
    let f = Fixture::new(&protected);
    f.runner.apply(&f.input()).await.unwrap();
    let bucket_urn = urn("aws:s3/bucket:Bucket", "bucket");
    assert!(f.state().resources[&bucket_urn].protect);

    f.write(&protected.replace("${prefix}-assets", "${prefix}-media"));
    match f.runner.preview(&f.input()).await {
        Err(RunnerError::ProgramFailed {
            reason, resource, ..
        }) => {
            assert_eq!(resource.as_deref(), Some(bucket_urn.as_str()));
            assert!(
                reason.contains("'bucket'") && reason.contains("protected"),
                "{reason}"
            );
        }
        other => panic!("expected ProgramFailed, got {other:?}"),
    }

    // Removing the resource from the program would delete it: refused, state untouched.
    f.write("name: shop\nruntime: yaml\n");
    let before = f.state();
    for result in [
        f.runner.preview(&f.input()).await.map(|_| ()),
        f.runner.apply(&f.input()).await.map(|_| ()),
    ] {
        match result {
            Err(RunnerError::ProgramFailed {
                resource, reason, ..
            }) => {
                assert_eq!(resource.as_deref(), Some(bucket_urn.as_str()));
                assert!(reason.contains("deleted"), "{reason}");
            }
            other => panic!("expected ProgramFailed, got {other:?}"),
        }
    }
    assert_eq!(f.state(), before);

    // Unprotecting is an apply of its own; then the delete goes through.
    f.write(BASE);
    f.runner.apply(&f.input()).await.unwrap();
    assert!(!f.state().resources[&bucket_urn].protect);
    f.write("name: shop\nruntime: yaml\n");
    let plan = f.runner.preview(&f.input()).await.unwrap().plan;
    assert_eq!(plan.deletes, 3);
    f.runner.apply(&f.input()).await.unwrap();
    assert!(f.state().resources.is_empty());
}

#[tokio::test]
async fn deletes_go_dependents_first() {
    let f = Fixture::new(BASE);
    f.runner.apply(&f.input()).await.unwrap();
    f.write("name: shop\nruntime: yaml\n");
    let plan = f.runner.preview(&f.input()).await.unwrap().plan;
    let order: Vec<_> = plan
        .resources
        .iter()
        .map(|r| r.urn.rsplit("::").next().unwrap().to_string())
        .collect();
    let pos = |n: &str| order.iter().position(|o| o == n).unwrap();
    assert!(pos("site") < pos("bucket"), "{order:?}");
    assert_eq!(plan.deletes, 3);
}

#[tokio::test]
async fn bad_references_are_invalid_programs() {
    let f = Fixture::new(&BASE.replace("${bucket.id}\n      index", "${bukket.id}\n      index"));
    match f.runner.preview(&f.input()).await {
        Err(RunnerError::InvalidProgram(r)) => {
            assert!(r.contains("site") && r.contains("bukket"), "{r}")
        }
        other => panic!("{other:?}"),
    }
    f.write(&BASE.replace("versioning: true", "versioning: ${site.index}"));
    match f.runner.apply(&f.input()).await {
        Err(RunnerError::InvalidProgram(r)) => assert!(
            r.contains("cycle") && r.contains("bucket -> site -> bucket"),
            "{r}"
        ),
        other => panic!("{other:?}"),
    }
    f.write("not: [valid");
    assert!(matches!(
        f.runner.preview(&f.input()).await,
        Err(RunnerError::InvalidProgram(_))
    ));
    std::fs::remove_file(f.program.path().join("Pulumi.yaml")).unwrap();
    assert!(
        matches!(f.runner.preview(&f.input()).await, Err(RunnerError::InvalidProgram(r)) if r.contains("Pulumi.yaml"))
    );
    assert!(!f.state_file().exists());
}

#[tokio::test]
async fn failure_knob_leaves_a_partial_apply() {
    let failing = BASE.replace(
        "      index: index.html",
        "      index: index.html\n      simulateFailure: quota exceeded",
    );
    let f = Fixture::new(&failing);
    let site_urn = urn("aws:s3/bucketWebsite:BucketWebsite", "site");
    match f.runner.apply(&f.input()).await {
        Err(RunnerError::ProgramFailed {
            reason,
            resource,
            log,
        }) => {
            assert_eq!(reason, "site: quota exceeded");
            assert_eq!(resource.as_deref(), Some(site_urn.as_str()));
            assert!(log.contains("quota exceeded"));
        }
        other => panic!("expected ProgramFailed, got {other:?}"),
    }
    let state = f.state();
    assert_eq!(
        state.resources.len(),
        2,
        "bucket and db were applied before the failure"
    );
    assert!(state
        .resources
        .contains_key(&urn("aws:s3/bucket:Bucket", "bucket")));
    assert!(!state.resources.contains_key(&site_urn));
    assert!(state.outputs.is_empty(), "no outputs from a failed apply");
    // Fixing the program applies the rest.
    f.write(BASE);
    let plan = f.runner.preview(&f.input()).await.unwrap().plan;
    assert_eq!((plan.adds, plan.changes), (1, 0));
    f.runner.apply(&f.input()).await.unwrap();
    assert_eq!(f.state().resources.len(), 3);
}

#[tokio::test]
async fn edits_outside_ferry_are_drift() {
    let f = Fixture::new(BASE);
    f.runner.apply(&f.input()).await.unwrap();
    assert_eq!(f.counts().await, (0, 0, 0, 0));
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(f.state_file()).unwrap()).unwrap();
    state["resources"][urn("aws:rds/instance:Instance", "db")]["inputs"]["size"] = json!("xlarge");
    std::fs::write(f.state_file(), serde_json::to_vec(&state).unwrap()).unwrap();
    assert_eq!(f.counts().await, (0, 1, 0, 0));
    // Apply puts the cloud back to the program's state.
    f.runner.apply(&f.input()).await.unwrap();
    assert_eq!(f.counts().await, (0, 0, 0, 0));
    // A resource created by hand in the cloud is deleted by the next apply.
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(f.state_file()).unwrap()).unwrap();
    state["resources"]["urn:pulumi:acme.dev::shop::aws:s3/bucket:Bucket::stray"] =
        json!({"type": "aws:s3/bucket:Bucket", "id": "stray-1", "inputs": {}});
    std::fs::write(f.state_file(), serde_json::to_vec(&state).unwrap()).unwrap();
    assert_eq!(f.counts().await, (0, 0, 1, 0));
}

fn contains_in_tree(dir: &Path, needle: &str) -> bool {
    std::fs::read_dir(dir).unwrap().any(|e| {
        let p = e.unwrap().path();
        if p.is_dir() {
            contains_in_tree(&p, needle)
        } else {
            String::from_utf8_lossy(&std::fs::read(&p).unwrap()).contains(needle)
        }
    })
}

#[tokio::test]
async fn secrets_never_reach_disk_or_logs() {
    let f = Fixture::new(BASE);
    let preview = f.runner.preview(&f.input()).await.unwrap();
    assert!(!preview.log.contains("hunter2"));
    assert!(preview.log.contains("[secret]"));
    let applied = f.runner.apply(&f.input()).await.unwrap();
    assert!(!applied.log.contains("hunter2"));
    assert_eq!(applied.outputs["dbUrl"], json!("[secret]"));
    let state = f.state();
    let db = &state.resources[&urn("aws:rds/instance:Instance", "db")];
    assert_eq!(db.inputs["password"], json!("[secret]"));
    assert_eq!(db.inputs["url"], json!("[secret]"));
    assert_eq!(db.inputs["size"], json!("small"));
    assert!(!contains_in_tree(f._data.path(), "hunter2"));
    // A failure message that quotes a secret is redacted too.
    f.write(&BASE.replace(
        "      size: small",
        "      size: small\n      simulateFailure: bad password ${dbPassword}",
    ));
    match f.runner.apply(&f.input()).await {
        Err(RunnerError::ProgramFailed { reason, log, .. }) => {
            assert_eq!(reason, "db: [secret]");
            assert!(!log.contains("hunter2"));
        }
        other => panic!("{other:?}"),
    }
    assert!(!contains_in_tree(f._data.path(), "hunter2"));
}

#[tokio::test]
async fn environments_are_separate_clouds() {
    let f = Fixture::new(BASE);
    f.runner.apply(&f.input()).await.unwrap();
    let staging = f.input_for("acme", "staging");
    let plan = f.runner.preview(&staging).await.unwrap().plan;
    assert_eq!(plan.adds, 3);
    assert!(plan.resources[0]
        .urn
        .starts_with("urn:pulumi:acme.staging::shop::"));
    let mut evil = f.input();
    evil.environment_id = "../escape".into();
    assert!(matches!(
        f.runner.apply(&evil).await,
        Err(RunnerError::InvalidProgram(_))
    ));
}

#[tokio::test]
async fn replace_is_emitted_in_the_pulumi_shape() {
    let f = Fixture::new(BASE);
    f.runner.apply(&f.input()).await.unwrap();
    f.write(&BASE.replace("${prefix}-assets", "${prefix}-media"));
    let log = f.runner.preview(&f.input()).await.unwrap().log;
    let doc: serde_json::Value = serde_json::from_str(&log).unwrap();
    let step = doc["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["op"] == "replace")
        .unwrap();
    assert_eq!(step["urn"], json!(urn("aws:s3/bucket:Bucket", "bucket")));
    assert_eq!(step["oldState"]["type"], "aws:s3/bucket:Bucket");
    assert_eq!(
        step["newState"]["inputs"]["bucketName"],
        "shop-eu-west-1-media"
    );
    assert_eq!(
        step["oldState"]["inputs"]["bucketName"],
        "shop-eu-west-1-assets"
    );
    assert_eq!(step["replaceReasons"], json!(["bucketName"]));
    assert_ne!(step["oldState"]["id"], step["newState"]["id"]);
    assert_eq!(
        doc["changeSummary"],
        json!({"replace": 1, "update": 1, "same": 1})
    );
}

/// Two tenants' environments of the same name are two clouds: each tenant sees only its own
/// resources, in its own state file, on its own stack.
#[tokio::test]
async fn tenants_are_separate_clouds() {
    let f = Fixture::new(BASE);
    let acme = f.input_for("acme", "prod");
    let globex = f.input_for("globex", "prod");
    f.runner.apply(&acme).await.unwrap();
    assert_eq!(f.runner.preview(&acme).await.unwrap().plan.adds, 0);
    // globex's prod is empty although acme's is not.
    let plan = f.runner.preview(&globex).await.unwrap().plan;
    assert_eq!((plan.adds, plan.changes, plan.deletes), (3, 0, 0));
    assert!(plan
        .resources
        .iter()
        .all(|r| r.urn.starts_with("urn:pulumi:globex.prod::shop::")));
    f.runner.apply(&globex).await.unwrap();
    let state = |tenant: &str| -> CloudState {
        let path = f
            .runner
            .state_path(&TenantId::parse(tenant).unwrap(), "prod")
            .unwrap();
        assert!(path.ends_with(format!("simulated-cloud/{tenant}/prod/state.json")));
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    };
    for tenant in ["acme", "globex"] {
        let s = state(tenant);
        assert_eq!(
            (s.tenant_id.as_str(), s.stack.as_str()),
            (tenant, format!("{tenant}.prod").as_str())
        );
        assert_eq!(s.resources.len(), 3);
        assert!(
            s.resources
                .keys()
                .all(|urn| urn.starts_with(&format!("urn:pulumi:{tenant}.prod::"))),
            "{:?}",
            s.resources.keys()
        );
    }
    // Destroying acme's resources (an empty program) leaves globex's alone.
    f.write("name: shop\nruntime: yaml\n");
    let plan = f.runner.preview(&acme).await.unwrap().plan;
    assert_eq!(plan.deletes, 3);
    f.runner.apply(&acme).await.unwrap();
    assert!(state("acme").resources.is_empty());
    assert_eq!(state("globex").resources.len(), 3);
}

/// A large program's plan is CPU work: it must leave the runtime free for the process's other
/// requests (two large programs once stalled every tenant's GETs for seconds).
#[tokio::test(flavor = "current_thread")]
async fn a_large_plan_does_not_hold_the_async_runtime() {
    let mut program = String::from("name: big\nruntime: yaml\nresources:\n");
    for i in 0..3_000 {
        program.push_str(&format!(
            "  r{i}:\n    type: aws:s3/bucket:Bucket\n    properties:\n      bucketPrefix: b{i}\n"
        ));
    }
    let f = Fixture::new(&program);
    let input = f.input();
    let preview = f.runner.preview(&input);
    tokio::pin!(preview);
    // On the one thread of this runtime, the ticker runs only while the preview waits.
    let mut ticks = 0;
    let outcome = loop {
        tokio::select! {
            biased;
            outcome = &mut preview => break outcome.unwrap(),
            _ = tokio::time::sleep(Duration::from_millis(1)) => ticks += 1,
        }
    };
    assert_eq!(outcome.plan.adds, 3_000);
    assert!(ticks > 0, "the runtime was held for the whole plan");
}
