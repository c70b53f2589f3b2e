//! Shared helpers of the end-to-end suite: a real server on a fresh database, tokens, and
//! a small HTTP client.
#![allow(dead_code, clippy::unwrap_used)]

use ferry_app::{Config, Server};
use ferry_store::database::Backend;
use ferry_store::testing::TestDatabase;
use serde_json::Value;
use std::time::Duration;

/// The HS256 key the test servers use.
pub const KEY: &str = "ferry-end-to-end-test-key-0123456789abcdef";

pub const READ: &str = "factory.provisioning.read";
pub const APPLY: &str = "factory.provisioning.apply";
pub const PUBLISH: &str = "factory.events.publish";

/// A Ferry server on its own database, reached over real HTTP.
pub struct TestServer {
    pub server: Option<Server>,
    pub db: Option<TestDatabase>,
    pub base: String,
    pub client: reqwest::Client,
    pub data_dir: tempfile::TempDir,
}

pub fn config(data_dir: &std::path::Path) -> Config {
    Config {
        http_addr: "127.0.0.1:0".parse().unwrap(),
        grpc_addr: Some("127.0.0.1:0".parse().unwrap()),
        data_dir: data_dir.to_path_buf(),
        jwt_hs256_key: Some(KEY.to_string()),
        poll_interval: Duration::from_millis(50),
        // API tests drive runs by hand; the workers' tests turn them on.
        workers: false,
        // What `declaration()` names, for every tenant: the example Git host, the example
        // configuration folder and `DB_*` variables.
        tenant_file_roots: Some(vec![
            format!("{}/tenants/{{tenant}}", data_dir.display()),
            "/etc/ferry".to_string(),
        ]),
        tenant_env_prefix: "DB_".to_string(),
        tenant_program_url_prefixes: vec!["https://git.example.com/".to_string()],
        ..Config::default()
    }
}

impl TestServer {
    /// A server on a fresh Postgres database (or SQLite file).
    pub async fn start(backend: Backend) -> Self {
        let data_dir = tempfile::tempdir().unwrap();
        Self::start_with(backend, config(data_dir.path()), data_dir).await
    }

    pub async fn start_with(
        backend: Backend,
        mut config: Config,
        data_dir: tempfile::TempDir,
    ) -> Self {
        let db = TestDatabase::new(backend).await;
        if backend == Backend::Postgres {
            config.database_url = Some(db.location.clone());
        }
        let server = Server::start_with(&config, db.db.clone()).await.unwrap();
        Self {
            base: format!("http://{}", server.addr),
            server: Some(server),
            db: Some(db),
            client: reqwest::Client::new(),
            data_dir,
        }
    }

    /// `GET /metrics` as text.
    pub async fn metrics(&self) -> String {
        let r = self.client.get(self.url("/metrics")).send().await.unwrap();
        r.text().await.unwrap()
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.server.take() {
            s.stop().await;
        }
        if let Some(db) = self.db.take() {
            db.cleanup().await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn get(&self, token: &str, path: &str) -> (u16, Value) {
        let r = self
            .client
            .get(self.url(path))
            .bearer_auth(token)
            .send()
            .await
            .unwrap();
        response(r).await
    }

    pub async fn post(&self, token: &str, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .client
            .post(self.url(path))
            .bearer_auth(token)
            .json(body)
            .send()
            .await
            .unwrap();
        response(r).await
    }

    /// `POST /factory/events` with one structured CloudEvent.
    pub async fn post_event(&self, token: &str, event: &Value) -> (u16, Value) {
        let r = self
            .client
            .post(self.url("/factory/events"))
            .bearer_auth(token)
            .header("content-type", "application/cloudevents+json")
            .body(event.to_string())
            .send()
            .await
            .unwrap();
        response(r).await
    }
}

pub async fn response(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    if status >= 400 {
        let ct = r
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        assert_eq!(ct, "application/problem+json", "errors are problem+json");
    }
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

pub fn token(tenant: &str, sub: &str, scopes: &[&str], roles: &[&str]) -> String {
    ferry_api::auth::issue_hs256(
        KEY.as_bytes(),
        tenant,
        sub,
        scopes,
        roles,
        Duration::from_secs(600),
    )
    .unwrap()
}

/// A service identity that may post other services' events (no human role).
pub fn service(tenant: &str, sub: &str) -> String {
    token(tenant, sub, &[PUBLISH], &[])
}

/// An Operator with both scopes.
pub fn operator(tenant: &str, sub: &str) -> String {
    token(tenant, sub, &[READ, APPLY], &["Operator"])
}

pub fn declaration(env: &str, commit: &str) -> Value {
    serde_json::json!({
        "environmentId": env,
        "projectId": "payments",
        "kind": "Environment",
        "programRef": "https://git.example.com/infra.git#envs/dev",
        "programVersion": commit,
        "strategy": "rolling",
        "configRefs": {"app": "file:///etc/ferry/app.yaml"},
        "secretRefs": {"dbPassword": "env://DB_PASSWORD"}
    })
}
