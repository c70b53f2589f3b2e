//! The HTTP runner client against an axum runner started in the test.
// Test helpers outside #[test] functions unwrap too: a failed setup is a failed test.
#![allow(clippy::unwrap_used)]

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use ferry_domain::ports::identity::{RunnerIdentity, IDENTITIES_SETTING};
use ferry_domain::ports::runner::{Runner, RunnerError, RunnerInput, StackName};
use ferry_domain::ports::SecretValue;
use ferry_domain::{EnvironmentId, TenantId};
use ferry_runners::http::{
    ApplyResponse, ErrorBody, ErrorKind, ErrorResponse, PreviewResponse, RunRequest,
    VersionResponse,
};
use ferry_runners::HttpRunner;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const TOKEN: &str = "runner-token";
const SECRET: &str = "db-password-42";
const PASSPHRASE: &str = "acme-state-passphrase";

#[derive(Clone, Default)]
struct Seen {
    requests: Arc<Mutex<Vec<RunRequest>>>,
}

fn authorized(headers: &HeaderMap) -> bool {
    headers.get("authorization").and_then(|v| v.to_str().ok()) == Some(&format!("Bearer {TOKEN}"))
}

fn unauthorized() -> axum::response::Response {
    let body = ErrorResponse {
        error: ErrorBody {
            kind: ErrorKind::Unauthorized,
            message: "bad token".into(),
            resource: None,
            log: None,
        },
    };
    (StatusCode::UNAUTHORIZED, Json(body)).into_response()
}

async fn version(headers: HeaderMap) -> axum::response::Response {
    if !authorized(&headers) {
        return unauthorized();
    }
    Json(VersionResponse {
        version: "remote-1.2.3".into(),
    })
    .into_response()
}

async fn preview(
    State(seen): State<Seen>,
    headers: HeaderMap,
    Json(req): Json<RunRequest>,
) -> axum::response::Response {
    if !authorized(&headers) {
        return unauthorized();
    }
    seen.requests.lock().unwrap().push(req);
    let fixture = std::fs::read(format!(
        "{}/tests/fixtures/pulumi/preview-creates.json",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&fixture).unwrap();
    Json(PreviewResponse {
        preview: doc,
        log: format!("previewed with {SECRET} as {PASSPHRASE}"),
    })
    .into_response()
}

async fn apply(State(seen): State<Seen>, Json(req): Json<RunRequest>) -> Json<ApplyResponse> {
    seen.requests.lock().unwrap().push(req);
    Json(ApplyResponse {
        outputs: BTreeMap::from([
            ("url".into(), json!("https://shop")),
            ("dsn".into(), json!(format!("pg://{SECRET}@db"))),
        ]),
        log: "applied".into(),
    })
}

async fn apply_fails() -> impl IntoResponse {
    let body = ErrorResponse {
        error: ErrorBody {
            kind: ErrorKind::ProgramFailed,
            message: format!("creating db: password {SECRET} rejected"),
            resource: Some("urn:pulumi:dev::shop::aws:rds/instance:Instance::db".into()),
            log: Some("log".into()),
        },
    };
    (StatusCode::UNPROCESSABLE_ENTITY, Json(body))
}

async fn not_json() -> &'static str {
    "<html>hello</html>"
}

async fn bad_gateway() -> impl IntoResponse {
    (StatusCode::BAD_GATEWAY, "upstream down")
}

async fn slow() -> &'static str {
    tokio::time::sleep(Duration::from_secs(10)).await;
    "{}"
}

async fn start() -> (String, Seen) {
    let seen = Seen::default();
    let app = Router::new()
        .route("/ok/v1/version", get(version))
        .route("/ok/v1/preview", post(preview))
        .route("/ok/v1/apply", post(apply))
        .route("/fail/v1/apply", post(apply_fails))
        .route("/garbage/v1/preview", post(not_json))
        .route("/garbage/v1/version", get(not_json))
        .route("/gateway/v1/apply", post(bad_gateway))
        .route("/slow/v1/preview", post(slow))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), seen)
}

fn input(timeout: Duration) -> (RunnerInput, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("Pulumi.yaml"),
        "name: shop\nruntime: yaml\n",
    )
    .unwrap();
    std::fs::create_dir_all(dir.path().join("sub")).unwrap();
    std::fs::write(dir.path().join("sub/data.bin"), [0u8, 159, 146, 150]).unwrap();
    std::fs::create_dir_all(dir.path().join(".git")).unwrap();
    std::fs::write(dir.path().join(".git/HEAD"), "ref: x").unwrap();
    let tenant = TenantId::parse("acme").unwrap();
    let stack = StackName::for_environment(&tenant, &EnvironmentId::parse("dev").unwrap());
    let input = RunnerInput {
        tenant,
        environment_id: "dev".into(),
        stack,
        program_dir: dir.path().to_path_buf(),
        config: BTreeMap::from([("region".into(), json!("eu-west-1"))]),
        secrets: BTreeMap::from([("dbPassword".into(), SecretValue::new(SECRET))]),
        timeout,
        refresh: false,
        exclude: Vec::new(),
        identity: Some(RunnerIdentity::new(BTreeMap::from([
            (
                "PULUMI_BACKEND_URL".to_string(),
                SecretValue::new("s3://state-acme"),
            ),
            (
                "PULUMI_CONFIG_PASSPHRASE".to_string(),
                SecretValue::new(PASSPHRASE),
            ),
        ]))),
    };
    (input, dir)
}

#[tokio::test]
async fn version_and_preview() {
    let (base, seen) = start().await;
    let runner = HttpRunner::new(format!("{base}/ok/"), Some(TOKEN.into()));
    assert_eq!(runner.name(), "http");
    assert_eq!(runner.version().await.unwrap(), "remote-1.2.3");
    let (input, _dir) = input(Duration::from_secs(10));
    let out = runner.preview(&input).await.unwrap();
    assert_eq!(out.plan.adds, 16);
    assert_eq!(out.plan.resources.len(), 16);
    assert!(out.log.contains("previewed with *** as ***"), "{}", out.log);
    assert!(!out.log.contains(SECRET) && !out.log.contains(PASSPHRASE));
    let req = seen.requests.lock().unwrap().pop().unwrap();
    assert_eq!(req.environment_id, "dev");
    assert_eq!(
        (req.tenant_id.as_str(), req.stack.as_str()),
        ("acme", "acme.dev")
    );
    assert_eq!(req.config["region"], json!("eu-west-1"));
    assert_eq!(req.secrets["dbPassword"], SECRET);
    // The tenant's identity goes with the run, and nothing else as one.
    assert_eq!(
        req.identity,
        BTreeMap::from([
            (
                "PULUMI_BACKEND_URL".to_string(),
                "s3://state-acme".to_string()
            ),
            (
                "PULUMI_CONFIG_PASSPHRASE".to_string(),
                PASSPHRASE.to_string()
            ),
        ])
    );
    assert_eq!(req.timeout_seconds, 10);
    assert_eq!(
        req.files.keys().collect::<Vec<_>>(),
        vec!["Pulumi.yaml", "sub/data.bin"]
    );
    let b64 = base64::engine::general_purpose::STANDARD;
    assert_eq!(
        b64.decode(&req.files["sub/data.bin"]).unwrap(),
        vec![0u8, 159, 146, 150]
    );
    assert_eq!(
        b64.decode(&req.files["Pulumi.yaml"]).unwrap(),
        b"name: shop\nruntime: yaml\n"
    );
}

/// A run without its tenant's identity is never sent: it fails naming the setting.
#[tokio::test]
async fn a_run_without_an_identity_is_not_sent() {
    let (base, seen) = start().await;
    let runner = HttpRunner::new(format!("{base}/ok"), Some(TOKEN.into()));
    assert!(runner.needs_identity());
    let (mut input, _dir) = input(Duration::from_secs(10));
    input.identity = None;
    for result in [
        runner.preview(&input).await.map(|_| ()),
        runner.apply(&input).await.map(|_| ()),
    ] {
        match result {
            Err(RunnerError::NoIdentity(r)) => assert!(r.contains(IDENTITIES_SETTING), "{r}"),
            other => panic!("{other:?}"),
        }
    }
    assert!(seen.requests.lock().unwrap().is_empty());
}

#[tokio::test]
async fn wrong_token_is_unavailable() {
    let (base, _) = start().await;
    let runner = HttpRunner::new(format!("{base}/ok"), Some("wrong".into()));
    match runner.version().await {
        Err(RunnerError::Unavailable(r)) => {
            assert!(r.contains("bad token") && r.contains("401"), "{r}")
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn apply_returns_outputs_with_secrets_redacted() {
    let (base, seen) = start().await;
    let runner = HttpRunner::new(format!("{base}/ok"), None);
    let (input, _dir) = input(Duration::from_secs(10));
    let out = runner.apply(&input).await.unwrap();
    assert_eq!(out.outputs["url"], json!("https://shop"));
    assert_eq!(out.outputs["dsn"], json!("pg://***@db"));
    assert_eq!(out.log, "applied");
    assert_eq!(seen.requests.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn apply_failure_names_the_resource() {
    let (base, _) = start().await;
    let runner = HttpRunner::new(format!("{base}/fail"), None);
    let (input, _dir) = input(Duration::from_secs(10));
    match runner.apply(&input).await {
        Err(RunnerError::ProgramFailed {
            reason,
            resource,
            log,
        }) => {
            assert_eq!(
                resource.as_deref(),
                Some("urn:pulumi:dev::shop::aws:rds/instance:Instance::db")
            );
            assert_eq!(reason, "creating db: password *** rejected");
            assert_eq!(log, "log");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn non_json_answers_are_bad_output() {
    let (base, _) = start().await;
    let runner = HttpRunner::new(format!("{base}/garbage"), None);
    let (input, _dir) = input(Duration::from_secs(10));
    match runner.preview(&input).await {
        Err(RunnerError::BadOutput(r)) => assert!(r.contains("<html>"), "{r}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        runner.version().await,
        Err(RunnerError::BadOutput(_))
    ));
    let gateway = HttpRunner::new(format!("{base}/gateway"), None);
    assert!(
        matches!(gateway.apply(&input).await, Err(RunnerError::Unavailable(r)) if r.contains("502"))
    );
    // A route the runner does not have: 404 without an error body.
    let missing = HttpRunner::new(format!("{base}/nowhere"), None);
    assert!(
        matches!(missing.preview(&input).await, Err(RunnerError::BadOutput(r)) if r.contains("404"))
    );
}

#[tokio::test]
async fn connection_refused_is_unavailable() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let runner = HttpRunner::new(format!("http://{addr}"), None);
    let (input, _dir) = input(Duration::from_secs(5));
    match runner.preview(&input).await {
        Err(RunnerError::Unavailable(r)) => assert!(r.contains(&addr.to_string()), "{r}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn slow_runner_times_out() {
    let (base, _) = start().await;
    let runner = HttpRunner::new(format!("{base}/slow"), None);
    let (input, _dir) = input(Duration::from_millis(300));
    let started = std::time::Instant::now();
    assert_eq!(
        runner.preview(&input).await.unwrap_err(),
        RunnerError::TimedOut(Duration::from_millis(300))
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// The OpenAPI document describes the same fields the client sends and reads.
#[test]
fn openapi_document_matches_the_protocol_types() {
    let path = format!(
        "{}/../schemas/runner-protocol.openapi.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    for p in ["/v1/version", "/v1/preview", "/v1/apply"] {
        assert!(doc["paths"][p].is_object(), "{p}");
    }
    let keys = |v: serde_json::Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
    let schema_keys = |name: &str| keys(doc["components"]["schemas"][name]["properties"].clone());
    let req = RunRequest {
        tenant_id: "acme".into(),
        environment_id: "dev".into(),
        stack: "acme.dev".into(),
        files: BTreeMap::new(),
        config: BTreeMap::new(),
        secrets: BTreeMap::new(),
        timeout_seconds: 1,
        refresh: true,
        exclude: vec!["urn:pulumi:acme.dev::web::aws:s3/bucket:Bucket::logs".into()],
        identity: BTreeMap::new(),
    };
    let mut sent = keys(serde_json::to_value(&req).unwrap());
    let mut documented = schema_keys("RunRequest");
    sent.sort();
    documented.sort();
    assert_eq!(sent, documented);
    let kinds: Vec<ErrorKind> = serde_json::from_value(
        doc["components"]["schemas"]["ErrorResponse"]["properties"]["error"]["properties"]["kind"]
            ["enum"]
            .clone(),
    )
    .unwrap();
    assert_eq!(kinds.len(), 6);
}
