//! Configuration, in layers: built-in defaults, then an optional TOML file (`--config` or
//! `FERRY_CONFIG`), then `FERRY_*` environment variables and `DATABASE_URL`. Every value is
//! checked at start; a bad one stops the process with a message naming the setting.

use ferry_domain::confinement::Confinement;
use serde::Deserialize;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// A setting that could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration {setting} ({source_name}): {reason}")]
pub struct ConfigError {
    /// The setting, as the user wrote it (e.g. `FERRY_HTTP_ADDR` or `http_addr`).
    pub setting: String,
    /// Where it came from (`environment`, the file path, …).
    pub source_name: String,
    /// Why it was refused.
    pub reason: String,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line.
    Json,
    /// Human-readable lines.
    Pretty,
}

/// Ferry's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Where the HTTP API listens (`FERRY_HTTP_ADDR`).
    pub http_addr: SocketAddr,
    /// Where the embedded store, keys and artifacts live (`FERRY_DATA_DIR`).
    pub data_dir: PathBuf,
    /// Postgres URL; SQLite in the data dir when absent (`DATABASE_URL`).
    pub database_url: Option<String>,
    /// HS256 signing key (`FERRY_JWT_HS256_KEY`); generated and kept in the data dir when
    /// neither it nor a JWKS URL is set.
    pub jwt_hs256_key: Option<String>,
    /// JWKS URL for RS256 tokens (`FERRY_JWT_JWKS_URL`).
    pub jwt_jwks_url: Option<String>,
    /// Required `iss` claim, if set (`FERRY_JWT_ISSUER`).
    pub jwt_issuer: Option<String>,
    /// Required `aud` claim, if set (`FERRY_JWT_AUDIENCE`).
    pub jwt_audience: Option<String>,
    /// How often subscriptions poll when no wake-up arrives (`FERRY_POLL_INTERVAL_MS`).
    pub poll_interval: Duration,
    /// How long a command response waits for the read model (`FERRY_READ_YOUR_WRITES_MS`).
    pub read_your_writes: Duration,
    /// `json` or `pretty` (`FERRY_LOG_FORMAT`).
    pub log_format: LogFormat,
    /// Filter directives, e.g. `info,ferry=debug` (`FERRY_LOG`).
    pub log_filter: String,
    /// Which IaC runner plans and applies (`FERRY_RUNNER`).
    pub runner: RunnerKind,
    /// The Pulumi CLI (`FERRY_PULUMI_BIN`).
    pub pulumi_bin: String,
    /// The remote runner's base URL, for `FERRY_RUNNER=http` (`FERRY_RUNNER_URL`).
    pub runner_url: Option<String>,
    /// Bearer token for the remote runner (`FERRY_RUNNER_TOKEN`).
    pub runner_token: Option<String>,
    /// Runner timeout per apply (`FERRY_APPLY_TIMEOUT_MINUTES`).
    pub apply_timeout: Duration,
    /// How long a run may wait for approval before it is rejected; `None` = forever
    /// (`FERRY_APPROVAL_EXPIRY_MINUTES`, 0 = never).
    pub approval_expiry: Option<Duration>,
    /// Folder of extra Rego policies (`FERRY_POLICY_DIR`).
    pub policy_dir: Option<PathBuf>,
    /// Where artifacts go: unset = `<data dir>/artifacts`, or `s3://`, `az://`, `gs://`
    /// (`FERRY_ARTIFACTS_URL`).
    pub artifacts_url: Option<String>,
    /// HashiCorp Vault address for `vault://` secrets (`FERRY_VAULT_ADDR`).
    pub vault_addr: Option<String>,
    /// Vault token (`FERRY_VAULT_TOKEN`).
    pub vault_token: Option<String>,
    /// Default baseline program per class, `<programRef>@<commit>`
    /// (`FERRY_BASELINE_PROGRAM_<CLASS>`).
    pub baseline_programs: Vec<(ferry_domain::EnvironmentClass, String, String)>,
    /// NATS server; the relay and inbound consumers run when set (`NATS_URL`).
    pub nats_url: Option<String>,
    /// JetStream stream Ferry publishes to (`FERRY_NATS_STREAM`).
    pub nats_stream: String,
    /// Run the planner and applier in this process (`FERRY_WORKERS`); API-only instances
    /// set it to false.
    pub workers: bool,
    /// CloudEvent sources trusted per inbound event (`FERRY_TRUSTED_SOURCES`); any source
    /// when unset.
    pub trusted_sources: ferry_messaging::TrustedSources,
    /// Postgres ends Ferry's sessions left idle inside a transaction this long
    /// (`FERRY_IDLE_IN_TRANSACTION_TIMEOUT_MS`).
    pub idle_in_transaction_timeout: Duration,
    /// How long a request waits for a store connection before answering 503
    /// (`FERRY_STORE_ACQUIRE_TIMEOUT_MS`).
    pub store_acquire_timeout: Duration,
    /// How long an SQLite writer waits for the write lock before answering 503
    /// (`FERRY_SQLITE_BUSY_TIMEOUT_MS`).
    pub sqlite_busy_timeout: Duration,
    /// A transaction holding the global stream back longer than this is named by `/readyz`
    /// and `ferry projections status` (`FERRY_STREAM_HOLD_WARN_MS`).
    pub stream_hold_warn: Duration,
    /// How long a worker's claim on a step lasts without renewal
    /// (`FERRY_WORKER_LEASE_SECONDS`).
    pub worker_lease: Duration,
    /// How long past an apply's lease, with its owner's lock free, before another instance
    /// reports it interrupted (`FERRY_WORKER_RECOVERY_GRACE_SECONDS`).
    pub worker_recovery_grace: Duration,
    /// Folder templates `file://` secrets and configuration may name
    /// (`FERRY_TENANT_FILE_ROOTS`); `None` = `<data dir>/tenants/{tenant}`.
    pub tenant_file_roots: Option<Vec<String>>,
    /// Folder templates local program repositories may be in (`FERRY_TENANT_PROGRAM_ROOTS`);
    /// `None` = `<data dir>/tenants/{tenant}`.
    pub tenant_program_roots: Option<Vec<String>>,
    /// Prefix template of the variables `env://` may name (`FERRY_TENANT_ENV_PREFIX`).
    pub tenant_env_prefix: String,
    /// Prefix template of the Vault paths `vault://` may name (`FERRY_TENANT_VAULT_PREFIX`).
    pub tenant_vault_prefix: String,
    /// URL prefix templates of remote program repositories
    /// (`FERRY_TENANT_PROGRAM_URL_PREFIXES`); none by default.
    pub tenant_program_url_prefixes: Vec<String>,
    /// URL prefix templates of `http(s)://` configuration
    /// (`FERRY_TENANT_CONFIG_URL_PREFIXES`); none by default.
    pub tenant_config_url_prefixes: Vec<String>,
    /// The configuration file that was read, if any (never resolvable by a tenant).
    pub config_file: Option<PathBuf>,
}

/// Which runner adapter to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunnerKind {
    /// Evaluates Pulumi YAML against a simulated cloud in the data dir.
    Simulated,
    /// The Pulumi CLI.
    Pulumi,
    /// A remote runner over HTTP.
    Http,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            http_addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            data_dir: PathBuf::from(".ferry"),
            database_url: None,
            jwt_hs256_key: None,
            jwt_jwks_url: None,
            jwt_issuer: None,
            jwt_audience: None,
            poll_interval: Duration::from_millis(500),
            read_your_writes: Duration::from_secs(2),
            log_format: LogFormat::Json,
            log_filter: "info".to_string(),
            runner: RunnerKind::Simulated,
            pulumi_bin: "pulumi".to_string(),
            runner_url: None,
            runner_token: None,
            apply_timeout: Duration::from_secs(45 * 60),
            approval_expiry: Some(Duration::from_secs(24 * 60 * 60)),
            policy_dir: None,
            artifacts_url: None,
            vault_addr: None,
            vault_token: None,
            baseline_programs: Vec::new(),
            nats_url: None,
            nats_stream: "FERRY_EVENTS".to_string(),
            workers: true,
            trusted_sources: ferry_messaging::TrustedSources::any(),
            idle_in_transaction_timeout: Duration::from_secs(60),
            store_acquire_timeout: Duration::from_secs(10),
            sqlite_busy_timeout: Duration::from_secs(15),
            stream_hold_warn: Duration::from_secs(5),
            worker_lease: Duration::from_secs(60),
            worker_recovery_grace: Duration::from_secs(30),
            tenant_file_roots: None,
            tenant_program_roots: None,
            tenant_env_prefix: "TENANT_{tenant}".to_string(),
            tenant_vault_prefix: "{tenant}/".to_string(),
            tenant_program_url_prefixes: Vec::new(),
            tenant_config_url_prefixes: Vec::new(),
            config_file: None,
        }
    }
}

/// A list in the file: an array of strings, or one comma-separated string.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum FileList {
    One(String),
    Many(Vec<String>),
}

impl FileList {
    fn into_raw(self) -> RawValue {
        match self {
            Self::One(text) => RawValue::Text(text),
            Self::Many(items) => RawValue::List(items),
        }
    }
}

/// The file layer: every key optional, unknown keys refused.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileLayer {
    http_addr: Option<String>,
    data_dir: Option<String>,
    database_url: Option<String>,
    jwt_hs256_key: Option<String>,
    jwt_jwks_url: Option<String>,
    jwt_issuer: Option<String>,
    jwt_audience: Option<String>,
    poll_interval_ms: Option<u64>,
    read_your_writes_ms: Option<u64>,
    log_format: Option<String>,
    log: Option<String>,
    runner: Option<String>,
    pulumi_bin: Option<String>,
    runner_url: Option<String>,
    runner_token: Option<String>,
    apply_timeout_minutes: Option<u64>,
    approval_expiry_minutes: Option<u64>,
    policy_dir: Option<String>,
    artifacts_url: Option<String>,
    vault_addr: Option<String>,
    vault_token: Option<String>,
    baseline_program_development: Option<String>,
    baseline_program_test: Option<String>,
    baseline_program_staging: Option<String>,
    baseline_program_production: Option<String>,
    nats_url: Option<String>,
    nats_stream: Option<String>,
    workers: Option<bool>,
    trusted_sources: Option<String>,
    idle_in_transaction_timeout_ms: Option<u64>,
    store_acquire_timeout_ms: Option<u64>,
    sqlite_busy_timeout_ms: Option<u64>,
    stream_hold_warn_ms: Option<u64>,
    worker_lease_seconds: Option<u64>,
    worker_recovery_grace_seconds: Option<u64>,
    tenant_file_roots: Option<FileList>,
    tenant_program_roots: Option<FileList>,
    tenant_env_prefix: Option<String>,
    tenant_vault_prefix: Option<String>,
    tenant_program_url_prefixes: Option<FileList>,
    tenant_config_url_prefixes: Option<FileList>,
}

/// The documented settings: (file key, environment variable, default, meaning). The README
/// table is written from this list.
pub const SETTINGS: &[(&str, &str, &str, &str)] = &[
    (
        "http_addr",
        "FERRY_HTTP_ADDR",
        "127.0.0.1:8080",
        "Address the HTTP API listens on.",
    ),
    (
        "data_dir",
        "FERRY_DATA_DIR",
        "./.ferry",
        "Embedded store (`ferry.db`), generated signing key.",
    ),
    (
        "database_url",
        "DATABASE_URL",
        "(unset: SQLite)",
        "Postgres URL; when set, events and read models live there.",
    ),
    (
        "jwt_hs256_key",
        "FERRY_JWT_HS256_KEY",
        "(generated)",
        "HS256 key for bearer tokens; at least 32 bytes.",
    ),
    (
        "jwt_jwks_url",
        "FERRY_JWT_JWKS_URL",
        "(unset)",
        "JWKS URL; when set, RS256 tokens are verified against it.",
    ),
    (
        "jwt_issuer",
        "FERRY_JWT_ISSUER",
        "(unset)",
        "Required `iss` claim.",
    ),
    (
        "jwt_audience",
        "FERRY_JWT_AUDIENCE",
        "(unset)",
        "Required `aud` claim.",
    ),
    (
        "poll_interval_ms",
        "FERRY_POLL_INTERVAL_MS",
        "500",
        "Projection polling fallback, 10 to 60000 ms.",
    ),
    (
        "read_your_writes_ms",
        "FERRY_READ_YOUR_WRITES_MS",
        "2000",
        "How long a command waits for its read model, 0 to 30000 ms.",
    ),
    (
        "log_format",
        "FERRY_LOG_FORMAT",
        "json",
        "`json` or `pretty`.",
    ),
    (
        "log",
        "FERRY_LOG",
        "info",
        "Log filter, e.g. `info,ferry_api=debug`.",
    ),
    (
        "runner",
        "FERRY_RUNNER",
        "simulated",
        "`simulated`, `pulumi` or `http`.",
    ),
    (
        "pulumi_bin",
        "FERRY_PULUMI_BIN",
        "pulumi",
        "The Pulumi CLI, for `FERRY_RUNNER=pulumi`.",
    ),
    (
        "runner_url",
        "FERRY_RUNNER_URL",
        "(unset)",
        "Remote runner base URL, for `FERRY_RUNNER=http`.",
    ),
    (
        "runner_token",
        "FERRY_RUNNER_TOKEN",
        "(unset)",
        "Bearer token for the remote runner.",
    ),
    (
        "apply_timeout_minutes",
        "FERRY_APPLY_TIMEOUT_MINUTES",
        "45",
        "Runner timeout per apply, 1 to 1440.",
    ),
    (
        "approval_expiry_minutes",
        "FERRY_APPROVAL_EXPIRY_MINUTES",
        "1440",
        "A run awaiting approval longer is rejected; 0 = never.",
    ),
    (
        "policy_dir",
        "FERRY_POLICY_DIR",
        "(unset)",
        "Folder of Rego policies evaluated with the built-in set.",
    ),
    (
        "artifacts_url",
        "FERRY_ARTIFACTS_URL",
        "(data dir)",
        "Artifact store: unset = `<data dir>/artifacts`, or `s3://`, `az://`, `gs://`.",
    ),
    (
        "vault_addr",
        "FERRY_VAULT_ADDR",
        "(unset)",
        "HashiCorp Vault address for `vault://` secrets.",
    ),
    (
        "vault_token",
        "FERRY_VAULT_TOKEN",
        "(unset)",
        "Vault token.",
    ),
    (
        "baseline_program_development",
        "FERRY_BASELINE_PROGRAM_DEVELOPMENT",
        "(unset)",
        "Default baseline program of the class, `<programRef>@<commit>`.",
    ),
    (
        "baseline_program_test",
        "FERRY_BASELINE_PROGRAM_TEST",
        "(unset)",
        "Same, for test environments.",
    ),
    (
        "baseline_program_staging",
        "FERRY_BASELINE_PROGRAM_STAGING",
        "(unset)",
        "Same, for staging environments.",
    ),
    (
        "baseline_program_production",
        "FERRY_BASELINE_PROGRAM_PRODUCTION",
        "(unset)",
        "Same, for production environments.",
    ),
    (
        "nats_url",
        "NATS_URL",
        "(unset)",
        "NATS server; when set, events are published to JetStream and inbound events consumed.",
    ),
    (
        "nats_stream",
        "FERRY_NATS_STREAM",
        "FERRY_EVENTS",
        "JetStream stream Ferry publishes to.",
    ),
    (
        "workers",
        "FERRY_WORKERS",
        "true",
        "Run the planner and applier here; `false` for API-only instances.",
    ),
    (
        "trusted_sources",
        "FERRY_TRUSTED_SOURCES",
        "(unset: any source)",
        "CloudEvent sources trusted per inbound event: `<event>=<source>[,<source>…]`, `;`-separated; set, an event no entry names is refused.",
    ),
    (
        "idle_in_transaction_timeout_ms",
        "FERRY_IDLE_IN_TRANSACTION_TIMEOUT_MS",
        "60000",
        "Postgres ends Ferry's sessions idle inside a transaction this long, 1000 to 3600000 ms.",
    ),
    (
        "store_acquire_timeout_ms",
        "FERRY_STORE_ACQUIRE_TIMEOUT_MS",
        "10000",
        "How long a request waits for a store connection before answering 503, 100 to 120000 ms.",
    ),
    (
        "sqlite_busy_timeout_ms",
        "FERRY_SQLITE_BUSY_TIMEOUT_MS",
        "15000",
        "How long an SQLite writer waits for the lock before answering 503, 10 to 120000 ms.",
    ),
    (
        "stream_hold_warn_ms",
        "FERRY_STREAM_HOLD_WARN_MS",
        "5000",
        "A transaction holding the event stream back longer is named by `/readyz` and `ferry projections status`, 100 to 3600000 ms.",
    ),
    (
        "worker_lease_seconds",
        "FERRY_WORKER_LEASE_SECONDS",
        "60",
        "A worker's claim on a step without renewal; the owner stops its runner at two thirds of it, 3 to 3600.",
    ),
    (
        "worker_recovery_grace_seconds",
        "FERRY_WORKER_RECOVERY_GRACE_SECONDS",
        "30",
        "Postgres: how long past an apply's lease, its owner's lock free, before it is reported interrupted, 0 to 3600.",
    ),
    (
        "tenant_file_roots",
        "FERRY_TENANT_FILE_ROOTS",
        "<data dir>/tenants/{tenant}",
        "Absolute folders (comma-separated templates; `{tenant}` = the tenant) that a tenant's `file://` secrets and configuration may name.",
    ),
    (
        "tenant_program_roots",
        "FERRY_TENANT_PROGRAM_ROOTS",
        "<data dir>/tenants/{tenant}",
        "Absolute folders (templates) a tenant's local program repositories may be in.",
    ),
    (
        "tenant_env_prefix",
        "FERRY_TENANT_ENV_PREFIX",
        "TENANT_{tenant}",
        "Prefix of the variables a tenant's `env://` secrets may name; `{tenant}` becomes the tenant with `_` `.` `-` `:` written `_5F` `_2E` `_2D` `_3A`, then `__` (tenant `acme`: `TENANT_acme__DB_PASSWORD`).",
    ),
    (
        "tenant_vault_prefix",
        "FERRY_TENANT_VAULT_PREFIX",
        "{tenant}/",
        "Vault path prefix (`mount/path/`) a tenant's `vault://` secrets must start with; empty = any path.",
    ),
    (
        "tenant_program_url_prefixes",
        "FERRY_TENANT_PROGRAM_URL_PREFIXES",
        "(none)",
        "URL prefixes (comma-separated templates) a tenant's remote program repositories must start with (`https://`, `http://`, `ssh://`, `git://`).",
    ),
    (
        "tenant_config_url_prefixes",
        "FERRY_TENANT_CONFIG_URL_PREFIXES",
        "(none)",
        "URL prefixes (templates) a tenant's `http(s)://` configuration must start with.",
    ),
];

struct Layer<'a> {
    source: &'a str,
    by_env_name: bool,
}

impl Layer<'_> {
    fn err(&self, key: &str, env: &str, reason: impl Into<String>) -> ConfigError {
        ConfigError {
            setting: if self.by_env_name { env } else { key }.to_string(),
            source_name: self.source.to_string(),
            reason: reason.into(),
        }
    }
}

fn non_empty(value: String, layer: &Layer, key: &str, env: &str) -> Result<String, ConfigError> {
    if value.trim().is_empty() {
        Err(layer.err(key, env, "must not be empty"))
    } else {
        Ok(value)
    }
}

fn ms_in(
    value: u64,
    min: u64,
    max: u64,
    layer: &Layer,
    key: &str,
    env: &str,
) -> Result<Duration, ConfigError> {
    if (min..=max).contains(&value) {
        Ok(Duration::from_millis(value))
    } else {
        Err(layer.err(
            key,
            env,
            format!("must be between {min} and {max} milliseconds"),
        ))
    }
}

impl Config {
    /// Defaults, then the file (if any), then the environment.
    pub fn load(
        file: Option<&std::path::Path>,
        env: &HashMap<String, String>,
    ) -> Result<Self, ConfigError> {
        let mut config = Self::default();
        let file = file
            .map(std::path::Path::to_path_buf)
            .or_else(|| env.get("FERRY_CONFIG").map(PathBuf::from));
        if let Some(path) = file {
            let source = path.display().to_string();
            let text = std::fs::read_to_string(&path).map_err(|e| ConfigError {
                setting: "FERRY_CONFIG".to_string(),
                source_name: source.clone(),
                reason: format!("cannot read the file: {e}"),
            })?;
            let layer: FileLayer = toml::from_str(&text).map_err(|e| ConfigError {
                setting: "file".to_string(),
                source_name: source.clone(),
                reason: e.message().to_string(),
            })?;
            config.apply_file(layer, &source)?;
            config.config_file = Some(path);
        }
        config.apply_env(env)?;
        config.validate()?;
        Ok(config)
    }

    fn set(
        &mut self,
        key: &str,
        env_name: &str,
        raw: RawValue,
        layer: &Layer,
    ) -> Result<(), ConfigError> {
        let text = |raw: RawValue| match raw {
            RawValue::Text(t) => Ok(t),
            RawValue::Int(i) => Ok(i.to_string()),
            RawValue::List(_) => Err(layer.err(key, env_name, "must be a single value")),
        };
        let int = |raw: RawValue| match raw {
            RawValue::Int(i) => Ok(i),
            RawValue::Text(t) => t
                .trim()
                .parse::<u64>()
                .map_err(|_| layer.err(key, env_name, format!("{t:?} is not a whole number"))),
            RawValue::List(_) => Err(layer.err(key, env_name, "must be a single value")),
        };
        // Comma-separated text or a list; blanks dropped, so "" is the empty list.
        let list = |raw: RawValue| -> Vec<String> {
            let items = match raw {
                RawValue::Text(t) => t.split(',').map(str::to_string).collect(),
                RawValue::Int(i) => vec![i.to_string()],
                RawValue::List(items) => items,
            };
            items
                .into_iter()
                .map(|i| i.trim().to_string())
                .filter(|i| !i.is_empty())
                .collect()
        };
        let template = |value: &str| {
            ferry_domain::confinement::Template::parse(value)
                .map(|_| ())
                .map_err(|e| layer.err(key, env_name, e.to_string()))
        };
        match key {
            "http_addr" => {
                let t = text(raw)?;
                self.http_addr = t.parse().map_err(|_| {
                    layer.err(
                        key,
                        env_name,
                        format!("{t:?} is not a socket address like 127.0.0.1:8080"),
                    )
                })?;
            }
            "data_dir" => {
                self.data_dir = PathBuf::from(non_empty(text(raw)?, layer, key, env_name)?)
            }
            "database_url" => {
                let t = non_empty(text(raw)?, layer, key, env_name)?;
                if !(t.starts_with("postgres://") || t.starts_with("postgresql://")) {
                    return Err(layer.err(
                        key,
                        env_name,
                        "must be a postgres:// or postgresql:// URL",
                    ));
                }
                self.database_url = Some(t);
            }
            "jwt_hs256_key" => {
                let t = text(raw)?;
                if t.len() < 32 {
                    return Err(layer.err(key, env_name, "must be at least 32 bytes"));
                }
                self.jwt_hs256_key = Some(t);
            }
            "jwt_jwks_url" => {
                let t = non_empty(text(raw)?, layer, key, env_name)?;
                if !(t.starts_with("https://") || t.starts_with("http://")) {
                    return Err(layer.err(key, env_name, "must be an http(s) URL"));
                }
                self.jwt_jwks_url = Some(t);
            }
            "jwt_issuer" => self.jwt_issuer = Some(non_empty(text(raw)?, layer, key, env_name)?),
            "jwt_audience" => {
                self.jwt_audience = Some(non_empty(text(raw)?, layer, key, env_name)?)
            }
            "poll_interval_ms" => {
                self.poll_interval = ms_in(int(raw)?, 10, 60_000, layer, key, env_name)?
            }
            "read_your_writes_ms" => {
                self.read_your_writes = ms_in(int(raw)?, 0, 30_000, layer, key, env_name)?;
            }
            "log_format" => {
                self.log_format = match text(raw)?.as_str() {
                    "json" => LogFormat::Json,
                    "pretty" => LogFormat::Pretty,
                    other => {
                        return Err(layer.err(
                            key,
                            env_name,
                            format!("{other:?} is not json or pretty"),
                        ))
                    }
                }
            }
            "log" => {
                let t = non_empty(text(raw)?, layer, key, env_name)?;
                tracing_subscriber::EnvFilter::try_new(&t)
                    .map_err(|e| layer.err(key, env_name, format!("not a log filter: {e}")))?;
                self.log_filter = t;
            }
            "runner" => {
                self.runner = match text(raw)?.as_str() {
                    "simulated" => RunnerKind::Simulated,
                    "pulumi" => RunnerKind::Pulumi,
                    "http" => RunnerKind::Http,
                    other => {
                        return Err(layer.err(
                            key,
                            env_name,
                            format!("{other:?} is not simulated, pulumi or http"),
                        ))
                    }
                }
            }
            "pulumi_bin" => self.pulumi_bin = non_empty(text(raw)?, layer, key, env_name)?,
            "runner_url" | "vault_addr" | "nats_url" => {
                let t = non_empty(text(raw)?, layer, key, env_name)?;
                let schemes: &[&str] = if key == "nats_url" {
                    &["nats://", "tls://"]
                } else {
                    &["http://", "https://"]
                };
                if !schemes.iter().any(|s| t.starts_with(s)) {
                    return Err(layer.err(
                        key,
                        env_name,
                        format!("must start with {}", schemes.join(" or ")),
                    ));
                }
                match key {
                    "runner_url" => self.runner_url = Some(t),
                    "vault_addr" => self.vault_addr = Some(t),
                    _ => self.nats_url = Some(t),
                }
            }
            "runner_token" => {
                self.runner_token = Some(non_empty(text(raw)?, layer, key, env_name)?)
            }
            "vault_token" => self.vault_token = Some(non_empty(text(raw)?, layer, key, env_name)?),
            "apply_timeout_minutes" => {
                let m = int(raw)?;
                if !(1..=1440).contains(&m) {
                    return Err(layer.err(key, env_name, "must be between 1 and 1440 minutes"));
                }
                self.apply_timeout = Duration::from_secs(m * 60);
            }
            "approval_expiry_minutes" => {
                let m = int(raw)?;
                self.approval_expiry = (m > 0).then(|| Duration::from_secs(m.saturating_mul(60)));
            }
            "policy_dir" => {
                self.policy_dir = Some(PathBuf::from(non_empty(text(raw)?, layer, key, env_name)?))
            }
            "artifacts_url" => {
                let t = non_empty(text(raw)?, layer, key, env_name)?;
                if !["s3://", "az://", "gs://", "file://"]
                    .iter()
                    .any(|s| t.starts_with(s))
                {
                    return Err(layer.err(
                        key,
                        env_name,
                        "must be an s3://, az://, gs:// or file:// URL",
                    ));
                }
                self.artifacts_url = Some(t);
            }
            "nats_stream" => {
                let t = non_empty(text(raw)?, layer, key, env_name)?;
                if !t
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                {
                    return Err(layer.err(
                        key,
                        env_name,
                        "may only contain letters, digits, '_' and '-'",
                    ));
                }
                self.nats_stream = t;
            }
            k if k.starts_with("baseline_program_") => {
                let class = match &k["baseline_program_".len()..] {
                    "development" => ferry_domain::EnvironmentClass::Development,
                    "test" => ferry_domain::EnvironmentClass::Test,
                    "staging" => ferry_domain::EnvironmentClass::Staging,
                    _ => ferry_domain::EnvironmentClass::Production,
                };
                let t = text(raw)?;
                let (program, commit) = t
                    .rsplit_once('@')
                    .ok_or_else(|| layer.err(key, env_name, "must be <programRef>@<commit>"))?;
                ferry_domain::ProgramRef::parse(program)
                    .map_err(|e| layer.err(key, env_name, format!("program: {e}")))?;
                ferry_domain::ProgramVersion::parse(commit)
                    .map_err(|e| layer.err(key, env_name, format!("commit: {e}")))?;
                self.baseline_programs.retain(|(c, _, _)| *c != class);
                self.baseline_programs
                    .push((class, program.to_string(), commit.to_string()));
            }
            "trusted_sources" => {
                let t = non_empty(text(raw)?, layer, key, env_name)?;
                self.trusted_sources = ferry_messaging::TrustedSources::parse(&t)
                    .map_err(|e| layer.err(key, env_name, e.to_string()))?;
            }
            "idle_in_transaction_timeout_ms" => {
                self.idle_in_transaction_timeout =
                    ms_in(int(raw)?, 1_000, 3_600_000, layer, key, env_name)?;
            }
            "store_acquire_timeout_ms" => {
                self.store_acquire_timeout = ms_in(int(raw)?, 100, 120_000, layer, key, env_name)?;
            }
            "sqlite_busy_timeout_ms" => {
                self.sqlite_busy_timeout = ms_in(int(raw)?, 10, 120_000, layer, key, env_name)?;
            }
            "stream_hold_warn_ms" => {
                self.stream_hold_warn = ms_in(int(raw)?, 100, 3_600_000, layer, key, env_name)?;
            }
            "worker_lease_seconds" | "worker_recovery_grace_seconds" => {
                let (min, value) = (u64::from(key == "worker_lease_seconds") * 3, int(raw)?);
                if !(min..=3600).contains(&value) {
                    return Err(layer.err(
                        key,
                        env_name,
                        format!("must be between {min} and 3600 seconds"),
                    ));
                }
                if key == "worker_lease_seconds" {
                    self.worker_lease = Duration::from_secs(value);
                } else {
                    self.worker_recovery_grace = Duration::from_secs(value);
                }
            }
            "tenant_file_roots" | "tenant_program_roots" => {
                let roots = list(raw);
                for root in &roots {
                    template(root)?;
                    if !std::path::Path::new(root).is_absolute() {
                        return Err(layer.err(
                            key,
                            env_name,
                            format!("{root:?} must be an absolute path"),
                        ));
                    }
                }
                if key == "tenant_file_roots" {
                    self.tenant_file_roots = Some(roots);
                } else {
                    self.tenant_program_roots = Some(roots);
                }
            }
            "tenant_env_prefix" => {
                let t = non_empty(text(raw)?, layer, key, env_name)?;
                template(&t)?;
                self.tenant_env_prefix = t;
            }
            "tenant_vault_prefix" => {
                let t = text(raw)?.trim().to_string();
                template(&t)?;
                self.tenant_vault_prefix = t;
            }
            "tenant_program_url_prefixes" | "tenant_config_url_prefixes" => {
                let prefixes = list(raw);
                for prefix in &prefixes {
                    template(prefix)?;
                }
                if key == "tenant_program_url_prefixes" {
                    self.tenant_program_url_prefixes = prefixes;
                } else {
                    self.tenant_config_url_prefixes = prefixes;
                }
            }
            "workers" => {
                self.workers = match text(raw)?.as_str() {
                    "true" | "1" | "yes" => true,
                    "false" | "0" | "no" => false,
                    other => {
                        return Err(layer.err(
                            key,
                            env_name,
                            format!("{other:?} is not true or false"),
                        ))
                    }
                }
            }
            _ => return Err(layer.err(key, env_name, "unknown setting")),
        }
        Ok(())
    }

    fn apply_file(&mut self, f: FileLayer, source: &str) -> Result<(), ConfigError> {
        let layer = Layer {
            source,
            by_env_name: false,
        };
        let entries: [(&str, Option<RawValue>); 41] = [
            ("http_addr", f.http_addr.map(RawValue::Text)),
            ("data_dir", f.data_dir.map(RawValue::Text)),
            ("database_url", f.database_url.map(RawValue::Text)),
            ("jwt_hs256_key", f.jwt_hs256_key.map(RawValue::Text)),
            ("jwt_jwks_url", f.jwt_jwks_url.map(RawValue::Text)),
            ("jwt_issuer", f.jwt_issuer.map(RawValue::Text)),
            ("jwt_audience", f.jwt_audience.map(RawValue::Text)),
            ("poll_interval_ms", f.poll_interval_ms.map(RawValue::Int)),
            (
                "read_your_writes_ms",
                f.read_your_writes_ms.map(RawValue::Int),
            ),
            ("log_format", f.log_format.map(RawValue::Text)),
            ("log", f.log.map(RawValue::Text)),
            ("runner", f.runner.map(RawValue::Text)),
            ("pulumi_bin", f.pulumi_bin.map(RawValue::Text)),
            ("runner_url", f.runner_url.map(RawValue::Text)),
            ("runner_token", f.runner_token.map(RawValue::Text)),
            (
                "apply_timeout_minutes",
                f.apply_timeout_minutes.map(RawValue::Int),
            ),
            (
                "approval_expiry_minutes",
                f.approval_expiry_minutes.map(RawValue::Int),
            ),
            ("policy_dir", f.policy_dir.map(RawValue::Text)),
            ("artifacts_url", f.artifacts_url.map(RawValue::Text)),
            ("vault_addr", f.vault_addr.map(RawValue::Text)),
            ("vault_token", f.vault_token.map(RawValue::Text)),
            (
                "baseline_program_development",
                f.baseline_program_development.map(RawValue::Text),
            ),
            (
                "baseline_program_test",
                f.baseline_program_test.map(RawValue::Text),
            ),
            (
                "baseline_program_staging",
                f.baseline_program_staging.map(RawValue::Text),
            ),
            (
                "baseline_program_production",
                f.baseline_program_production.map(RawValue::Text),
            ),
            ("nats_url", f.nats_url.map(RawValue::Text)),
            ("nats_stream", f.nats_stream.map(RawValue::Text)),
            ("workers", f.workers.map(|b| RawValue::Text(b.to_string()))),
            ("trusted_sources", f.trusted_sources.map(RawValue::Text)),
            (
                "idle_in_transaction_timeout_ms",
                f.idle_in_transaction_timeout_ms.map(RawValue::Int),
            ),
            (
                "store_acquire_timeout_ms",
                f.store_acquire_timeout_ms.map(RawValue::Int),
            ),
            (
                "sqlite_busy_timeout_ms",
                f.sqlite_busy_timeout_ms.map(RawValue::Int),
            ),
            (
                "stream_hold_warn_ms",
                f.stream_hold_warn_ms.map(RawValue::Int),
            ),
            (
                "worker_lease_seconds",
                f.worker_lease_seconds.map(RawValue::Int),
            ),
            (
                "worker_recovery_grace_seconds",
                f.worker_recovery_grace_seconds.map(RawValue::Int),
            ),
            (
                "tenant_file_roots",
                f.tenant_file_roots.map(FileList::into_raw),
            ),
            (
                "tenant_program_roots",
                f.tenant_program_roots.map(FileList::into_raw),
            ),
            ("tenant_env_prefix", f.tenant_env_prefix.map(RawValue::Text)),
            (
                "tenant_vault_prefix",
                f.tenant_vault_prefix.map(RawValue::Text),
            ),
            (
                "tenant_program_url_prefixes",
                f.tenant_program_url_prefixes.map(FileList::into_raw),
            ),
            (
                "tenant_config_url_prefixes",
                f.tenant_config_url_prefixes.map(FileList::into_raw),
            ),
        ];
        for (key, value) in entries {
            if let Some(value) = value {
                let env_name = env_name_of(key);
                self.set(key, env_name, value, &layer)?;
            }
        }
        Ok(())
    }

    fn apply_env(&mut self, env: &HashMap<String, String>) -> Result<(), ConfigError> {
        let layer = Layer {
            source: "environment",
            by_env_name: true,
        };
        for (key, env_name, _, _) in SETTINGS {
            if let Some(value) = env.get(*env_name) {
                self.set(key, env_name, RawValue::Text(value.clone()), &layer)?;
            }
        }
        // A misspelt FERRY_ variable would otherwise be ignored in silence.
        for name in env.keys().filter(|k| k.starts_with("FERRY_")) {
            let known = SETTINGS.iter().any(|(_, e, _, _)| e == name)
                || matches!(name.as_str(), "FERRY_CONFIG");
            if !known {
                return Err(ConfigError {
                    setting: name.clone(),
                    source_name: "environment".to_string(),
                    reason: "unknown setting".to_string(),
                });
            }
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.runner == RunnerKind::Http && self.runner_url.is_none() {
            return Err(ConfigError {
                setting: "FERRY_RUNNER_URL".to_string(),
                source_name: "configuration".to_string(),
                reason: "FERRY_RUNNER=http needs FERRY_RUNNER_URL".to_string(),
            });
        }
        if self.jwt_hs256_key.is_some() && self.jwt_jwks_url.is_some() {
            return Err(ConfigError {
                setting: "FERRY_JWT_JWKS_URL".to_string(),
                source_name: "configuration".to_string(),
                reason: "set either FERRY_JWT_HS256_KEY or FERRY_JWT_JWKS_URL, not both"
                    .to_string(),
            });
        }
        self.confinement()?;
        Ok(())
    }

    /// The rules confining each tenant's references, from the `tenant_*` settings, Ferry's
    /// own paths (data dir, configuration file, policy folder, local artifact folder) and
    /// the configured baseline programs (trusted as they are). Ferry's paths are taken as
    /// they really are (relative ones from the current folder, links resolved as far as
    /// the path exists), so the default roots under the data dir are real paths too.
    pub fn confinement(&self) -> Result<Confinement, ConfigError> {
        use ferry_domain::confinement::{ConfinementError, ConfinementSettings, FerryFiles};
        let absolute = |p: &std::path::Path| real_path(p);
        let data_dir = absolute(&self.data_dir);
        let default_roots = || vec![format!("{}/tenants/{{tenant}}", data_dir.display())];
        let artifacts_dir = self
            .artifacts_url
            .as_deref()
            .and_then(|u| u.strip_prefix("file://"))
            .map(|p| absolute(std::path::Path::new(p)));
        let trusted_programs = self
            .baseline_programs
            .iter()
            .filter_map(|(_, program, commit)| {
                Some((
                    ferry_domain::ProgramRef::parse(program.as_str()).ok()?,
                    ferry_domain::ProgramVersion::parse(commit.as_str()).ok()?,
                ))
            })
            .collect();
        let settings = ConfinementSettings {
            ferry: FerryFiles {
                data_dir: data_dir.clone(),
                config_file: self.config_file.as_deref().map(absolute),
                policy_dir: self.policy_dir.as_deref().map(absolute),
                artifacts_dir,
            },
            file_roots: self.tenant_file_roots.clone().unwrap_or_else(default_roots),
            program_roots: self
                .tenant_program_roots
                .clone()
                .unwrap_or_else(default_roots),
            env_prefix: self.tenant_env_prefix.clone(),
            vault_prefix: self.tenant_vault_prefix.clone(),
            program_url_prefixes: self.tenant_program_url_prefixes.clone(),
            config_url_prefixes: self.tenant_config_url_prefixes.clone(),
            trusted_programs,
        };
        Confinement::new(settings).map_err(|e| match e {
            ConfinementError::Setting { setting, reason } => ConfigError {
                setting: setting.env_name().to_string(),
                source_name: "configuration".to_string(),
                reason,
            },
            ConfinementError::RelativeFerryPath { path } => ConfigError {
                setting: "FERRY_DATA_DIR".to_string(),
                source_name: "configuration".to_string(),
                reason: format!("{} must be an absolute path", path.display()),
            },
        })
    }
}

/// `path` made absolute, with its longest existing part resolved (links followed), the
/// rest kept as written.
fn real_path(path: &std::path::Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(real) = std::fs::canonicalize(existing) {
            return rest.iter().rev().fold(real, |p, part| p.join(part));
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                existing = parent;
            }
            _ => return absolute,
        }
    }
}

enum RawValue {
    Text(String),
    Int(u64),
    List(Vec<String>),
}

fn env_name_of(key: &str) -> &'static str {
    SETTINGS
        .iter()
        .find(|(k, _, _, _)| *k == key)
        .map_or("", |(_, e, _, _)| e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn defaults_then_file_then_environment() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ferry.toml");
        std::fs::write(
            &file,
            "http_addr = \"0.0.0.0:9000\"\npoll_interval_ms = 250\n",
        )
        .unwrap();
        let c = Config::load(Some(&file), &env(&[])).unwrap();
        assert_eq!(c.http_addr.to_string(), "0.0.0.0:9000");
        assert_eq!(c.poll_interval, Duration::from_millis(250));
        assert_eq!(c.data_dir, PathBuf::from(".ferry"));
        let c = Config::load(Some(&file), &env(&[("FERRY_HTTP_ADDR", "127.0.0.1:7000")])).unwrap();
        assert_eq!(c.http_addr.to_string(), "127.0.0.1:7000");
        assert_eq!(c.poll_interval, Duration::from_millis(250));
    }

    #[test]
    fn bad_values_name_the_setting() {
        let e = Config::load(None, &env(&[("FERRY_HTTP_ADDR", "nowhere")])).unwrap_err();
        assert_eq!(e.setting, "FERRY_HTTP_ADDR");
        assert!(e.to_string().contains("FERRY_HTTP_ADDR"), "{e}");
        let e = Config::load(None, &env(&[("DATABASE_URL", "mysql://x")])).unwrap_err();
        assert_eq!(e.setting, "DATABASE_URL");
        let e = Config::load(None, &env(&[("FERRY_POLL_INTERVAL_MS", "fast")])).unwrap_err();
        assert_eq!(e.setting, "FERRY_POLL_INTERVAL_MS");
        let e = Config::load(None, &env(&[("FERRY_HTTP_ADRR", "x")])).unwrap_err();
        assert_eq!(
            (e.setting.as_str(), e.reason.as_str()),
            ("FERRY_HTTP_ADRR", "unknown setting")
        );
        let e = Config::load(None, &env(&[("FERRY_JWT_HS256_KEY", "short")])).unwrap_err();
        assert_eq!(e.setting, "FERRY_JWT_HS256_KEY");
        let e = Config::load(None, &env(&[("FERRY_RUNNER", "terraform")])).unwrap_err();
        assert_eq!(e.setting, "FERRY_RUNNER");
        let e = Config::load(None, &env(&[("FERRY_RUNNER", "http")])).unwrap_err();
        assert_eq!(e.setting, "FERRY_RUNNER_URL");
        let e = Config::load(
            None,
            &env(&[("FERRY_BASELINE_PROGRAM_STAGING", "/srv/infra#stg")]),
        )
        .unwrap_err();
        assert_eq!(e.setting, "FERRY_BASELINE_PROGRAM_STAGING");
        let e = Config::load(None, &env(&[("NATS_URL", "http://x")])).unwrap_err();
        assert_eq!(e.setting, "NATS_URL");
        let e =
            Config::load(None, &env(&[("FERRY_TRUSTED_SOURCES", "ApprovalDecided")])).unwrap_err();
        assert_eq!(e.setting, "FERRY_TRUSTED_SOURCES");
        let e = Config::load(None, &env(&[("FERRY_SQLITE_BUSY_TIMEOUT_MS", "0")])).unwrap_err();
        assert_eq!(e.setting, "FERRY_SQLITE_BUSY_TIMEOUT_MS");
        let c = Config::load(
            None,
            &env(&[
                ("FERRY_APPROVAL_EXPIRY_MINUTES", "0"),
                ("FERRY_BASELINE_PROGRAM_STAGING", "/srv/infra#stg@abcdef1"),
            ]),
        )
        .unwrap();
        assert_eq!(c.approval_expiry, None);
        assert_eq!(c.baseline_programs.len(), 1);

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ferry.toml");
        std::fs::write(&file, "read_your_writes_ms = 999999\n").unwrap();
        let e = Config::load(Some(&file), &env(&[])).unwrap_err();
        assert_eq!(e.setting, "read_your_writes_ms");
        assert_eq!(e.source_name, file.display().to_string());
        std::fs::write(&file, "htp_addr = \"x\"\n").unwrap();
        let e = Config::load(Some(&file), &env(&[])).unwrap_err();
        assert!(e.reason.contains("htp_addr"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn ferrys_paths_are_taken_as_they_really_are() {
        let dir = tempfile::tempdir().unwrap();
        let real = std::fs::canonicalize(dir.path()).unwrap();
        std::fs::create_dir(real.join("actual")).unwrap();
        std::os::unix::fs::symlink(real.join("actual"), real.join("link")).unwrap();
        assert_eq!(
            real_path(&real.join("link/data/x")),
            real.join("actual/data/x")
        );
        assert_eq!(real_path(&real.join("link")), real.join("actual"));
        assert_eq!(
            real_path(Path::new("/nonexistent/a")),
            Path::new("/nonexistent/a")
        );
    }

    #[test]
    fn every_confinement_setting_is_listed() {
        for setting in ferry_domain::confinement::Setting::ALL {
            assert!(
                SETTINGS
                    .iter()
                    .any(|(k, e, _, _)| *k == setting.file_key() && *e == setting.env_name()),
                "{setting} is not in SETTINGS"
            );
        }
    }

    #[test]
    fn tenant_settings_default_to_the_data_dir_and_are_validated() {
        let dir = tempfile::tempdir().unwrap();
        let data = std::fs::canonicalize(dir.path()).unwrap().join("data");
        let data_text = data.display().to_string();
        let c = Config::load(None, &env(&[("FERRY_DATA_DIR", &data_text)])).unwrap();
        let rules = c.confinement().unwrap();
        let acme = ferry_domain::TenantId::parse("acme").unwrap();
        use ferry_domain::confinement::RootKind;
        assert_eq!(
            rules.roots(&acme, RootKind::Files),
            [data.join("tenants/acme")]
        );
        assert_eq!(
            rules.roots(&acme, RootKind::Programs),
            [data.join("tenants/acme")]
        );
        assert_eq!(rules.env_prefix(&acme), "TENANT_acme__");
        assert_eq!(rules.vault_prefix(&acme), "acme/");

        // Lists from the environment (comma-separated) and from the file (arrays).
        let c = Config::load(
            None,
            &env(&[
                ("FERRY_DATA_DIR", &data_text),
                ("FERRY_TENANT_FILE_ROOTS", "/srv/t/{tenant}, /srv/shared"),
                (
                    "FERRY_TENANT_PROGRAM_URL_PREFIXES",
                    "https://git.example.com/{tenant}/",
                ),
            ]),
        )
        .unwrap();
        assert_eq!(
            c.tenant_file_roots,
            Some(vec![
                "/srv/t/{tenant}".to_string(),
                "/srv/shared".to_string()
            ])
        );
        assert_eq!(c.tenant_program_url_prefixes.len(), 1);
        let file = dir.path().join("ferry.toml");
        std::fs::write(
            &file,
            "tenant_config_url_prefixes = [\"https://cfg.example.com/{tenant}/\"]\ntenant_env_prefix = \"T_{tenant}\"\n",
        )
        .unwrap();
        let c = Config::load(Some(&file), &env(&[])).unwrap();
        assert_eq!(c.tenant_config_url_prefixes.len(), 1);
        assert_eq!(c.config_file.as_deref(), Some(file.as_path()));

        // A root holding the data dir's keys, a prefix Ferry reserves, a relative root:
        // refused at start, naming the setting.
        for (name, value, reason) in [
            (
                "FERRY_TENANT_FILE_ROOTS",
                dir.path().display().to_string(),
                "token signing key",
            ),
            (
                "FERRY_TENANT_PROGRAM_ROOTS",
                format!("{data_text}/{{tenant}}"),
                "Ferry's",
            ),
            (
                "FERRY_TENANT_FILE_ROOTS",
                "relative/{tenant}".to_string(),
                "absolute",
            ),
            (
                "FERRY_TENANT_ENV_PREFIX",
                "FERRY_{tenant}".to_string(),
                "reserves",
            ),
            (
                "FERRY_TENANT_VAULT_PREFIX",
                "../{tenant}".to_string(),
                "segments",
            ),
            (
                "FERRY_TENANT_CONFIG_URL_PREFIXES",
                "ftp://x/".to_string(),
                "scheme",
            ),
            (
                "FERRY_TENANT_FILE_ROOTS",
                "/srv/{tenant".to_string(),
                "placeholder",
            ),
        ] {
            let e = Config::load(
                None,
                &env(&[("FERRY_DATA_DIR", &data_text), (name, &value)]),
            )
            .unwrap_err();
            assert_eq!(e.setting, name, "{e}");
            assert!(e.reason.contains(reason), "{name}={value}: {e}");
        }
        // The configuration file itself may not be in a root.
        std::fs::write(
            &file,
            format!("tenant_file_roots = [\"{}\"]\n", dir.path().display()),
        )
        .unwrap();
        let e =
            Config::load(Some(&file), &env(&[("FERRY_DATA_DIR", "/elsewhere/data")])).unwrap_err();
        assert_eq!(e.setting, "FERRY_TENANT_FILE_ROOTS");
        assert!(e.reason.contains("configuration file"), "{e}");
    }
}
