//! Attacks a hostile Operator would try, end to end over HTTP: forged approvals in bodies,
//! another service's events posted with a person's token, an untrusted source, a reused
//! Idempotency-Key raced from two requests. Each must be refused and leave no trace.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use ferry_store::database::Backend;
use serde_json::{json, Value};

async fn admin_environment(s: &TestServer, env: &str, class: &str) {
    let admin = token("acme", "platform", &[READ, APPLY], &["PlatformAdmin"]);
    let r = s
        .client
        .put(s.url(&format!("/factory/environments/{env}")))
        .bearer_auth(admin)
        .json(&json!({"environmentClass": class}))
        .send()
        .await
        .unwrap();
    let (status, body) = response(r).await;
    assert!(status == 201 || status == 200, "{body}");
}

async fn declare(s: &TestServer, env: &str) -> Value {
    let (status, spec) = s
        .post(
            &operator("acme", "alice"),
            "/factory/provisioning/specifications",
            &declaration(env, "3f2a9c1"),
        )
        .await;
    assert_eq!(status, 201, "{spec}");
    spec
}

fn plan_body(spec: &Value) -> Value {
    json!({"specificationId": spec["specificationId"], "specificationVersion": spec["version"],
           "environmentId": spec["environmentId"], "kind": "Release"})
}

async fn post_event(s: &TestServer, token: &str, event: &Value) -> (u16, Value) {
    s.post_event(token, event).await
}

async fn count(s: &TestServer, sql: &str) -> i64 {
    let db = &s.db.as_ref().unwrap().db;
    ferry_store::on_pool!(db, pool => sqlx::query_scalar(sql).fetch_one(pool).await.unwrap())
}

fn approval_decided(run: &str, source: &str, decided_by: &str) -> Value {
    json!({
        "specversion": "1.0", "id": format!("approval-{}", uuid::Uuid::new_v4()), "source": source,
        "type": "runcontrol.approvals.v1.approval-decided", "tenantid": "acme",
        "data": {"approvalId": uuid::Uuid::new_v4(), "tenantId": "acme", "provisioningRunId": run,
                 "decision": "approve", "decidedBy": decided_by}
    })
}

fn environment_created(env: &str, class: &str, source: &str) -> Value {
    json!({
        "specversion": "1.0", "id": format!("env-{}", uuid::Uuid::new_v4()), "source": source,
        "type": "environments.v1.environment-created", "tenantid": "acme",
        "data": {"environmentId": env, "tenantId": "acme", "environmentClass": class}
    })
}

#[tokio::test]
async fn a_caller_cannot_supply_a_promotions_approval() {
    let s = TestServer::start(Backend::Postgres).await;
    admin_environment(&s, "payments-prod", "production").await;
    let spec = declare(&s, "payments-prod").await;
    let mut body = plan_body(&spec);
    body["promotionId"] = json!(uuid::Uuid::new_v4());
    body["approvalId"] = json!(uuid::Uuid::new_v4());
    let (status, problem) = s
        .post(
            &operator("acme", "alice"),
            "/factory/provisioning/runs",
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
    assert_eq!(fields, ["promotionId", "approvalId"], "{problem}");
    // Either one alone is refused too.
    body.as_object_mut().unwrap().remove("promotionId");
    let (status, _) = s
        .post(
            &operator("acme", "alice"),
            "/factory/provisioning/runs",
            &body,
        )
        .await;
    assert_eq!(status, 422);
    assert_eq!(
        count(
            &s,
            "SELECT count(*) FROM events WHERE aggregate_type = 'ProvisioningRun'"
        )
        .await,
        0,
        "no run was recorded"
    );
    s.stop().await;
}

#[tokio::test]
async fn a_persons_token_cannot_post_another_services_events() {
    let s = TestServer::start(Backend::Postgres).await;
    admin_environment(&s, "payments-prod", "production").await;
    let spec = declare(&s, "payments-prod").await;
    let (status, run) = s
        .post(
            &operator("acme", "alice"),
            "/factory/provisioning/runs",
            &plan_body(&spec),
        )
        .await;
    assert_eq!(status, 201, "{run}");
    let id = run["provisioningRunId"].as_str().unwrap();

    // The requester approves her own run in bob's name through run control's event.
    let (status, problem) = post_event(
        &s,
        &operator("acme", "alice"),
        &approval_decided(id, "urn:runcontrol", "bob"),
    )
    .await;
    assert_eq!(status, 403, "{problem}");
    // ... or re-classes production as development, bypassing PlatformAdmin.
    let (status, _) = post_event(
        &s,
        &operator("acme", "alice"),
        &environment_created("payments-prod", "development", "urn:environments"),
    )
    .await;
    assert_eq!(status, 403);
    // A PlatformAdmin is a person too; a token that has the scope and a human role is
    // refused.
    let mixed = token(
        "acme",
        "platform",
        &[READ, APPLY, PUBLISH],
        &["PlatformAdmin"],
    );
    let (status, problem) = post_event(
        &s,
        &mixed,
        &environment_created("payments-prod", "development", "urn:environments"),
    )
    .await;
    assert_eq!(status, 403, "{problem}");

    let alice = operator("acme", "alice");
    let (_, env) = s.get(&alice, "/factory/environments/payments-prod").await;
    assert_eq!(env["environmentClass"], "production");
    let (_, run) = s
        .get(&alice, &format!("/factory/provisioning/runs/{id}"))
        .await;
    assert_eq!(run["state"], "Requested");
    assert_eq!(
        count(
            &s,
            "SELECT count(*) FROM events WHERE event_type IN ('ApprovalGranted', 'EnvironmentUpdated', 'EnvironmentClassLowered')"
        )
        .await,
        0
    );
    s.stop().await;
}

#[tokio::test]
async fn only_trusted_sources_speak_for_a_service_and_lowering_a_class_is_audited() {
    let data = tempfile::tempdir().unwrap();
    let mut config = config(data.path());
    config.trusted_sources = ferry_messaging::TrustedSources::parse(
        "environments.v1.*=urn:environments;ApprovalDecided=urn:runcontrol",
    )
    .unwrap()
    .with_identities(
        ferry_messaging::SourceIdentities::parse(
            "urn:environments=svc-environments;urn:runcontrol=svc-runcontrol",
        )
        .unwrap(),
    );
    let s = TestServer::start_with(Backend::Postgres, config, data).await;
    admin_environment(&s, "payments-prod", "production").await;
    let spec = declare(&s, "payments-prod").await;
    let (_, run) = s
        .post(
            &operator("acme", "alice"),
            "/factory/provisioning/runs",
            &plan_body(&spec),
        )
        .await;
    let id = run["provisioningRunId"].as_str().unwrap().to_string();

    // A service token, but a source not trusted for the event.
    let svc = service("acme", "svc-environments");
    let (status, problem) = post_event(
        &s,
        &svc,
        &environment_created("payments-prod", "development", "urn:somewhere-else"),
    )
    .await;
    assert_eq!(status, 403, "{problem}");
    assert!(
        problem["detail"].as_str().unwrap().contains("not trusted"),
        "{problem}"
    );
    // The trusted source may ask to lower the class; production holds until a second
    // person approves, and the lowering is then an event of its own naming both.
    let (status, accepted) = post_event(
        &s,
        &svc,
        &environment_created("payments-prod", "development", "urn:environments"),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let (_, env) = s
        .get(
            &operator("acme", "alice"),
            "/factory/environments/payments-prod",
        )
        .await;
    assert_eq!(env["environmentClass"], "production", "{env}");
    assert_eq!(
        env["pendingClassLowering"]["requestedBy"], "svc-environments",
        "{env}"
    );
    let second = token("acme", "platform-2", &[READ, APPLY], &["PlatformAdmin"]);
    let (status, env) = s
        .post(
            &second,
            "/factory/environments/payments-prod/class-lowering",
            &json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(status, 200, "{env}");
    assert_eq!(env["environmentClass"], "development", "{env}");
    let db = &s.db.as_ref().unwrap().db;
    let lowered: Vec<(Value, Value)> = ferry_store::on_pool!(db, pool => sqlx::query_as(
        "SELECT payload, metadata FROM events WHERE event_type = 'EnvironmentClassLowered'"
    ).fetch_all(pool).await.unwrap());
    assert_eq!(lowered.len(), 1);
    let (payload, metadata) = &lowered[0];
    let inner = &payload["EnvironmentClassLowered"];
    assert_eq!(inner["previousClass"], "production");
    assert_eq!(inner["environmentClass"], "development");
    assert_eq!(inner["loweredBy"], "svc-environments");
    assert_eq!(inner["approvedBy"], "platform-2");
    assert_eq!(metadata["actor"], "platform-2");

    // The run requested before keeps the class it was requested under.
    let alice = operator("acme", "alice");
    let (_, run) = s
        .get(&alice, &format!("/factory/provisioning/runs/{id}"))
        .await;
    assert_eq!(run["environmentClass"], "production");
    s.stop().await;
}

#[tokio::test]
async fn concurrent_requests_with_one_key_share_the_first_answer() {
    let s = TestServer::start(Backend::Postgres).await;
    admin_environment(&s, "payments-dev", "development").await;
    let spec = declare(&s, "payments-dev").await;
    let body = plan_body(&spec);
    let post = |body: Value| {
        let s = &s;
        async move {
            let r = s
                .client
                .post(s.url("/factory/provisioning/runs"))
                .bearer_auth(operator("acme", "alice"))
                .header("idempotency-key", "deploy-42")
                .json(&body)
                .send()
                .await
                .unwrap();
            response(r).await
        }
    };
    let answers = futures::future::join_all((0..8).map(|_| post(body.clone()))).await;
    let ids: std::collections::BTreeSet<String> = answers
        .iter()
        .map(|(status, run)| {
            assert_eq!(*status, 201, "{run}");
            run["provisioningRunId"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(ids.len(), 1, "one run for one key: {answers:?}");
    // The key stays bound to the first body, whatever the concurrent requests did.
    let mut other = body.clone();
    other["kind"] = json!("Baseline");
    let (status, problem) = post(other).await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(
        count(
            &s,
            "SELECT count(*) FROM events WHERE event_type = 'ProvisioningRequested'"
        )
        .await,
        1
    );
    s.stop().await;
}

#[tokio::test]
async fn a_locked_embedded_store_answers_503_with_retry_after() {
    let data = tempfile::tempdir().unwrap();
    let mut config = config(data.path());
    config.sqlite_busy_timeout = std::time::Duration::from_millis(50);
    let db = ferry_store::Database::open_sqlite_with(
        data.path(),
        &ferry_app::server::store_options(&config),
    )
    .await
    .unwrap();
    db.migrate().await.unwrap();
    ferry_projections::projection::ensure_all_tables(
        &db,
        &ferry_app::Contexts::builtin().projections(),
    )
    .await
    .unwrap();
    let server = ferry_app::Server::start_with(&config, db.clone())
        .await
        .unwrap();
    let base = format!("http://{}", server.addr);
    // Another process holds SQLite's write lock.
    let mut blocker = ferry_store::Tx::begin(&db).await.unwrap();
    blocker
        .execute(
            "INSERT INTO subscription_checkpoints (name) VALUES ('blocker')",
            &[],
        )
        .await
        .unwrap();
    let r = reqwest::Client::new()
        .post(format!("{base}/factory/provisioning/specifications"))
        .bearer_auth(operator("acme", "alice"))
        .json(&declaration("payments-dev", "3f2a9c1"))
        .send()
        .await
        .unwrap();
    let retry_after = r.headers().get("retry-after").cloned();
    let (status, problem) = response(r).await;
    assert_eq!(status, 503, "{problem}");
    assert!(retry_after.is_some(), "503 carries Retry-After");
    drop(blocker);
    let r = reqwest::Client::new()
        .post(format!("{base}/factory/provisioning/specifications"))
        .bearer_auth(operator("acme", "alice"))
        .json(&declaration("payments-dev", "3f2a9c1"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201, "accepted once the lock is gone");
    server.stop().await;
}

/// Plans run `id` by hand (no workers here) so that it waits for approval.
async fn awaiting_approval(s: &TestServer, id: &str) {
    use ferry_domain::receipts::PlanReceipt;
    use ferry_domain::run::{ProvisioningRun, RunCommand};
    let db = s.db.as_ref().unwrap().db.clone();
    let runs: ferry_store::Repository<ProvisioningRun> = ferry_store::Repository::new(db, ());
    let tenant = ferry_domain::TenantId::parse("acme").unwrap();
    let meta = ferry_store::EventMetadata::for_request(
        tenant.clone(),
        ferry_domain::Actor::parse("system:planner").unwrap(),
        uuid::Uuid::new_v4(),
    );
    let receipt = PlanReceipt {
        ignored: Vec::new(),
        adds: 1,
        changes: 0,
        deletes: 0,
        replaces: 0,
        resources: vec![],
        inputs_hash: "ab".repeat(32),
        program_version: "3f2a9c1".to_string(),
        runner: "simulated".to_string(),
        runner_version: "1".to_string(),
        policy: None,
        warnings: vec![],
    };
    for command in [
        RunCommand::RecordPlan {
            receipt: Box::new(receipt),
            logs_ref: None,
            at: chrono::Utc::now(),
        },
        RunCommand::RequireApproval {
            reason: "production".to_string(),
            at: chrono::Utc::now(),
        },
    ] {
        runs.execute(&tenant, id, command, &meta, false)
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn a_repeated_decision_is_a_duplicate_and_a_late_state_report_changes_nothing() {
    let s = TestServer::start(Backend::Postgres).await;
    admin_environment(&s, "payments-prod", "production").await;
    let spec = declare(&s, "payments-prod").await;
    let (_, run) = s
        .post(
            &operator("acme", "alice"),
            "/factory/provisioning/runs",
            &plan_body(&spec),
        )
        .await;
    let id = run["provisioningRunId"].as_str().unwrap().to_string();
    awaiting_approval(&s, &id).await;

    // Run control decides; then repeats the same decision under a new message id (as a
    // redelivery after a crash would): the second is a duplicate, not a refusal.
    let runcontrol = service("acme", "svc-runcontrol");
    let first = approval_decided(&id, "urn:runcontrol", "bob");
    let (status, accepted) = post_event(&s, &runcontrol, &first).await;
    assert_eq!(
        (status, &accepted["duplicate"]),
        (202, &json!(false)),
        "{accepted}"
    );
    let mut repeat = first.clone();
    repeat["id"] = json!(format!("approval-{}", uuid::Uuid::new_v4()));
    let (status, accepted) = post_event(&s, &runcontrol, &repeat).await;
    assert_eq!(
        (status, &accepted["duplicate"]),
        (202, &json!(true)),
        "{accepted}"
    );
    let db = &s.db.as_ref().unwrap().db;
    assert!(ferry_messaging::inbound::store::dead_letters(db, 10)
        .await
        .unwrap()
        .is_empty());
    // Events posted over HTTP answer before the read model moves: wait for it.
    let (server, alice, path) = (
        &s,
        &operator("acme", "alice"),
        &format!("/factory/provisioning/runs/{id}"),
    );
    ferry_store::testing::eventually_showing("the approval in the read model", 10, || async move {
        let (_, run) = server.get(alice, path).await;
        if run["authorization"]["approvedBy"] == "bob" {
            Ok(())
        } else {
            Err(run.to_string())
        }
    })
    .await;
    assert_eq!(
        count(
            &s,
            "SELECT count(*) FROM events WHERE event_type = 'ApprovalGranted'"
        )
        .await,
        1
    );

    // Readiness reports arrive out of order: the older one is history.
    let environments = service("acme", "svc-environments");
    let state = |id: &str, state: &str, time: &str| {
        json!({
            "specversion": "1.0", "id": id, "source": "urn:environments", "time": time,
            "type": "environments.v1.environment-state-changed", "tenantid": "acme",
            "data": {"environmentId": "payments-prod", "tenantId": "acme", "state": state}
        })
    };
    let (status, _) = post_event(
        &s,
        &environments,
        &state("s-2", "ready", "2026-12-02T10:00:05Z"),
    )
    .await;
    assert_eq!(status, 202);
    let (status, _) = post_event(
        &s,
        &environments,
        &state("s-1", "degraded", "2026-12-02T10:00:01Z"),
    )
    .await;
    assert_eq!(status, 202);
    let (_, env) = s
        .get(
            &operator("acme", "alice"),
            "/factory/environments/payments-prod",
        )
        .await;
    assert_eq!(env["ready"], true, "{env}");
    s.stop().await;
}

/// Issue 37: tokens for `Alice`, `alice ` and `alice` followed by a zero-width space each
/// approved alice's production run, and run control's event naming `decidedBy: "alice "`
/// did as well. The person is compared, not the spelling; a hidden character is refused.
#[tokio::test]
async fn the_requester_cannot_approve_under_another_spelling() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let s = TestServer::start(backend).await;
        admin_environment(&s, "payments-prod", "production").await;
        let spec = declare(&s, "payments-prod").await;
        let (status, run) = s
            .post(
                &operator("acme", "alice"),
                "/factory/provisioning/runs",
                &plan_body(&spec),
            )
            .await;
        assert_eq!(status, 201, "{run}");
        let id = run["provisioningRunId"].as_str().unwrap().to_string();
        awaiting_approval(&s, &id).await;
        let path = format!("/factory/provisioning/runs/{id}/approval");
        let approve = json!({"decision": "approve", "reason": "looks right"});
        // Ferry's own actor names are not a person's: a token or an approver spelled so
        // would pass for Ferry in the record.
        for (sub, expected) in [
            ("Alice", 403),
            ("alice ", 403),
            ("alice\u{200B}", 401),
            ("system:verifier", 401),
            ("SYSTEM:reconciler", 401),
            ("nats:urn:runcontrol", 401),
        ] {
            let (status, problem) = s.post(&operator("acme", sub), &path, &approve).await;
            assert_eq!(status, expected, "{backend:?} {sub:?}: {problem}");
        }
        // Run control's word for it is compared the same way, and a hidden character in
        // the name it gives is refused.
        let runcontrol = service("acme", "svc-runcontrol");
        let (status, problem) = post_event(
            &s,
            &runcontrol,
            &approval_decided(&id, "urn:runcontrol", "alice "),
        )
        .await;
        assert_eq!(status, 422, "{backend:?}: {problem}");
        let (status, problem) = post_event(
            &s,
            &runcontrol,
            &approval_decided(&id, "urn:runcontrol", "ALICE\u{2060}"),
        )
        .await;
        assert_eq!(status, 400, "{backend:?}: {problem}");
        assert!(
            problem["detail"].as_str().unwrap().contains("decidedBy"),
            "{problem}"
        );
        let (status, problem) = post_event(
            &s,
            &runcontrol,
            &approval_decided(&id, "urn:runcontrol", "system:planner"),
        )
        .await;
        assert_eq!(status, 422, "{backend:?}: {problem}");
        assert!(
            problem["detail"].as_str().unwrap().contains("decidedBy"),
            "{problem}"
        );

        let (_, run) = s
            .get(
                &operator("acme", "alice"),
                &format!("/factory/provisioning/runs/{id}"),
            )
            .await;
        assert_eq!(run["state"], "AwaitingApproval", "{backend:?}: {run}");
        assert_eq!(
            count(
                &s,
                "SELECT count(*) FROM events WHERE event_type = 'ApprovalGranted'"
            )
            .await,
            0,
            "{backend:?}"
        );
        s.stop().await;
    }
}

/// Issue 37: with `FERRY_TRUSTED_SOURCES` set, a service token with `sub: svc-anything`
/// that wrote `source: urn:runcontrol` in the body was accepted. A body never chooses its
/// own authority: the token's subject must be bound to the source.
#[tokio::test]
async fn a_body_never_chooses_its_own_source() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let data = tempfile::tempdir().unwrap();
        let mut config = config(data.path());
        config.trusted_sources = ferry_messaging::TrustedSources::parse(
            "ApprovalDecided=urn:runcontrol;environments.v1.*=urn:environments",
        )
        .unwrap()
        .with_identities(
            ferry_messaging::SourceIdentities::parse("urn:runcontrol=svc-runcontrol").unwrap(),
        );
        let s = TestServer::start_with(backend, config, data).await;
        admin_environment(&s, "payments-prod", "production").await;
        let spec = declare(&s, "payments-prod").await;
        let (_, run) = s
            .post(
                &operator("acme", "alice"),
                "/factory/provisioning/runs",
                &plan_body(&spec),
            )
            .await;
        let id = run["provisioningRunId"].as_str().unwrap().to_string();
        awaiting_approval(&s, &id).await;

        // Another service writes run control's source into its body.
        let (status, problem) = post_event(
            &s,
            &service("acme", "svc-anything"),
            &approval_decided(&id, "urn:runcontrol", "bob"),
        )
        .await;
        assert_eq!(status, 403, "{backend:?}: {problem}");
        assert!(
            problem["detail"]
                .as_str()
                .unwrap()
                .contains("FERRY_SOURCE_IDENTITIES"),
            "{problem}"
        );
        // A trusted source no identity is bound to speaks over NATS only.
        let (status, problem) = post_event(
            &s,
            &service("acme", "svc-environments"),
            &environment_created("payments-prod", "development", "urn:environments"),
        )
        .await;
        assert_eq!(status, 403, "{backend:?}: {problem}");
        assert_eq!(
            count(
                &s,
                "SELECT count(*) FROM events WHERE event_type IN ('ApprovalGranted', 'EnvironmentUpdated', 'EnvironmentClassLowered')"
            )
            .await,
            0,
            "{backend:?}"
        );
        // Run control's own identity is heard.
        let (status, accepted) = post_event(
            &s,
            &service("acme", "svc-runcontrol"),
            &approval_decided(&id, "urn:runcontrol", "bob"),
        )
        .await;
        assert_eq!(status, 202, "{backend:?}: {accepted}");
        let r = s.client.get(s.url("/readyz")).send().await.unwrap();
        let (_, ready) = response(r).await;
        assert_eq!(ready["inboundTrust"]["mode"], "bound", "{ready}");
        s.stop().await;
    }
}

/// Unset, every service token may post every event: the single-team default, which
/// `/readyz` states.
#[tokio::test]
async fn readyz_says_when_every_service_may_post_every_event() {
    let s = TestServer::start(Backend::Sqlite).await;
    let r = s.client.get(s.url("/readyz")).send().await.unwrap();
    let (status, ready) = response(r).await;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["inboundTrust"]["mode"], "open", "{ready}");
    assert!(
        ready["inboundTrust"]["detail"]
            .as_str()
            .unwrap()
            .contains("every service token"),
        "{ready}"
    );
    s.stop().await;
}

/// Issue 37: a PlatformAdmin alone lowered `sprod` from production to development
/// (`PUT /factory/environments/sprod`), applied without approval, and raised it back; a
/// service token's `EnvironmentCreated` lowered it the same way. Lowering out of production
/// waits for a second person, whichever way it arrives; meanwhile runs keep production's
/// rules.
#[tokio::test]
async fn lowering_out_of_production_needs_a_second_person() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let s = TestServer::start(backend).await;
        admin_environment(&s, "sprod", "production").await;
        let admin = token("acme", "platform", &[READ, APPLY], &["PlatformAdmin"]);
        let r = s
            .client
            .put(s.url("/factory/environments/sprod"))
            .bearer_auth(&admin)
            .json(&json!({"environmentClass": "development"}))
            .send()
            .await
            .unwrap();
        let (status, env) = response(r).await;
        assert_eq!(status, 202, "{backend:?}: {env}");
        assert_eq!(env["environmentClass"], "production", "{env}");
        assert_eq!(
            env["pendingClassLowering"]["environmentClass"], "development",
            "{env}"
        );

        // A run requested meanwhile is a production run: it needs an approval.
        let spec = declare(&s, "sprod").await;
        let (status, run) = s
            .post(
                &operator("acme", "alice"),
                "/factory/provisioning/runs",
                &plan_body(&spec),
            )
            .await;
        assert_eq!(status, 201, "{run}");
        assert_eq!(run["environmentClass"], "production", "{backend:?}: {run}");

        // Neither its requester (under any spelling) nor an Operator approves the lowering.
        let path = "/factory/environments/sprod/class-lowering";
        let approve = json!({"decision": "approve"});
        for sub in ["platform", "Platform "] {
            let me = token("acme", sub, &[READ, APPLY], &["PlatformAdmin"]);
            let (status, problem) = s.post(&me, path, &approve).await;
            assert_eq!(status, 403, "{backend:?} {sub:?}: {problem}");
        }
        let (status, _) = s.post(&operator("acme", "bob"), path, &approve).await;
        assert_eq!(status, 403);
        let (_, env) = s
            .get(&operator("acme", "alice"), "/factory/environments/sprod")
            .await;
        assert_eq!(env["environmentClass"], "production", "{env}");

        // A service's EnvironmentCreated asks the same way, and is refused the same way.
        let r = s
            .client
            .put(s.url("/factory/environments/sprod"))
            .bearer_auth(&admin)
            .json(&json!({"environmentClass": "production"}))
            .send()
            .await
            .unwrap();
        let (status, env) = response(r).await;
        assert_eq!(status, 200, "{env}");
        assert!(env.get("pendingClassLowering").is_none(), "{env}");
        let (status, accepted) = post_event(
            &s,
            &service("acme", "svc-environments"),
            &environment_created("sprod", "development", "urn:environments"),
        )
        .await;
        assert_eq!(status, 202, "{backend:?}: {accepted}");
        let (_, env) = s
            .get(&operator("acme", "alice"), "/factory/environments/sprod")
            .await;
        assert_eq!(env["environmentClass"], "production", "{backend:?}: {env}");
        assert_eq!(
            env["pendingClassLowering"]["requestedBy"], "svc-environments",
            "{env}"
        );
        assert_eq!(
            count(
                &s,
                "SELECT count(*) FROM events WHERE event_type = 'EnvironmentClassLowered'"
            )
            .await,
            0,
            "{backend:?}"
        );

        // A second PlatformAdmin decides.
        let second = token("acme", "platform-2", &[READ, APPLY], &["PlatformAdmin"]);
        let (status, env) = s.post(&second, path, &approve).await;
        assert_eq!(status, 200, "{backend:?}: {env}");
        assert_eq!(env["environmentClass"], "development", "{env}");
        let (status, problem) = s.post(&second, path, &approve).await;
        assert_eq!(status, 409, "nothing left to decide: {problem}");
        s.stop().await;
    }
}
