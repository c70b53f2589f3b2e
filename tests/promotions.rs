//! Promotions end to end over HTTP: releases recorded, promotions queued one per
//! environment, the gates in order with their evidence, rejection naming the failing gate,
//! a hotfix that policy allows, a withdrawn release, and another tenant kept out.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod common;
#[path = "promotions/console.rs"]
mod console;

use axum::routing::get;
use common::*;
use ferry_messaging::testing::Nats;
use ferry_store::database::Backend;
use ferry_store::testing::eventually_showing;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::Arc;

const D_READ: &str = "factory.delivery.read";
const D_PROMOTE: &str = "factory.delivery.promote";

/// A Ferry with its workers (the promotion driver) and a health endpoint the test controls.
struct Delivery {
    s: TestServer,
    health: String,
    status: Arc<AtomicU16>,
    /// The test's endpoint server: `/healthz`, `/smoke` (200), `/smoke-broken` (500) and a
    /// Prometheus `/api/v1/query` answering `slo` (NaN: no value); Ferry's
    /// `FERRY_PROMETHEUS_URL`.
    base: String,
    slo: Arc<AtomicU64>,
    /// The queries Prometheus was sent, in order.
    queries: Arc<std::sync::Mutex<Vec<String>>>,
    /// Requests the test's endpoint server answered, by path.
    hits: Arc<std::sync::Mutex<Vec<String>>>,
    /// `<repository>#stacks/web` and its commit, in acme's folder.
    program: (String, String),
    _root: tempfile::TempDir,
}

const PROGRAM: &str = "name: web\nruntime: yaml\nresources:\n  site:\n    type: aws:s3/bucket:Bucket\n    properties:\n      bucketPrefix: web\noutputs:\n  siteId: ${site.id}\n";

fn git(dir: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_AUTHOR_NAME", "t")
        .env("GIT_AUTHOR_EMAIL", "t@example.com")
        .env("GIT_COMMITTER_NAME", "t")
        .env("GIT_COMMITTER_EMAIL", "t@example.com")
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

async fn start(backend: Backend, policy: Option<&str>) -> Delivery {
    start_with(backend, policy, |_| {}).await
}

async fn start_with(
    backend: Backend,
    policy: Option<&str>,
    tune: impl FnOnce(&mut ferry_app::Config),
) -> Delivery {
    let root = tempfile::tempdir().unwrap();
    let repo = root.path().join("acme/infra");
    std::fs::create_dir_all(repo.join("stacks/web")).unwrap();
    git(&repo, &["init", "-q"]);
    std::fs::write(repo.join("stacks/web/Pulumi.yaml"), PROGRAM).unwrap();
    git(&repo, &["add", "."]);
    git(&repo, &["commit", "-qm", "web"]);
    let commit = git(&repo, &["rev-parse", "HEAD"]);
    let program = (format!("{}#stacks/web", repo.display()), commit);
    let status = Arc::new(AtomicU16::new(200));
    let answer = status.clone();
    let slo = Arc::new(AtomicU64::new(0.0f64.to_bits()));
    let slo_value = slo.clone();
    let queries = Arc::new(std::sync::Mutex::new(Vec::new()));
    let asked = queries.clone();
    let hits = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = hits.clone();
    // Where `/redirect` sends a client: another loopback port, under no probe URL prefix,
    // whose every request is recorded as `elsewhere`.
    let elsewhere = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let location = format!("http://{}/metrics", elsewhere.local_addr().unwrap());
    let noted = hits.clone();
    let other = axum::Router::new().fallback(move || {
        noted.lock().unwrap().push("elsewhere".to_string());
        async { "ferry_secrets 1" }
    });
    tokio::spawn(async move { axum::serve(elsewhere, other).await });
    let app = axum::Router::new()
        .route(
            "/healthz",
            get(move || {
                let answer = answer.clone();
                async move {
                    axum::http::StatusCode::from_u16(answer.load(Ordering::SeqCst))
                        .unwrap_or(axum::http::StatusCode::OK)
                }
            }),
        )
        .route("/smoke", get(|| async { "ok" }))
        .route(
            "/smoke-broken",
            get(|| async { axum::http::StatusCode::INTERNAL_SERVER_ERROR }),
        )
        .route(
            "/redirect",
            get(move || {
                let to = location.clone();
                async move { axum::response::Redirect::temporary(&to) }
            }),
        )
        .route(
            "/api/v1/query",
            get(
                move |query: axum::extract::Query<std::collections::HashMap<String, String>>| {
                    asked
                        .lock()
                        .unwrap()
                        .push(query.get("query").cloned().unwrap_or_default());
                    let value = f64::from_bits(slo_value.load(Ordering::SeqCst));
                    async move {
                        axum::Json(json!({"status": "success", "data": {"resultType": "vector",
                        "result": [{"metric": {}, "value": [1.7e9, value.to_string()]}]}}))
                    }
                },
            ),
        );
    let app = app.layer(axum::middleware::from_fn(
        move |request: axum::extract::Request, next: axum::middleware::Next| {
            seen.lock().unwrap().push(request.uri().path().to_string());
            next.run(request)
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let health = format!("{base}/healthz");
    tokio::spawn(async move { axum::serve(listener, app).await });
    let data = tempfile::tempdir().unwrap();
    let mut config = config(data.path());
    config.workers = true;
    config.prometheus_url = Some(base.clone());
    // The endpoint server is on loopback, which probes reach only where a prefix names it.
    config.tenant_probe_url_prefixes = Some(vec![format!("{base}/")]);
    config.tenant_program_roots = Some(vec![format!("{}/{{tenant}}", root.path().display())]);
    tune(&mut config);
    if let Some(rego) = policy {
        let dir = data.path().join("policies");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("team.rego"), rego).unwrap();
        config.policy_dir = Some(dir);
    }
    Delivery {
        s: TestServer::start_with(backend, config, data).await,
        health,
        status,
        base,
        slo,
        queries,
        hits,
        program,
        _root: root,
    }
}

fn admin(tenant: &str) -> String {
    token(
        tenant,
        "platform",
        &[READ, APPLY, D_READ, D_PROMOTE],
        &["PlatformAdmin"],
    )
}

fn promoter(tenant: &str, sub: &str) -> String {
    token(tenant, sub, &[D_READ, D_PROMOTE], &["Operator"])
}

impl Delivery {
    async fn put(&self, token: &str, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .s
            .client
            .put(self.s.url(path))
            .bearer_auth(token)
            .json(body)
            .send()
            .await
            .unwrap();
        response(r).await
    }

    async fn environment(&self, env: &str, class: &str) {
        let (status, body) = self
            .put(
                &admin("acme"),
                &format!("/factory/environments/{env}"),
                &json!({"environmentClass": class, "healthUrl": self.health}),
            )
            .await;
        assert_eq!(status, 201, "{body}");
    }

    async fn release(&self, id: &str, version: &str, pipeline: Value) -> (u16, Value) {
        self.put(
            &admin("acme"),
            &format!("/factory/delivery/releases/{id}"),
            &json!({
                "projectId": "payments", "version": version,
                "programRef": self.program.0, "programVersion": self.program.1,
                "pipeline": pipeline
            }),
        )
        .await
    }

    async fn promote(&self, release: &str, env: &str, extra: Value) -> Value {
        let mut body = json!({"releaseId": release, "environmentId": env});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        let (status, promotion) = self
            .s
            .post(
                &promoter("acme", "alice"),
                "/factory/delivery/promotions",
                &body,
            )
            .await;
        assert_eq!(status, 201, "{promotion}");
        assert_eq!(promotion["state"], "Requested");
        promotion
    }

    /// A release of the repository's program.
    async fn deployable(&self, version: &str) -> String {
        let id = uuid::Uuid::new_v4().to_string();
        let (status, body) = self
            .put(
                &admin("acme"),
                &format!("/factory/delivery/releases/{id}"),
                &json!({
                    "projectId": "payments", "version": version,
                    "programRef": self.program.0, "programVersion": self.program.1,
                    "pipeline": passed()
                }),
            )
            .await;
        assert_eq!(status, 201, "{body}");
        id
    }

    /// A release of the repository's program whose smoke suite is one GET of `path` on the
    /// test's endpoint server, expecting 200.
    async fn with_smoke(&self, version: &str, path: &str) -> String {
        let id = uuid::Uuid::new_v4().to_string();
        let body = json!({
            "projectId": "payments", "version": version,
            "programRef": self.program.0, "programVersion": self.program.1,
            "pipeline": passed(),
            "smokeChecks": [{"name": "checkout", "url": format!("{}{path}", self.base)}]
        });
        let (status, body) = self
            .put(
                &admin("acme"),
                &format!("/factory/delivery/releases/{id}"),
                &body,
            )
            .await;
        assert_eq!(status, 201, "{body}");
        id
    }

    async fn wait(&self, promotion: &Value, state: &str) -> Value {
        self.wait_any(promotion, &[state]).await
    }

    async fn wait_any(&self, promotion: &Value, states: &[&str]) -> Value {
        self.wait_until(promotion, &format!("promotion in {states:?}"), |p| {
            states.iter().any(|state| p["state"] == *state)
        })
        .await
    }

    /// The promotion once `check` holds of it.
    async fn wait_until(
        &self,
        promotion: &Value,
        what: &str,
        check: impl Fn(&Value) -> bool,
    ) -> Value {
        let path = format!(
            "/factory/delivery/promotions/{}",
            promotion["promotionId"].as_str().unwrap()
        );
        let (s, path, check) = (&self.s, &path, &check);
        eventually_showing(what, 30, || async move {
            let (_, p) = s.get(&promoter("acme", "alice"), path).await;
            if check(&p) {
                Ok(p)
            } else {
                Err(p.to_string())
            }
        })
        .await
    }
}

const PASSED: &str = r#"[{"name": "unit", "result": "passed"}, {"name": "e2e", "result": "passed", "url": "https://ci.example.com/7"}]"#;

fn passed() -> Value {
    serde_json::from_str(PASSED).unwrap()
}

async fn gates_queue_and_reject(backend: Backend) {
    let d = start(backend, None).await;
    d.environment("payments-dev", "development").await;
    d.environment("payments-prod", "production").await;
    let release = uuid::Uuid::new_v4().to_string();

    // A release is recorded once; the same again is unchanged, another under its id refused.
    let (status, body) = d.release(&release, "2.3.0", passed()).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["state"], "Ready");
    let (status, _) = d.release(&release, "2.3.0", passed()).await;
    assert_eq!(status, 200);
    let (status, body) = d.release(&release, "2.3.1", passed()).await;
    assert_eq!(status, 409, "{body}");

    // Into development: every gate recorded in order, approved without an approval, handed
    // off and applied; it holds the environment while verification watches (15 minutes).
    let first = d.promote(&release, "payments-dev", json!({})).await;
    let first = d.wait(&first, "Verifying").await;
    let gates: Vec<(&str, &str)> = first["gates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| (g["kind"].as_str().unwrap(), g["outcome"].as_str().unwrap()))
        .collect();
    assert_eq!(
        gates,
        [
            ("PipelineResults", "Passed"),
            ("Policy", "Passed"),
            ("PriorEnvironment", "NotApplicable"),
            ("EnvironmentReady", "Passed"),
            ("EvaluationEvidence", "NotApplicable"),
        ]
    );
    assert_eq!(first["gates"][3]["evidence"]["source"], "probed");
    assert_eq!(first["gates"][3]["evidence"]["status"], 200);
    assert_eq!(first["approvalRequired"], false);

    // A second promotion into the same environment queues behind the first.
    let queued = d.promote(&release, "payments-dev", json!({})).await;

    // Skipping the path: production before staging is rejected at the prior-environment
    // gate, which names it. Promotions are driven in request order, so by the time this one
    // is decided the queued one was looked at and left waiting.
    let skip = d.promote(&release, "payments-prod", json!({})).await;
    let skip = d.wait(&skip, "Rejected").await;
    assert_eq!(skip["rejection"]["gate"], "PriorEnvironment", "{skip}");
    let reason = skip["rejection"]["reason"].as_str().unwrap();
    assert!(
        reason.contains("has not completed in a staging environment"),
        "{reason}"
    );
    let (_, still) =
        d.s.get(
            &promoter("acme", "alice"),
            &format!(
                "/factory/delivery/promotions/{}",
                queued["promotionId"].as_str().unwrap()
            ),
        )
        .await;
    assert_eq!(still["state"], "Requested", "{still}");
    assert!(still["gates"].as_array().unwrap().is_empty());

    // A hotfix without a policy that allows it is rejected at the same gate.
    let hotfix = d
        .promote(
            &release,
            "payments-prod",
            json!({"hotfix": {"reason": "CVE-2026-1"}}),
        )
        .await;
    let hotfix = d.wait(&hotfix, "Rejected").await;
    assert_eq!(hotfix["rejection"]["gate"], "PriorEnvironment");
    assert!(hotfix["rejection"]["reason"]
        .as_str()
        .unwrap()
        .contains("policy does not allow this hotfix"));

    // A failing pipeline is rejected at the first gate, naming the stage.
    let broken = uuid::Uuid::new_v4().to_string();
    let (status, _) = d
        .release(
            &broken,
            "2.4.0",
            json!([{"name": "e2e", "result": "failed"}]),
        )
        .await;
    assert_eq!(status, 201);
    let failing = d.promote(&broken, "payments-prod", json!({})).await;
    let failing = d.wait(&failing, "Rejected").await;
    assert_eq!(failing["rejection"]["gate"], "PipelineResults");
    assert!(failing["rejection"]["reason"]
        .as_str()
        .unwrap()
        .contains("e2e"));
    assert_eq!(
        failing["gates"].as_array().unwrap().len(),
        1,
        "gates stop at the first failure"
    );

    // An environment whose health URL does not answer 2xx is not ready.
    d.environment("payments-sandbox", "development").await;
    d.status.store(503, Ordering::SeqCst);
    let unready = d.promote(&release, "payments-sandbox", json!({})).await;
    let unready = d.wait(&unready, "Rejected").await;
    d.status.store(200, Ordering::SeqCst);
    assert_eq!(
        unready["rejection"]["gate"], "EnvironmentReady",
        "{unready}"
    );
    assert!(unready["rejection"]["reason"]
        .as_str()
        .unwrap()
        .contains("answered 503"));

    // Withdrawn: the queued promotion is rejected and no new one is accepted.
    let event = json!({
        "specversion": "1.0", "id": format!("withdrawn-{release}"), "source": "urn:releases",
        "type": "releases.releases.v1.release-withdrawn", "tenantid": "acme",
        "datacontenttype": "application/json",
        "data": {"releaseId": release, "tenantId": "acme", "projectId": "payments",
                 "reason": "licence problem"}
    });
    let (status, body) =
        d.s.post_event(&service("acme", "svc-releases"), &event)
            .await;
    assert_eq!(status, 202, "{body}");
    let rejected = d.wait(&queued, "Rejected").await;
    assert_eq!(rejected["rejection"]["reason"], "the release was withdrawn");
    let (status, body) =
        d.s.post(
            &promoter("acme", "alice"),
            "/factory/delivery/promotions",
            &json!({"releaseId": release, "environmentId": "payments-dev"}),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert!(body.to_string().contains("licence problem"), "{body}");
    let (status, list) =
        d.s.get(
            &promoter("acme", "alice"),
            "/factory/delivery/releases?state=Withdrawn",
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(list["items"][0]["releaseId"], release.as_str());

    // Another tenant sees none of it and cannot promote it.
    let (status, _) =
        d.s.get(
            &promoter("globex", "mallory"),
            &format!(
                "/factory/delivery/promotions/{}",
                first["promotionId"].as_str().unwrap()
            ),
        )
        .await;
    assert_eq!(status, 404);
    let (status, body) =
        d.s.post(
            &promoter("globex", "mallory"),
            "/factory/delivery/promotions",
            &json!({"releaseId": broken, "environmentId": "payments-dev"}),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    let (_, list) =
        d.s.get(
            &promoter("globex", "mallory"),
            "/factory/delivery/promotions",
        )
        .await;
    assert_eq!(list["items"], json!([]));
    // Only a PlatformAdmin (or the release service) records releases; an Operator may not.
    let (status, _) = d
        .put(
            &promoter("acme", "alice"),
            &format!("/factory/delivery/releases/{}", uuid::Uuid::new_v4()),
            &json!({"projectId": "payments", "version": "1", "programRef": "https://git.example.com/p.git",
                    "programVersion": "3f2a9c1", "pipeline": []}),
        )
        .await;
    assert_eq!(status, 403);
    d.s.stop().await;
}

#[tokio::test]
async fn gates_run_in_order_queue_per_environment_and_reject_naming_the_gate_on_sqlite() {
    gates_queue_and_reject(Backend::Sqlite).await;
}

#[tokio::test]
async fn gates_run_in_order_queue_per_environment_and_reject_naming_the_gate_on_postgres() {
    gates_queue_and_reject(Backend::Postgres).await;
}

#[tokio::test]
async fn a_hotfix_that_policy_allows_passes_the_path_with_evidence_and_waits_for_approval() {
    let policy = "package ferry.deployment\n\nimport rego.v1\n\nhotfix contains msg if {\n\tinput.hotfix\n\tmsg := sprintf(\"team policy: hotfixes may skip the path (%s)\", [input.hotfix])\n}\n";
    let d = start(Backend::Sqlite, Some(policy)).await;
    d.environment("payments-prod", "production").await;
    let release = uuid::Uuid::new_v4().to_string();
    let (status, _) = d.release(&release, "2.3.1", passed()).await;
    assert_eq!(status, 201);
    let p = d
        .promote(
            &release,
            "payments-prod",
            json!({"hotfix": {"reason": "CVE-2026-1"}, "strategy": "Canary"}),
        )
        .await;
    let p = d.wait(&p, "AwaitingApproval").await;
    let prior = &p["gates"][2];
    assert_eq!(prior["kind"], "PriorEnvironment");
    assert_eq!(prior["outcome"], "Passed");
    assert_eq!(prior["evidence"]["hotfix"]["reason"], "CVE-2026-1");
    assert_eq!(
        prior["evidence"]["policy"][0],
        "team policy: hotfixes may skip the path (CVE-2026-1)"
    );
    assert_eq!(p["gates"][1]["evidence"]["decision"], "require_approval");
    assert_eq!(p["approvalRequired"], true);
    assert_eq!(p["strategy"], "Canary");

    // Run control decides it: the decision must name the pending approval.
    let path = format!(
        "/factory/delivery/promotions/{}",
        p["promotionId"].as_str().unwrap()
    );
    let (s, path) = (&d.s, &path);
    let p = eventually_showing("the approval with its plan", 30, || async move {
        let (_, p) = s.get(&promoter("acme", "alice"), path).await;
        if p["approval"]["approvalId"].is_string() {
            Ok(p)
        } else {
            Err(p.to_string())
        }
    })
    .await;
    let decided = |approval: String, id: &str| {
        json!({
            "specversion": "1.0", "id": id, "source": "urn:runcontrol",
            "type": "runcontrol.approvals.v1.approval-decided", "tenantid": "acme",
            "datacontenttype": "application/json",
            "data": {"approvalId": approval, "tenantId": "acme",
                     "promotionId": p["promotionId"], "decision": "approve",
                     "decidedBy": "carol", "reason": "CAB-7"}
        })
    };
    let server = &d.s;
    let post = |event: Value| async move {
        server
            .post_event(&service("acme", "svc-runcontrol"), &event)
            .await
    };
    let (status, body) = post(decided(uuid::Uuid::new_v4().to_string(), "decision-1")).await;
    assert_ne!(
        status, 202,
        "another approval's decision is refused: {body}"
    );
    let approval = p["approval"]["approvalId"].as_str().unwrap().to_string();
    let (status, body) = post(decided(approval, "decision-2")).await;
    assert_eq!(status, 202, "{body}");
    let p = d.wait_any(&p, &["Deploying", "Verifying"]).await;
    assert_eq!(p["approvalDecision"]["decidedBy"], "carol");
    d.s.stop().await;
}

async fn a_release_goes_through_the_path(backend: Backend, nats: Option<&Nats>) {
    let d = start_with(backend, None, |c| {
        c.verification_window = std::time::Duration::from_secs(1);
        c.nats_url = nats.map(Nats::url);
    })
    .await;
    for (env, class) in [
        ("payments-dev", "development"),
        ("payments-test", "test"),
        ("payments-staging", "staging"),
        ("payments-prod", "production"),
    ] {
        d.environment(env, class).await;
    }
    let release = d.deployable("2.3.0").await;

    // Development: gates, hand-off, a Release run planned and applied, verified, completed.
    let dev = d
        .promote(&release, "payments-dev", json!({"strategy": "BlueGreen"}))
        .await;
    let dev = d.wait(&dev, "Completed").await;
    let run_id = dev["provisioningRunId"].as_str().unwrap();
    assert!(
        dev["desiredStateRef"].as_str().unwrap().ends_with("@1"),
        "{dev}"
    );
    let (_, run) =
        d.s.get(
            &operator("acme", "alice"),
            &format!("/factory/provisioning/runs/{run_id}"),
        )
        .await;
    assert_eq!(run["state"], "Applied", "{run}");
    assert_eq!(run["kind"], "Release");
    assert_eq!(run["promotionId"], dev["promotionId"]);
    let measurements = dev["verification"]["measurements"].as_array().unwrap();
    assert!(!measurements.is_empty());
    assert!(measurements
        .iter()
        .all(|m| m["passed"] == true && m["value"] == "200"));
    assert_eq!(dev["verification"]["outcome"], "Passed");
    let (status, current) =
        d.s.get(
            &promoter("acme", "alice"),
            "/factory/environments/payments-dev/current-release",
        )
        .await;
    assert_eq!(status, 200, "{current}");
    assert_eq!(current["releaseId"], release.as_str());
    assert_eq!(current["version"], "2.3.0");

    // Skipping test is refused, naming the class it skipped.
    let skip = d.promote(&release, "payments-staging", json!({})).await;
    let skip = d.wait(&skip, "Rejected").await;
    assert!(skip["rejection"]["reason"]
        .as_str()
        .unwrap()
        .contains("has not completed in a test environment"));

    // Test, then staging, then production, which waits for its approval.
    for env in ["payments-test", "payments-staging"] {
        let p = d.promote(&release, env, json!({})).await;
        let p = d.wait(&p, "Completed").await;
        assert_eq!(p["gates"][2]["outcome"], "Passed", "{p}");
    }
    // Production: requested by someone who is also a Reviewer, who still cannot approve it.
    let alice = token(
        "acme",
        "alice",
        &[D_READ, D_PROMOTE, READ, APPLY],
        &["Operator", "Reviewer"],
    );
    let (status, prod) =
        d.s.post(
            &alice,
            "/factory/delivery/promotions",
            &json!({"releaseId": release, "environmentId": "payments-prod"}),
        )
        .await;
    assert_eq!(status, 201, "{prod}");
    let prod = d.wait(&prod, "AwaitingApproval").await;
    assert_eq!(
        prod["gates"][2]["evidence"]["completion"]["environmentId"],
        "payments-staging"
    );
    // Ferry plans first and asks for the approval with the plan attached.
    let path = format!(
        "/factory/delivery/promotions/{}",
        prod["promotionId"].as_str().unwrap()
    );
    let (s, path) = (&d.s, &path);
    let prod = eventually_showing("the approval with its plan", 30, || async move {
        let (_, p) = s.get(&promoter("acme", "alice"), path).await;
        if p["approval"]["planInputsHash"].is_string() {
            Ok(p)
        } else {
            Err(p.to_string())
        }
    })
    .await;
    let run_id = prod["approval"]["provisioningRunId"]
        .as_str()
        .unwrap()
        .to_string();
    // The runs' read model follows on its own subscription: wait for it.
    let run_path = format!("/factory/provisioning/runs/{run_id}");
    let run_path = &run_path;
    let run = eventually_showing("the run awaiting approval", 30, || async move {
        let (_, run) = s.get(&operator("acme", "alice"), run_path).await;
        if run["state"] == "AwaitingApproval" {
            Ok(run)
        } else {
            Err(run.to_string())
        }
    })
    .await;
    assert_eq!(
        run["planReceipt"]["inputsHash"],
        prod["approval"]["planInputsHash"]
    );
    // The requester is refused by name; the run cannot be approved around the promotion.
    let (status, body) =
        d.s.post(
            &alice,
            &format!("{path}/approval"),
            &json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(body["detail"].as_str().unwrap().contains("alice"), "{body}");
    let (status, body) =
        d.s.post(
            &operator("acme", "carol"),
            &format!("/factory/provisioning/runs/{run_id}/approval"),
            &json!({"decision": "approve", "reason": "shortcut"}),
        )
        .await;
    assert_eq!(status, 403, "{body}");
    // Another identity with the Reviewer role approves; the run applies under that approval.
    let bob = token("acme", "bob", &[D_READ, D_PROMOTE], &["Reviewer"]);
    let (status, body) =
        d.s.post(
            &bob,
            &format!("{path}/approval"),
            &json!({"decision": "approve", "reason": "CAB-12"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let prod = d.wait(&prod, "Completed").await;
    assert_eq!(prod["approvalDecision"]["decidedBy"], "bob");
    let (_, run) =
        d.s.get(
            &operator("acme", "alice"),
            &format!("/factory/provisioning/runs/{run_id}"),
        )
        .await;
    assert_eq!(run["state"], "Applied", "{run}");
    assert_eq!(run["authorization"]["approvedBy"], "bob", "{run}");
    assert_eq!(
        run["authorization"]["approvalId"],
        prod["approval"]["approvalId"]
    );
    let (_, r) =
        d.s.get(
            &promoter("acme", "alice"),
            &format!("/factory/delivery/releases/{release}"),
        )
        .await;
    let completed: Vec<&str> = r["completedIn"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["environmentId"].as_str().unwrap())
        .collect();
    assert_eq!(
        completed,
        [
            "payments-dev",
            "payments-test",
            "payments-staging",
            "payments-prod"
        ]
    );

    // A release whose health check fails during verification is rolled back to the one
    // that completed there before, automatically, with the evidence kept.
    let bad = d.deployable("2.4.0").await;
    let p = d.promote(&bad, "payments-dev", json!({})).await;
    d.wait_any(&p, &["Approved", "Deploying", "Verifying"])
        .await;
    d.status.store(503, Ordering::SeqCst);
    let path = format!(
        "/factory/delivery/promotions/{}",
        p["promotionId"].as_str().unwrap()
    );
    let (s, path) = (&d.s, &path);
    eventually_showing("verification failed", 30, || async move {
        let (_, p) = s.get(&promoter("acme", "alice"), path).await;
        if p["verification"]["outcome"] == "Failed" {
            Ok(p)
        } else {
            Err(p.to_string())
        }
    })
    .await;
    d.status.store(200, Ordering::SeqCst);
    let rolled = d.wait(&p, "RolledBack").await;
    assert!(rolled["verification"]["measurements"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["passed"] == false && m["value"] == "503"));
    assert_eq!(rolled["failure"]["rolledBack"], true, "{rolled}");
    assert_eq!(rolled["rollback"]["outcome"], "Completed");
    assert_eq!(rolled["rollback"]["automatic"], true);
    assert_eq!(rolled["rollback"]["restoredReleaseId"], release.as_str());
    let rollback = format!(
        "/factory/delivery/promotions/{}",
        rolled["rollback"]["rollbackPromotionId"].as_str().unwrap()
    );
    let (_, rollback) = d.s.get(&promoter("acme", "alice"), &rollback).await;
    assert_eq!(rollback["state"], "Completed", "{rollback}");
    assert_eq!(rollback["rollbackOf"]["releaseId"], bad.as_str());
    assert!(rollback["approvalRequired"] == false);
    let (_, current) =
        d.s.get(
            &promoter("acme", "alice"),
            "/factory/environments/payments-dev/current-release",
        )
        .await;
    assert_eq!(current["releaseId"], release.as_str(), "{current}");
    // The bad release is quarantined in that environment.
    let (status, body) =
        d.s.post(
            &promoter("acme", "alice"),
            "/factory/delivery/promotions",
            &json!({"releaseId": bad, "environmentId": "payments-dev"}),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert!(body.to_string().contains("quarantined"), "{body}");

    // By hand: an Operator rolls production back to what ran there before (nothing), and
    // staging's older completion cannot be rolled back while another runs there.
    let carol = token(
        "acme",
        "carol",
        &[D_READ, "factory.delivery.operate"],
        &["Operator"],
    );
    let prod_path = format!(
        "/factory/delivery/promotions/{}",
        prod["promotionId"].as_str().unwrap()
    );
    let (status, body) =
        d.s.post(
            &carol,
            &format!("{prod_path}/rollback"),
            &json!({"reason": "bad numbers"}),
        )
        .await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("nothing to restore"),
        "{body}"
    );
    let (status, _) =
        d.s.post(
            &promoter("acme", "alice"),
            &format!("{prod_path}/rollback"),
            &json!({"reason": "x"}),
        )
        .await;
    assert_eq!(
        status, 403,
        "the operate scope and the Operator role are needed"
    );
    // A second release in development, rolled back by hand to the first.
    let next = d.deployable("2.5.0").await;
    let p = d.promote(&next, "payments-dev", json!({})).await;
    let p = d.wait(&p, "Completed").await;
    let path = format!(
        "/factory/delivery/promotions/{}",
        p["promotionId"].as_str().unwrap()
    );
    let (status, body) =
        d.s.post(&carol, &format!("{path}/rollback"), &json!({"reason": ""}))
            .await;
    assert_eq!(status, 422, "{body}");
    let (status, body) =
        d.s.post(
            &carol,
            &format!("{path}/rollback"),
            &json!({"reason": "customer reports"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["rollback"]["automatic"], false);
    let p = d.wait(&p, "RolledBack").await;
    assert_eq!(p["rollback"]["startedBy"], "carol");
    assert_eq!(p["rollback"]["outcome"], "Completed");
    let (_, current) =
        d.s.get(
            &promoter("acme", "alice"),
            "/factory/environments/payments-dev/current-release",
        )
        .await;
    assert_eq!(current["releaseId"], release.as_str(), "{current}");

    // The quarantine of the bad release in development is lifted by an Operator, with a
    // reason; then it may be promoted there again.
    let lift = format!("/factory/delivery/releases/{bad}/quarantines/payments-dev/lift");
    let (status, _) =
        d.s.post(&promoter("acme", "alice"), &lift, &json!({"reason": "x"}))
            .await;
    assert_eq!(
        status, 403,
        "the operate scope and the Operator role are needed"
    );
    let (status, body) = d.s.post(&carol, &lift, &json!({"reason": " "})).await;
    assert_eq!(status, 422, "{body}");
    let mallory = token(
        "globex",
        "mallory",
        &[D_READ, "factory.delivery.operate"],
        &["Operator"],
    );
    let (status, body) =
        d.s.post(&mallory, &lift, &json!({"reason": "mine now"}))
            .await;
    assert_eq!(status, 409, "another tenant sees no quarantine: {body}");
    let (status, body) =
        d.s.post(&carol, &lift, &json!({"reason": "the config fix is in"}))
            .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["liftedBy"], "carol");
    assert_eq!(body["promotionId"], rolled["promotionId"]);
    let (status, body) = d.s.post(&carol, &lift, &json!({"reason": "again"})).await;
    assert_eq!(status, 409, "{body}");
    let again = d.promote(&bad, "payments-dev", json!({})).await;
    d.wait(&again, "Completed").await;

    let metrics = d.s.metrics().await;
    for family in [
        r#"connectsoft_factory_delivery_promotions_total{environmentClass="production",state="Completed",tenant="acme"}"#,
        r#"connectsoft_factory_delivery_promotions_total{environmentClass="development",state="RolledBack",tenant="acme"}"#,
        r#"connectsoft_factory_delivery_promotions_total{environmentClass="staging",state="Rejected",tenant="acme"}"#,
        r#"connectsoft_factory_delivery_rollbacks_total{automatic="true",environmentClass="development",tenant="acme"}"#,
        r#"connectsoft_factory_delivery_rollbacks_total{automatic="false",environmentClass="development",tenant="acme"}"#,
        r#"connectsoft_factory_delivery_promotion_lead_time_seconds_count{environmentClass="production"}"#,
    ] {
        assert!(metrics.contains(family), "{family} missing from /metrics");
    }
    if let Some(nats) = nats {
        published_once_with_the_seed_payloads(&d, nats, [&release, &bad, &next]).await;
    }
    d.s.stop().await;
}

/// Every promotion's integration events are on JetStream with payloads that match their
/// schemas, each promotion's request once. `good` ran in development before `bad` failed its
/// verification there (automatic rollback: `PromotionFailed{rolledBack}`) and `next` was
/// rolled back by hand (`RollbackCompleted`); `bad` completed there last.
async fn published_once_with_the_seed_payloads(
    d: &Delivery,
    nats: &Nats,
    [good, bad, next]: [&str; 3],
) {
    use futures::TryStreamExt;
    let (_, all) =
        d.s.get(
            &promoter("acme", "alice"),
            "/factory/delivery/promotions?limit=100",
        )
        .await;
    let promotions = all["items"].as_array().unwrap().len();
    let js = async_nats::jetstream::new(async_nats::connect(&nats.url()).await.unwrap());
    let js = &js;
    let stream = eventually_showing("the relay's stream", 15, || async move {
        js.get_stream("FERRY_EVENTS")
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    let stream = &stream;
    // The relay publishes after the commit: wait until it has caught up with the last event.
    eventually_showing("every promotion's request on NATS", 30, || async move {
        let counts: Vec<(String, usize)> = stream
            .info_with_subjects("releases.promotions.v1.promotion-requested")
            .await
            .map_err(|e| e.to_string())?
            .try_collect()
            .await
            .map_err(|e| e.to_string())?;
        match counts.first() {
            Some((_, n)) if *n == promotions => Ok(()),
            other => Err(format!("{other:?} of {promotions}")),
        }
    })
    .await;
    let last = |subject: &'static str| async move {
        let message = eventually_showing(subject, 30, || async move {
            stream
                .get_last_raw_message_by_subject(subject)
                .await
                .map_err(|e| e.to_string())
        })
        .await;
        let event: Value = serde_json::from_slice(&message.payload).unwrap();
        assert_eq!(event["type"], subject);
        assert_eq!(event["tenantid"], "acme");
        // `releases.promotions.v1.<event>` → `<event>`; `ferry.events.<aggregate>.<event>` →
        // `ferry/<aggregate>.<event>`.
        let file = match subject.strip_prefix("ferry.events.") {
            Some(domain) => format!("ferry/{domain}"),
            None => subject.rsplit('.').next().unwrap().to_string(),
        };
        let path = format!(
            "{}/schemas/events/{file}.schema.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let schema: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let data = event["data"].clone();
        assert!(
            jsonschema::validator_for(&schema).unwrap().is_valid(&data),
            "{subject}: {data} does not match its schema"
        );
        data
    };
    // The test's last promotion (the bad release again, after its quarantine was lifted)
    // completed last: once it is on NATS, so is everything before it.
    eventually_showing("the last completion on NATS", 30, || async move {
        let message = stream
            .get_last_raw_message_by_subject("releases.promotions.v1.promotion-completed")
            .await
            .map_err(|e| e.to_string())?;
        let event: Value = serde_json::from_slice(&message.payload).unwrap();
        if event["data"]["releaseId"] == bad {
            Ok(())
        } else {
            Err(event.to_string())
        }
    })
    .await;
    let requested = last("releases.promotions.v1.promotion-requested").await;
    assert_eq!(requested["projectId"], "payments");
    let approved = last("releases.promotions.v1.promotion-approved").await;
    assert!(
        approved["desiredStateRef"].as_str().unwrap().contains('@'),
        "{approved}"
    );
    let completed = last("releases.promotions.v1.promotion-completed").await;
    assert_eq!(completed["environmentId"], "payments-dev");
    assert_eq!(completed["previousReleaseId"], good, "{completed}");
    let failed = last("releases.promotions.v1.promotion-failed").await;
    assert_eq!(
        (failed["releaseId"].as_str(), &failed["rolledBack"]),
        (Some(bad), &json!(true)),
        "{failed}"
    );
    let rollback = last("releases.promotions.v1.rollback-completed").await;
    assert_eq!(
        (
            rollback["releaseId"].as_str(),
            rollback["restoredReleaseId"].as_str()
        ),
        (Some(next), Some(good)),
        "{rollback}"
    );
    // The finer events go on the promotion's domain subjects.
    last("ferry.events.promotion.gate-evaluated").await;
}

#[tokio::test]
async fn a_release_goes_development_test_staging_and_production_approved_by_another_on_sqlite() {
    a_release_goes_through_the_path(Backend::Sqlite, None).await;
}

#[tokio::test]
async fn a_release_goes_development_test_staging_and_production_approved_by_another_on_postgres() {
    a_release_goes_through_the_path(Backend::Postgres, Some(&Nats::start().await)).await;
}

#[tokio::test]
async fn a_production_approval_left_undecided_expires_and_rejects_the_promotion() {
    let policy = "package ferry.deployment\n\nimport rego.v1\n\nhotfix contains \"hotfixes may skip the path\" if input.hotfix\n";
    let d = start_with(Backend::Sqlite, Some(policy), |c| {
        c.approval_expiry = Some(std::time::Duration::from_secs(2));
    })
    .await;
    d.environment("payments-prod", "production").await;
    let release = d.deployable("2.3.2").await;
    let p = d
        .promote(
            &release,
            "payments-prod",
            json!({"hotfix": {"reason": "CVE-2026-2"}}),
        )
        .await;
    let p = d.wait(&p, "Rejected").await;
    let reason = p["rejection"]["reason"].as_str().unwrap();
    assert!(reason.contains("expired"), "{reason}");
    // It was asked with its plan before it expired, and says it expired.
    assert!(p["approval"]["planInputsHash"].is_string(), "{p}");
    assert_eq!(p["approvalStatus"], "Expired", "{p}");
    d.s.stop().await;
}

#[tokio::test]
async fn a_verification_with_nothing_to_probe_is_held_for_an_operator() {
    let d = start(Backend::Sqlite, None).await;
    // Recorded without a health URL; the environment service reports it ready.
    let (status, body) = d
        .put(
            &admin("acme"),
            "/factory/environments/payments-dev",
            &json!({"environmentClass": "development"}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let event = json!({
        "specversion": "1.0", "id": "env-ready-1", "source": "urn:environments",
        "type": "environments.v1.environment-state-changed", "tenantid": "acme",
        "datacontenttype": "application/json",
        "data": {"environmentId": "payments-dev", "tenantId": "acme", "state": "Ready"}
    });
    let (status, body) =
        d.s.post_event(&service("acme", "svc-environments"), &event)
            .await;
    assert_eq!(status, 202, "{body}");
    let release = d.deployable("3.0.0").await;
    let p = d.promote(&release, "payments-dev", json!({})).await;
    let path = format!(
        "/factory/delivery/promotions/{}",
        p["promotionId"].as_str().unwrap()
    );
    let (s, path) = (&d.s, &path);
    let held = eventually_showing("a held verification", 30, || async move {
        let (_, p) = s.get(&promoter("acme", "alice"), path).await;
        if p["verification"]["outcome"] == "Inconclusive" {
            Ok(p)
        } else {
            Err(p.to_string())
        }
    })
    .await;
    assert_eq!(held["state"], "Verifying");
    assert_eq!(held["gates"][3]["evidence"]["source"], "reported");
    let carol = token(
        "acme",
        "carol",
        &[D_READ, "factory.delivery.operate"],
        &["Operator"],
    );
    let (status, body) =
        d.s.post(
            &carol,
            &format!("{path}/verification"),
            &json!({"outcome": "Passed", "reason": ""}),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    let (status, body) = d
        .s
        .post(
            &carol,
            &format!("{path}/verification"),
            &json!({"outcome": "Passed", "reason": "dashboards green; the service has no health endpoint"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "Completed");
    assert_eq!(body["verification"]["concludedBy"], "carol");
    d.s.stop().await;
}

#[tokio::test]
async fn commands_answer_from_the_aggregate_when_the_read_model_has_not_caught_up() {
    let d = start_with(Backend::Sqlite, None, |c| {
        c.read_your_writes = std::time::Duration::ZERO;
        c.workers = false;
    })
    .await;
    d.environment("payments-dev", "development").await;
    let release = uuid::Uuid::new_v4().to_string();
    let (status, body) = d.release(&release, "1.0.0", passed()).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["releaseId"], release.as_str());
    let p = d.promote(&release, "payments-dev", json!({})).await;
    assert_eq!(p["releaseId"], release.as_str());
    d.s.stop().await;
}

#[tokio::test]
async fn concurrent_promotion_requests_with_one_key_share_the_first_answer() {
    let d = start_with(Backend::Postgres, None, |c| c.workers = false).await;
    d.environment("payments-dev", "development").await;
    let release = d.deployable("1.0.0").await;
    let body = json!({"releaseId": release, "environmentId": "payments-dev"});
    let post = || {
        let (s, body) = (&d.s, &body);
        async move {
            let r = s
                .client
                .post(s.url("/factory/delivery/promotions"))
                .bearer_auth(promoter("acme", "alice"))
                .header("idempotency-key", "promote-1.0.0")
                .json(body)
                .send()
                .await
                .unwrap();
            response(r).await
        }
    };
    let answers = futures::future::join_all((0..8).map(|_| post())).await;
    for (status, promotion) in &answers {
        assert_eq!(*status, 201, "{promotion}");
        // Every answer is the request as it was recorded, whichever request recorded it.
        assert_eq!(promotion, &answers[0].1, "{answers:?}");
    }
    assert_eq!(answers[0].1["state"], "Requested");
    assert_eq!(answers[0].1["releaseId"], release.as_str());
    let (status, page) =
        d.s.get(
            &promoter("acme", "alice"),
            &format!("/factory/delivery/promotions?releaseId={release}"),
        )
        .await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["items"].as_array().unwrap().len(), 1, "{page}");
    d.s.stop().await;
}

#[tokio::test]
async fn the_promotion_path_reloads_without_a_restart_and_a_bad_file_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ferry.toml");
    std::fs::write(&file, "verification_window = \"1s\"\n").unwrap();
    let path = file.clone();
    let d = start_with(Backend::Sqlite, None, move |c| {
        c.verification_window = std::time::Duration::from_secs(1);
        c.config_file = Some(path);
    })
    .await;
    d.environment("payments-dev", "development").await;
    d.environment("payments-prod", "production").await;
    let release = d.deployable("3.0.0").await;
    let dev = d.promote(&release, "payments-dev", json!({})).await;
    d.wait(&dev, "Completed").await;
    let prod = d.promote(&release, "payments-prod", json!({})).await;
    let prod = d.wait(&prod, "Rejected").await;
    assert!(
        prod["rejection"]["reason"]
            .as_str()
            .unwrap()
            .contains("staging"),
        "{prod}"
    );

    // The team's path skips test and staging: taken up on reload, no restart.
    std::fs::write(
        &file,
        "verification_window = \"1s\"\npromotion_path = \"development,production\"\n",
    )
    .unwrap();
    let server = d.s.server.as_ref().unwrap();
    let env = std::collections::HashMap::new();
    assert!(server.reload(&env).unwrap(), "the path changed");
    let prod = d.promote(&release, "payments-prod", json!({})).await;
    let prod = d.wait_any(&prod, &["AwaitingApproval", "Rejected"]).await;
    assert_eq!(prod["state"], "AwaitingApproval", "{prod}");
    let prior = prod["gates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["kind"] == "PriorEnvironment")
        .unwrap();
    assert_eq!(prior["outcome"], "Passed", "{prior}");

    // A file that does not load is refused, naming the setting; the settings in use stay.
    std::fs::write(&file, "verification_window = \"forever\"\n").unwrap();
    let refused = server.reload(&env).unwrap_err();
    assert!(
        refused.to_string().contains("verification_window"),
        "{refused}"
    );
    std::fs::write(
        &file,
        "verification_window = \"1s\"\npromotion_path = \"development,production\"\n",
    )
    .unwrap();
    assert!(
        !server.reload(&env).unwrap(),
        "nothing changed since the last good reload"
    );
    d.s.stop().await;
}

#[tokio::test]
async fn smoke_checks_and_the_slo_are_measured_and_fail_or_hold_the_verification() {
    let d = start_with(Backend::Sqlite, None, |c| {
        c.verification_window = std::time::Duration::from_secs(1);
    })
    .await;
    let slo = |value: f64| d.slo.store(value.to_bits(), Ordering::SeqCst);
    slo(0.002);
    let (status, env) = d
        .put(
            &admin("acme"),
            "/factory/environments/shop-dev",
            &json!({"environmentClass": "development", "healthUrl": d.health,
                    "slo": {"query": "sum(rate(errors[5m])) / sum(rate(requests[5m]))",
                            "threshold": 0.01}}),
        )
        .await;
    assert_eq!(status, 201, "{env}");
    assert_eq!(env["slo"]["bound"], "AtMost");
    let (status, body) = d
        .put(
            &admin("acme"),
            "/factory/environments/shop-test",
            &json!({"environmentClass": "test", "slo": {"query": " ", "threshold": 1}}),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["errors"][0]["field"], "slo.query");
    let (status, body) = d
        .put(
            &admin("acme"),
            &format!("/factory/delivery/releases/{}", uuid::Uuid::new_v4()),
            &json!({"projectId": "payments", "version": "0.1.0",
                "programRef": d.program.0, "programVersion": d.program.1,
                "pipeline": passed(),
                "smokeChecks": [{"name": "a", "url": "ftp://x"}]}),
        )
        .await;
    assert_eq!(status, 422, "a smoke check is an http(s) GET: {body}");

    // Health, the smoke suite and the objective all pass: completed, every value kept.
    let good = d.with_smoke("1.0.0", "/smoke").await;
    let p = d.promote(&good, "shop-dev", json!({})).await;
    let p = d.wait(&p, "Completed").await;
    let measurements = p["verification"]["measurements"].as_array().unwrap();
    let of = |kind: &str| {
        measurements
            .iter()
            .filter(|m| m["kind"] == kind)
            .cloned()
            .collect::<Vec<_>>()
    };
    assert!(of("Health").iter().all(|m| m["passed"] == true), "{p}");
    let smoke = of("Smoke");
    assert_eq!(smoke.len(), 1, "the suite runs once: {p}");
    assert_eq!(
        (
            &smoke[0]["name"],
            &smoke[0]["value"],
            &smoke[0]["threshold"]
        ),
        (&json!("checkout"), &json!("200"), &json!("200"))
    );
    let objective = of("Slo");
    assert!(!objective.is_empty(), "{p}");
    assert_eq!(objective[0]["value"], "0.002");
    assert_eq!(objective[0]["threshold"], "<= 0.01");

    // The error ratio goes over the objective: verification fails and the release before
    // is restored (its own verification passing once the ratio is back).
    slo(0.5);
    let bad = d.with_smoke("1.1.0", "/smoke").await;
    let p = d.promote(&bad, "shop-dev", json!({})).await;
    let failed = d
        .wait_until(&p, "the SLO failing", |p| {
            p["verification"]["outcome"] == "Failed"
        })
        .await;
    assert!(
        failed["verification"]["reason"]
            .as_str()
            .unwrap()
            .contains("the SLO check"),
        "{failed}"
    );
    slo(0.002);
    let rolled = d.wait(&p, "RolledBack").await;
    assert_eq!(rolled["rollback"]["restoredReleaseId"], good.as_str());

    // A smoke check answering another status than expected fails the release too.
    let broken = d.with_smoke("1.2.0", "/smoke-broken").await;
    let p = d.promote(&broken, "shop-dev", json!({})).await;
    let p = d.wait(&p, "RolledBack").await;
    assert!(
        p["verification"]["reason"]
            .as_str()
            .unwrap()
            .contains("smoke check checkout measured 500 (must be 200)"),
        "{p}"
    );

    // Prometheus has no value: the tooling failed, not the release. Held for an Operator.
    slo(f64::NAN);
    let next = d.with_smoke("1.3.0", "/smoke").await;
    let p = d.promote(&next, "shop-dev", json!({})).await;
    let held = d
        .wait_until(&p, "the verification held", |p| {
            p["verification"]["outcome"] == "Error"
        })
        .await;
    let path = format!(
        "/factory/delivery/promotions/{}",
        p["promotionId"].as_str().unwrap()
    );
    assert_eq!(held["state"], "Verifying");
    assert!(
        held["verification"]["reason"]
            .as_str()
            .unwrap()
            .contains("could not run"),
        "{held}"
    );
    let carol = token(
        "acme",
        "carol",
        &[D_READ, "factory.delivery.operate"],
        &["Operator"],
    );
    let (status, body) = d
        .s
        .post(
            &carol,
            &format!("{path}/verification"),
            &json!({"outcome": "Passed", "reason": "Prometheus was being upgraded; dashboards are green"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    d.wait(&p, "Completed").await;
    d.s.stop().await;
}

#[tokio::test]
async fn probe_urls_stay_in_the_tenant_s_prefixes_when_the_operator_sets_them() {
    let d = start_with(Backend::Sqlite, None, |c| {
        c.tenant_probe_url_prefixes = Some(vec!["https://{tenant}.apps.example.com/".to_string()]);
    })
    .await;
    let (status, body) = d
        .put(
            &admin("acme"),
            "/factory/environments/shop-dev",
            &json!({"environmentClass": "development", "healthUrl": "http://169.254.169.254/latest/meta-data"}),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["errors"][0]["field"], "healthUrl");
    let (status, body) = d
        .put(
            &admin("acme"),
            "/factory/environments/shop-dev",
            &json!({"environmentClass": "development", "healthUrl": "https://acme.apps.example.com/healthz"}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let release = |smoke: &str| {
        json!({"projectId": "payments", "version": "1.0.0",
            "programRef": d.program.0, "programVersion": d.program.1, "pipeline": passed(),
            "smokeChecks": [{"name": "ok", "url": "https://acme.apps.example.com/smoke"},
                            {"name": "theirs", "url": smoke}]})
    };
    let id = uuid::Uuid::new_v4();
    let (status, body) = d
        .put(
            &admin("acme"),
            &format!("/factory/delivery/releases/{id}"),
            &release("https://globex.apps.example.com/admin"),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["errors"][0]["field"], "smokeChecks[1].url");
    let (status, body) = d
        .put(
            &admin("acme"),
            &format!("/factory/delivery/releases/{id}"),
            &release("https://acme.apps.example.com/checkout"),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    d.s.stop().await;
}

/// Ferry's own port, the metadata service and private networks, however the address is
/// written, are no health URL or smoke check unless the operator's prefix names them.
#[tokio::test]
async fn probes_reach_no_loopback_or_private_address_unless_a_prefix_names_it() {
    // No prefixes: nothing is confined by prefix, which no longer means "anywhere".
    let d = start_with(Backend::Sqlite, None, |c| {
        c.tenant_probe_url_prefixes = None
    })
    .await;
    let port = d.base.rsplit(':').next().unwrap().to_string();
    for url in [
        d.health.clone(),
        d.s.url("/metrics"),
        format!("http://2130706433:{port}/healthz"),
        format!("http://0x7f.1:{port}/healthz"),
        format!("http://[::ffff:127.0.0.1]:{port}/healthz"),
        format!("http://[::1]:{port}/healthz"),
        format!("http://localhost:{port}/healthz"),
        "http://169.254.169.254/latest/meta-data/".to_string(),
        "http://10.0.0.7:9000/admin".to_string(),
        "http://[fd00::1]/".to_string(),
    ] {
        let (status, body) = d
            .put(
                &admin("acme"),
                "/factory/environments/shop-dev",
                &json!({"environmentClass": "development", "healthUrl": url}),
            )
            .await;
        assert_eq!(status, 422, "{url}: {body}");
        assert_eq!(body["errors"][0]["field"], "healthUrl", "{body}");
    }
    let (status, body) = d
        .put(
            &admin("acme"),
            &format!("/factory/delivery/releases/{}", uuid::Uuid::new_v4()),
            &json!({"projectId": "payments", "version": "1.0.0",
                "programRef": d.program.0, "programVersion": d.program.1, "pipeline": passed(),
                "smokeChecks": [{"name": "metrics", "url": d.s.url("/metrics")}]}),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["errors"][0]["field"], "smokeChecks[0].url", "{body}");
    assert!(d.hits.lock().unwrap().is_empty());
    d.s.stop().await;
}

/// A prefix naming a loopback address lets probes reach it, and a redirect from there to
/// an address no prefix names is not followed.
#[tokio::test]
async fn probes_reach_an_address_a_prefix_names_and_follow_no_redirect_away() {
    // The prefix is the endpoint server's own address (`start_with` sets it).
    let d = start_with(Backend::Sqlite, None, |c| {
        c.verification_window = std::time::Duration::from_secs(1);
    })
    .await;
    d.environment("shop-dev", "development").await;
    let release = d.with_smoke("1.0.0", "/redirect").await;
    let p = d.promote(&release, "shop-dev", json!({})).await;
    let p = d
        .wait_until(&p, "the verification failed", |p| {
            p["verification"]["outcome"] == "Failed"
        })
        .await;
    let smoke: Vec<&Value> = p["verification"]["measurements"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["kind"] == "Smoke")
        .collect();
    assert_eq!(smoke[0]["value"], "307", "the redirect is the answer: {p}");
    let hits = d.hits.lock().unwrap().clone();
    assert!(hits.iter().any(|h| h == "/healthz"), "{hits:?}");
    assert!(hits.iter().any(|h| h == "/redirect"), "{hits:?}");
    assert!(!hits.iter().any(|h| h == "elsewhere"), "{hits:?}");
    d.s.stop().await;
}

/// An environment's SLO query goes to the shared Prometheus with the tenant's matcher on
/// every selector; one naming another tenant's series is refused.
#[tokio::test]
async fn slo_queries_read_only_the_tenant_s_series() {
    let d = start_with(Backend::Sqlite, None, |c| {
        c.verification_window = std::time::Duration::from_secs(1);
    })
    .await;
    for query in [
        "sum(rate(errors{tenant=\"acme\"}[5m])) / sum(rate(requests{tenant=\"acme\"}[5m]))",
        "sum(errors{tenant=~\".*\"})",
        "sum(errors{tenant=~\"globex|acme\"})",
        "sum(errors{tenant!=\"globex\"})",
        "sum(errors{tenant=\"globex\"}) + sum(errors{tenant=\"acme\"})",
    ] {
        let (status, body) = d
            .put(
                &admin("globex"),
                "/factory/environments/g-dev",
                &json!({"environmentClass": "development",
                        "slo": {"query": query, "threshold": 0.01}}),
            )
            .await;
        assert_eq!(status, 422, "{query}: {body}");
        assert_eq!(body["errors"][0]["field"], "slo.query", "{body}");
    }
    assert!(d.queries.lock().unwrap().is_empty());

    // acme's query names no tenant: every selector is given acme's.
    let (status, body) = d
        .put(
            &admin("acme"),
            "/factory/environments/shop-dev",
            &json!({"environmentClass": "development", "healthUrl": d.health,
                    "slo": {"query": "sum(rate(errors[5m])) / sum(rate(requests{job=\"web\"}[5m]))",
                            "threshold": 0.01}}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let release = d.deployable("1.0.0").await;
    let p = d.promote(&release, "shop-dev", json!({})).await;
    let p = d.wait(&p, "Completed").await;
    let confined = "sum(rate(errors{tenant=\"acme\"}[5m])) / sum(rate(requests{job=\"web\",tenant=\"acme\"}[5m]))";
    let queries = d.queries.lock().unwrap().clone();
    assert!(!queries.is_empty());
    assert!(queries.iter().all(|q| q == confined), "{queries:?}");
    let slo = p["verification"]["measurements"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["kind"] == "Slo")
        .cloned()
        .unwrap();
    assert_eq!(slo["name"], confined, "{p}");
    d.s.stop().await;
}

/// A client of the server's gRPC interface calling as `token`.
fn grpc_request<T>(token: &str, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if !token.is_empty() {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    request
}

#[tokio::test]
async fn over_grpc_a_promotion_is_requested_once_and_the_applied_specification_is_read() {
    use ferry_app::grpc::pb::delivery::promotions_client::PromotionsClient;
    use ferry_app::grpc::pb::delivery::{Hotfix, RequestPromotionRequest};
    use ferry_app::grpc::pb::provisioning::provisioning_client::ProvisioningClient;
    use ferry_app::grpc::pb::provisioning::GetCurrentSpecificationRequest;
    use tonic::Code;
    use tonic_types::StatusExt;

    let d = start_with(Backend::Sqlite, None, |c| {
        c.verification_window = std::time::Duration::from_secs(1);
    })
    .await;
    d.environment("payments-dev", "development").await;
    let release = d.deployable("2.3.0").await;
    let addr = d.s.server.as_ref().unwrap().grpc_addr.unwrap();
    let url = format!("http://{addr}");
    let mut promotions = PromotionsClient::connect(url.clone()).await.unwrap();
    let mut provisioning = ProvisioningClient::connect(url.clone()).await.unwrap();
    let alice = promoter("acme", "alice");
    let run_id = uuid::Uuid::new_v4().to_string();
    let ask = RequestPromotionRequest {
        release_id: release.clone(),
        environment_id: "payments-dev".into(),
        strategy: "BlueGreen".into(),
        run_id: run_id.clone(),
        receipt_ref: "https://factory.example.com/runs/7/receipt".into(),
        hotfix: None,
        idempotency_key: "deploy-env-7".into(),
    };

    // Requested over gRPC, the promotion runs to Completed like one asked over HTTP.
    let first = promotions
        .request(grpc_request(&alice, ask.clone()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.state, "Requested");
    assert_eq!(first.tenant_id, "acme");
    assert_eq!(first.requested_by, "alice");
    assert_eq!(first.run_id, run_id);
    assert_eq!(first.strategy, "BlueGreen");
    let done = d
        .wait(&json!({"promotionId": first.promotion_id}), "Completed")
        .await;
    assert_eq!(
        done["receiptRef"],
        "https://factory.example.com/runs/7/receipt"
    );

    // A retry with the same key answers with the first promotion; another request under that
    // key is refused.
    let again = promotions
        .request(grpc_request(&alice, ask.clone()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again, first);
    let other = RequestPromotionRequest {
        strategy: "Canary".into(),
        ..ask.clone()
    };
    let refused = promotions
        .request(grpc_request(&alice, other))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::AlreadyExists, "{refused:?}");

    // The specification last applied there, as the HTTP endpoint answers it.
    let current = provisioning
        .get_current_specification(grpc_request(
            &admin("acme"),
            GetCurrentSpecificationRequest {
                environment_id: "payments-dev".into(),
                kind: "Workload".into(),
            },
        ))
        .await
        .unwrap()
        .into_inner();
    let spec = &current.specifications[0];
    let applied = spec.applied.as_ref().unwrap();
    assert_eq!(applied.version, 1);
    assert_eq!(
        applied.provisioning_run_id,
        done["provisioningRunId"].as_str().unwrap()
    );
    assert_eq!(spec.latest.as_ref().unwrap().release_id, release);

    // Each refusal has its status.
    let no_token = promotions
        .request(grpc_request("", ask.clone()))
        .await
        .unwrap_err();
    assert_eq!(no_token.code(), Code::Unauthenticated);
    let reader = token("acme", "rita", &[READ, D_READ], &["Reader"]);
    let denied = promotions
        .request(grpc_request(&reader, ask.clone()))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    let bad = RequestPromotionRequest {
        release_id: "not-a-uuid".into(),
        idempotency_key: String::new(),
        ..ask.clone()
    };
    let invalid = promotions
        .request(grpc_request(&alice, bad))
        .await
        .unwrap_err();
    assert_eq!(invalid.code(), Code::InvalidArgument, "{invalid:?}");
    let details = invalid.get_error_details();
    assert_eq!(
        details.bad_request().unwrap().field_violations[0].field,
        "release_id"
    );
    let hotfix = RequestPromotionRequest {
        hotfix: Some(Hotfix { reason: " ".into() }),
        idempotency_key: String::new(),
        ..ask.clone()
    };
    let invalid = promotions
        .request(grpc_request(&alice, hotfix))
        .await
        .unwrap_err();
    assert_eq!(
        invalid
            .get_error_details()
            .bad_request()
            .unwrap()
            .field_violations[0]
            .field,
        "hotfix.reason"
    );
    let kind = provisioning
        .get_current_specification(grpc_request(
            &admin("acme"),
            GetCurrentSpecificationRequest {
                environment_id: "payments-dev".into(),
                kind: "Bogus".into(),
            },
        ))
        .await
        .unwrap_err();
    assert_eq!(kind.code(), Code::InvalidArgument);
    // Tenant B cannot read tenant A's environment: to it, there is none.
    for (token, environment) in [
        (admin("globex"), "payments-dev"),
        (admin("acme"), "nowhere"),
    ] {
        let missing = provisioning
            .get_current_specification(grpc_request(
                &token,
                GetCurrentSpecificationRequest {
                    environment_id: environment.into(),
                    kind: String::new(),
                },
            ))
            .await
            .unwrap_err();
        assert_eq!(missing.code(), Code::NotFound, "{missing:?}");
    }
    // Nor promote into it (it records no such environment).
    let globex = promotions
        .request(grpc_request(
            &promoter("globex", "mallory"),
            RequestPromotionRequest {
                idempotency_key: String::new(),
                ..ask.clone()
            },
        ))
        .await
        .unwrap_err();
    assert_eq!(globex.code(), Code::InvalidArgument, "{globex:?}");

    // What gRPC users expect: the health service and reflection (for grpcurl).
    let channel = tonic::transport::Endpoint::from_shared(url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    for service in [
        "ferry.delivery.v1.Promotions",
        "ferry.provisioning.v1.Provisioning",
    ] {
        let serving = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(serving.status, 1, "{service} SERVING");
    }
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let mut reflection = ServerReflectionClient::new(channel);
    let ask_services = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = reflection
        .server_reflection_info(futures::stream::iter([ask_services]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("{answer:?}");
    };
    let names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
    for service in [
        "ferry.delivery.v1.Promotions",
        "ferry.provisioning.v1.Provisioning",
        "grpc.health.v1.Health",
    ] {
        assert!(names.contains(&service), "{names:?}");
    }
    // Clients that ask the older v1alpha reflection (Python's grpcio, older grpcurl) too.
    {
        use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
        use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
        let channel = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let ask = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let answer = ServerReflectionClient::new(channel)
            .server_reflection_info(futures::stream::iter([ask]))
            .await
            .unwrap()
            .into_inner()
            .message()
            .await
            .unwrap()
            .unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
            panic!("{answer:?}");
        };
        let names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
        for service in [
            "ferry.delivery.v1.Promotions",
            "ferry.provisioning.v1.Provisioning",
        ] {
            assert!(names.contains(&service), "v1alpha: {names:?}");
        }
    }
    let metrics = d.s.metrics().await;
    assert!(
        metrics.contains(r#"ferry_grpc_requests_total{code="Ok",method="Promotions.Request"} 2"#),
        "{metrics}"
    );

    // The store gone: UNAVAILABLE, with advice on when to retry.
    d.s.db.as_ref().unwrap().db.close().await;
    let away = provisioning
        .get_current_specification(grpc_request(
            &admin("acme"),
            GetCurrentSpecificationRequest {
                environment_id: "payments-dev".into(),
                kind: String::new(),
            },
        ))
        .await
        .unwrap_err();
    assert_eq!(away.code(), Code::Unavailable, "{away:?}");
    assert!(away.get_error_details().retry_info().is_some());
    d.s.stop().await;
}

/// A release withdrawn by another instance (its own cache of aggregates) is refused here,
/// though this instance's cached copy of the release is not withdrawn: the request is
/// decided on the release as stored.
#[tokio::test]
async fn a_release_withdrawn_on_another_instance_is_not_promoted() {
    use ferry_domain::release::{Release, ReleaseCommand};
    use ferry_domain::{Actor, ReleaseId, TenantId};
    use ferry_store::{Database, EventMetadata, Repository};

    let d = start(Backend::Postgres, None).await;
    d.environment("payments-dev", "development").await;
    // Recorded through this instance, which keeps it cached.
    let release = d.deployable("1.0.0").await;
    let t = d.s.db.as_ref().unwrap();
    let elsewhere: Repository<Release> =
        Repository::new(Database::from_pool(t.db.pool().clone()), ());
    let acme = TenantId::parse("acme").unwrap();
    let by = Actor::parse("svc-releases").unwrap();
    let withdraw = ReleaseCommand::Withdraw {
        reason: "licence problem".to_string(),
        by: by.clone(),
        at: chrono::Utc::now(),
    };
    let id = Release::aggregate_id(&acme, ReleaseId::parse(&release).unwrap());
    let meta = EventMetadata::for_request(acme.clone(), by, uuid::Uuid::new_v4());
    elsewhere
        .execute(&acme, &id, withdraw, &meta, false)
        .await
        .unwrap();
    let (status, body) =
        d.s.post(
            &promoter("acme", "alice"),
            "/factory/delivery/promotions",
            &json!({"releaseId": release, "environmentId": "payments-dev"}),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert!(
        body.to_string().contains("was withdrawn: licence problem"),
        "{body}"
    );
    d.s.stop().await;
}

/// A promotion of `release` (of `project`) into `environment`, recorded straight through
/// the store as a version before the edge's project check would have recorded it (the
/// issue 37 reproduction was made on such a version).
async fn recorded_before_the_check(
    d: &Delivery,
    tenant: &str,
    project: &str,
    release: &str,
    environment: &str,
) -> String {
    use ferry_domain::promotion::{Promotion, PromotionCommand, PromotionRequest};
    let db = d.s.db.as_ref().unwrap().db.clone();
    let promotions: ferry_store::Repository<Promotion> = ferry_store::Repository::new(db, ());
    let tenant = ferry_domain::TenantId::parse(tenant).unwrap();
    let id = ferry_domain::PromotionId::new_random();
    let request = PromotionRequest {
        promotion_id: id,
        tenant_id: tenant.clone(),
        project_id: ferry_domain::ProjectId::parse(project).unwrap(),
        release_id: ferry_domain::ReleaseId::parse(release).unwrap(),
        environment_id: ferry_domain::EnvironmentId::parse(environment).unwrap(),
        environment_class: ferry_domain::EnvironmentClass::Development,
        strategy: Default::default(),
        run_id: None,
        hotfix: None,
        receipt_ref: None,
        previous_release_id: None,
        rollback_of: None,
        requested_by: ferry_domain::Actor::parse("gina").unwrap(),
        requested_at: chrono::Utc::now(),
    };
    let metadata = ferry_store::EventMetadata {
        tenant_id: tenant.clone(),
        actor: ferry_domain::Actor::parse("gina").unwrap(),
        correlation_id: id.as_uuid(),
        causation_id: id.as_uuid(),
        request_id: uuid::Uuid::new_v4(),
    };
    promotions
        .execute(
            &tenant,
            &id.to_string(),
            PromotionCommand::Request(Box::new(request)),
            &metadata,
            true,
        )
        .await
        .unwrap();
    id.to_string()
}

/// Issue 37: a globex Operator declared `g-dev`'s Workload specification with
/// `projectId: "other"` and promoted a release of project `g` there; the driver failed on it
/// at every pass and acme's promotion into a fresh environment waited in `Requested` for as
/// long as globex wished. The request is refused now (422 naming `projectId`); one recorded
/// before that check fails alone, says why on itself, in `/readyz` and `/metrics`, and acme's
/// promotion goes through.
async fn one_tenant_s_failing_promotion_never_holds_another_s(backend: Backend) {
    let d = start(backend, None).await;
    let globex = admin("globex");
    let (status, body) = d
        .put(
            &globex,
            "/factory/environments/g-dev",
            &json!({"environmentClass": "development", "healthUrl": d.health}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let mut workload = declaration("g-dev", &d.program.1);
    workload["kind"] = json!("Workload");
    workload["projectId"] = json!("other");
    let (status, body) =
        d.s.post(&globex, "/factory/provisioning/specifications", &workload)
            .await;
    assert_eq!(status, 201, "{body}");
    let release = uuid::Uuid::new_v4().to_string();
    let (status, body) = d
        .put(
            &globex,
            &format!("/factory/delivery/releases/{release}"),
            &json!({
                "projectId": "g", "version": "1.0.0",
                "programRef": "https://git.example.com/g.git#web",
                "programVersion": d.program.1, "pipeline": passed()
            }),
        )
        .await;
    assert_eq!(status, 201, "{body}");

    // Validated at the edge: refused when requested, naming the field.
    let (status, body) =
        d.s.post(
            &promoter("globex", "gina"),
            "/factory/delivery/promotions",
            &json!({"releaseId": release, "environmentId": "g-dev"}),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["errors"][0]["field"], "projectId", "{body}");

    // One recorded before the check reaches the hand-off and fails there at every attempt.
    let stuck = recorded_before_the_check(&d, "globex", "g", &release, "g-dev").await;
    let path = format!("/factory/delivery/promotions/{stuck}");
    let (s, path_ref) = (&d.s, &path);
    let shown = eventually_showing(
        "globex's promotion says why it is stuck",
        30,
        || async move {
            let (_, p) = s.get(&promoter("globex", "gina"), path_ref).await;
            if p["stuck"]["error"]
                .as_str()
                .is_some_and(|e| e.contains("project"))
            {
                Ok(p)
            } else {
                Err(p.to_string())
            }
        },
    )
    .await;
    assert_eq!(shown["state"], "Approved", "{shown}");

    // Acme's promotion into a fresh environment, requested after it, goes through.
    d.environment("payments-fresh", "development").await;
    let acme = d.deployable("3.0.0").await;
    let promotion = d.promote(&acme, "payments-fresh", json!({})).await;
    let promotion = d.wait(&promotion, "Verifying").await;
    assert!(promotion.get("stuck").is_none(), "{promotion}");

    // The stuck one is counted where an operator looks, and is still retried alone.
    let (status, ready) = response(d.s.client.get(d.s.url("/readyz")).send().await.unwrap()).await;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["status"], "degraded", "{ready}");
    assert!(
        ready["problems"].as_array().unwrap().iter().any(|p| p
            .as_str()
            .unwrap()
            .starts_with("promotions: 1 item(s) of 1 tenant(s)")),
        "{ready}"
    );
    let metrics = d.s.metrics().await;
    assert!(
        metrics.contains("ferry_loop_items_failing{loop=\"promotions\"} 1"),
        "{metrics}"
    );
    let (_, again) = d.s.get(&promoter("globex", "gina"), &path).await;
    assert_eq!(again["state"], "Approved", "{again}");

    // It ends another way (rejected by a command that is not the driver's, as another
    // instance or a decision would): it is no longer the driver's, so nothing counts it as
    // stuck any more (it used to stay in `/readyz` and the metric until a restart).
    reject_outside_the_driver(&d, "globex", &stuck).await;
    let s = &d.s;
    eventually_showing(
        "the ended promotion is no longer counted",
        30,
        || async move {
            let (_, ready) = response(s.client.get(s.url("/readyz")).send().await.unwrap()).await;
            let metrics = s.metrics().await;
            let counted = ready["problems"].as_array().is_some_and(|p| {
                p.iter()
                    .any(|p| p.as_str().is_some_and(|p| p.starts_with("promotions:")))
            });
            if !counted && metrics.contains("ferry_loop_items_failing{loop=\"promotions\"} 0") {
                Ok(())
            } else {
                Err(ready.to_string())
            }
        },
    )
    .await;
    let (_, ended) = d.s.get(&promoter("globex", "gina"), &path).await;
    assert_eq!(ended["state"], "Rejected", "{ended}");
    assert!(ended.get("stuck").is_none(), "{ended}");
    d.s.stop().await;
}

async fn reject_outside_the_driver(d: &Delivery, tenant: &str, promotion: &str) {
    use ferry_domain::promotion::{Promotion, PromotionCommand};
    let db = d.s.db.as_ref().unwrap().db.clone();
    let promotions: ferry_store::Repository<Promotion> = ferry_store::Repository::new(db, ());
    let tenant = ferry_domain::TenantId::parse(tenant).unwrap();
    let metadata = ferry_store::EventMetadata {
        tenant_id: tenant.clone(),
        actor: ferry_domain::Actor::parse("gina").unwrap(),
        correlation_id: uuid::Uuid::new_v4(),
        causation_id: uuid::Uuid::new_v4(),
        request_id: uuid::Uuid::new_v4(),
    };
    let reject = PromotionCommand::Reject {
        reason: "given up".to_string(),
        at: chrono::Utc::now(),
    };
    promotions
        .execute(&tenant, promotion, reject, &metadata, true)
        .await
        .unwrap();
}

#[tokio::test]
async fn one_tenant_s_failing_promotion_never_holds_another_s_on_sqlite() {
    one_tenant_s_failing_promotion_never_holds_another_s(Backend::Sqlite).await;
}

#[tokio::test]
async fn one_tenant_s_failing_promotion_never_holds_another_s_on_postgres() {
    one_tenant_s_failing_promotion_never_holds_another_s(Backend::Postgres).await;
}

/// Issue 37 §8: names, reasons and links come back as stored, and a console renders them.
/// What cannot be shown faithfully (ANSI escapes, invisible characters, `javascript:`
/// links, a 250 KB reason) is refused where it arrives, over HTTP and as an inbound event,
/// naming the field; markup is text and comes back as the same text.
#[tokio::test]
async fn text_a_console_renders_is_checked_where_it_arrives() {
    let d = start(Backend::Sqlite, None).await;
    let acme = admin("acme");
    let release_body = |pipeline: Value| {
        json!({
            "projectId": "payments", "version": "1.0.0",
            "programRef": "https://git.example.com/payments.git#infra",
            "programVersion": d.program.1, "pipeline": pipeline
        })
    };
    for (pipeline, field) in [
        (
            json!([{"name": "unit", "result": "passed", "url": "javascript:alert(1)"}]),
            "pipeline[0].url",
        ),
        (
            json!([{"name": "unit", "result": "passed", "url": "data:text/html,<script>x</script>"}]),
            "pipeline[0].url",
        ),
        (
            json!([{"name": "unit", "result": "passed"},
                   {"name": "\u{1b}[2J\u{1b}[31me2e", "result": "passed"}]),
            "pipeline[1].name",
        ),
        (
            json!([{"name": "unit\u{202E}tset", "result": "passed"}]),
            "pipeline[0].name",
        ),
        (
            json!([{"name": "n".repeat(257), "result": "passed"}]),
            "pipeline[0].name",
        ),
    ] {
        let id = uuid::Uuid::new_v4();
        let (status, body) = d
            .put(
                &acme,
                &format!("/factory/delivery/releases/{id}"),
                &release_body(pipeline),
            )
            .await;
        assert_eq!(status, 422, "{field}: {body}");
        assert_eq!(body["errors"][0]["field"], field, "{body}");
    }
    let mut long_summary = release_body(passed());
    long_summary["hasAgentGeneratedAssets"] = json!(true);
    long_summary["evaluationEvidence"] = json!({"passed": true, "summary": "s".repeat(250_000)});
    let (status, body) = d
        .put(
            &acme,
            &format!("/factory/delivery/releases/{}", uuid::Uuid::new_v4()),
            &long_summary,
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["errors"][0]["field"], "evaluationEvidence.summary");

    // Markup is text: kept, and answered as JSON text.
    let markup = uuid::Uuid::new_v4();
    let (status, body) = d
        .put(
            &acme,
            &format!("/factory/delivery/releases/{markup}"),
            &release_body(
                json!([{"name": "<script>alert(1)</script>", "result": "passed",
                                   "url": "https://ci.example.com/7"}]),
            ),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    assert!(
        body.to_string().contains("<script>alert(1)</script>"),
        "{body}"
    );

    // The same refusal as an inbound event: nothing is recorded.
    let sneaky = uuid::Uuid::new_v4();
    let event = json!({
        "specversion": "1.0", "id": format!("ready-{sneaky}"), "source": "urn:releases",
        "type": "releases.releases.v1.release-ready", "tenantid": "acme",
        "datacontenttype": "application/json",
        "data": {"releaseId": sneaky, "tenantId": "acme", "projectId": "payments",
                 "version": "1.0.0", "programRef": "https://git.example.com/payments.git#infra",
                 "programVersion": d.program.1,
                 "pipeline": [{"name": "unit", "result": "passed", "url": "JavaScript:alert(1)"}]}
    });
    let (status, body) =
        d.s.post_event(&service("acme", "svc-releases"), &event)
            .await;
    assert_eq!(status, 422, "{body}");
    assert!(body.to_string().contains("pipeline[0].url"), "{body}");
    let (_, listed) =
        d.s.get(&promoter("acme", "alice"), "/factory/delivery/releases")
            .await;
    assert!(
        !listed.to_string().contains(&sneaky.to_string()),
        "{listed}"
    );

    // Reasons are capped at 2,000 characters and refuse escapes, before anything is done.
    let operator = token(
        "acme",
        "olive",
        &[D_READ, "factory.delivery.operate"],
        &["Operator"],
    );
    let (status, body) =
        d.s.post(
            &operator,
            &format!("/factory/delivery/releases/{markup}/quarantines/payments-dev/lift"),
            &json!({"reason": "r".repeat(2001)}),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["errors"][0]["field"], "reason", "{body}");
    let (status, body) =
        d.s.post(
            &acme,
            &format!("/factory/provisioning/runs/{}/cancel", uuid::Uuid::new_v4()),
            &json!({"reason": "done\u{1b}]8;;https://evil.example\u{7}click\u{1b}]8;;\u{7}"}),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["errors"][0]["field"], "reason", "{body}");

    // Links an environment is probed at are web URLs.
    let (status, body) = d
        .put(
            &acme,
            "/factory/environments/payments-js",
            &json!({"environmentClass": "development", "healthUrl": "javascript:alert(1)"}),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["errors"][0]["field"], "healthUrl", "{body}");
    d.s.stop().await;
}

/// A Ferry with the promotion path's four environments recorded and a verification window
/// of `window` seconds.
async fn with_the_path(backend: Backend, window: u64) -> Delivery {
    let d = start_with(backend, None, |c| {
        c.verification_window = std::time::Duration::from_secs(window);
    })
    .await;
    for (env, class) in [
        ("payments-dev", "development"),
        ("payments-test", "test"),
        ("payments-staging", "staging"),
        ("payments-prod", "production"),
    ] {
        d.environment(env, class).await;
    }
    d
}

/// The path to production for `release`: development, test and staging completed, then
/// production approved by a Reviewer who did not request it; answers the production
/// promotion once it is `Verifying` or later.
async fn through_to_production(d: &Delivery, release: &str) -> Value {
    for env in ["payments-dev", "payments-test", "payments-staging"] {
        let p = d.promote(release, env, json!({})).await;
        d.wait(&p, "Completed").await;
    }
    let prod = d.promote(release, "payments-prod", json!({})).await;
    let path = format!(
        "/factory/delivery/promotions/{}",
        prod["promotionId"].as_str().unwrap()
    );
    // A Reviewer holding only the delivery scopes reads the plan the approval covers.
    let bob = token("acme", "bob", &[D_READ, D_PROMOTE], &["Reviewer"]);
    let (s, path_ref, bob_ref) = (&d.s, &path, &bob);
    let pending = eventually_showing("the production approval with its plan", 60, || async move {
        let (_, p) = s.get(bob_ref, path_ref).await;
        if p["approvalStatus"] == "Pending" && p["approvalPlan"].is_object() {
            Ok(p)
        } else {
            Err(p.to_string())
        }
    })
    .await;
    let plan = &pending["approvalPlan"];
    assert_eq!(
        plan["inputsHash"], pending["approval"]["planInputsHash"],
        "{pending}"
    );
    assert_eq!(
        plan["provisioningRunId"],
        pending["approval"]["provisioningRunId"]
    );
    assert!(plan["programVersion"].is_string(), "{plan}");
    let resources = plan["resources"].as_array().unwrap();
    assert!(!resources.is_empty(), "{plan}");
    assert!(
        resources
            .iter()
            .all(|r| r["urn"].is_string() && r["op"].is_string()),
        "{plan}"
    );
    assert!(plan["adds"].is_u64() && plan["deletes"].is_u64(), "{plan}");
    assert_eq!(
        pending["approvableBy"]["roles"],
        json!(["Reviewer", "PlatformAdmin"])
    );
    assert_eq!(pending["approvableBy"]["except"], json!(["alice"]));
    let log =
        d.s.client
            .get(d.s.url(plan["log"].as_str().unwrap()))
            .bearer_auth(&bob)
            .send()
            .await
            .unwrap();
    assert_eq!(log.status(), 200);
    assert!(!log.text().await.unwrap().is_empty());
    let (status, body) =
        d.s.post(
            &bob,
            &format!("{path}/approval"),
            &json!({"decision": "approve", "reason": "CAB"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["approvalStatus"], "Approved", "{body}");
    assert_eq!(
        body["approvalPlan"]["inputsHash"], plan["inputsHash"],
        "{body}"
    );
    d.wait_any(&prod, &["Verifying", "Completed"]).await
}

/// The run a rollback promotion applied, by the promotion's id.
async fn rollback_run(d: &Delivery, rollback_promotion: &str) -> Value {
    let path = format!("/factory/delivery/promotions/{rollback_promotion}");
    let (_, rollback) = d.s.get(&promoter("acme", "alice"), &path).await;
    assert_eq!(rollback["state"], "Completed", "{rollback}");
    let run = rollback["provisioningRunId"].as_str().unwrap();
    let (_, run) =
        d.s.get(
            &operator("acme", "alice"),
            &format!("/factory/provisioning/runs/{run}"),
        )
        .await;
    assert_eq!(run["state"], "Applied", "{run}");
    run
}

/// Issue 38: a rollback in production stopped at its run's approval, which nobody could
/// give. Its run now applies under the rollback's own authority (the failed verification,
/// or the Operator by role), recorded on the run; the failed promotion ends `RolledBack`,
/// the rollback `Completed`, the previous release current. Rolling back a rollback would
/// bring the quarantined release back: refused.
async fn rollbacks_in_production_restore_the_previous_release(backend: Backend) {
    let d = with_the_path(backend, 2).await;
    let good = d.deployable("1.0.0").await;
    let first = through_to_production(&d, &good).await;
    d.wait(&first, "Completed").await;

    // Automatic: the next release fails its verification in production.
    let bad = d.deployable("1.1.0").await;
    let failing = through_to_production(&d, &bad).await;
    d.status.store(503, Ordering::SeqCst);
    let path = format!(
        "/factory/delivery/promotions/{}",
        failing["promotionId"].as_str().unwrap()
    );
    let (s, path_ref) = (&d.s, &path);
    eventually_showing("verification failed in production", 30, || async move {
        let (_, p) = s.get(&promoter("acme", "alice"), path_ref).await;
        if p["verification"]["outcome"] == "Failed" {
            Ok(p)
        } else {
            Err(p.to_string())
        }
    })
    .await;
    d.status.store(200, Ordering::SeqCst);
    let rolled = d.wait(&failing, "RolledBack").await;
    assert_eq!(rolled["rollback"]["automatic"], true, "{rolled}");
    assert_eq!(rolled["failure"]["rolledBack"], true, "{rolled}");
    let run = rollback_run(
        &d,
        rolled["rollback"]["rollbackPromotionId"].as_str().unwrap(),
    )
    .await;
    assert_eq!(run["authorization"]["type"], "rollback", "{run}");
    assert_eq!(run["authorization"]["automatic"], true, "{run}");
    assert_eq!(
        run["authorization"]["rollsBack"], rolled["promotionId"],
        "{run}"
    );
    let (_, current) =
        d.s.get(
            &promoter("acme", "alice"),
            "/factory/environments/payments-prod/current-release",
        )
        .await;
    assert_eq!(current["releaseId"], good.as_str(), "{current}");

    // By hand: an Operator rolls a completed production promotion back.
    let next = d.deployable("1.2.0").await;
    let completed = through_to_production(&d, &next).await;
    let completed = d.wait(&completed, "Completed").await;
    let carol = token(
        "acme",
        "carol",
        &[D_READ, "factory.delivery.operate"],
        &["Operator"],
    );
    let path = format!(
        "/factory/delivery/promotions/{}",
        completed["promotionId"].as_str().unwrap()
    );
    let (status, body) =
        d.s.post(
            &carol,
            &format!("{path}/rollback"),
            &json!({"reason": "error budget burnt"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let rolled = d.wait(&completed, "RolledBack").await;
    let rollback_id = rolled["rollback"]["rollbackPromotionId"]
        .as_str()
        .unwrap()
        .to_string();
    let run = rollback_run(&d, &rollback_id).await;
    assert_eq!(run["authorization"]["type"], "rollback", "{run}");
    assert_eq!(run["authorization"]["automatic"], false, "{run}");
    assert_eq!(run["authorization"]["authorisedBy"], "carol", "{run}");
    let (_, current) =
        d.s.get(
            &promoter("acme", "alice"),
            "/factory/environments/payments-prod/current-release",
        )
        .await;
    assert_eq!(current["releaseId"], good.as_str(), "{current}");

    // Rolling the rollback back would restore the quarantined release: refused.
    let (status, body) =
        d.s.post(
            &carol,
            &format!("/factory/delivery/promotions/{rollback_id}/rollback"),
            &json!({"reason": "undo"}),
        )
        .await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("quarantined"),
        "{body}"
    );
    d.s.stop().await;
}

#[tokio::test]
async fn rollbacks_in_production_restore_the_previous_release_on_sqlite() {
    rollbacks_in_production_restore_the_previous_release(Backend::Sqlite).await;
}

#[tokio::test]
async fn rollbacks_in_production_restore_the_previous_release_on_postgres() {
    rollbacks_in_production_restore_the_previous_release(Backend::Postgres).await;
}

/// Issue 38: a folder or commit typo was accepted and failed only at plan time; a release
/// naming a missing commit was recorded `Ready`; a specification for an environment Ferry
/// never heard of silently became production. Caught where they are made now.
#[tokio::test]
async fn mistakes_are_caught_when_they_are_made() {
    let d = start(Backend::Sqlite, None).await;
    d.environment("payments-dev", "development").await;
    let alice = operator("acme", "alice");
    let (repo, _) = d.program.0.split_once('#').unwrap();
    let declare = |program_ref: String, commit: String, env: &str| {
        json!({"environmentId": env, "projectId": "payments", "kind": "Workload",
               "programRef": program_ref, "programVersion": commit})
    };
    let missing = "0123456789abcdef0123456789abcdef01234567".to_string();
    let (status, body) =
        d.s.post(
            &alice,
            "/factory/provisioning/specifications",
            &declare(
                format!("{repo}#stacks/wbe"),
                d.program.1.clone(),
                "payments-dev",
            ),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["errors"][0]["field"], "programRef", "{body}");
    assert!(body.to_string().contains("stacks/wbe"), "{body}");
    let (status, body) =
        d.s.post(
            &alice,
            "/factory/provisioning/specifications",
            &declare(d.program.0.clone(), missing.clone(), "payments-dev"),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["errors"][0]["field"], "programVersion", "{body}");

    // A release recorded over HTTP with a commit its repository does not hold: 422.
    let (status, body) = d
        .put(
            &admin("acme"),
            &format!("/factory/delivery/releases/{}", uuid::Uuid::new_v4()),
            &json!({"projectId": "payments", "version": "9.9.9",
                    "programRef": d.program.0, "programVersion": missing,
                    "pipeline": passed()}),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["errors"][0]["field"], "programVersion", "{body}");

    // The release service's report is kept, with the problem; it is not promotable.
    let release = uuid::Uuid::new_v4();
    let event = json!({
        "specversion": "1.0", "id": format!("ready-{release}"), "source": "urn:releases",
        "type": "releases.releases.v1.release-ready", "tenantid": "acme",
        "datacontenttype": "application/json",
        "data": {"releaseId": release, "tenantId": "acme", "projectId": "payments",
                 "version": "9.9.9", "programRef": d.program.0, "programVersion": missing,
                 "pipeline": [{"name": "unit", "result": "passed"}]}
    });
    let (status, body) =
        d.s.post_event(&service("acme", "svc-releases"), &event)
            .await;
    assert_eq!(status, 202, "{body}");
    let p = d
        .promote(&release.to_string(), "payments-dev", json!({}))
        .await;
    let p = d.wait(&p, "Rejected").await;
    assert_eq!(p["rejection"]["gate"], "PipelineResults", "{p}");
    assert!(
        p["rejection"]["reason"]
            .as_str()
            .unwrap()
            .contains(&missing),
        "{p}"
    );

    // An environment Ferry has not heard of: accepted, treated as production, and said so.
    let (status, spec) =
        d.s.post(
            &alice,
            "/factory/provisioning/specifications",
            &declare(d.program.0.clone(), d.program.1.clone(), "paymnets-dev"),
        )
        .await;
    assert_eq!(status, 201, "{spec}");
    assert!(
        spec["warnings"][0]
            .as_str()
            .unwrap()
            .contains("paymnets-dev"),
        "{spec}"
    );
    let (status, known) =
        d.s.post(
            &alice,
            "/factory/provisioning/specifications",
            &declare(d.program.0.clone(), d.program.1.clone(), "payments-dev"),
        )
        .await;
    assert_eq!(status, 201, "{known}");
    assert!(known.get("warnings").is_none(), "{known}");
    let (status, run) =
        d.s.post(
            &alice,
            "/factory/provisioning/runs",
            &json!({"specificationId": spec["specificationId"],
                    "specificationVersion": spec["version"],
                    "environmentId": "paymnets-dev", "kind": "Release"}),
        )
        .await;
    assert_eq!(status, 201, "{run}");
    let path = format!(
        "/factory/provisioning/runs/{}",
        run["provisioningRunId"].as_str().unwrap()
    );
    let (s, path) = (&d.s, &path);
    let waiting = eventually_showing("the run awaiting approval", 30, || async move {
        let (_, run) = s.get(&operator("acme", "alice"), path).await;
        if run["state"] == "AwaitingApproval" {
            Ok(run)
        } else {
            Err(run.to_string())
        }
    })
    .await;
    let reason = waiting["approval"]["requiredReason"].as_str().unwrap();
    assert!(
        reason.contains("paymnets-dev is not recorded")
            && reason.contains("PUT /factory/environments/paymnets-dev"),
        "{reason}"
    );
    d.s.stop().await;
}

/// Issue 38: "what runs where" was one request per environment. `GET /factory/environments`
/// answers it, with filters and paging, and `GET /factory/delivery/releases` finds
/// `payments@1.1.0`.
async fn environments_are_listed_with_what_runs_there(backend: Backend) {
    let d = with_the_path(backend, 1).await;
    let good = d.deployable("1.0.0").await;
    for env in ["payments-dev", "payments-test", "payments-staging"] {
        let p = d.promote(&good, env, json!({})).await;
        d.wait(&p, "Completed").await;
    }
    let waiting = d.promote(&good, "payments-prod", json!({})).await;
    d.wait(&waiting, "AwaitingApproval").await;
    // A newer release in development, rolled back by hand: quarantined there.
    let bad = d.deployable("1.1.0").await;
    let p = d.promote(&bad, "payments-dev", json!({})).await;
    let p = d.wait(&p, "Completed").await;
    let carol = token(
        "acme",
        "carol",
        &[D_READ, "factory.delivery.operate"],
        &["Operator"],
    );
    let (status, body) =
        d.s.post(
            &carol,
            &format!(
                "/factory/delivery/promotions/{}/rollback",
                p["promotionId"].as_str().unwrap()
            ),
            &json!({"reason": "bad"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    d.wait(&p, "RolledBack").await;

    let reader = token("acme", "rita", &[D_READ], &["Reviewer"]);
    let (status, page) = d.s.get(&reader, "/factory/environments").await;
    assert_eq!(status, 200, "{page}");
    let items = page["items"].as_array().unwrap();
    let ids: Vec<&str> = items
        .iter()
        .map(|e| e["environmentId"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        [
            "payments-prod",
            "payments-staging",
            "payments-test",
            "payments-dev"
        ],
        "newest first: {page}"
    );
    let dev = &items[3];
    assert_eq!(dev["environmentClass"], "development", "{dev}");
    assert_eq!(dev["currentReleases"][0]["projectId"], "payments", "{dev}");
    assert_eq!(
        dev["currentReleases"][0]["releaseId"],
        good.as_str(),
        "{dev}"
    );
    assert_eq!(dev["quarantines"][0]["releaseId"], bad.as_str(), "{dev}");
    assert_eq!(dev["openDriftProposals"], 0, "{dev}");
    assert!(
        dev["appliedSpecifications"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["kind"] == "Workload" && s["version"].as_u64() >= Some(1)),
        "{dev}"
    );
    let prod = &items[0];
    assert_eq!(
        prod["promotionsInFlight"][0]["state"], "AwaitingApproval",
        "{prod}"
    );
    assert_eq!(prod["promotionsInFlight"][0]["releaseId"], good.as_str());
    assert!(
        prod["currentReleases"].as_array().unwrap().is_empty(),
        "{prod}"
    );

    // Filters and paging.
    let (_, only) =
        d.s.get(&reader, "/factory/environments?environmentClass=production")
            .await;
    let only: Vec<&str> = only["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["environmentId"].as_str().unwrap())
        .collect();
    assert_eq!(only, ["payments-prod"]);
    let (_, first) = d.s.get(&reader, "/factory/environments?limit=3").await;
    assert_eq!(first["items"].as_array().unwrap().len(), 3, "{first}");
    let cursor = first["nextCursor"].as_str().unwrap();
    let (_, rest) =
        d.s.get(
            &reader,
            &format!("/factory/environments?limit=3&cursor={cursor}"),
        )
        .await;
    assert_eq!(rest["items"][0]["environmentId"], "payments-dev", "{rest}");
    assert!(rest.get("nextCursor").is_none(), "{rest}");
    let (status, problem) =
        d.s.get(&reader, "/factory/environments?environmentClass=prod")
            .await;
    assert_eq!(status, 400, "{problem}");
    // Another tenant sees none of them.
    let (_, theirs) =
        d.s.get(
            &token("globex", "gina", &[D_READ], &[]),
            "/factory/environments",
        )
        .await;
    assert!(theirs["items"].as_array().unwrap().is_empty(), "{theirs}");

    // A release found by project and version.
    let (_, found) =
        d.s.get(
            &reader,
            "/factory/delivery/releases?projectId=payments&version=1.1.0",
        )
        .await;
    let found = found["items"].as_array().unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0]["releaseId"], bad.as_str());
    d.s.stop().await;
}

#[tokio::test]
async fn environments_are_listed_with_what_runs_there_on_sqlite() {
    environments_are_listed_with_what_runs_there(Backend::Sqlite).await;
}

#[tokio::test]
async fn environments_are_listed_with_what_runs_there_on_postgres() {
    environments_are_listed_with_what_runs_there(Backend::Postgres).await;
}

/// Issue 38: the promotion showed `AwaitingApproval` before its plan existed, and approving
/// then answered a bare 409. The approval says `Planning` until its plan is attached, and a
/// decision meanwhile is refused naming that status. (The runner here never answers, so
/// the plan never comes.)
#[tokio::test]
async fn an_approval_is_planning_until_its_plan_is_attached() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let runner_url = format!("http://{}", silent.local_addr().unwrap());
    // Accepts every connection and answers none (until the test ends).
    let listening = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let policy = "package ferry.deployment\n\nimport rego.v1\n\nhotfix contains \"hotfixes may skip the path\" if input.hotfix\n";
    let d = start_with(Backend::Sqlite, Some(policy), |c| {
        c.runner = ferry_app::config::RunnerKind::Http;
        c.runner_url = Some(runner_url);
        c.runner_shared_identity = Some(ferry_domain::ports::identity::RunnerIdentity::new(
            Default::default(),
        ));
    })
    .await;
    d.environment("payments-prod", "production").await;
    let release = d.deployable("1.0.0").await;
    // A hotfix skips the path where policy allows it; production still needs its approval.
    let p = d
        .promote(
            &release,
            "payments-prod",
            json!({"hotfix": {"reason": "CVE-2026-3"}}),
        )
        .await;
    let path = format!(
        "/factory/delivery/promotions/{}",
        p["promotionId"].as_str().unwrap()
    );
    let (s, path_ref) = (&d.s, &path);
    let planning = eventually_showing("the approval planning", 30, || async move {
        let (_, p) = s.get(&promoter("acme", "alice"), path_ref).await;
        if p["approvalStatus"] == "Planning" {
            Ok(p)
        } else {
            Err(p.to_string())
        }
    })
    .await;
    assert_eq!(planning["state"], "AwaitingApproval", "{planning}");
    assert!(planning.get("approvalPlan").is_none(), "{planning}");
    let bob = token("acme", "bob", &[D_READ, D_PROMOTE], &["Reviewer"]);
    let (status, problem) =
        d.s.post(
            &bob,
            &format!("{path}/approval"),
            &json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(status, 409, "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .starts_with("the approval is Planning"),
        "{problem}"
    );
    listening.abort();
    d.s.stop().await;
}
