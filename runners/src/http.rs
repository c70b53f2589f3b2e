//! The HTTP runner: a client for a remote runner service, and the protocol's message
//! types (documented as OpenAPI 3.1 in `schemas/runner-protocol.openapi.json`).
//!
//! * `GET  /v1/version` → [`VersionResponse`]
//! * `POST /v1/preview` with a [`RunRequest`] → [`PreviewResponse`] (the `pulumi preview
//!   --json` document, parsed here with [`parse_preview`])
//! * `POST /v1/apply` with a [`RunRequest`] → [`ApplyResponse`]
//! * any failure: a non-2xx status with an [`ErrorResponse`] (kind, message, failing
//!   resource).
//!
//! The request carries the program folder's files (path → base64), the resolved
//! configuration and secrets, and the tenant's runner identity (`identity`: the variables
//! its program runs with, its backend, passphrase and cloud credentials, resolved per tenant
//! from `FERRY_RUNNER_IDENTITIES`), so the base URL must be `https` outside a test or a
//! trusted network; a bearer token authenticates Ferry to the runner. The remote runner
//! runs the program with that identity and nothing of its own; a run without an identity
//! is not sent (it fails naming the setting).
//!
//! **Cancellation.** The protocol has no cancel operation. When the workers drop an apply
//! (they lost its lease), the request is dropped and its connection closed; that is the only
//! signal a remote runner gets. A remote runner should stop the run when its client goes
//! away; one that does not may go on changing the stack after Ferry reported the apply
//! interrupted, so at most one runner per environment holds only for runners that do.

use crate::preview::parse_preview;
use base64::Engine as _;
use ferry_domain::ports::identity::missing_identity;
use ferry_domain::ports::redact;
use ferry_domain::ports::runner::{ApplyOutcome, PreviewOutcome, Runner, RunnerError, RunnerInput};
use ferry_domain::ports::SecretValue;
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The most of a runner's answer Ferry reads (as much as the Pulumi runner reads of its
/// child's output).
const MAX_RESPONSE_BYTES: u64 = crate::pulumi::MAX_STDOUT_BYTES;

/// Largest program folder sent to a remote runner.
pub const MAX_PROGRAM_BYTES: u64 = 16 * 1024 * 1024;
const VERSION_TIMEOUT: Duration = Duration::from_secs(30);

/// Body of `POST /v1/preview` and `POST /v1/apply`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunRequest {
    /// The tenant the run belongs to: keep its state apart from every other tenant's.
    pub tenant_id: String,
    /// The environment.
    pub environment_id: String,
    /// The stack: `<tenant>.<environment>` with `_`, `.` and `:` escaped (injective).
    pub stack: String,
    /// The program folder: relative path (with `/`) → base64 (standard) content.
    pub files: BTreeMap<String, String>,
    /// Resolved configuration by key.
    pub config: BTreeMap<String, Value>,
    /// Resolved secrets by key (never logged or stored by the runner).
    pub secrets: BTreeMap<String, String>,
    /// How long the runner may take.
    pub timeout_seconds: u64,
    /// Read the resources' real state first (`pulumi preview --refresh`): reconciliation runs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub refresh: bool,
    /// Resources (URNs) to leave alone (`pulumi up --exclude`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
    /// The tenant's runner identity: the environment variables its program runs with
    /// (`PULUMI_BACKEND_URL`, `PULUMI_CONFIG_PASSPHRASE`, cloud credentials), and no other
    /// credential (never logged or stored by the runner).
    pub identity: BTreeMap<String, String>,
}

/// Answer of `GET /v1/version`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionResponse {
    /// The runner's version.
    pub version: String,
}

/// Answer of `POST /v1/preview`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreviewResponse {
    /// The `pulumi preview --json` document.
    pub preview: Value,
    /// The runner's log.
    #[serde(default)]
    pub log: String,
}

/// Answer of `POST /v1/apply`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApplyResponse {
    /// The program's outputs.
    pub outputs: BTreeMap<String, Value>,
    /// The runner's log.
    #[serde(default)]
    pub log: String,
}

/// What kind of failure a remote runner reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ErrorKind {
    /// The program failed (possibly part-way through an apply).
    ProgramFailed,
    /// The program is invalid.
    InvalidProgram,
    /// The run did not finish in time.
    TimedOut,
    /// The runner cannot run anything now.
    Unavailable,
    /// The request was malformed.
    BadRequest,
    /// The token is missing or wrong.
    Unauthorized,
}

/// A failure body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorResponse {
    /// The failure.
    pub error: ErrorBody,
}

/// The details of a failure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What kind of failure.
    pub kind: ErrorKind,
    /// A reason a person can act on.
    pub message: String,
    /// The failing resource (URN or name), if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// The runner's log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<String>,
}

/// A client for a remote runner.
#[derive(Debug, Clone)]
pub struct HttpRunner {
    base_url: String,
    token: Option<String>,
    client: Result<reqwest::Client, NoClient>,
}

/// The HTTP client could not be built (the TLS backend did not initialise): every call
/// fails with it. Shared, since the runner is cloned and the error is not.
#[derive(Debug, Clone, thiserror::Error)]
#[error("cannot build HTTP client: {0}")]
struct NoClient(Arc<reqwest::Error>);

impl HttpRunner {
    /// A client for the runner at `base_url` (e.g. `https://runner.internal`), sending
    /// `token` as a bearer token when given.
    pub fn new(base_url: impl Into<String>, token: Option<String>) -> Self {
        let client = reqwest::Client::builder()
            .build()
            .map_err(|e| NoClient(Arc::new(e)));
        Self {
            base_url: base_url.into().trim_end_matches('/').to_string(),
            token,
            client,
        }
    }

    async fn call<T: DeserializeOwned>(
        &self,
        path: &str,
        body: Option<&RunRequest>,
        timeout: Duration,
        secrets: &BTreeMap<String, SecretValue>,
    ) -> Result<T, RunnerError> {
        let client = self
            .client
            .as_ref()
            .map_err(|e| RunnerError::Unavailable(e.to_string()))?;
        let url = format!("{}{path}", self.base_url);
        let mut req = match body {
            Some(b) => client.post(&url).json(b),
            None => client.get(&url),
        }
        .timeout(timeout);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let transport = |e: reqwest::Error| {
            if e.is_timeout() {
                RunnerError::TimedOut(timeout)
            } else {
                RunnerError::Unavailable(format!("cannot reach runner at {url}: {e}"))
            }
        };
        let mut resp = req.send().await.map_err(transport)?;
        let status = resp.status();
        // Read up to the limit only: a runner answering without end cannot take Ferry's memory.
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(transport)? {
            if (body.len() + chunk.len()) as u64 > MAX_RESPONSE_BYTES {
                return Err(RunnerError::BadOutput(format!(
                    "runner at {url} answered more than {MAX_RESPONSE_BYTES} bytes; the rest was not read"
                )));
            }
            body.extend_from_slice(&chunk);
        }
        let text = String::from_utf8_lossy(&body).into_owned();
        let excerpt = || {
            redact(
                &text.chars().take(300).collect::<String>(),
                secrets.values(),
            )
        };
        if status.is_success() {
            return serde_json::from_str(&text).map_err(|e| {
                RunnerError::BadOutput(format!(
                    "runner at {url} answered {status} with an unexpected body ({e}): {}",
                    excerpt()
                ))
            });
        }
        let Ok(ErrorResponse { error }) = serde_json::from_str::<ErrorResponse>(&text) else {
            return Err(if status.is_server_error() {
                RunnerError::Unavailable(format!(
                    "runner at {url} answered {status}: {}",
                    excerpt()
                ))
            } else {
                RunnerError::BadOutput(format!("runner at {url} answered {status}: {}", excerpt()))
            });
        };
        let message = redact(&error.message, secrets.values());
        Err(match error.kind {
            ErrorKind::ProgramFailed => RunnerError::ProgramFailed {
                reason: message,
                resource: error.resource,
                log: redact(error.log.as_deref().unwrap_or_default(), secrets.values()),
            },
            ErrorKind::InvalidProgram => RunnerError::InvalidProgram(message),
            ErrorKind::TimedOut => RunnerError::TimedOut(timeout),
            ErrorKind::Unavailable | ErrorKind::BadRequest | ErrorKind::Unauthorized => {
                RunnerError::Unavailable(format!("runner at {url} refused ({status}): {message}"))
            }
        })
    }
}

/// Builds the request: the program folder's files (without `.git`), config and secrets.
fn run_request(input: &RunnerInput) -> Result<RunRequest, RunnerError> {
    let identity = input
        .identity
        .as_ref()
        .ok_or_else(|| RunnerError::NoIdentity(missing_identity(&input.tenant)))?;
    let mut files = BTreeMap::new();
    let mut total = 0u64;
    collect_files(
        &input.program_dir,
        &input.program_dir,
        &mut files,
        &mut total,
    )?;
    Ok(RunRequest {
        tenant_id: input.tenant.to_string(),
        environment_id: input.environment_id.clone(),
        stack: input.stack.to_string(),
        files,
        config: input.config.clone(),
        secrets: input
            .secrets
            .iter()
            .map(|(k, v)| (k.clone(), v.expose().to_string()))
            .collect(),
        timeout_seconds: input.timeout.as_secs().max(1),
        refresh: input.refresh,
        exclude: input.exclude.clone(),
        identity: identity
            .vars()
            .iter()
            .map(|(k, v)| (k.clone(), v.expose().to_string()))
            .collect(),
    })
}

/// Everything to redact from a run's answers: its secrets and its identity's values.
fn redactions(input: &RunnerInput) -> BTreeMap<String, SecretValue> {
    let mut all = input.secrets.clone();
    if let Some(identity) = &input.identity {
        for (name, value) in identity.vars() {
            all.insert(format!("identity:{name}"), value.clone());
        }
    }
    all
}

fn collect_files(
    root: &Path,
    dir: &Path,
    files: &mut BTreeMap<String, String>,
    total: &mut u64,
) -> Result<(), RunnerError> {
    let fail = |p: &Path, e: std::io::Error| {
        RunnerError::InvalidProgram(format!("cannot read program folder {}: {e}", p.display()))
    };
    let entries = std::fs::read_dir(dir).map_err(|e| fail(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| fail(dir, e))?;
        let path = entry.path();
        // Symlinks are skipped: they could point outside the program folder.
        let meta = std::fs::symlink_metadata(&path).map_err(|e| fail(&path, e))?;
        if meta.is_dir() {
            if entry.file_name() != ".git" {
                collect_files(root, &path, files, total)?;
            }
        } else if meta.is_file() {
            *total += meta.len();
            if *total > MAX_PROGRAM_BYTES {
                return Err(RunnerError::InvalidProgram(format!(
                    "program folder {} is larger than {MAX_PROGRAM_BYTES} bytes",
                    root.display()
                )));
            }
            let bytes = std::fs::read(&path).map_err(|e| fail(&path, e))?;
            let rel = path
                .strip_prefix(root)
                .map_err(|_| {
                    RunnerError::InvalidProgram(format!(
                        "{} is outside the program",
                        path.display()
                    ))
                })?
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            files.insert(rel, base64::engine::general_purpose::STANDARD.encode(bytes));
        }
    }
    Ok(())
}

#[async_trait::async_trait]
impl Runner for HttpRunner {
    fn name(&self) -> &'static str {
        "http"
    }

    fn needs_identity(&self) -> bool {
        true
    }

    async fn version(&self) -> Result<String, RunnerError> {
        let v: VersionResponse = self
            .call("/v1/version", None, VERSION_TIMEOUT, &BTreeMap::new())
            .await?;
        Ok(v.version)
    }

    #[tracing::instrument(skip_all, fields(runner = "http", stack = %input.stack))]
    async fn preview(&self, input: &RunnerInput) -> Result<PreviewOutcome, RunnerError> {
        let req = run_request(input)?;
        let secrets = &redactions(input);
        let resp: PreviewResponse = self
            .call("/v1/preview", Some(&req), input.timeout, secrets)
            .await?;
        let doc = serde_json::to_string_pretty(&resp.preview)
            .map_err(|e| RunnerError::BadOutput(format!("preview document: {e}")))?;
        let plan = parse_preview(doc.as_bytes())?;
        let log = if resp.log.is_empty() {
            doc
        } else {
            format!("{doc}\n{}", resp.log)
        };
        Ok(PreviewOutcome {
            plan,
            log: redact(&log, secrets.values()),
        })
    }

    #[tracing::instrument(skip_all, fields(runner = "http", stack = %input.stack))]
    async fn apply(&self, input: &RunnerInput) -> Result<ApplyOutcome, RunnerError> {
        let req = run_request(input)?;
        let secrets = &redactions(input);
        let resp: ApplyResponse = self
            .call("/v1/apply", Some(&req), input.timeout, secrets)
            .await?;
        let outputs = resp
            .outputs
            .into_iter()
            .map(|(k, v)| (k, crate::pulumi::redact_json(v, secrets)))
            .collect();
        Ok(ApplyOutcome {
            outputs,
            log: redact(&resp.log, secrets.values()),
        })
    }
}
