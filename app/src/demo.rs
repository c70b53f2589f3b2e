//! `ferry serve --demo`: a tenant a newcomer can look at in the console within a minute.
//! Only on the embedded default and only into an empty data dir (a user's own data is never
//! mixed with the demo's), Ferry records, through its own API, a `demo` tenant with four
//! environments along the promotion path and a program repository in the data dir; a
//! release completed up to production, one that failed verification in production and was
//! rolled back (quarantined there), one completed up to staging and waiting for a
//! production approval with its plan, and a drift proposal in staging. The environments'
//! health endpoints, which verification probes, are served by Ferry itself under
//! `/demo/health/`, and the demo tenant's probe prefix allows exactly them. It prints the
//! console's address and a one-time sign-in link per demo person.

use crate::config::Config;
use crate::console::session;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

/// The demo's tenant.
pub const TENANT: &str = "demo";

/// The environments along the path, with their classes.
const ENVIRONMENTS: [(&str, &str); 4] = [
    ("demo-dev", "development"),
    ("demo-test", "test"),
    ("demo-staging", "staging"),
    ("demo-prod", "production"),
];

/// Whether this process serves the demo's health endpoints, and which answer 503.
static HEALTH: Mutex<Option<BTreeSet<String>>> = Mutex::new(None);

/// Why the demo cannot start.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// The demo runs only on the embedded default.
    #[error("--demo runs on the embedded default only: unset DATABASE_URL and NATS_URL")]
    NotEmbedded,
    /// The data dir holds something already.
    #[error("--demo needs an empty data dir, and {0} is not empty: the demo's data is never mixed with yours (set FERRY_DATA_DIR to a new folder)")]
    NotEmpty(PathBuf),
    /// The data dir could not be read or written.
    #[error("--demo cannot use {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `git` could not make the demo's program repository.
    #[error("--demo makes its program repository with git: {0}")]
    Git(String),
    /// Ferry did not answer as the demo expected.
    #[error("--demo could not record {what}: {detail}")]
    Seed {
        /// What it was recording.
        what: String,
        /// What Ferry answered.
        detail: String,
    },
    /// A token could not be made.
    #[error(transparent)]
    Key(#[from] ferry_api::auth::KeyError),
}

/// Checks that the demo may start with `config` and adjusts it: verification windows of a
/// few seconds, and the demo tenant's probes allowed to exactly Ferry's own demo health
/// endpoints.
pub fn prepare(mut config: Config) -> Result<Config, DemoError> {
    if config.database_url.is_some() || config.nats_url.is_some() {
        return Err(DemoError::NotEmbedded);
    }
    let dir = &config.data_dir;
    match std::fs::read_dir(dir) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                return Err(DemoError::NotEmpty(dir.clone()));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(DemoError::Io {
                path: dir.clone(),
                source,
            })
        }
    }
    config.workers = true;
    config.verification_window = Duration::from_secs(3);
    config.tenant_probe_url_prefixes = Some(vec![format!("{}/demo/health/", base(&config))]);
    *HEALTH.lock().unwrap_or_else(|p| p.into_inner()) = Some(BTreeSet::new());
    Ok(config)
}

/// Where Ferry answers, as a client on this machine reaches it.
fn base(config: &Config) -> String {
    let addr = config.http_addr;
    let addr = if addr.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], addr.port()))
    } else {
        addr
    };
    format!("http://{addr}")
}

/// `GET /demo/health/{environment}`: 200, or 503 while the demo makes a verification fail;
/// 404 when the process is not a demo.
pub async fn health(
    axum::extract::Path(environment): axum::extract::Path<String>,
) -> axum::http::StatusCode {
    use axum::http::StatusCode;
    match &*HEALTH.lock().unwrap_or_else(|p| p.into_inner()) {
        None => StatusCode::NOT_FOUND,
        Some(failing) if failing.contains(&environment) => StatusCode::SERVICE_UNAVAILABLE,
        Some(_) => StatusCode::OK,
    }
}

fn set_failing(environment: &str, failing: bool) {
    if let Some(set) = &mut *HEALTH.lock().unwrap_or_else(|p| p.into_inner()) {
        if failing {
            set.insert(environment.to_string());
        } else {
            set.remove(environment);
        }
    }
}

/// What the demo made: the console's address and a sign-in link per person.
#[derive(Debug)]
pub struct Demo {
    /// The console.
    pub console: String,
    /// (person, role, one-time sign-in link).
    pub links: Vec<(&'static str, &'static str, String)>,
}

/// Records the demo through the API of the server at `config.http_addr`.
pub async fn seed(config: &Config) -> Result<Demo, DemoError> {
    let key = ferry_api::auth::load_or_create_key(&config.data_dir)?;
    let people = [
        ("alice", "Operator"),
        ("bob", "Reviewer"),
        ("platform", "PlatformAdmin"),
    ];
    let scopes = [
        ferry_api::auth::SCOPE_READ,
        ferry_api::auth::SCOPE_APPLY,
        crate::contexts::promotions::READ,
        crate::contexts::promotions::PROMOTE,
        crate::contexts::promotions::OPERATE,
    ];
    let mut tokens = Vec::new();
    for (sub, role) in people {
        let token = ferry_api::auth::issue_hs256(
            &key,
            TENANT,
            sub,
            &scopes,
            &[role],
            Duration::from_secs(12 * 3600),
        )
        .map_err(|e| DemoError::Seed {
            what: format!("{sub}'s token"),
            detail: e.to_string(),
        })?;
        tokens.push(token);
    }
    let api = Api {
        base: base(config),
        http: reqwest::Client::new(),
        alice: tokens[0].clone(),
        bob: tokens[1].clone(),
        platform: tokens[2].clone(),
    };
    let (repository, commit) = repository(&config.data_dir)?;
    api.record(&repository, &commit, &config.data_dir).await?;
    let links = people
        .iter()
        .zip(tokens)
        .map(|((sub, role), token)| {
            let code = session::one_time_link(token);
            (*sub, *role, format!("{}/login/link/{code}", api.base))
        })
        .collect();
    Ok(Demo {
        console: format!("{}/", api.base),
        links,
    })
}

/// The demo's program, committed in a repository in the demo tenant's folder.
fn repository(data_dir: &Path) -> Result<(PathBuf, String), DemoError> {
    let repo = data_dir.join("tenants").join(TENANT).join("shop");
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DemoError::Io { path, source }
    };
    std::fs::create_dir_all(repo.join("stacks/web")).map_err(io(&repo))?;
    std::fs::write(
        repo.join("stacks/web/Pulumi.yaml"),
        "name: web\nruntime: yaml\nresources:\n  site:\n    type: aws:s3/bucket:Bucket\n    properties:\n      bucketPrefix: shop\noutputs:\n  siteId: ${site.id}\n",
    )
    .map_err(io(&repo))?;
    let git = |args: &[&str]| -> Result<String, DemoError> {
        let out = std::process::Command::new("git")
            .args([
                "-c",
                "user.name=Ferry demo",
                "-c",
                "user.email=demo@ferry.invalid",
            ])
            .args(args)
            .current_dir(&repo)
            .output()
            .map_err(|e| DemoError::Git(e.to_string()))?;
        if !out.status.success() {
            return Err(DemoError::Git(
                String::from_utf8_lossy(&out.stderr).trim().to_string(),
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    git(&["init", "-q"])?;
    git(&["add", "."])?;
    git(&["commit", "-qm", "the shop's web stack"])?;
    let commit = git(&["rev-parse", "HEAD"])?;
    let repo = std::path::absolute(&repo).map_err(io(&repo))?;
    Ok((repo, commit))
}

/// The demo's people talking to Ferry's API.
struct Api {
    base: String,
    http: reqwest::Client,
    alice: String,
    bob: String,
    platform: String,
}

impl Api {
    async fn send(
        &self,
        what: &str,
        method: reqwest::Method,
        path: &str,
        token: &str,
        body: Option<Value>,
    ) -> Result<Value, DemoError> {
        let failed = |detail: String| DemoError::Seed {
            what: what.to_string(),
            detail,
        };
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.map_err(|e| failed(e.to_string()))?;
        let status = response.status();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            return Err(failed(format!("{status}: {body}")));
        }
        Ok(body)
    }

    /// The promotion once `done` holds of it (within two minutes).
    async fn wait(
        &self,
        promotion: &str,
        what: &str,
        done: impl Fn(&Value) -> bool,
    ) -> Result<Value, DemoError> {
        let path = format!("/factory/delivery/promotions/{promotion}");
        for _ in 0..1200 {
            let p = self
                .send(what, reqwest::Method::GET, &path, &self.alice, None)
                .await?;
            if done(&p) {
                return Ok(p);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(DemoError::Seed {
            what: what.to_string(),
            detail: format!("promotion {promotion} did not get there"),
        })
    }

    async fn promote(&self, release: &str, environment: &str) -> Result<String, DemoError> {
        let body = json!({"releaseId": release, "environmentId": environment});
        let p = self
            .send(
                &format!("the promotion to {environment}"),
                reqwest::Method::POST,
                "/factory/delivery/promotions",
                &self.alice,
                Some(body),
            )
            .await?;
        Ok(p["promotionId"].as_str().unwrap_or_default().to_string())
    }

    async fn state(&self, promotion: &str, state: &str) -> Result<Value, DemoError> {
        self.wait(promotion, &format!("promotion {promotion} {state}"), |p| {
            p["state"] == state
        })
        .await
    }

    async fn approve(&self, promotion: &str) -> Result<(), DemoError> {
        self.wait(promotion, "the production approval with its plan", |p| {
            p["approvalStatus"] == "Pending" && p["approvalPlan"].is_object()
        })
        .await?;
        let body = json!({"decision": "approve", "reason": "change board: approved"});
        let path = format!("/factory/delivery/promotions/{promotion}/approval");
        self.send(
            "the approval",
            reqwest::Method::POST,
            &path,
            &self.bob,
            Some(body),
        )
        .await?;
        Ok(())
    }

    async fn release(
        &self,
        version: &str,
        repository: &Path,
        commit: &str,
    ) -> Result<String, DemoError> {
        let id = uuid::Uuid::new_v4().to_string();
        let body = json!({
            "projectId": "shop", "version": version,
            "programRef": format!("{}#stacks/web", repository.display()),
            "programVersion": commit,
            "pipeline": [{"name": "unit", "result": "passed"}, {"name": "e2e", "result": "passed"}]
        });
        let path = format!("/factory/delivery/releases/{id}");
        self.send(
            &format!("release {version}"),
            reqwest::Method::PUT,
            &path,
            &self.platform,
            Some(body),
        )
        .await?;
        Ok(id)
    }

    /// Up to staging, completed each time.
    async fn to_staging(&self, release: &str) -> Result<(), DemoError> {
        for (environment, _) in &ENVIRONMENTS[..3] {
            let p = self.promote(release, environment).await?;
            self.state(&p, "Completed").await?;
        }
        Ok(())
    }

    async fn record(
        &self,
        repository: &Path,
        commit: &str,
        data_dir: &Path,
    ) -> Result<(), DemoError> {
        for (environment, class) in ENVIRONMENTS {
            let body = json!({"environmentClass": class,
                              "healthUrl": format!("{}/demo/health/{environment}", self.base)});
            let path = format!("/factory/environments/{environment}");
            self.send(
                &format!("environment {environment}"),
                reqwest::Method::PUT,
                &path,
                &self.platform,
                Some(body),
            )
            .await?;
        }
        // 1.0.0 runs in production.
        tracing::info!("demo: release 1.0.0 through to production");
        let good = self.release("1.0.0", repository, commit).await?;
        self.to_staging(&good).await?;
        let p = self.promote(&good, "demo-prod").await?;
        self.approve(&p).await?;
        self.state(&p, "Completed").await?;
        // 1.1.0 fails its verification in production and is rolled back (quarantined).
        tracing::info!("demo: release 1.1.0 fails verification in production and is rolled back");
        let bad = self.release("1.1.0", repository, commit).await?;
        self.to_staging(&bad).await?;
        let p = self.promote(&bad, "demo-prod").await?;
        self.approve(&p).await?;
        self.state(&p, "Verifying").await?;
        set_failing("demo-prod", true);
        let failed = self
            .wait(&p, "the failed verification", |p| {
                p["verification"]["outcome"] == "Failed"
            })
            .await;
        set_failing("demo-prod", false);
        failed?;
        self.state(&p, "RolledBack").await?;
        // 1.2.0 waits for bob's approval in production.
        tracing::info!("demo: release 1.2.0 waits for a production approval");
        let next = self.release("1.2.0", repository, commit).await?;
        self.to_staging(&next).await?;
        let p = self.promote(&next, "demo-prod").await?;
        self.wait(&p, "the production approval with its plan", |p| {
            p["approvalStatus"] == "Pending" && p["approvalPlan"].is_object()
        })
        .await?;
        // Last (a proposal waiting in staging would hold the releases' runs there): a bucket
        // made by hand in staging, which the reconciliation proposes to delete.
        tracing::info!("demo: drift in staging");
        self.drift(data_dir).await
    }

    /// Adds a resource to the simulated cloud of staging by hand and reconciles it.
    async fn drift(&self, data_dir: &Path) -> Result<(), DemoError> {
        let cloud = data_dir
            .join("simulated-cloud")
            .join(TENANT)
            .join("demo-staging")
            .join("state.json");
        let io = |source| DemoError::Io {
            path: cloud.clone(),
            source,
        };
        let text = std::fs::read_to_string(&cloud).map_err(io)?;
        let mut state: Value = serde_json::from_str(&text).map_err(|e| DemoError::Seed {
            what: "the drift".to_string(),
            detail: e.to_string(),
        })?;
        let resources = state["resources"].as_object_mut();
        let site = resources
            .as_ref()
            .and_then(|r| r.iter().find(|(urn, _)| urn.ends_with("::site")))
            .map(|(urn, v)| (urn.clone(), v.clone()));
        if let (Some(resources), Some((urn, value))) = (resources, site) {
            resources.insert(urn.replace("::site", "::stray"), value);
        }
        std::fs::write(&cloud, state.to_string()).map_err(io)?;
        let body = json!({"environmentId": "demo-staging"});
        self.send(
            "the reconciliation",
            reqwest::Method::POST,
            "/factory/provisioning/reconcile",
            &self.alice,
            Some(body),
        )
        .await?;
        Ok(())
    }
}
