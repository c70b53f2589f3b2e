//! End-to-end provisioning: a real Git repository holding a Pulumi YAML program, the real
//! workers and adapters, the simulated runner; on real Postgres and on the SQLite default.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod common;

use common::*;
use ferry_store::database::Backend;
use ferry_store::testing::eventually_showing;
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;

const PROGRAM: &str = r#"name: web
runtime: yaml
resources:
  site:
    type: aws:s3/bucket:Bucket
    properties:
      bucketPrefix: web
      tags:
        owner: payments
  database:
    type: simulated:db:Instance
    properties:
      size: small
      password: ${dbPassword}
outputs:
  siteId: ${site.id}
"#;

const BASELINE: &str = r#"name: base
runtime: yaml
resources:
  network:
    type: aws:ec2/vpc:Vpc
    properties:
      cidrBlock: 10.0.0.0/16
outputs:
  networkId: ${network.id}
"#;

const FAILING: &str = r#"name: web
runtime: yaml
resources:
  site:
    type: aws:s3/bucket:Bucket
    properties:
      bucketPrefix: web
  queue:
    type: aws:sqs/queue:Queue
    properties:
      simulateFailure: access denied creating the queue
"#;

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_AUTHOR_NAME", "t")
        .env("GIT_AUTHOR_EMAIL", "t@example.com")
        .env("GIT_COMMITTER_NAME", "t")
        .env("GIT_COMMITTER_EMAIL", "t@example.com")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// A repository with `stacks/web/Pulumi.yaml`; returns (path, good commit, failing commit).
fn repository(root: &Path) -> (String, String, String) {
    let repo = root.join("infra");
    std::fs::create_dir_all(repo.join("stacks/web")).unwrap();
    git(&repo, &["init", "-q"]);
    std::fs::write(repo.join("stacks/web/Pulumi.yaml"), PROGRAM).unwrap();
    std::fs::create_dir_all(repo.join("stacks/base")).unwrap();
    std::fs::write(repo.join("stacks/base/Pulumi.yaml"), BASELINE).unwrap();
    git(&repo, &["add", "."]);
    git(&repo, &["commit", "-qm", "web"]);
    let good = git(&repo, &["rev-parse", "HEAD"]);
    std::fs::write(repo.join("stacks/web/Pulumi.yaml"), FAILING).unwrap();
    git(&repo, &["commit", "-qam", "queue"]);
    let failing = git(&repo, &["rev-parse", "HEAD"]);
    (repo.display().to_string(), good, failing)
}

struct Fixture {
    s: TestServer,
    repo: String,
    good: String,
    failing: String,
    secret: String,
    secret_file: String,
    _root: tempfile::TempDir,
}

/// The tenants' folders are `<root>/<tenant>`: acme's holds the repository and the secret.
async fn start(backend: Backend) -> Fixture {
    start_tuned(backend, |_| {}).await
}

async fn start_tuned(backend: Backend, tune: impl FnOnce(&mut ferry_app::Config)) -> Fixture {
    let root = tempfile::tempdir().unwrap();
    let (repo, good, failing) = repository(&root.path().join("acme"));
    let secret = format!("pw-{}", uuid::Uuid::new_v4().simple());
    let secret_file = root.path().join("acme/db-password");
    std::fs::write(&secret_file, format!("{secret}\n")).unwrap();
    let data = tempfile::tempdir().unwrap();
    let mut config = config(data.path());
    config.workers = true;
    config.approval_expiry = None;
    let tenant_roots = vec![format!("{}/{{tenant}}", root.path().display())];
    config.tenant_file_roots = Some(tenant_roots.clone());
    config.tenant_program_roots = Some(tenant_roots);
    tune(&mut config);
    let s = TestServer::start_with(backend, config, data).await;
    Fixture {
        s,
        repo,
        good,
        failing,
        secret,
        secret_file: secret_file.display().to_string(),
        _root: root,
    }
}

impl Fixture {
    async fn environment(&self, env: &str, class: &str) {
        let admin = token("acme", "platform", &[READ, APPLY], &["PlatformAdmin"]);
        let r = self
            .s
            .client
            .put(self.s.url(&format!("/factory/environments/{env}")))
            .bearer_auth(admin)
            .json(&json!({"environmentClass": class}))
            .send()
            .await
            .unwrap();
        let (status, body) = response(r).await;
        assert_eq!(status, 201, "{body}");
    }

    async fn declare(&self, env: &str, commit: &str) -> Value {
        let body = json!({
            "environmentId": env, "projectId": "payments", "kind": "Workload",
            "programRef": format!("{}#stacks/web", self.repo),
            "programVersion": commit,
            "secretRefs": {"dbPassword": format!("file://{}", self.secret_file)}
        });
        let (status, spec) = self
            .s
            .post(
                &operator("acme", "alice"),
                "/factory/provisioning/specifications",
                &body,
            )
            .await;
        assert_eq!(status, 201, "{spec}");
        spec
    }

    async fn run(&self, env: &str, commit: &str) -> String {
        let spec = self.declare(env, commit).await;
        let body = json!({"specificationId": spec["specificationId"], "specificationVersion": spec["version"], "environmentId": env, "kind": "Release"});
        let (status, run) = self
            .s
            .post(
                &operator("acme", "alice"),
                "/factory/provisioning/runs",
                &body,
            )
            .await;
        assert_eq!(status, 201, "{run}");
        run["provisioningRunId"].as_str().unwrap().to_string()
    }

    async fn wait(&self, id: &str, state: &str) -> Value {
        let alice = operator("acme", "alice");
        let (alice, path) = (&alice, &format!("/factory/provisioning/runs/{id}"));
        eventually_showing(&format!("run {id} in {state}"), 20, || async move {
            let (_, run) = self.s.get(alice, path).await;
            if run["state"] == state {
                Ok(run)
            } else {
                Err(format!("{run:#}"))
            }
        })
        .await
    }

    async fn stop(self) {
        self.s.stop().await;
    }
}

async fn non_production_run_applies_with_both_receipts(backend: Backend) {
    let f = start(backend).await;
    f.environment("payments-dev", "development").await;
    let id = f.run("payments-dev", &f.good).await;
    let run = f.wait(&id, "Applied").await;
    let plan = &run["planReceipt"];
    assert_eq!(
        (
            plan["adds"].as_u64(),
            plan["changes"].as_u64(),
            plan["deletes"].as_u64()
        ),
        (Some(2), Some(0), Some(0)),
        "{run:#}"
    );
    assert_eq!(plan["runner"], "simulated");
    assert_eq!(plan["programVersion"], f.good.as_str());
    assert_eq!(plan["inputsHash"].as_str().unwrap().len(), 64);
    assert_eq!(plan["policy"]["decision"], "allow");
    let types: Vec<&str> = plan["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["type"].as_str().unwrap())
        .collect();
    assert!(
        types.contains(&"aws:s3/bucket:Bucket") && types.contains(&"simulated:db:Instance"),
        "{types:?}"
    );
    let apply = &run["applyReceipt"];
    assert_eq!(apply["result"], "Succeeded");
    assert!(
        apply["outputs"]["siteId"]
            .as_str()
            .unwrap()
            .starts_with("site-"),
        "{apply}"
    );
    assert!(run["logsRef"].as_str().unwrap().contains("apply.log"));
    assert_eq!(run["environmentClass"], "development");

    // Logs, metrics and the environment's current specification.
    let r =
        f.s.client
            .get(f.s.url(&format!("/factory/provisioning/runs/{id}/logs")))
            .bearer_auth(operator("acme", "alice"))
            .send()
            .await
            .unwrap();
    assert_eq!(r.status(), 200);
    let logs = r.text().await.unwrap();
    assert!(
        logs.contains("==> plan") && logs.contains("==> apply"),
        "{logs}"
    );
    // The run shows Applied a moment before the applier counts it: wait for the count.
    let server = &f.s;
    eventually_showing("the Applied run counted", 10, || async move {
        let metrics = server
            .client
            .get(server.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let counted = metrics.contains("connectsoft_factory_provisioning_runs_total{tenant=\"acme\",kind=\"Release\",state=\"Applied\"} 1")
            && metrics.contains(
                "connectsoft_factory_provisioning_apply_duration_seconds_count{kind=\"Release\"} 1",
            );
        if counted {
            Ok(())
        } else {
            Err(metrics)
        }
    })
    .await;
    // The group commit's counters: on Postgres the commands' events went through it (a
    // group may hold one command); SQLite appends one command at a time and shows none.
    let metrics = f.s.metrics().await;
    let counter = |name: &str| {
        metrics.lines().find_map(|line| {
            line.strip_prefix(name)?
                .strip_prefix(' ')?
                .parse::<u64>()
                .ok()
        })
    };
    match backend {
        Backend::Postgres => {
            let groups = counter("ferry_append_groups_total").expect("groups counted");
            let commands = counter("ferry_append_group_commands_total").expect("commands counted");
            let events = counter("ferry_append_group_events_total").expect("events counted");
            assert!(
                groups >= 1 && commands >= groups && events >= commands,
                "{groups} {commands} {events}"
            );
            assert!(
                counter("ferry_append_groups_split_total").is_some(),
                "{metrics}"
            );
        }
        Backend::Sqlite => assert!(!metrics.contains("ferry_append_group"), "{metrics}"),
    }
    // Each read model follows the stream on its own; wait for this one to catch up.
    let (alice, id) = (&operator("acme", "alice"), &id);
    eventually_showing("the applied specification shown", 10, || async {
        let (_, current) =
            f.s.get(
                alice,
                "/factory/provisioning/environments/payments-dev/current-specification",
            )
            .await;
        if current["specifications"][0]["applied"]["provisioningRunId"] == id.as_str() {
            Ok(())
        } else {
            Err(format!("{current:#}"))
        }
    })
    .await;

    // The secret is nowhere: not in any table, not in any file Ferry wrote.
    assert_secret_absent(&f).await;

    // Planning again finds nothing to change.
    let again = f.run("payments-dev", &f.good).await;
    let run = f.wait(&again, "Applied").await;
    assert_eq!(run["planReceipt"]["adds"], 0);
    f.stop().await;
}

/// The id of the baseline run planned for `env`, once it shows.
async fn baseline_run(f: &Fixture, token: &str, env: &str) -> String {
    let path = format!("/factory/provisioning/runs?kind=Baseline&environmentId={env}");
    let path = &path;
    eventually_showing(&format!("a baseline run for {env}"), 20, || async move {
        let (_, page) = f.s.get(token, path).await;
        page["items"][0]["provisioningRunId"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("{page:#}"))
    })
    .await
}

#[tokio::test]
async fn a_non_production_run_applies_on_postgres() {
    non_production_run_applies_with_both_receipts(Backend::Postgres).await;
}

#[tokio::test]
async fn a_non_production_run_applies_on_the_embedded_default() {
    non_production_run_applies_with_both_receipts(Backend::Sqlite).await;
}

async fn assert_secret_absent(f: &Fixture) {
    use ferry_store::on_pool;
    let db = &f.s.db.as_ref().unwrap().db;
    let tables: Vec<String> = match db.backend() {
        Backend::Postgres => {
            on_pool!(db, pool => sqlx::query_scalar("SELECT tablename::text FROM pg_tables WHERE schemaname = 'public'").fetch_all(pool).await.unwrap())
        }
        Backend::Sqlite => {
            on_pool!(db, pool => sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table'").fetch_all(pool).await.unwrap())
        }
    };
    assert!(tables.len() >= 8, "{tables:?}");
    for table in tables {
        let rows: Vec<String> = match db.backend() {
            Backend::Postgres => {
                on_pool!(db, pool => sqlx::query_scalar(&format!("SELECT t::text FROM \"{table}\" t")).fetch_all(pool).await.unwrap())
            }
            Backend::Sqlite => {
                let columns: Vec<String> = on_pool!(db, pool => sqlx::query_scalar(&format!("SELECT name FROM pragma_table_info('{table}')")).fetch_all(pool).await.unwrap());
                // Blobs are searched as hex (the secret's hex is checked below).
                let concat = columns
                    .iter()
                    .map(|c| format!("COALESCE(CASE WHEN typeof(\"{c}\") = 'blob' THEN hex(\"{c}\") ELSE CAST(\"{c}\" AS TEXT) END, '')"))
                    .collect::<Vec<_>>()
                    .join(" || '|' || ");
                on_pool!(db, pool => sqlx::query_scalar(&format!("SELECT {concat} FROM \"{table}\"")).fetch_all(pool).await.unwrap())
            }
        };
        let hex_secret: String = f.secret.bytes().map(|b| format!("{b:02X}")).collect();
        for row in rows {
            assert!(
                !row.contains(&f.secret) && !row.contains(&hex_secret),
                "the secret is in table {table}: {row}"
            );
        }
    }
    let mut files = 0;
    let mut stack = vec![f.s.data_dir.path().to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files += 1;
                let bytes = std::fs::read(&path).unwrap();
                assert!(
                    !String::from_utf8_lossy(&bytes).contains(&f.secret),
                    "the secret is in {}",
                    path.display()
                );
            }
        }
    }
    assert!(
        files >= 3,
        "artifacts and the simulated cloud were searched"
    );
}

#[tokio::test]
async fn a_production_run_waits_for_another_identitys_approval() {
    let f = start(Backend::Postgres).await;
    f.environment("payments-prod", "production").await;
    let id = f.run("payments-prod", &f.good).await;
    let run = f.wait(&id, "AwaitingApproval").await;
    assert_eq!(run["planReceipt"]["policy"]["decision"], "require_approval");
    assert!(run["approval"]["requiredReason"].as_str().is_some());
    let approval = format!("/factory/provisioning/runs/{id}/approval");
    let (status, problem) =
        f.s.post(
            &operator("acme", "alice"),
            &approval,
            &json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(status, 403, "{problem}");
    let (status, _) =
        f.s.post(
            &operator("acme", "bob"),
            &approval,
            &json!({"decision": "approve", "reason": "CHG-7"}),
        )
        .await;
    assert_eq!(status, 200);
    let run = f.wait(&id, "Applied").await;
    assert_eq!(run["authorization"]["approvedBy"], "bob");

    // The same through run control's ApprovalDecided event (here over HTTP).
    let id = f.run("payments-prod", &f.good).await;
    f.wait(&id, "AwaitingApproval").await;
    let approval_id = uuid::Uuid::new_v4();
    let event = json!({
        "specversion": "1.0", "id": format!("approval-{approval_id}"), "source": "urn:runcontrol",
        "type": "runcontrol.approvals.v1.approval-decided", "tenantid": "acme",
        "datacontenttype": "application/json",
        "data": {"approvalId": approval_id, "tenantId": "acme", "provisioningRunId": id,
                 "decision": "approve", "decidedBy": "carol", "reason": "CAB approved"}
    });
    let (status, body) =
        f.s.post_event(&service("acme", "svc-runcontrol"), &event)
            .await;
    assert_eq!(status, 202, "{body}");
    let run = f.wait(&id, "Applied").await;
    assert_eq!(run["authorization"]["approvedBy"], "carol");
    assert_eq!(run["approvalId"], approval_id.to_string());
    f.stop().await;
}

/// The passwords the Compose example's `deploy/nats.conf` reads from the environment.
const NATS_PASSWORDS: [(&str, &str); 4] = [
    ("NATS_PASSWORD_FERRY", "ferry-pw"),
    ("NATS_PASSWORD_RUNCONTROL", "runcontrol-pw"),
    ("NATS_PASSWORD_ENVIRONMENTS", "environments-pw"),
    ("NATS_PASSWORD_RELEASES", "releases-pw"),
];

/// Run control's approval of run `run`, as anyone may write it.
fn nats_approval(run: &str) -> bytes::Bytes {
    let approval_id = uuid::Uuid::new_v4();
    json!({
        "specversion": "1.0", "id": format!("approval-{approval_id}"), "source": "urn:runcontrol",
        "type": "runcontrol.approvals.v1.approval-decided", "tenantid": "acme",
        "datacontenttype": "application/json",
        "data": {"approvalId": approval_id, "tenantId": "acme", "provisioningRunId": run,
                 "decision": "approve", "decidedBy": "carol", "reason": "CAB approved"}
    })
    .to_string()
    .into()
}

#[tokio::test]
async fn over_nats_only_run_controls_user_approves_a_production_run() {
    const APPROVALS: &str = "runcontrol.approvals.v1.approval-decided";
    let conf = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/nats.conf");
    let nats = ferry_messaging::testing::Nats::start_with_config(
        &conf,
        &NATS_PASSWORDS,
        ("ferry", "ferry-pw"),
    )
    .await;
    // Ferry's NATS user, through its settings.
    let settings = [
        ("NATS_URL", nats.url()),
        ("FERRY_NATS_USER", "ferry".to_string()),
        ("FERRY_NATS_PASSWORD", "ferry-pw".to_string()),
    ];
    let nats_auth = ferry_app::Config::load(
        None,
        &settings
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
    )
    .unwrap()
    .nats_auth;
    let f = start_tuned(Backend::Postgres, |c| {
        c.nats_url = Some(nats.url());
        c.nats_auth = nats_auth;
    })
    .await;
    f.environment("payments-prod", "production").await;
    f.environment("billing-prod", "production").await;
    let target = f.run("payments-prod", &f.good).await;
    let marker = f.run("billing-prod", &f.good).await;
    f.wait(&target, "AwaitingApproval").await;
    f.wait(&marker, "AwaitingApproval").await;
    let runcontrol =
        async_nats::jetstream::new(nats.connect_as("runcontrol", "runcontrol-pw").await);
    // Ferry's consumer makes the stream storing approvals in the background.
    let js = &nats.js().await;
    eventually_showing("a stream storing approvals", 20, || async move {
        js.stream_by_subject(APPROVALS)
            .await
            .map_err(|e| e.to_string())
    })
    .await;

    // Every other user publishes an approval of the target run: the release service's, the
    // environment service's and Ferry's own.
    for (user, password) in [
        ("releases", "releases-pw"),
        ("environments", "environments-pw"),
        ("ferry", "ferry-pw"),
    ] {
        let client = nats.connect_as(user, password).await;
        client
            .publish(APPROVALS, nats_approval(&target))
            .await
            .unwrap();
        client.flush().await.unwrap();
    }
    // Then run control approves the other run: that one is handled, the target stays
    // unapproved, and the stream holds run control's approval alone.
    runcontrol
        .publish(APPROVALS, nats_approval(&marker))
        .await
        .unwrap()
        .await
        .unwrap();
    let run = f.wait(&marker, "Applied").await;
    assert_eq!(run["authorization"]["approvedBy"], "carol");
    let (_, run) =
        f.s.get(
            &operator("acme", "alice"),
            &format!("/factory/provisioning/runs/{target}"),
        )
        .await;
    assert_eq!(run["state"], "AwaitingApproval", "{run}");
    let stream = js
        .get_stream(js.stream_by_subject(APPROVALS).await.unwrap())
        .await
        .unwrap();
    let mut subjects = stream.info_with_subjects(APPROVALS).await.unwrap();
    let stored = futures::StreamExt::next(&mut subjects)
        .await
        .map(Result::unwrap);
    assert_eq!(stored, Some((APPROVALS.to_string(), 1)));

    // Run control's approval of the target run is handled like any other.
    runcontrol
        .publish(APPROVALS, nats_approval(&target))
        .await
        .unwrap()
        .await
        .unwrap();
    let run = f.wait(&target, "Applied").await;
    assert_eq!(run["authorization"]["approvedBy"], "carol");
    f.stop().await;
}

#[tokio::test]
async fn a_wrong_commit_is_refused_naming_it_and_a_failing_program_names_the_resource() {
    let f = start(Backend::Sqlite).await;
    f.environment("payments-dev", "development").await;
    // A commit the repository does not hold is refused when declared, naming it (planning
    // checks again: the workers' tests fail a plan on a commit that is gone).
    let wrong = "0123456789abcdef0123456789abcdef01234567";
    let body = json!({
        "environmentId": "payments-dev", "projectId": "payments", "kind": "Workload",
        "programRef": format!("{}#stacks/web", f.repo), "programVersion": wrong,
    });
    let (status, problem) =
        f.s.post(
            &operator("acme", "alice"),
            "/factory/provisioning/specifications",
            &body,
        )
        .await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["errors"][0]["field"], "programVersion", "{problem}");
    assert!(problem.to_string().contains(wrong), "{problem}");

    let id = f.run("payments-dev", &f.failing).await;
    let run = f.wait(&id, "Failed").await;
    assert_eq!(run["failure"]["stage"], "apply");
    assert!(
        run["failure"]["reason"]
            .as_str()
            .unwrap()
            .contains("access denied"),
        "{run:#}"
    );
    assert!(
        run["applyReceipt"]["failingResource"]
            .as_str()
            .unwrap()
            .contains("queue"),
        "{run:#}"
    );
    assert_eq!(run["applyReceipt"]["result"], "Failed");
    f.stop().await;
}

#[tokio::test]
async fn a_new_environment_gets_its_baseline_planned_and_applied() {
    let f = start(Backend::Postgres).await;
    let admin = token("acme", "platform", &[READ, APPLY], &["PlatformAdmin"]);
    let body = json!({"environmentClass": "test", "baselineProgram": {"programRef": format!("{}#stacks/base", f.repo), "programVersion": f.good}});
    let r =
        f.s.client
            .put(f.s.url("/factory/environments/payments-test"))
            .bearer_auth(&admin)
            .json(&body)
            .send()
            .await
            .unwrap();
    assert_eq!(response(r).await.0, 201);
    // The same PUT again changes nothing.
    let r =
        f.s.client
            .put(f.s.url("/factory/environments/payments-test"))
            .bearer_auth(&admin)
            .json(&body)
            .send()
            .await
            .unwrap();
    assert_eq!(response(r).await.0, 200);
    let alice = &operator("acme", "alice");
    let id = baseline_run(&f, alice, "payments-test").await;
    let run = f.wait(&id, "Applied").await;
    assert!(
        run["applyReceipt"]["outputs"]["networkId"]
            .as_str()
            .unwrap()
            .starts_with("network-"),
        "{run:#}"
    );
    assert_eq!(run["kind"], "Baseline");
    assert_eq!(run["requestedBy"], "system:baseline");
    let (_, env) = f.s.get(alice, "/factory/environments/payments-test").await;
    assert_eq!(env["environmentClass"], "test");
    // An Operator may not record environments.
    let r =
        f.s.client
            .put(f.s.url("/factory/environments/x"))
            .bearer_auth(alice)
            .json(&json!({"environmentClass": "test"}))
            .send()
            .await
            .unwrap();
    assert_eq!(response(r).await.0, 403);
    f.stop().await;
}

fn admin(tenant: &str) -> String {
    token(tenant, "platform", &[READ, APPLY], &["PlatformAdmin"])
}

/// How many events the store holds.
async fn event_count(f: &Fixture) -> i64 {
    use ferry_store::on_pool;
    let db = &f.s.db.as_ref().unwrap().db;
    on_pool!(db, pool => sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM events").fetch_one(pool).await.unwrap())
}

/// Ferry's own key file and variables, and `/etc` as a program: each refused with a 422
/// naming the field and the rule, and nothing stored.
#[tokio::test]
async fn references_a_tenant_may_not_reach_are_refused_at_declaration() {
    let f = start(Backend::Postgres).await;
    let data = f.s.data_dir.path().display().to_string();
    let program = format!("{}#stacks/web", f.repo);
    let before = event_count(&f).await;
    let cases = [
        (
            "secretRefs.k",
            program.clone(),
            format!("file://{data}/jwt-hs256.key"),
            "token signing key",
        ),
        (
            "secretRefs.k",
            program.clone(),
            format!("file://{data}/secret-fingerprint.key"),
            "secret fingerprint key",
        ),
        (
            "secretRefs.k",
            program.clone(),
            format!("file://{data}/ferry.db"),
            "embedded database",
        ),
        (
            "secretRefs.k",
            program.clone(),
            "env://FERRY_JWT_HS256_KEY".to_string(),
            "never resolvable",
        ),
        (
            "secretRefs.k",
            program.clone(),
            "env://DATABASE_URL".to_string(),
            "never resolvable",
        ),
        (
            "secretRefs.k",
            program.clone(),
            "env://AWS_SECRET_ACCESS_KEY".to_string(),
            "never resolvable",
        ),
        (
            "secretRefs.k",
            program.clone(),
            format!("file://{}", f.secret_file.replace("/acme/", "/globex/")),
            "FERRY_TENANT_FILE_ROOTS",
        ),
        (
            "secretRefs.k",
            program.clone(),
            "vault://globex/db#password".to_string(),
            "FERRY_TENANT_VAULT_PREFIX",
        ),
        (
            "programRef",
            "/etc#".to_string(),
            format!("file://{}", f.secret_file),
            "FERRY_TENANT_PROGRAM_ROOTS",
        ),
        (
            "programRef",
            "https://internal.example/infra.git#web".to_string(),
            format!("file://{}", f.secret_file),
            "FERRY_TENANT_PROGRAM_URL_PREFIXES",
        ),
    ];
    for (field, program, secret, reason) in cases {
        let body = json!({
            "environmentId": "payments-dev", "projectId": "payments", "kind": "Workload",
            "programRef": program, "programVersion": f.good,
            "secretRefs": {"k": secret}
        });
        let (status, problem) =
            f.s.post(
                &operator("acme", "alice"),
                "/factory/provisioning/specifications",
                &body,
            )
            .await;
        assert_eq!(status, 422, "{body}: {problem}");
        let errors = problem["errors"].as_array().unwrap();
        assert_eq!(errors.len(), 1, "{problem}");
        assert_eq!(errors[0]["field"], field, "{problem}");
        assert!(
            errors[0]["reason"].as_str().unwrap().contains(reason),
            "{secret}: {problem}"
        );
    }
    // Configuration: a file outside the roots, a URL with no prefix configured.
    let body = json!({
        "environmentId": "payments-dev", "projectId": "payments", "kind": "Workload",
        "programRef": program, "programVersion": f.good,
        "configRefs": {"app": format!("file://{data}/work/x.yaml"), "remote": "https://config.example/app"}
    });
    let (status, problem) =
        f.s.post(
            &operator("acme", "alice"),
            "/factory/provisioning/specifications",
            &body,
        )
        .await;
    assert_eq!(status, 422, "{problem}");
    let fields: Vec<&str> = problem["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["field"].as_str().unwrap())
        .collect();
    assert_eq!(fields, ["configRefs.app", "configRefs.remote"], "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("FERRY_TENANT_CONFIG_URL_PREFIXES"),
        "{problem}"
    );
    // Another tenant naming acme's repository and secret.
    let body = json!({
        "environmentId": "payments-dev", "projectId": "payments", "kind": "Workload",
        "programRef": program, "programVersion": f.good,
        "secretRefs": {"dbPassword": format!("file://{}", f.secret_file)}
    });
    let (status, problem) =
        f.s.post(
            &operator("globex", "mallory"),
            "/factory/provisioning/specifications",
            &body,
        )
        .await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["errors"].as_array().unwrap().len(), 2, "{problem}");
    // A baseline program outside the roots.
    let r =
        f.s.client
            .put(f.s.url("/factory/environments/payments-test"))
            .bearer_auth(admin("acme"))
            .json(&json!({"environmentClass": "test", "baselineProgram": {"programRef": "/etc#", "programVersion": f.good}}))
            .send()
            .await
            .unwrap();
    let (status, problem) = response(r).await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["errors"][0]["field"], "baselineProgram.programRef");
    assert_eq!(event_count(&f).await, before, "nothing was stored");
    // What acme may reach is still accepted.
    f.declare("payments-dev", &f.good).await;
    assert!(event_count(&f).await > before);
    f.stop().await;
}

/// Specifications stored before the rules existed (written through the domain, not the
/// API): the run fails at resolution, naming the reference, and nothing is read.
#[tokio::test]
async fn references_stored_before_the_rules_fail_at_resolution() {
    use ferry_domain::run::{ProvisioningRun, RunCommand, RunRequest};
    use ferry_domain::specification::{Declaration, DeploymentSpecification, SpecificationCommand};
    use ferry_domain::*;
    use ferry_store::{EventMetadata, Repository};
    let f = start(Backend::Sqlite).await;
    let db = f.s.db.as_ref().unwrap().db.clone();
    let tenant = TenantId::parse("acme").unwrap();
    let meta = EventMetadata::for_request(
        tenant.clone(),
        Actor::parse("alice").unwrap(),
        uuid::Uuid::new_v4(),
    );
    let data = f.s.data_dir.path().display().to_string();
    let program = format!("{}#stacks/web", f.repo);
    let key_file = format!("file://{data}/secret-fingerprint.key");
    let cases = [
        (program.clone(), key_file.clone()),
        (program.clone(), "env://FERRY_JWT_HS256_KEY".to_string()),
        (program.clone(), "env://DATABASE_URL".to_string()),
        (program.clone(), "env://AWS_SECRET_ACCESS_KEY".to_string()),
        ("/etc#".to_string(), format!("file://{}", f.secret_file)),
    ];
    let specs: Repository<DeploymentSpecification> = Repository::new(db.clone(), ());
    let runs: Repository<ProvisioningRun> = Repository::new(db, ());
    let mut started = Vec::new();
    for (i, (program, secret)) in cases.iter().enumerate() {
        let environment = EnvironmentId::parse(format!("old-{i}")).unwrap();
        let spec_id =
            SpecificationId::for_environment(&tenant, &environment, SpecificationKind::Workload);
        let declaration = Declaration {
            specification_id: spec_id,
            tenant_id: tenant.clone(),
            project_id: ProjectId::parse("payments").unwrap(),
            environment_id: environment.clone(),
            kind: SpecificationKind::Workload,
            program_ref: ProgramRef::parse(program.as_str()).unwrap(),
            program_version: ProgramVersion::parse(f.good.as_str()).unwrap(),
            release_id: None,
            strategy: None,
            config_refs: Default::default(),
            secret_refs: std::collections::BTreeMap::from([(
                "k".to_string(),
                SecretRef::parse(secret.as_str()).unwrap(),
            )]),
            declared_by: Actor::parse("alice").unwrap(),
            declared_at: chrono::Utc::now(),
        };
        specs
            .execute(
                &tenant,
                &spec_id.to_string(),
                SpecificationCommand::Declare(Box::new(declaration)),
                &meta,
                true,
            )
            .await
            .unwrap();
        let run_id = ProvisioningRunId::new_random();
        let request = RunRequest {
            provisioning_run_id: run_id,
            tenant_id: tenant.clone(),
            project_id: ProjectId::parse("payments").unwrap(),
            environment_id: environment,
            environment_class: Some(EnvironmentClass::Development),
            specification_id: spec_id,
            specification_version: 1,
            kind: ProvisioningKind::Release,
            promotion_id: None,
            approval_id: None,
            follows_failed_apply: None,
            requested_by: Actor::parse("alice").unwrap(),
            requested_at: chrono::Utc::now(),
        };
        runs.execute(
            &tenant,
            &run_id.to_string(),
            RunCommand::Request(Box::new(request)),
            &meta,
            true,
        )
        .await
        .unwrap();
        started.push(run_id.to_string());
    }
    let key = std::fs::read_to_string(f.s.data_dir.path().join("secret-fingerprint.key"))
        .unwrap_or_default();
    for ((program, secret), id) in cases.iter().zip(&started) {
        let run = f.wait(id, "Failed").await;
        assert_eq!(run["failure"]["stage"], "plan", "{run:#}");
        let reason = run["failure"]["reason"].as_str().unwrap();
        let named = if program == "/etc#" { program } else { secret };
        assert!(reason.contains(named.as_str()), "{named}: {reason}");
        assert!(
            reason.contains("refused")
                || reason.contains("never resolvable")
                || reason.contains("outside"),
            "{reason}"
        );
        assert!(key.is_empty() || !reason.contains(key.trim()), "{reason}");
    }
    f.stop().await;
}

/// Tenants acme and globex both apply the same program to an environment named `prod`:
/// two clouds, each holding only its tenant's resources.
#[tokio::test]
async fn two_tenants_apply_to_prod_and_each_sees_only_its_own_resources() {
    let f = start(Backend::Postgres).await;
    let root = f._root.path();
    let (globex_repo, globex_good, _) = repository(&root.join("globex"));
    let globex_secret = root.join("globex/db-password");
    std::fs::write(&globex_secret, "globex-password\n").unwrap();
    let mut applied = Vec::new();
    for (tenant, repo, commit, secret) in [
        (
            "acme",
            f.repo.clone(),
            f.good.clone(),
            f.secret_file.clone(),
        ),
        (
            "globex",
            globex_repo,
            globex_good,
            globex_secret.display().to_string(),
        ),
    ] {
        let r =
            f.s.client
                .put(f.s.url("/factory/environments/prod"))
                .bearer_auth(admin(tenant))
                .json(&json!({"environmentClass": "development"}))
                .send()
                .await
                .unwrap();
        assert_eq!(response(r).await.0, 201);
        let who = operator(tenant, "alice");
        let body = json!({
            "environmentId": "prod", "projectId": "payments", "kind": "Workload",
            "programRef": format!("{repo}#stacks/web"), "programVersion": commit,
            "secretRefs": {"dbPassword": format!("file://{secret}")}
        });
        let (status, spec) =
            f.s.post(&who, "/factory/provisioning/specifications", &body)
                .await;
        assert_eq!(status, 201, "{spec}");
        let body = json!({"specificationId": spec["specificationId"], "specificationVersion": 1, "environmentId": "prod", "kind": "Release"});
        let (status, run) = f.s.post(&who, "/factory/provisioning/runs", &body).await;
        assert_eq!(status, 201, "{run}");
        let id = run["provisioningRunId"].as_str().unwrap().to_string();
        let (server, who, path) = (&f.s, &who, &format!("/factory/provisioning/runs/{id}"));
        let run = eventually_showing("the run ends", 20, || async move {
            let (_, run) = server.get(who, path).await;
            if run["state"] == "Applied" || run["state"] == "Failed" {
                Ok(run)
            } else {
                Err(format!("{run:#}"))
            }
        })
        .await;
        assert_eq!(run["state"], "Applied", "{run:#}");
        // The second tenant's prod starts empty too: both resources are new to it.
        assert_eq!(run["planReceipt"]["adds"], 2, "{tenant}: {run:#}");
        applied.push((tenant, run));
    }
    let (acme_site, globex_site) = (
        applied[0].1["applyReceipt"]["outputs"]["siteId"].clone(),
        applied[1].1["applyReceipt"]["outputs"]["siteId"].clone(),
    );
    assert_ne!(acme_site, globex_site, "two clouds mint two ids");
    for (tenant, _) in &applied {
        let path =
            f.s.data_dir
                .path()
                .join(format!("simulated-cloud/{tenant}/prod/state.json"));
        let state: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(state["tenantId"], *tenant);
        let urns: Vec<&String> = state["resources"].as_object().unwrap().keys().collect();
        assert_eq!(urns.len(), 2, "{urns:?}");
        assert!(
            urns.iter()
                .all(|u| u.starts_with(&format!("urn:pulumi:{tenant}.prod::web::"))),
            "{urns:?}"
        );
    }
    assert!(!f.s.data_dir.path().join("simulated-cloud/prod").exists());
    f.stop().await;
}

/// The operator's baseline program lives outside every tenant's roots: it is trusted as
/// configured (that program at that commit), for the class default and when named exactly.
#[tokio::test]
async fn the_operators_baseline_program_works_outside_the_tenant_roots() {
    let operator_repos = tempfile::tempdir().unwrap();
    let (repo, good, _) = repository(operator_repos.path());
    let baseline = format!("{repo}#stacks/base");
    let f = start_tuned(Backend::Sqlite, |config| {
        config.baseline_programs = vec![(
            ferry_domain::EnvironmentClass::Test,
            ferry_domain::environment::BaselineProgram {
                program_ref: ferry_domain::ProgramRef::parse(baseline.clone()).unwrap(),
                program_version: ferry_domain::ProgramVersion::parse(good.clone()).unwrap(),
            },
        )];
    })
    .await;
    let put = |env: &str, body: Value| {
        let request =
            f.s.client
                .put(f.s.url(&format!("/factory/environments/{env}")))
                .bearer_auth(admin("acme"))
                .json(&body);
        async move { response(request.send().await.unwrap()).await }
    };
    // The class default.
    let (status, body) = put("payments-test", json!({"environmentClass": "test"})).await;
    assert_eq!(status, 201, "{body}");
    // Named exactly: accepted; at another commit it is the tenant's reference and refused.
    let (status, body) = put(
        "payments-test-2",
        json!({"environmentClass": "test", "baselineProgram": {"programRef": baseline, "programVersion": good}}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = put(
        "payments-test-3",
        json!({"environmentClass": "test", "baselineProgram": {"programRef": baseline, "programVersion": f.failing}}),
    )
    .await;
    assert_eq!(status, 422, "{body}");
    let alice = &operator("acme", "alice");
    for env in ["payments-test", "payments-test-2"] {
        let id = baseline_run(&f, alice, env).await;
        let run = f.wait(&id, "Applied").await;
        assert_eq!(run["planReceipt"]["programVersion"], good.as_str());
    }
    f.stop().await;
}

/// The simulated cloud's state of `env` (acme's), edited by hand: drift made outside Ferry.
fn edit_cloud(f: &Fixture, env: &str, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path =
        f.s.data_dir
            .path()
            .join("simulated-cloud/acme")
            .join(env)
            .join("state.json");
    let mut state: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(state["resources"].as_object_mut().unwrap());
    std::fs::write(&path, state.to_string()).unwrap();
}

/// The URN of the resource whose name ends the URN with `::name`.
fn urn(resources: &serde_json::Map<String, Value>, name: &str) -> String {
    resources
        .keys()
        .find(|u| u.ends_with(&format!("::{name}")))
        .unwrap_or_else(|| panic!("no {name} in {resources:?}"))
        .clone()
}

impl Fixture {
    /// Waits until the environment's read model shows a specification applied there (what
    /// the reconciler re-plans), after the run's own view says Applied.
    async fn wait_applied(&self, env: &str) {
        let alice = operator("acme", "alice");
        let path = format!("/factory/provisioning/environments/{env}/current-specification");
        let (alice, path) = (&alice, &path);
        eventually_showing(
            &format!("{env}'s applied specification"),
            20,
            || async move {
                let (_, current) = self.s.get(alice, path).await;
                if current["specifications"][0]["applied"].is_object() {
                    Ok(())
                } else {
                    Err(current.to_string())
                }
            },
        )
        .await;
    }

    /// A new environment of `class` with the good program applied, once the environment's
    /// read model shows it (what the reconciler re-plans); the run.
    async fn applied_in(&self, env: &str, class: &str) -> String {
        self.environment(env, class).await;
        let run = self.run(env, &self.good).await;
        self.wait(&run, "Applied").await;
        self.wait_applied(env).await;
        run
    }

    /// Bob (not the requester) approves `run`.
    async fn approve_as_bob(&self, run: &str, reason: &str) {
        let (status, body) = self
            .s
            .post(
                &operator("acme", "bob"),
                &format!("/factory/provisioning/runs/{run}/approval"),
                &json!({"decision": "approve", "reason": reason}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }

    /// `POST /factory/provisioning/reconcile` for `env` as alice; the one run it started.
    async fn reconcile(&self, env: &str) -> String {
        let (status, body) = self
            .s
            .post(
                &operator("acme", "alice"),
                "/factory/provisioning/reconcile",
                &json!({"environmentId": env}),
            )
            .await;
        assert_eq!(status, 202, "{body}");
        assert_eq!(body["runs"].as_array().unwrap().len(), 1, "{body}");
        assert_eq!(body["runs"][0]["started"], true, "{body}");
        body["runs"][0]["provisioningRunId"]
            .as_str()
            .unwrap()
            .to_string()
    }
}

#[tokio::test]
async fn reconciliation_repairs_harmless_drift_and_proposes_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ferry.toml");
    std::fs::write(&file, "auto_apply_non_destructive = true\n").unwrap();
    let config_file = file.clone();
    let f = start_tuned(Backend::Sqlite, move |c| c.config_file = Some(config_file)).await;
    f.environment("payments-dev", "development").await;
    f.environment("payments-prod", "production").await;
    let dev = f.run("payments-dev", &f.good).await;
    f.wait(&dev, "Applied").await;
    f.wait_applied("payments-dev").await;

    // Nothing changed outside Ferry: the run says so, and is never applied.
    let run = f.reconcile("payments-dev").await;
    let run = f.wait(&run, "InSync").await;
    assert_eq!(run["kind"], "Reconciliation");
    assert_eq!(run["specificationVersion"], 1);
    let (_, page) =
        f.s.get(
            &operator("acme", "alice"),
            "/factory/provisioning/runs?state=InSync&environmentId=payments-dev",
        )
        .await;
    assert_eq!(page["items"].as_array().unwrap().len(), 1, "{page}");

    // A property changed by hand in development is put back, no one asked.
    edit_cloud(&f, "payments-dev", |r| {
        let site = urn(r, "site");
        r[&site]["inputs"]["bucketPrefix"] = json!("changed-by-hand");
    });
    let run = f.reconcile("payments-dev").await;
    let run = f.wait(&run, "Applied").await;
    assert_eq!(run["planReceipt"]["changes"], 1, "{run}");
    let again = f.reconcile("payments-dev").await;
    f.wait(&again, "InSync").await;

    // A resource created by hand (the plan would delete it) is a proposal, applied only as
    // planned and only when someone other than the requester approves.
    edit_cloud(&f, "payments-dev", |r| {
        let site = r[&urn(r, "site")].clone();
        let stray = urn(r, "site").replace("::site", "::stray");
        r.insert(stray, site);
    });
    let run = f.reconcile("payments-dev").await;
    let proposal = f.wait(&run, "AwaitingApproval").await;
    assert_eq!(proposal["planReceipt"]["deletes"], 1, "{proposal}");
    assert!(proposal["approval"]["requiredReason"]
        .as_str()
        .unwrap()
        .contains("deletes or replaces"));
    for (filter, count) in [("true", 1), ("false", 0)] {
        let (_, open) =
            f.s.get(
                &operator("acme", "alice"),
                &format!("/factory/provisioning/proposals?destructive={filter}"),
            )
            .await;
        assert_eq!(open["items"].as_array().unwrap().len(), count, "{open}");
    }
    let approval = format!("/factory/provisioning/runs/{run}/approval");
    let (status, _) =
        f.s.post(
            &operator("acme", "alice"),
            &approval,
            &json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(
        status, 403,
        "the requester of the reconciliation cannot approve it"
    );
    let (status, body) =
        f.s.post(
            &operator("acme", "bob"),
            &approval,
            &json!({"decision": "approve", "reason": "the stray bucket is not ours"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    f.wait(&run, "Applied").await;

    // AutoApplyNonDestructive turned off at run time: the next drift is a proposal too.
    std::fs::write(&file, "auto_apply_non_destructive = false\n").unwrap();
    assert!(f
        .s
        .server
        .as_ref()
        .unwrap()
        .reload(&std::collections::HashMap::new())
        .unwrap());
    edit_cloud(&f, "payments-dev", |r| {
        let site = urn(r, "site");
        r[&site]["inputs"]["bucketPrefix"] = json!("changed-again");
    });
    let run = f.reconcile("payments-dev").await;
    let proposal = f.wait(&run, "AwaitingApproval").await;
    assert!(proposal["approval"]["requiredReason"]
        .as_str()
        .unwrap()
        .contains("AutoApplyNonDestructive is off"));

    // Drift in production is always a proposal, even a harmless one.
    let prod = f.run("payments-prod", &f.good).await;
    f.wait(&prod, "AwaitingApproval").await;
    let (status, _) =
        f.s.post(
            &operator("acme", "bob"),
            &format!("/factory/provisioning/runs/{prod}/approval"),
            &json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(status, 200);
    f.wait(&prod, "Applied").await;
    f.wait_applied("payments-prod").await;
    edit_cloud(&f, "payments-prod", |r| {
        let site = urn(r, "site");
        r[&site]["inputs"]["bucketPrefix"] = json!("changed-in-prod");
    });
    let run = f.reconcile("payments-prod").await;
    // (The domain's rule; here the built-in policy asks for approval in production first.)
    let proposal = f.wait(&run, "AwaitingApproval").await;
    assert_eq!(proposal["planReceipt"]["changes"], 1, "{proposal}");

    // Nothing applied there yet: 404 names it; another tenant reconciles nothing of acme's.
    f.environment("payments-test", "test").await;
    let (status, body) =
        f.s.post(
            &operator("acme", "alice"),
            "/factory/provisioning/reconcile",
            &json!({"environmentId": "payments-test"}),
        )
        .await;
    assert_eq!(status, 404, "{body}");
    let (status, body) =
        f.s.post(
            &operator("globex", "mallory"),
            "/factory/provisioning/reconcile",
            &json!({}),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["runs"], json!([]), "{body}");
    let metrics = f.s.metrics().await;
    for line in [
        r#"connectsoft_factory_provisioning_reconciliation_diffs_total{destructive="false",tenant="acme"} 3"#,
        r#"connectsoft_factory_provisioning_reconciliation_diffs_total{destructive="true",tenant="acme"} 1"#,
        r#"connectsoft_factory_provisioning_runs_total{tenant="acme",kind="Reconciliation",state="InSync"} 2"#,
    ] {
        assert!(metrics.contains(line), "{line} missing from\n{metrics}");
    }
    f.stop().await;
}

#[tokio::test]
async fn each_window_is_planned_once_across_instances_busy_environments_wait_and_a_newer_plan_replaces_a_proposal(
) {
    use ferry_app::contexts::provisioning::reconcile::{leading, reconcile, Reconciliation, Scope};
    let f = start(Backend::Postgres).await;
    f.applied_in("payments-dev", "development").await;
    let db = f.s.db.as_ref().unwrap().db.clone();
    let by = ferry_domain::Actor::parse("system:reconciler").unwrap();
    let all = Scope::default();

    // Two instances reconcile the same scheduled window at once: one run between them.
    let window = "2026-12-03T12:00Z";
    let (a, b) = tokio::join!(
        reconcile(&db, &all, window, &by),
        reconcile(&db, &all, window, &by)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    let runs: Vec<_> = a.runs.iter().chain(&b.runs).collect();
    assert_eq!(runs.len(), 2, "{a:?} {b:?}");
    assert_eq!(runs[0].provisioning_run_id, runs[1].provisioning_run_id);
    assert_eq!(runs.iter().filter(|r| r.started).count(), 1, "{runs:?}");
    let run = runs[0].provisioning_run_id.to_string();
    f.wait(&run, "InSync").await;
    // After the window, a restart reconciling it again finds the same run.
    let again = reconcile(&db, &all, window, &by).await.unwrap();
    assert!(!again.runs[0].started, "{again:?}");

    // One leader at a time: while a pass holds the lock, another instance's pass stands by.
    let led = leading(&db, || async {
        let other = leading(&db, || async { unreachable!("the lock is held") }).await;
        assert!(other.unwrap().is_none());
        Ok(Reconciliation {
            window: "w".to_string(),
            runs: Vec::new(),
            skipped: Vec::new(),
        })
    })
    .await
    .unwrap();
    assert!(led.is_some());

    // A promotion holding the environment: skipped this window, saying so.
    let pool = match db.pool() {
        ferry_store::database::Pool::Postgres(pool) => pool.clone(),
        ferry_store::database::Pool::Sqlite(_) => unreachable!("a Postgres test"),
    };
    sqlx::query("INSERT INTO promotion_slots VALUES ('acme', 'payments-dev', 'p-7')")
        .execute(&pool)
        .await
        .unwrap();
    let busy = reconcile(&db, &all, "2026-12-03T16:00Z", &by)
        .await
        .unwrap();
    assert!(busy.runs.is_empty(), "{busy:?}");
    assert_eq!(busy.skipped[0].reason, "promotion p-7 holds it");
    sqlx::query("DELETE FROM promotion_slots")
        .execute(&pool)
        .await
        .unwrap();

    // An open proposal is replaced by the next re-plan of the environment.
    edit_cloud(&f, "payments-dev", |r| {
        let site = r[&urn(r, "site")].clone();
        r.insert(urn(r, "site").replace("::site", "::stray"), site);
    });
    let older = f.reconcile("payments-dev").await;
    f.wait(&older, "AwaitingApproval").await;
    let newer = f.reconcile("payments-dev").await;
    let superseded = f.wait(&older, "Superseded").await;
    assert!(
        superseded["supersededReason"]
            .as_str()
            .unwrap()
            .contains(&newer),
        "{superseded}"
    );
    f.wait(&newer, "AwaitingApproval").await;

    // The open proposals: only the newer one, destructive.
    let alice = operator("acme", "alice");
    let (_, open) =
        f.s.get(&alice, "/factory/provisioning/proposals?destructive=true")
            .await;
    let ids: Vec<&str> = open["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["provisioningRunId"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [newer.as_str()], "{open}");
    assert!(open["items"][0]["planReceipt"]["resources"].is_array());
    let (_, none) =
        f.s.get(
            &alice,
            "/factory/provisioning/proposals?destructive=false&environmentId=payments-dev",
        )
        .await;
    assert_eq!(none["items"], json!([]), "{none}");
    let (status, body) =
        f.s.get(&alice, "/factory/provisioning/proposals?destructive=maybe")
            .await;
    assert_eq!(status, 400, "{body}");
    f.stop().await;
}

impl Fixture {
    /// `POST …/ignore-rules` for `env` as `who`; the status and the body.
    async fn ignore(&self, who: &str, env: &str, body: Value) -> (u16, Value) {
        let (status, rule) = self
            .s
            .post(
                &operator("acme", who),
                &format!("/factory/provisioning/environments/{env}/ignore-rules"),
                &body,
            )
            .await;
        (status, rule)
    }
}

/// The inputs of the resource named `name` in acme's simulated cloud of `env`.
fn cloud_inputs(f: &Fixture, env: &str, name: &str) -> Value {
    let path =
        f.s.data_dir
            .path()
            .join("simulated-cloud/acme")
            .join(env)
            .join("state.json");
    let state: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let resources = state["resources"].as_object().unwrap();
    resources[&urn(resources, name)]["inputs"].clone()
}

#[tokio::test]
async fn an_ignore_rule_hides_exactly_its_difference_and_an_approval_covers_only_the_plan_shown() {
    let f = start(Backend::Sqlite).await;
    f.applied_in("payments-dev", "development").await;
    let (mut site, mut database, mut stray) = (String::new(), String::new(), String::new());

    // Two hand edits: the site's tags (the team accepts them) and the database's size.
    edit_cloud(&f, "payments-dev", |r| {
        site = urn(r, "site");
        database = urn(r, "database");
        stray = site.replace("::site", "::stray");
        r[&site]["inputs"]["tags"]["cost-center"] = json!("by-hand");
        r[&database]["inputs"]["size"] = json!("huge");
    });
    // A rule needs a reason and a real URN; who added it is the token's, never the body's.
    let (status, body) = f
        .ignore(
            "alice",
            "payments-dev",
            json!({"urn": site, "property": "tags", "reason": " "}),
        )
        .await;
    assert_eq!(
        (status, body["errors"][0]["field"].as_str()),
        (422, Some("reason")),
        "{body}"
    );
    let (status, body) = f
        .ignore(
            "alice",
            "payments-dev",
            json!({"urn": "site", "reason": "r"}),
        )
        .await;
    assert!(matches!(status, 400 | 422), "{body}");
    assert!(body.to_string().contains("urn"), "{body}");
    let (status, body) = f
        .ignore(
            "alice",
            "payments-dev",
            json!({"urn": site, "reason": "r", "addedBy": "someone-else"}),
        )
        .await;
    assert!(
        matches!(status, 400 | 422),
        "a forged actor is refused: {body}"
    );
    let (status, reader) =
        f.s.post(
            &token("acme", "rita", &[READ], &["Reader"]),
            "/factory/provisioning/environments/payments-dev/ignore-rules",
            &json!({"urn": site, "reason": "r"}),
        )
        .await;
    assert_eq!(status, 403, "{reader}");
    let (status, tags) = f
        .ignore(
            "alice",
            "payments-dev",
            json!({"urn": site, "property": "tags", "reason": "the cost team tags buckets by hand"}),
        )
        .await;
    assert_eq!(status, 201, "{tags}");
    assert_eq!(tags["addedBy"], "alice");
    let (status, again) = f
        .ignore(
            "bob",
            "payments-dev",
            json!({"urn": site, "property": "tags", "reason": "twice"}),
        )
        .await;
    assert_eq!(status, 409, "the same difference is ignored once: {again}");

    // The reconciliation repairs the database and leaves the tags alone, saying which rule.
    let run = f.reconcile("payments-dev").await;
    let run = f.wait(&run, "Applied").await;
    let receipt = &run["planReceipt"];
    assert_eq!(receipt["changes"], 1, "{run:#}");
    assert_eq!(receipt["ignored"][0]["urn"], site.as_str(), "{run:#}");
    assert_eq!(
        receipt["ignored"][0]["properties"],
        json!(["tags"]),
        "{run:#}"
    );
    assert_eq!(
        receipt["ignored"][0]["ruleIds"],
        json!([tags["ruleId"]]),
        "{run:#}"
    );
    assert_eq!(
        cloud_inputs(&f, "payments-dev", "database")["size"],
        "small"
    );
    assert_eq!(
        cloud_inputs(&f, "payments-dev", "site")["tags"]["cost-center"],
        "by-hand"
    );
    let again = f.reconcile("payments-dev").await;
    let in_sync = f.wait(&again, "InSync").await;
    assert_eq!(in_sync["planReceipt"]["ignored"][0]["urn"], site.as_str());

    // A property rule cannot hide a difference the apply would overwrite: shown, with a note.
    edit_cloud(&f, "payments-dev", |r| {
        r[&site]["inputs"]["bucketPrefix"] = json!("renamed-by-hand");
    });
    let run = f.reconcile("payments-dev").await;
    let run = f.wait(&run, "Applied").await;
    assert!(run["planReceipt"]["ignored"].is_null(), "{run:#}");
    assert!(
        run["planReceipt"]["warnings"][0]
            .as_str()
            .unwrap()
            .contains("bucketPrefix"),
        "{run:#}"
    );

    // A resource created by hand, accepted as a whole: in sync, and left in the cloud.
    edit_cloud(&f, "payments-dev", |r| {
        let copy = r[&site].clone();
        r.insert(stray.clone(), copy);
    });
    let (status, whole) = f
        .ignore(
            "alice",
            "payments-dev",
            json!({"urn": stray, "reason": "the data team's bucket"}),
        )
        .await;
    assert_eq!(status, 201, "{whole}");
    let run = f.reconcile("payments-dev").await;
    let run = f.wait(&run, "InSync").await;
    assert_eq!(run["planReceipt"]["ignored"][0]["op"], "delete", "{run:#}");
    let (_, rules) =
        f.s.get(
            &operator("acme", "alice"),
            "/factory/provisioning/environments/payments-dev/ignore-rules",
        )
        .await;
    assert_eq!(rules["rules"].as_array().unwrap().len(), 2, "{rules}");

    // Another tenant sees none of acme's rules and cannot remove one.
    let mallory = operator("globex", "mallory");
    let (_, theirs) =
        f.s.get(
            &mallory,
            "/factory/provisioning/environments/payments-dev/ignore-rules",
        )
        .await;
    assert_eq!(theirs["rules"], json!([]), "{theirs}");
    let remove = format!(
        "/factory/provisioning/environments/payments-dev/ignore-rules/{}/remove",
        whole["ruleId"].as_str().unwrap()
    );
    let (status, body) =
        f.s.post(&mallory, &remove, &json!({"reason": "mine now"}))
            .await;
    assert_eq!(status, 404, "{body}");

    // Removed (with a reason), the stray bucket is a proposal again.
    let (status, body) =
        f.s.post(&operator("acme", "bob"), &remove, &json!({}))
            .await;
    assert!(
        matches!(status, 400 | 422),
        "a removal needs a reason: {body}"
    );
    let (status, removed) =
        f.s.post(
            &operator("acme", "bob"),
            &remove,
            &json!({"reason": "the data team moved out"}),
        )
        .await;
    assert_eq!(status, 200, "{removed}");
    assert_eq!(removed["removedBy"], "bob");
    let (status, _) =
        f.s.post(
            &operator("acme", "bob"),
            &remove,
            &json!({"reason": "again"}),
        )
        .await;
    assert_eq!(status, 409);
    let proposal = f.reconcile("payments-dev").await;
    let shown = f.wait(&proposal, "AwaitingApproval").await;
    assert_eq!(shown["planReceipt"]["deletes"], 1, "{shown:#}");

    // The target changes after the proposal was shown: approving it applies nothing.
    edit_cloud(&f, "payments-dev", |r| {
        r[&database]["inputs"]["size"] = json!("tiny");
    });
    f.approve_as_bob(&proposal, "the stray bucket goes").await;
    let superseded = f.wait(&proposal, "Superseded").await;
    let reason = superseded["supersededReason"].as_str().unwrap();
    assert!(
        reason.contains("target changed after the plan") && reason.contains(&database),
        "{reason}"
    );
    assert_eq!(
        cloud_inputs(&f, "payments-dev", "database")["size"],
        "tiny",
        "nothing applied"
    );
    assert!(
        cloud_inputs(&f, "payments-dev", "stray").is_object(),
        "nothing deleted"
    );
    f.stop().await;
}

#[tokio::test]
async fn after_a_failed_apply_the_next_reconciliation_proposes_the_fix() {
    let f = start(Backend::Sqlite).await;
    f.applied_in("payments-test", "test").await;
    // The next version fails half-way: the site is changed, the queue is never created.
    let failed = f.run("payments-test", &f.failing).await;
    let failed_run = f.wait(&failed, "Failed").await;
    assert_eq!(
        failed_run["applyReceipt"]["result"], "Failed",
        "{failed_run:#}"
    );
    assert!(
        cloud_inputs(&f, "payments-test", "site")["tags"].is_null(),
        "partly changed"
    );

    // Re-planning what was last applied shows the fix; in a test environment a harmless
    // difference would apply by itself, but not after a failed apply.
    let run = f.reconcile("payments-test").await;
    let proposal = f.wait(&run, "AwaitingApproval").await;
    assert_eq!(proposal["specificationVersion"], 1, "{proposal:#}");
    assert_eq!(proposal["planReceipt"]["changes"], 1, "{proposal:#}");
    let reason = proposal["approval"]["requiredReason"].as_str().unwrap();
    assert!(
        reason.contains(&failed) && reason.contains("failed"),
        "{reason}"
    );
    f.approve_as_bob(&run, "back to version 1").await;
    f.wait(&run, "Applied").await;
    assert_eq!(
        cloud_inputs(&f, "payments-test", "site")["tags"]["owner"],
        "payments"
    );
    // Put right, the environment is in sync and harmless drift repairs itself again.
    let next = f.reconcile("payments-test").await;
    f.wait(&next, "InSync").await;

    // A refresh that cannot read the resources' state is a failed check, never "in sync".
    let state =
        f.s.data_dir
            .path()
            .join("simulated-cloud/acme/payments-test/state.json");
    std::fs::write(&state, "{ not the cloud's state").unwrap();
    let broken = f.reconcile("payments-test").await;
    let failed = f.wait(&broken, "Failed").await;
    assert_eq!(failed["failure"]["stage"], "plan", "{failed:#}");
    assert!(
        failed["failure"]["reason"]
            .as_str()
            .unwrap()
            .contains("corrupt"),
        "{failed:#}"
    );
    f.stop().await;
}

#[tokio::test]
async fn two_ferry_processes_reconcile_a_window_once() {
    let f = start(Backend::Postgres).await;
    f.applied_in("payments-dev", "development").await;
    let url = f.s.db.as_ref().unwrap().location.clone();
    let spawn = || {
        let data = tempfile::tempdir().unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("FERRY_DATA_DIR", data.path())
            .env("DATABASE_URL", &url)
            .env("FERRY_LOG", "warn")
            .args(["reconcile", "--window", "2026-12-03T20:00Z"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        (child, data)
    };
    // Two processes at once, then a third after them (a restart): one run between them.
    let (a, b) = (spawn(), spawn());
    let mut outputs = Vec::new();
    for (child, _data) in [a, b] {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        outputs.push(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let (late, _data) = spawn();
    let out = late.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let late: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(late["runs"][0]["started"], false, "{late}");
    let started: usize = outputs
        .iter()
        .filter_map(|o| serde_json::from_str::<Value>(o).ok())
        .map(|v| {
            v["runs"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|r| r["started"] == true)
                .count()
        })
        .sum();
    assert_eq!(started, 1, "{outputs:?}");
    let run = late["runs"][0]["provisioningRunId"]
        .as_str()
        .unwrap()
        .to_string();
    f.wait(&run, "InSync").await;
    let (_, page) =
        f.s.get(
            &operator("acme", "alice"),
            "/factory/provisioning/runs?kind=Reconciliation&environmentId=payments-dev",
        )
        .await;
    assert_eq!(page["items"].as_array().unwrap().len(), 1, "{page}");
    f.stop().await;
}

/// Runs git in `dir` with `input` on its standard input.
fn git_stdin(dir: &Path, args: &[&str], input: &[u8]) -> String {
    use std::io::Write;
    let mut child = Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_AUTHOR_NAME", "t")
        .env("GIT_AUTHOR_EMAIL", "t@example.com")
        .env("GIT_COMMITTER_NAME", "t")
        .env("GIT_COMMITTER_EMAIL", "t@example.com")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "git {args:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// A tree holding exactly `entries` (mode, name, object id) in this order, duplicates
/// included (which `git mktree` would refuse).
fn raw_tree(repo: &Path, entries: &[(&str, &str, String)]) -> String {
    let mut bytes = Vec::new();
    for (mode, name, id) in entries {
        bytes.extend_from_slice(format!("{mode} {name}\0").as_bytes());
        for pair in id.as_bytes().chunks(2) {
            let pair = std::str::from_utf8(pair).unwrap();
            bytes.push(u8::from_str_radix(pair, 16).unwrap());
        }
    }
    git_stdin(
        repo,
        &["hash-object", "-t", "tree", "-w", "--literally", "--stdin"],
        &bytes,
    )
}

/// A commit of acme's repository whose `stacks/web` holds `a/b/c/d/l -> ../../../..` (the
/// work folder a step checks out into, `<data>/work/<tenant>/<run>/<step>`) and `extra`.
fn hostile_commit(repo: &Path, extra: &[(&str, &str, &str)]) -> String {
    let blob = |data: &str| git_stdin(repo, &["hash-object", "-w", "--stdin"], data.as_bytes());
    let mut ladder = raw_tree(repo, &[("120000", "l", blob("../../../.."))]);
    for name in ["d", "c", "b"] {
        ladder = raw_tree(repo, &[("40000", name, ladder)]);
    }
    let mut web = vec![("40000", "a", ladder)];
    web.extend(
        extra
            .iter()
            .map(|(mode, name, data)| (*mode, *name, blob(data))),
    );
    let web = raw_tree(repo, &web);
    let stacks = raw_tree(repo, &[("40000", "web", web)]);
    let root = raw_tree(repo, &[("40000", "stacks", stacks)]);
    git(repo, &["commit-tree", &root, "-m", "hostile"])
}

/// The issue's reproductions end to end: a program whose links, each inside alone, lead
/// together four levels above the checkout (the data dir). A name twice (the link, then a
/// blob) must not overwrite Ferry's own key, and a `Pulumi.yaml` led outside must not be
/// planned: each run fails at its plan naming the entry, and nothing outside changes.
#[cfg(unix)]
#[tokio::test]
async fn a_program_whose_links_leave_the_checkout_fails_naming_the_entry() {
    use std::os::unix::fs::PermissionsExt;
    let f = start(Backend::Sqlite).await;
    f.environment("payments-dev", "development").await;
    let repo = Path::new(&f.repo);
    let data = f.s.data_dir.path().to_path_buf();
    let key = data.join("secret-fingerprint.key");
    let before = std::fs::read(&key).unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&key), 0o600);

    let through_link = hostile_commit(
        repo,
        &[
            ("100644", "Pulumi.yaml", PROGRAM),
            (
                "120000",
                "x",
                "a/b/c/d/l/../../../../secret-fingerprint.key",
            ),
            ("100644", "x", "PWNED-BY-ACM"),
        ],
    );
    let id = f.run("payments-dev", &through_link).await;
    let run = f.wait(&id, "Failed").await;
    assert_eq!(run["failure"]["stage"], "plan", "{run:#}");
    let reason = run["failure"]["reason"].as_str().unwrap();
    assert!(reason.contains("entry stacks/web/x"), "{reason}");
    assert_eq!(std::fs::read(&key).unwrap(), before, "the key is untouched");
    assert_eq!(mode(&key), 0o600);

    // Another program lying outside the checkout (as another tenant's would).
    let outside = data.join("other-program.yaml");
    std::fs::write(&outside, PROGRAM.replace("name: web", "name: elsewhere")).unwrap();
    let read_outside = hostile_commit(
        repo,
        &[(
            "120000",
            "Pulumi.yaml",
            "a/b/c/d/l/../../../../other-program.yaml",
        )],
    );
    let id = f.run("payments-dev", &read_outside).await;
    let run = f.wait(&id, "Failed").await;
    assert_eq!(run["failure"]["stage"], "plan", "{run:#}");
    let reason = run["failure"]["reason"].as_str().unwrap();
    assert!(reason.contains("entry stacks/web/Pulumi.yaml"), "{reason}");
    assert!(reason.contains("leads outside the checkout"), "{reason}");
    f.stop().await;
}
