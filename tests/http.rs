//! End-to-end tests through real HTTP against real Postgres (and the SQLite default).

mod common;

use common::*;
use ferry_store::database::Backend;
use serde_json::{json, Value};
use std::time::Duration;

async fn declare(s: &TestServer, token: &str, env: &str, commit: &str) -> Value {
    let (status, body) = s
        .post(
            token,
            "/factory/provisioning/specifications",
            &declaration(env, commit),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    body
}

fn plan_body(spec: &Value, kind: &str) -> Value {
    json!({
        "specificationId": spec["specificationId"],
        "specificationVersion": spec["version"],
        "environmentId": spec["environmentId"],
        "kind": kind
    })
}

#[tokio::test]
async fn a_user_declares_plans_lists_gets_and_cancels() {
    let s = TestServer::start(Backend::Postgres).await;
    let alice = operator("acme", "alice");

    let v1 = declare(&s, &alice, "payments-dev", "3f2a9c1").await;
    let v2 = declare(&s, &alice, "payments-dev", "4b5c6d7").await;
    assert_eq!(
        (v1["version"].as_u64(), v2["version"].as_u64()),
        (Some(1), Some(2))
    );
    assert_eq!(v1["specificationId"], v2["specificationId"]);
    assert_eq!(v2["secretRefs"]["dbPassword"], "env://DB_PASSWORD");

    // Read-your-writes: the list shows both versions right after the POSTs.
    let (status, page) = s
        .get(
            &alice,
            "/factory/provisioning/specifications?environmentId=payments-dev",
        )
        .await;
    assert_eq!(status, 200);
    let versions: Vec<u64> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["version"].as_u64().unwrap())
        .collect();
    assert_eq!(versions, [2, 1]);

    let (status, run) = s
        .post(
            &alice,
            "/factory/provisioning/runs",
            &plan_body(&v2, "Release"),
        )
        .await;
    assert_eq!(status, 201, "{run}");
    assert_eq!(run["state"], "Requested");
    assert_eq!(run["projectId"], "payments");
    assert_eq!(run["requestedBy"], "alice");
    let id = run["provisioningRunId"].as_str().unwrap().to_string();

    let (status, got) = s
        .get(&alice, &format!("/factory/provisioning/runs/{id}"))
        .await;
    assert_eq!((status, &got), (200, &run));

    let (_, second) = s
        .post(
            &alice,
            "/factory/provisioning/runs",
            &plan_body(&v1, "Baseline"),
        )
        .await;
    let (status, page) = s
        .get(
            &alice,
            "/factory/provisioning/runs?environmentId=payments-dev&limit=1",
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        page["items"][0]["provisioningRunId"],
        second["provisioningRunId"]
    );
    let cursor = page["nextCursor"].as_str().unwrap();
    let (_, next) = s
        .get(
            &alice,
            &format!(
                "/factory/provisioning/runs?environmentId=payments-dev&limit=1&cursor={cursor}"
            ),
        )
        .await;
    assert_eq!(next["items"][0]["provisioningRunId"], id.as_str());
    assert!(next.get("nextCursor").is_none());
    let (_, baselines) = s
        .get(&alice, "/factory/provisioning/runs?kind=Baseline")
        .await;
    assert_eq!(baselines["items"].as_array().unwrap().len(), 1);

    let (status, cancelled) = s
        .post(
            &alice,
            &format!("/factory/provisioning/runs/{id}/cancel"),
            &json!({"reason": "wrong window"}),
        )
        .await;
    assert_eq!(status, 200, "{cancelled}");
    assert_eq!(cancelled["state"], "Cancelled");
    assert_eq!(cancelled["cancellation"]["reason"], "wrong window");
    let (_, listed) = s
        .get(&alice, "/factory/provisioning/runs?state=Cancelled")
        .await;
    assert_eq!(listed["items"][0]["provisioningRunId"], id.as_str());

    // Cancelling again is the wrong state.
    let (status, problem) = s
        .post(
            &alice,
            &format!("/factory/provisioning/runs/{id}/cancel"),
            &json!({}),
        )
        .await;
    assert_eq!(status, 409);
    assert_eq!(problem["type"], "urn:ferry:problem:wrong-state");

    let (status, current) = s
        .get(
            &alice,
            "/factory/provisioning/environments/payments-dev/current-specification",
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(current["specifications"][0]["latest"]["version"], 2);
    assert!(current["specifications"][0].get("applied").is_none());
    s.stop().await;
}

#[tokio::test]
async fn errors_are_problems_with_the_right_status() {
    let s = TestServer::start(Backend::Postgres).await;
    let alice = operator("acme", "alice");
    let spec = declare(&s, &alice, "payments-dev", "3f2a9c1").await;
    let runs = "/factory/provisioning/runs";

    // 401: no token, garbage token, token signed with another key, expired token.
    let r = s.client.get(s.url(runs)).send().await.unwrap();
    assert_eq!(r.headers()["www-authenticate"], "Bearer realm=\"ferry\"");
    assert_eq!(response(r).await.0, 401);
    assert_eq!(s.get("garbage", runs).await.0, 401);
    let foreign = ferry_api::auth::issue_hs256(
        b"another-key-another-key-another-key!",
        "acme",
        "x",
        &[READ],
        &[],
        std::time::Duration::from_secs(60),
    )
    .unwrap();
    assert_eq!(s.get(&foreign, runs).await.0, 401);
    let no_tenant = {
        use jsonwebtoken::{encode, EncodingKey, Header};
        let claims = json!({"sub": "x", "scope": READ, "exp": chrono::Utc::now().timestamp() + 60});
        encode(
            &Header::default(),
            &claims,
            &EncodingKey::from_secret(KEY.as_bytes()),
        )
        .unwrap()
    };
    let (status, problem) = s.get(&no_tenant, runs).await;
    assert_eq!(status, 401);
    assert!(problem["detail"].as_str().unwrap().contains("tenant"));

    // 403: missing scope; missing role for a change.
    let reader = token("acme", "rita", &[READ], &["Observer"]);
    let (status, problem) = s.post(&reader, runs, &plan_body(&spec, "Release")).await;
    assert_eq!(status, 403);
    assert!(problem["detail"].as_str().unwrap().contains(APPLY));
    let no_read = token("acme", "x", &[APPLY], &["Operator"]);
    assert_eq!(s.get(&no_read, runs).await.0, 403);
    let no_role = token("acme", "x", &[READ, APPLY], &["Observer"]);
    assert_eq!(
        s.post(&no_role, runs, &plan_body(&spec, "Release")).await.0,
        403
    );

    // 404: unknown run, unknown environment, malformed id, unknown path.
    assert_eq!(
        s.get(
            &alice,
            "/factory/provisioning/runs/3b241101-e2bb-4255-8caf-4136c566a962"
        )
        .await
        .0,
        404
    );
    assert_eq!(
        s.get(&alice, "/factory/provisioning/runs/not-a-uuid")
            .await
            .0,
        404
    );
    assert_eq!(
        s.get(
            &alice,
            "/factory/provisioning/environments/nowhere/current-specification"
        )
        .await
        .0,
        404
    );
    assert_eq!(s.get(&alice, "/factory/nothing").await.0, 404);
    assert_eq!(
        s.post(
            &alice,
            "/factory/provisioning/runs/3b241101-e2bb-4255-8caf-4136c566a962/cancel",
            &json!({})
        )
        .await
        .0,
        404
    );

    // 400: malformed JSON and query parameters, with the field.
    let r = s
        .client
        .post(s.url(runs))
        .bearer_auth(&alice)
        .header("content-type", "application/json")
        .body("{\"specificationId\": ")
        .send()
        .await
        .unwrap();
    let (status, problem) = response(r).await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (400, Some("urn:ferry:problem:malformed-json"))
    );
    let (status, problem) = s.get(&alice, "/factory/provisioning/runs?state=Done").await;
    assert_eq!(
        (status, problem["errors"][0]["field"].as_str()),
        (400, Some("state"))
    );
    assert_eq!(
        s.get(&alice, "/factory/provisioning/runs?limit=0").await.0,
        400
    );
    assert_eq!(
        s.get(&alice, "/factory/provisioning/runs?cursor=zzz")
            .await
            .0,
        400
    );
    let (status, problem) = s
        .get(&alice, "/factory/provisioning/runs?enviromentId=x")
        .await;
    assert_eq!(
        (status, problem["errors"][0]["field"].as_str()),
        (400, Some("enviromentId"))
    );

    // 415: not JSON.
    let r = s
        .client
        .post(s.url(runs))
        .bearer_auth(&alice)
        .body("x=1")
        .send()
        .await
        .unwrap();
    assert_eq!(response(r).await.0, 415);

    // 422: missing and refused fields, by name; references to records that do not exist.
    let (status, problem) = s
        .post(&alice, runs, &json!({"specificationVersion": 1}))
        .await;
    assert_eq!(
        (status, problem["errors"][0]["field"].as_str()),
        (422, Some("specificationId"))
    );
    let mut bad = declaration("payments-dev", "3f2a9c1");
    bad["secretRefs"]["dbPassword"] = json!("s3cr3t-value");
    let (status, problem) = s
        .post(&alice, "/factory/provisioning/specifications", &bad)
        .await;
    assert_eq!(status, 422);
    assert_eq!(problem["errors"][0]["field"], "secretRefs.dbPassword");
    assert!(problem["errors"][0]["reason"]
        .as_str()
        .unwrap()
        .contains("not a value"));
    let mut bad = declaration("payments-dev", "main");
    bad["kind"] = json!("Environment");
    let (status, problem) = s
        .post(&alice, "/factory/provisioning/specifications", &bad)
        .await;
    assert_eq!(
        (status, problem["errors"][0]["field"].as_str()),
        (422, Some("programVersion"))
    );
    let (status, problem) = s
        .post(
            &alice,
            "/factory/provisioning/specifications",
            &json!({"environmentId": "x", "extra": 1}),
        )
        .await;
    assert_eq!(status, 422, "{problem}");
    let mut wrong = plan_body(&spec, "Release");
    wrong["specificationVersion"] = json!(7);
    let (status, problem) = s.post(&alice, runs, &wrong).await;
    assert_eq!(
        (status, problem["errors"][0]["field"].as_str()),
        (422, Some("specificationVersion"))
    );
    let mut wrong = plan_body(&spec, "Release");
    wrong["environmentId"] = json!("payments-prod");
    assert_eq!(s.post(&alice, runs, &wrong).await.0, 422);
    let mut wrong = plan_body(&spec, "Release");
    wrong["kind"] = json!("Rollout");
    let (status, problem) = s.post(&alice, runs, &wrong).await;
    assert_eq!(
        (status, problem["errors"][0]["field"].as_str()),
        (422, Some("kind"))
    );
    let mut other_project = declaration("payments-dev", "3f2a9c1");
    other_project["projectId"] = json!("billing");
    let (status, problem) = s
        .post(
            &alice,
            "/factory/provisioning/specifications",
            &other_project,
        )
        .await;
    assert_eq!(
        (status, problem["errors"][0]["field"].as_str()),
        (422, Some("projectId"))
    );

    // 405 for a known path with the wrong method.
    let r = s
        .client
        .delete(s.url(runs))
        .bearer_auth(&alice)
        .send()
        .await
        .unwrap();
    assert_eq!(response(r).await.0, 405);
    s.stop().await;
}

/// Requests a plan under an idempotency key: the status, the body, and whether the answer
/// was a replay of the first one.
async fn plan_with_key(s: &TestServer, token: &str, key: &str, body: Value) -> (u16, Value, bool) {
    let r = s
        .client
        .post(s.url("/factory/provisioning/runs"))
        .bearer_auth(token)
        .header("Idempotency-Key", key)
        .json(&body)
        .send()
        .await
        .expect("the server answers");
    let replayed = r.headers().contains_key("idempotent-replayed");
    let (status, body) = response(r).await;
    (status, body, replayed)
}

#[tokio::test]
async fn an_idempotency_key_replays_the_first_response_and_refuses_another_body() {
    let s = TestServer::start(Backend::Postgres).await;
    let alice = operator("acme", "alice");
    let spec = declare(&s, &alice, "payments-dev", "3f2a9c1").await;
    let post = |body: Value, key: &'static str| plan_with_key(&s, &alice, key, body);
    let (s1, first, replay1) = post(plan_body(&spec, "Release"), "deploy-42").await;
    let (s2, second, replay2) = post(plan_body(&spec, "Release"), "deploy-42").await;
    assert_eq!((s1, s2, replay1, replay2), (201, 201, false, true));
    assert_eq!(first, second);
    let (status, problem, _) = post(plan_body(&spec, "Baseline"), "deploy-42").await;
    assert_eq!(status, 422);
    assert_eq!(problem["type"], "urn:ferry:problem:idempotency-key-reused");
    let (_, page) = s.get(&alice, "/factory/provisioning/runs").await;
    assert_eq!(
        page["items"].as_array().unwrap().len(),
        1,
        "one run for one key"
    );

    // Concurrent retries with one key still make one run.
    let (a, b) = tokio::join!(
        post(plan_body(&spec, "Release"), "deploy-43"),
        post(plan_body(&spec, "Release"), "deploy-43")
    );
    assert!(a.0 == 201 || a.0 == 409, "{a:?}");
    assert!(b.0 == 201 || b.0 == 409, "{b:?}");
    let (_, page) = s.get(&alice, "/factory/provisioning/runs").await;
    assert_eq!(page["items"].as_array().unwrap().len(), 2);
    s.stop().await;
}

#[tokio::test]
async fn a_key_whose_request_was_refused_serves_a_corrected_retry() {
    let s = TestServer::start(Backend::Postgres).await;
    let alice = operator("acme", "alice");
    let spec = declare(&s, &alice, "payments-dev", "3f2a9c1").await;
    let post = |body: Value| async {
        let (status, body, _) = plan_with_key(&s, &alice, "deploy-7", body).await;
        (status, body)
    };
    // A version that was never declared: refused (decided before the key is reserved; a
    // command refused after it gives the key back), and the key is not kept for that body.
    let mut wrong = plan_body(&spec, "Release");
    wrong["specificationVersion"] = json!(99);
    let (status, problem) = post(wrong).await;
    assert!((400..500).contains(&status), "{status} {problem}");
    // The corrected body under the same key runs, instead of being refused as another
    // body reusing the key (422).
    let (status, run) = post(plan_body(&spec, "Release")).await;
    assert_eq!(status, 201, "{run}");
    let (status, replay) = post(plan_body(&spec, "Release")).await;
    assert_eq!((status, &replay), (201, &run));
    s.stop().await;
}

#[tokio::test]
async fn a_tenant_never_sees_or_changes_another_tenants_records() {
    let s = TestServer::start(Backend::Postgres).await;
    let alice = operator("acme", "alice");
    let mallory = operator("globex", "mallory");
    let spec = declare(&s, &alice, "payments-dev", "3f2a9c1").await;
    let (_, run) = s
        .post(
            &alice,
            "/factory/provisioning/runs",
            &plan_body(&spec, "Release"),
        )
        .await;
    let id = run["provisioningRunId"].as_str().unwrap();

    assert_eq!(
        s.get(&mallory, &format!("/factory/provisioning/runs/{id}"))
            .await
            .0,
        404
    );
    let (_, page) = s.get(&mallory, "/factory/provisioning/runs").await;
    assert!(page["items"].as_array().unwrap().is_empty());
    let (_, page) = s
        .get(&mallory, "/factory/provisioning/specifications")
        .await;
    assert!(page["items"].as_array().unwrap().is_empty());
    assert_eq!(
        s.get(
            &mallory,
            "/factory/provisioning/environments/payments-dev/current-specification"
        )
        .await
        .0,
        404
    );
    assert_eq!(
        s.post(
            &mallory,
            &format!("/factory/provisioning/runs/{id}/cancel"),
            &json!({})
        )
        .await
        .0,
        404
    );
    assert_eq!(
        s.post(
            &mallory,
            &format!("/factory/provisioning/runs/{id}/approval"),
            &json!({"decision": "approve"})
        )
        .await
        .0,
        404
    );
    // Planning against another tenant's specification: it does not exist for them.
    let (status, problem) = s
        .post(
            &mallory,
            "/factory/provisioning/runs",
            &plan_body(&spec, "Release"),
        )
        .await;
    assert_eq!(
        (status, problem["errors"][0]["field"].as_str()),
        (422, Some("specificationId"))
    );
    // The same environment name in another tenant is another specification.
    let theirs = declare(&s, &mallory, "payments-dev", "3f2a9c1").await;
    assert_ne!(theirs["specificationId"], spec["specificationId"]);
    assert_eq!(theirs["version"], 1);

    let (_, still) = s
        .get(&alice, &format!("/factory/provisioning/runs/{id}"))
        .await;
    assert_eq!(still["state"], "Requested");
    s.stop().await;
}

/// The planner arrives with the next issue; here the test plays it through the domain,
/// then a person decides through HTTP.
#[tokio::test]
async fn the_requester_cannot_approve_and_another_identity_can() {
    use ferry_domain::receipts::PlanReceipt;
    use ferry_domain::run::{ProvisioningRun, RunCommand};
    use ferry_domain::*;
    use ferry_store::{EventMetadata, Repository};

    let s = TestServer::start(Backend::Postgres).await;
    let alice = operator("acme", "alice");
    let bob = operator("acme", "bob");
    let spec = declare(&s, &alice, "payments-prod", "3f2a9c1").await;
    let (_, run) = s
        .post(
            &alice,
            "/factory/provisioning/runs",
            &plan_body(&spec, "Release"),
        )
        .await;
    let id = run["provisioningRunId"].as_str().unwrap().to_string();

    let runs: Repository<ProvisioningRun> = Repository::new(s.db.as_ref().unwrap().db.clone(), ());
    let tenant = TenantId::parse("acme").unwrap();
    let meta = EventMetadata::for_request(
        tenant.clone(),
        Actor::parse("system:planner").unwrap(),
        uuid::Uuid::new_v4(),
    );
    let plan = PlanReceipt {
        ignored: Vec::new(),
        adds: 2,
        changes: 0,
        deletes: 0,
        replaces: 0,
        resources: vec![],
        inputs_hash: "ab".repeat(32),
        program_version: "3f2a9c1".into(),
        runner: "simulated".into(),
        runner_version: "test".into(),
        policy: None,
        warnings: vec![],
    };
    for command in [
        RunCommand::RecordPlan {
            receipt: Box::new(plan),
            logs_ref: None,
            at: chrono::Utc::now(),
        },
        RunCommand::RequireApproval {
            reason: "production apply without the promotion's approval".into(),
            at: chrono::Utc::now(),
        },
    ] {
        runs.execute(&tenant, &id, command, &meta, false)
            .await
            .unwrap();
    }
    // An unknown environment class is production: starting the apply is refused.
    let err = runs
        .execute(
            &tenant,
            &id,
            RunCommand::StartApply {
                at: chrono::Utc::now(),
            },
            &meta,
            false,
        )
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        ferry_store::CommandError::Domain(ferry_domain::run::RunError::InvalidTransition { .. })
    ));

    let approval = format!("/factory/provisioning/runs/{id}/approval");
    let (status, problem) = s
        .post(&alice, &approval, &json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 403, "{problem}");
    assert!(problem["detail"]
        .as_str()
        .unwrap()
        .contains("cannot approve"));
    let (status, problem) = s.post(&bob, &approval, &json!({"decision": "maybe"})).await;
    assert_eq!(
        (status, problem["errors"][0]["field"].as_str()),
        (422, Some("decision"))
    );
    let (status, approved) = s
        .post(
            &bob,
            &approval,
            &json!({"decision": "approve", "reason": "change CHG-1 reviewed"}),
        )
        .await;
    assert_eq!(status, 200, "{approved}");
    assert_eq!(approved["state"], "Applying");
    assert_eq!(approved["approval"]["decision"]["decidedBy"], "bob");
    assert_eq!(approved["authorization"]["type"], "approval");
    let (_, got) = s
        .get(&alice, &format!("/factory/provisioning/runs/{id}"))
        .await;
    assert_eq!(got, approved);
    // Too late to cancel, and the decision is made.
    assert_eq!(
        s.post(
            &alice,
            &format!("/factory/provisioning/runs/{id}/cancel"),
            &json!({})
        )
        .await
        .0,
        409
    );
    assert_eq!(
        s.post(&bob, &approval, &json!({"decision": "reject"}))
            .await
            .0,
        409
    );
    s.stop().await;
}

#[tokio::test]
async fn rs256_tokens_verify_against_a_jwks_url() {
    use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
    let jwks: Value = serde_json::from_str(include_str!("fixtures/rs256-test-jwks.json")).unwrap();
    let app = axum::Router::new().route(
        "/jwks.json",
        axum::routing::get(move || async move { axum::Json(jwks) }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let jwks_url = format!("http://{}/jwks.json", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.jwt_hs256_key = None;
    config.jwt_jwks_url = Some(jwks_url);
    config.jwt_issuer = Some("https://idp.example".to_string());
    let s = TestServer::start_with(Backend::Postgres, config, dir).await;

    let key = EncodingKey::from_rsa_pem(include_bytes!("fixtures/rs256-test-key.pem")).unwrap();
    let sign = |iss: &str, kid: &str| {
        let mut header = Header::new(Algorithm::RS256);
        header.kid = Some(kid.to_string());
        let claims = json!({"sub": "svc-deployer", "tenant": "acme", "scope": READ, "iss": iss, "exp": chrono::Utc::now().timestamp() + 60});
        encode(&header, &claims, &key).unwrap()
    };
    assert_eq!(
        s.get(
            &sign("https://idp.example", "ferry-test-1"),
            "/factory/provisioning/runs"
        )
        .await
        .0,
        200
    );
    assert_eq!(
        s.get(
            &sign("https://evil.example", "ferry-test-1"),
            "/factory/provisioning/runs"
        )
        .await
        .0,
        401
    );
    assert_eq!(
        s.get(
            &sign("https://idp.example", "unknown-kid"),
            "/factory/provisioning/runs"
        )
        .await
        .0,
        401
    );
    // An HS256 token is not accepted when RS256 is configured.
    assert_eq!(
        s.get(&operator("acme", "alice"), "/factory/provisioning/runs")
            .await
            .0,
        401
    );
    s.stop().await;
}

#[tokio::test]
async fn the_embedded_default_serves_the_same_api_on_sqlite() {
    let s = TestServer::start(Backend::Sqlite).await;
    let alice = operator("acme", "alice");
    let spec = declare(&s, &alice, "payments-dev", "3f2a9c1").await;
    let (status, run) = s
        .post(
            &alice,
            "/factory/provisioning/runs",
            &plan_body(&spec, "Decommission"),
        )
        .await;
    assert_eq!(status, 201);
    let id = run["provisioningRunId"].as_str().unwrap();
    let (_, got) = s
        .get(&alice, &format!("/factory/provisioning/runs/{id}"))
        .await;
    assert_eq!(got["kind"], "Decommission");
    let (status, _) = s
        .post(
            &alice,
            &format!("/factory/provisioning/runs/{id}/cancel"),
            &json!({}),
        )
        .await;
    assert_eq!(status, 200);
    let (_, page) = s
        .get(&alice, "/factory/provisioning/runs?state=Cancelled")
        .await;
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    s.stop().await;
}

#[tokio::test]
async fn health_readiness_and_openapi_need_no_token() {
    let s = TestServer::start(Backend::Postgres).await;
    let get = |p: &str| s.client.get(s.url(p)).send();
    assert_eq!(get("/healthz").await.unwrap().status(), 200);
    let ready: Value = get("/readyz").await.unwrap().json().await.unwrap();
    assert_eq!(ready["status"], "ready");
    let names: Vec<&str> = ready["subscriptions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["delivery", "environments", "runs", "specifications"]
    );
    let r = get("/openapi.json").await.unwrap();
    assert!(r.headers().contains_key("x-request-id"));
    let doc: Value = r.json().await.unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    assert!(
        doc["paths"]["/factory/provisioning/runs/{provisioningRunId}/approval"]["post"].is_object()
    );
    s.stop().await;
}

#[test]
fn the_published_openapi_document_is_current() {
    let published =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/schemas/openapi.json"))
            .unwrap_or_default();
    assert!(
        published == ferry_app::Contexts::builtin().api().document_text(),
        "schemas/openapi.json is stale: run `cargo run -- schemas`"
    );
}

#[test]
fn every_published_schema_of_every_context_is_current() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas");
    let stale: Vec<String> = ferry_app::Contexts::builtin()
        .published_schemas()
        .unwrap()
        .into_iter()
        .filter(|(path, content)| {
            std::fs::read_to_string(dir.join(path)).unwrap_or_default() != *content
        })
        .map(|(path, _)| path)
        .collect();
    assert!(
        stale.is_empty(),
        "stale or missing under schemas/: {stale:?}; run `cargo run -- schemas`"
    );
}

#[tokio::test]
async fn every_documented_operation_is_served_and_no_other_method_on_its_path() {
    let s = TestServer::start(Backend::Sqlite).await;
    let doc: Value = s
        .client
        .get(s.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let paths = doc["paths"].as_object().unwrap();
    assert_eq!(paths.len(), 30, "{:?}", paths.keys().collect::<Vec<_>>());
    let methods = ["get", "post", "put", "patch", "delete"];
    for (template, item) in paths {
        // Any value for a parameter: the router must match the path before a handler looks.
        let path = template
            .split('/')
            .map(|segment| {
                if segment.starts_with('{') {
                    "00000000-0000-0000-0000-000000000000"
                } else {
                    segment
                }
            })
            .collect::<Vec<_>>()
            .join("/");
        for method in methods {
            let request = s
                .client
                .request(method.to_uppercase().parse().unwrap(), s.url(&path))
                .timeout(Duration::from_secs(10));
            // The event stream never ends: its status line is all this test needs.
            let status = request.send().await.unwrap().status().as_u16();
            if item.get(method).is_some() {
                assert!(
                    status != 404 && status != 405,
                    "{method} {template} is documented but answers {status}"
                );
            } else {
                assert_eq!(
                    status, 405,
                    "{method} {template} is served but not documented"
                );
            }
        }
    }
    s.stop().await;
}

#[tokio::test]
async fn hostile_bodies_get_a_problem_and_change_nothing() {
    let s = TestServer::start(Backend::Sqlite).await;
    let alice = operator("acme", "alice");
    let path = "/factory/provisioning/specifications";
    let send = |body: Vec<u8>| {
        s.client
            .post(s.url(path))
            .bearer_auth(&alice)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let oversized = format!(
        r#"{{"environmentId": "payments-dev", "projectId": "{}"}}"#,
        "x".repeat(ferry_api::extract::MAX_BODY)
    );
    let nested = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let invalid_utf8 = b"{\"environmentId\": \"pay\xff\xfements\"}".to_vec();
    for (what, body) in [
        ("oversized", oversized.into_bytes()),
        ("deeply nested", nested.into_bytes()),
        ("invalid UTF-8", invalid_utf8),
    ] {
        let r = send(body).await.unwrap();
        let status = r.status().as_u16();
        assert!((400..500).contains(&status), "{what}: {status}");
        assert_eq!(
            r.headers()["content-type"],
            "application/problem+json",
            "{what}"
        );
    }
    let (_, page) = s.get(&alice, path).await;
    assert_eq!(page["items"], json!([]), "nothing was declared: {page}");
    s.stop().await;
}

#[tokio::test]
async fn what_axum_refuses_before_a_handler_is_a_problem_too() {
    let s = TestServer::start(Backend::Sqlite).await;
    let alice = operator("acme", "alice");
    // A path segment that is not UTF-8 once decoded, on a GET and on a POST with a body.
    for (method, path) in [
        (reqwest::Method::GET, "/factory/provisioning/runs/%FF"),
        (reqwest::Method::GET, "/factory/environments/%C0%AF"),
        (
            reqwest::Method::POST,
            "/factory/provisioning/runs/%FF/approval",
        ),
    ] {
        let r = s
            .client
            .request(method.clone(), s.url(path))
            .bearer_auth(&alice)
            .json(&json!({"decision": "approve"}))
            .send()
            .await
            .unwrap();
        assert!(r.headers().contains_key("x-request-id"), "{path}");
        let (status, problem) = response(r).await;
        assert_eq!(status, 400, "{method} {path}: {problem}");
        assert_eq!(problem["status"], 400, "{problem}");
        assert_eq!(problem["type"], "urn:ferry:problem:invalid-request");
        let field = problem["errors"][0]["field"].as_str().unwrap();
        assert!(
            ["provisioningRunId", "environmentId"].contains(&field),
            "{problem}"
        );
    }
    // A body past the limit where the handler reads raw bytes (CloudEvents).
    let r = s
        .client
        .post(s.url("/factory/events"))
        .bearer_auth(service("acme", "svc"))
        .header("content-type", "application/cloudevents+json")
        .body(vec![b'x'; ferry_api::extract::MAX_BODY + 1])
        .send()
        .await
        .unwrap();
    let (status, problem) = response(r).await;
    assert_eq!(status, 413, "{problem}");
    assert_eq!(problem["type"], "urn:ferry:problem:payload-too-large");
    // The document says so: a path parameter or a body can be malformed (400), and a problem
    // without refused fields leaves `errors` out.
    let r = s.client.get(s.url("/openapi.json")).send().await.unwrap();
    let doc: Value = r.json().await.unwrap();
    for (path, method) in [
        (
            "/factory/provisioning/runs/{provisioningRunId}/approval",
            "post",
        ),
        ("/factory/provisioning/runs/{provisioningRunId}", "get"),
        (
            "/factory/delivery/promotions/{promotionId}/rollback",
            "post",
        ),
    ] {
        assert!(
            doc["paths"][path][method]["responses"]["400"].is_object(),
            "{method} {path} documents 400"
        );
    }
    // Recording an environment or a release answers 201 the first time: documented too.
    for path in [
        "/factory/environments/{environmentId}",
        "/factory/delivery/releases/{releaseId}",
    ] {
        assert!(
            doc["paths"][path]["put"]["responses"]["201"].is_object(),
            "PUT {path} documents 201"
        );
    }
    let required = doc["components"]["schemas"]["Problem"]["required"]
        .as_array()
        .unwrap();
    assert!(!required.contains(&json!("errors")), "{required:?}");
    s.stop().await;
}

/// Two instances on one database, each with its own cache of aggregates: a plan request on
/// one is decided on what the other recorded, never on a stale copy.
#[tokio::test]
async fn a_plan_is_decided_on_what_another_instance_recorded() {
    let s = TestServer::start(Backend::Postgres).await;
    let t = s.db.as_ref().unwrap();
    let data = tempfile::tempdir().unwrap();
    let mut other_config = config(data.path());
    other_config.database_url = Some(t.location.clone());
    let other = ferry_app::Server::start_with(
        &other_config,
        ferry_store::Database::from_pool(t.db.pool().clone()),
    )
    .await
    .unwrap();
    let other_base = format!("http://{}", other.addr);
    let alice = operator("acme", "alice");
    let admin = token("acme", "platform", &[READ, APPLY], &["PlatformAdmin"]);
    let register = |base: String, class: &'static str| {
        let (client, admin) = (s.client.clone(), admin.clone());
        async move {
            let r = client
                .put(format!("{base}/factory/environments/payments-dev"))
                .bearer_auth(admin)
                .json(&json!({"environmentClass": class}))
                .send()
                .await
                .unwrap();
            let (status, body) = response(r).await;
            assert!(status == 200 || status == 201, "{status} {body}");
        }
    };
    register(s.base.clone(), "development").await;
    let v1 = declare(&s, &alice, "payments-dev", "3f2a9c1").await;
    let plan = |spec: Value| {
        let (s, alice) = (&s, &alice);
        async move {
            let (status, run) = s
                .post(
                    alice,
                    "/factory/provisioning/runs",
                    &plan_body(&spec, "Release"),
                )
                .await;
            assert_eq!(status, 201, "{run}");
            run
        }
    };
    assert_eq!(plan(v1.clone()).await["environmentClass"], "development");

    // The other instance makes the environment production: this one's cached copy says
    // development, the append sees it moved, and the plan is decided on the stored class.
    register(other_base.clone(), "production").await;
    assert_eq!(plan(v1).await["environmentClass"], "production");

    // The other instance declares version 2, which this one's cached specification lacks.
    let r = s
        .client
        .post(format!("{other_base}/factory/provisioning/specifications"))
        .bearer_auth(&alice)
        .json(&declaration("payments-dev", "4b5c6d7"))
        .send()
        .await
        .unwrap();
    let (status, v2) = response(r).await;
    assert_eq!(status, 201, "{v2}");
    let run = plan(v2).await;
    assert_eq!(
        (
            run["specificationVersion"].as_u64(),
            &run["environmentClass"]
        ),
        (Some(2), &json!("production"))
    );
    other.stop().await;
    s.stop().await;
}

/// Issue 37 changed how ids are named from an `Idempotency-Key`. A first request made by a
/// version before it reserved its key for the run it made under the old name, and crashed
/// before answering; its retry, served by this version, lands on that run (the key's record
/// holds the id), not on a second one.
#[allow(clippy::unwrap_used)] // a test's body, shared by its two engines
async fn a_retry_across_the_upgrade_lands_on_the_run_its_first_request_made(backend: Backend) {
    use ferry_domain::run::{ProvisioningRun, RunCommand, RunRequest};
    let s = TestServer::start(backend).await;
    let alice = operator("acme", "alice");
    let spec = declare(&s, &alice, "payments-dev", "3f2a9c1").await;
    let body = plan_body(&spec, "Release");
    let acme = ferry_domain::TenantId::parse("acme").unwrap();
    let old = ferry_domain::ProvisioningRunId::legacy_for_idempotency_key(&acme, "deploy-9");
    assert_ne!(
        old,
        ferry_domain::ProvisioningRunId::for_idempotency_key(&acme, "deploy-9")
    );
    let db = s.db.as_ref().unwrap().db.clone();
    let reservation = ferry_api::extract::IdempotentRequest {
        key: "deploy-9",
        operation: "PlanProvisioning",
        body: &body,
        resource_id: &old.to_string(),
        owner: "the-first-request",
    };
    let first = reservation.reserve(&db, "acme").await.unwrap();
    assert!(matches!(first, ferry_api::extract::Reservation::Proceed(_)));
    let runs: ferry_store::Repository<ProvisioningRun> = ferry_store::Repository::new(db, ());
    let request = RunRequest {
        provisioning_run_id: old,
        tenant_id: acme.clone(),
        project_id: ferry_domain::ProjectId::parse("payments").unwrap(),
        environment_id: ferry_domain::EnvironmentId::parse("payments-dev").unwrap(),
        environment_class: None,
        specification_id: ferry_domain::SpecificationId::parse(
            spec["specificationId"].as_str().unwrap(),
        )
        .unwrap(),
        specification_version: 1,
        kind: ferry_domain::ProvisioningKind::Release,
        promotion_id: None,
        approval_id: None,
        follows_failed_apply: None,
        requested_by: ferry_domain::Actor::parse("alice").unwrap(),
        requested_at: chrono::Utc::now(),
    };
    let metadata = ferry_store::EventMetadata {
        tenant_id: acme.clone(),
        actor: ferry_domain::Actor::parse("alice").unwrap(),
        correlation_id: old.as_uuid(),
        causation_id: old.as_uuid(),
        request_id: uuid::Uuid::new_v4(),
    };
    runs.execute(
        &acme,
        &old.to_string(),
        RunCommand::Request(Box::new(request)),
        &metadata,
        true,
    )
    .await
    .unwrap();

    let (status, run, _) = plan_with_key(&s, &alice, "deploy-9", body.clone()).await;
    assert_eq!(status, 201, "{run}");
    assert_eq!(run["provisioningRunId"], old.to_string(), "{run}");
    let (status, replay, replayed) = plan_with_key(&s, &alice, "deploy-9", body).await;
    assert_eq!((status, replayed), (201, true), "{replay}");
    assert_eq!(replay["provisioningRunId"], old.to_string());
    let (_, page) = s.get(&alice, "/factory/provisioning/runs").await;
    assert_eq!(page["items"].as_array().unwrap().len(), 1, "{page}");
    s.stop().await;
}

#[tokio::test]
async fn a_retry_across_the_upgrade_lands_on_the_run_its_first_request_made_on_sqlite() {
    a_retry_across_the_upgrade_lands_on_the_run_its_first_request_made(Backend::Sqlite).await;
}

#[tokio::test]
async fn a_retry_across_the_upgrade_lands_on_the_run_its_first_request_made_on_postgres() {
    a_retry_across_the_upgrade_lands_on_the_run_its_first_request_made(Backend::Postgres).await;
}

/// Issue 37: a tenant named `promotion` planned with `Idempotency-Key: <P>/0`, P acme's
/// promotion id (predictable from acme's key), and its run took the name of acme's hand-off
/// run. Its run now has a name of its own.
#[tokio::test]
async fn a_tenant_named_promotion_cannot_take_another_s_hand_off_run() {
    let s = TestServer::start(Backend::Sqlite).await;
    let acme = ferry_domain::TenantId::parse("acme").unwrap();
    let promotion = ferry_domain::PromotionId::for_idempotency_key(&acme, "release-42");
    let hand_off = ferry_domain::ProvisioningRunId::for_promotion(&acme, promotion, 0);
    let mallory = operator("promotion", "mallory");
    let spec = declare(&s, &mallory, "payments-dev", "3f2a9c1").await;
    let key = format!("{promotion}/0");
    let (status, run, _) = plan_with_key(&s, &mallory, &key, plan_body(&spec, "Release")).await;
    assert_eq!(status, 201, "{run}");
    let taken = run["provisioningRunId"].as_str().unwrap();
    assert_ne!(taken, hand_off.to_string());
    // Nor the name the hand-off had before issue 37 (a hand-off under way across the
    // upgrade is found under it only when it is that promotion's own run).
    assert_ne!(
        taken,
        ferry_domain::ProvisioningRunId::legacy_for_promotion(promotion, 0).to_string()
    );
    s.stop().await;
}
