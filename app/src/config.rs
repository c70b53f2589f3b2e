//! Configuration, in layers: built-in defaults, then an optional TOML file (`--config` or
//! `FERRY_CONFIG`), then `FERRY_*` environment variables and `DATABASE_URL`/`NATS_URL`.
//! Every value is checked at start; a bad one stops the process with a message naming the
//! setting as the user wrote it (`FERRY_HTTP_ADDR` or `http_addr`) and where it came from.
//!
//! Each setting is declared once, in the `settings!` list below: its file key, its variable
//! (`FERRY_` and the key in upper case unless the declaration names another), its default
//! and its meaning (the doc comment). From that list come the raw settings that figment
//! layers, the variables Ferry knows, [`SETTINGS`] and the configuration table of
//! `docs/configuration.md` ([`markdown_table`]). One validation step then turns the raw
//! settings into a [`Config`], naming a refused value through figment's metadata for the
//! layer that gave it.

use ferry_domain::confinement::Confinement;
use ferry_domain::environment::BaselineProgram;
use ferry_domain::ports::identity::{IdentitySpec, RunnerIdentities, RunnerIdentity};
use figment::providers::{Format, Serialized, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider, Source};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
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
    /// Address the internal gRPC interface listens on; `None` = not served
    /// (`FERRY_GRPC_ADDR=off`).
    pub grpc_addr: Option<SocketAddr>,
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
    /// Each tenant's runner identity, as references (`FERRY_RUNNER_IDENTITIES`).
    pub runner_identities: BTreeMap<ferry_domain::TenantId, IdentitySpec>,
    /// The identity shared by every tenant without one, declared on purpose: the named
    /// variables with their values in the environment `load` was handed
    /// (`FERRY_RUNNER_SHARED_IDENTITY`); `None` = none is shared.
    pub runner_shared_identity: Option<RunnerIdentity>,
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
    pub baseline_programs: Vec<(ferry_domain::EnvironmentClass, BaselineProgram)>,
    /// NATS server; the relay and inbound consumers run when set (`NATS_URL`).
    pub nats_url: Option<String>,
    /// JetStream stream Ferry publishes to (`FERRY_NATS_STREAM`).
    pub nats_stream: String,
    /// Ferry's NATS user and TLS (`FERRY_NATS_CREDS_FILE`, `FERRY_NATS_NKEY_SEED_FILE`,
    /// `FERRY_NATS_USER` and `FERRY_NATS_PASSWORD`, `FERRY_NATS_TOKEN`, `FERRY_NATS_TLS_*`).
    pub nats_auth: ferry_messaging::nats::NatsAuth,
    /// Run the planner and applier in this process (`FERRY_WORKERS`); API-only instances
    /// set it to false.
    pub workers: bool,
    /// CloudEvent sources trusted per inbound event (`FERRY_TRUSTED_SOURCES`), with the
    /// service identities bound to each source (`FERRY_SOURCE_IDENTITIES`); any source from
    /// any service token when both are unset.
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
    /// Events' worth of aggregates kept in memory per aggregate type, so that a command
    /// reads only the events after them; 0 turns the cache off
    /// (`FERRY_AGGREGATE_CACHE_EVENTS`).
    pub aggregate_cache_events: usize,
    /// Bytes a run's checked-out program may hold (`FERRY_MAX_PROGRAM_BYTES`).
    pub max_program_bytes: u64,
    /// Resources one plan may list (`FERRY_MAX_PLAN_RESOURCES`).
    pub max_plan_resources: usize,
    /// Bytes one receipt may take as stored, and one stored log
    /// (`FERRY_MAX_RECEIPT_BYTES`).
    pub max_receipt_bytes: usize,
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
    /// Environment classes in promotion order (`FERRY_PROMOTION_PATH`).
    pub promotion_path: ferry_domain::promotion::gates::PromotionPath,
    /// How long verification watches an applied release (`FERRY_VERIFICATION_WINDOW`).
    pub verification_window: Duration,
    /// Roll back automatically when verification fails
    /// (`FERRY_AUTO_ROLLBACK_ON_VERIFICATION_FAILURE`).
    pub auto_rollback: bool,
    /// The Prometheus HTTP API that environments' SLO queries go to (`FERRY_PROMETHEUS_URL`).
    pub prometheus_url: Option<String>,
    /// The label SLO queries are confined by (`FERRY_PROMETHEUS_TENANT_LABEL`).
    pub prometheus_tenant_label: String,
    /// Reconciliation applies adds and in-place changes outside production
    /// (`FERRY_AUTO_APPLY_NON_DESTRUCTIVE`).
    pub auto_apply_non_destructive: bool,
    /// When the reconciler re-plans every environment, cron syntax in UTC; `None` = only on
    /// demand (`FERRY_RECONCILE_SCHEDULE=off`).
    pub reconcile_schedule: Option<String>,
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
    /// URL prefix templates of health URLs and smoke checks
    /// (`FERRY_TENANT_PROBE_URL_PREFIXES`); `None` = any URL (of a public address).
    pub tenant_probe_url_prefixes: Option<Vec<String>>,
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

/// Declares every setting once and generates from the list: [`RawSettings`] (what figment
/// layers, defaults included), [`SETTINGS`] and the configuration table's rows ([`ROWS`]).
///
/// Each entry is the setting's meaning (its doc comment, the table's last column), its
/// file key and raw type, then, in this order and each optional: `= default` (a literal;
/// without one the setting is unset by default), `env "NAME"` (when its variable is not
/// `FERRY_` and the key in upper case), `shown "text"` (the table's default column when it
/// is not the default in backticks), `row (...)` or `row folded` (when one table row
/// stands for several settings).
macro_rules! settings {
    ($(
        $(#[doc = $doc:literal])+
        $key:ident: $ty:ty $(= $default:literal)?
            $(, env $env:literal)?
            $(, shown $shown:literal)?
            $(, row $row:tt)?
        ;
    )+) => {
        /// Every setting as the defaults, the file and the environment give it, before any
        /// check. An unknown key is refused: a misspelt one would otherwise be ignored.
        #[derive(Debug, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct RawSettings {
            $( $(#[doc = $doc])+ $key: raw_type!($ty $(= $default)?), )+
        }

        impl Default for RawSettings {
            fn default() -> Self {
                Self { $( $key: raw_default!($ty $(= $default)?), )+ }
            }
        }

        /// Every setting: (file key, environment variable, default as the table shows it,
        /// meaning), in the table's order. The configuration table (`docs/configuration.md`)
        /// is generated from it ([`markdown_table`]).
        pub const SETTINGS: &[(&str, &str, &str, &str)] = &[
            $( (
                stringify!($key),
                variable!($key $($env)?),
                shown!($($shown)?; $($default)?),
                concat!($($doc),+).trim_ascii(),
            ), )+
        ];

        /// How each of [`SETTINGS`] shows in the configuration table, in the same order.
        const ROWS: &[Row] = &[ $( row!($($row)?), )+ ];
    };
}

/// A raw setting's type: as declared when it has a default, else optional.
macro_rules! raw_type {
    ($ty:ty = $default:literal) => { $ty };
    ($ty:ty) => { Option<$ty> };
}

/// A raw setting's default: the declared one, else unset.
macro_rules! raw_default {
    ($ty:ty = $default:literal) => {
        <$ty>::from($default)
    };
    ($ty:ty) => {
        None
    };
}

/// A setting's variable: the declared one, else `FERRY_` and the key in upper case (made
/// at compile time, so that [`SETTINGS`] stays a plain constant).
macro_rules! variable {
    ($key:ident $env:literal) => {
        $env
    };
    ($key:ident) => {{
        const NAME: [u8; FERRY_PREFIX.len() + stringify!($key).len()] =
            ferry_variable(stringify!($key));
        match ::core::str::from_utf8(&NAME) {
            Ok(name) => name,
            Err(_) => panic!("a setting's key is ASCII"),
        }
    }};
}

/// A setting's default as the table shows it: as declared, else the default in backticks.
/// A setting with neither does not compile.
macro_rules! shown {
    ($shown:literal; $($default:literal)?) => {
        $shown
    };
    (; $default:literal) => {
        concat!("`", $default, "`")
    };
}

/// A setting's row in the configuration table.
macro_rules! row {
    () => {
        Row::Own
    };
    (folded) => {
        Row::Folded
    };
    (($key:literal, $variable:literal)) => {
        Row::Named($key, $variable)
    };
}

/// The prefix of Ferry's own variables.
const FERRY_PREFIX: &str = "FERRY_";

/// `FERRY_` and `key` in upper case, as bytes (`N` is their length).
const fn ferry_variable<const N: usize>(key: &str) -> [u8; N] {
    let (prefix, key) = (FERRY_PREFIX.as_bytes(), key.as_bytes());
    let mut name = [0u8; N];
    let mut i = 0;
    while i < N {
        name[i] = if i < prefix.len() {
            prefix[i]
        } else {
            key[i - prefix.len()].to_ascii_uppercase()
        };
        i += 1;
    }
    name
}

/// How a setting shows in the configuration table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Row {
    /// A row of its own: its key and its variable.
    Own,
    /// A row with these first two cells, standing for it and the folded settings after it.
    Named(&'static str, &'static str),
    /// No row: the named row before it stands for it.
    Folded,
}

settings! {
    /// Address the HTTP API listens on.
    http_addr: String = "127.0.0.1:8080";
    /// Address the internal gRPC interface (`Provisioning`, `Promotions`, health, reflection)
    /// listens on; `off` = not served.
    grpc_addr: String = "127.0.0.1:50051";
    /// Embedded store (`ferry.db`) and generated signing key.
    data_dir: String = ".ferry", shown "`./.ferry`";
    /// Postgres URL; events and read models live there. Its `sslmode` decides TLS: the
    /// default, `prefer`, encrypts whenever the server offers it, which on one machine costs
    /// both sides CPU for nothing (`?sslmode=disable`; `verify-full` across a network).
    database_url: String, env "DATABASE_URL", shown "unset: SQLite";
    /// HS256 key for bearer tokens, at least 32 bytes.
    jwt_hs256_key: String, shown "generated";
    /// When set, RS256 tokens are verified against this JWKS.
    jwt_jwks_url: String, shown "unset";
    /// Required `iss` claim.
    jwt_issuer: String, shown "unset";
    /// Required `aud` claim.
    jwt_audience: String, shown "unset";
    /// Projection polling fallback (10 to 60000).
    poll_interval_ms: Whole = 500;
    /// How long a command waits for its read model (0 to 30000).
    read_your_writes_ms: Whole = 2000;
    /// `json` or `pretty`; logs go to stderr.
    log_format: String = "json";
    /// Log filter, e.g. `info,ferry_api=debug`.
    log: String = "info";
    /// Run the planner and applier here; `false` for API-only instances.
    workers: Flag = true;
    /// `simulated`, `pulumi` or `http`.
    runner: String = "simulated";
    /// The Pulumi CLI, for `FERRY_RUNNER=pulumi`.
    pulumi_bin: String = "pulumi";
    /// Remote runner base URL, for `FERRY_RUNNER=http` (protocol:
    /// `schemas/runner-protocol.openapi.json`).
    runner_url: String, shown "unset";
    /// Bearer token for the remote runner.
    runner_token: String, shown "unset";
    /// Each tenant's runner identity for `FERRY_RUNNER=pulumi` or `http` (its program gets
    /// this and nothing of Ferry's; see the trust model): JSON in the variable, a table in
    /// the file, mapping a tenant to `{"backend": "s3://state-acme", "passphrase":
    /// "<secret reference>", "env": {"AWS_ACCESS_KEY_ID": "<secret reference>"}}`. Each
    /// reference is resolved in that tenant's own secret scope; two tenants never share a
    /// backend (an `http(s)://` service excepted), a passphrase or a credential. A tenant
    /// without one cannot plan.
    runner_identities: Json, shown "none";
    /// Single-tenant installations only: the server's variables (e.g.
    /// `PULUMI_BACKEND_URL,PULUMI_CONFIG_PASSPHRASE,AWS_PROFILE`) that the program of every
    /// tenant without an identity of its own gets. Ferry's own variables are refused.
    runner_shared_identity: List, shown "unset: none shared";
    /// Runner timeout per apply (`ApplyTimeoutMinutes`), 1 to 1440.
    apply_timeout_minutes: Whole = 45;
    /// A run awaiting approval longer is rejected; `0` = never.
    approval_expiry_minutes: Whole = 1440;
    /// Folder of Rego policies evaluated with the built-in set.
    policy_dir: String, shown "unset";
    /// `file://` folder, or `s3://bucket/prefix`, `az://container/prefix`, `gs://bucket/prefix`
    /// configured by the usual `AWS_*`, `AZURE_*`, `GOOGLE_*` variables.
    artifacts_url: String, shown "`<data dir>/artifacts`";
    /// HashiCorp Vault for `vault://mount/path#key` secrets (KV v2).
    vault_addr: String, shown "unset";
    /// Vault token.
    vault_token: String, shown "unset";
    /// Default baseline program of a class, `<programRef>@<commit>`.
    baseline_program_development: String, shown "unset", row (
        "`baseline_program_<class>`",
        "`FERRY_BASELINE_PROGRAM_DEVELOPMENT`, `_TEST`, `_STAGING`, `_PRODUCTION`"
    );
    /// Default baseline program of test environments.
    baseline_program_test: String, shown "unset", row folded;
    /// Default baseline program of staging environments.
    baseline_program_staging: String, shown "unset", row folded;
    /// Default baseline program of production environments.
    baseline_program_production: String, shown "unset", row folded;
    /// NATS server; when set, the relay publishes every event and the inbound consumers run.
    nats_url: String, env "NATS_URL", shown "unset";
    /// JetStream stream Ferry publishes to.
    nats_stream: String = "FERRY_EVENTS";
    /// Ferry's NATS credentials file (`.creds`: user JWT and nkey seed), checked at start.
    /// Ferry connects as one NATS user: this, an nkey seed, user and password, or a token
    /// (the trust model says which permissions that user and the others need).
    nats_creds_file: String, shown "unset";
    /// File holding Ferry's NATS user nkey seed (`SU…`).
    nats_nkey_seed_file: String, shown "unset";
    /// Ferry's NATS user, with `nats_password`.
    nats_user: String, shown "unset";
    /// The NATS user's password (never logged).
    nats_password: String, shown "unset";
    /// A NATS token (never logged).
    nats_token: String, shown "unset";
    /// PEM file of the authorities NATS's certificate must chain to; TLS is then required.
    nats_tls_ca_file: String, shown "unset";
    /// PEM file of Ferry's client certificate for NATS, with `nats_tls_key_file`; TLS is
    /// then required.
    nats_tls_cert_file: String, shown "unset";
    /// PEM file of the client certificate's key.
    nats_tls_key_file: String, shown "unset";
    /// Refuse a NATS connection without TLS (a `tls://` URL, a CA or a client certificate
    /// require it too).
    nats_tls_required: Flag = false;
    /// CloudEvent sources trusted per inbound event (see the trust model).
    trusted_sources: String, shown "unset: any source";
    /// Service identities (token subjects) allowed to post each CloudEvent source over HTTP,
    /// `<source>=<identity>[,<identity>…]` `;`-separated (see the trust model).
    source_identities: String, shown "unset: any service, unless sources are trusted";
    /// Postgres ends Ferry's sessions idle in a transaction this long (1000 to 3600000).
    idle_in_transaction_timeout_ms: Whole = 60000;
    /// How long a request waits for a store connection before 503 (100 to 120000).
    store_acquire_timeout_ms: Whole = 10000;
    /// How long an SQLite writer waits for the lock before 503 (10 to 120000).
    sqlite_busy_timeout_ms: Whole = 15000;
    /// A worker's claim on a step without renewal; the owner stops its runner at two thirds
    /// of it (3 to 3600).
    worker_lease_seconds: Whole = 60;
    /// Postgres: how long past an apply's lease, its owner's lock free, before another
    /// instance reports it interrupted (0 to 3600).
    worker_recovery_grace_seconds: Whole = 30;
    /// A transaction holding the event stream back longer is named by `/readyz` (100 to
    /// 3600000).
    stream_hold_warn_ms: Whole = 5000;
    /// Events' worth of aggregates each aggregate type keeps in memory, so that a command
    /// reads only the events stored after them; keep it above what the aggregates in use
    /// hold, or they are reloaded in full again and again (0 to 10000000; 0 turns the cache
    /// off).
    aggregate_cache_events: Whole = 1000000;
    /// Bytes a run's checked-out program folder may hold: a larger program's plan fails,
    /// naming this setting, before any runner reads it (1024 to 1073741824).
    max_program_bytes: Whole = 8388608;
    /// Resources one plan may list: a plan with more fails, naming this setting (1 to
    /// 1000000).
    max_plan_resources: Whole = 10000;
    /// Bytes one plan or apply receipt may take as stored (a larger plan fails; an apply's
    /// outputs are left out of its receipt, saying why) and one stored log (cut beyond it)
    /// (1024 to 268435456).
    max_receipt_bytes: Whole = 4194304;
    /// Absolute folders (comma-separated, or a TOML array; `{tenant}` = the tenant) that a
    /// tenant's `file://` secrets and configuration may name. A root that could hold Ferry's
    /// own files stops start-up.
    tenant_file_roots: List, shown "`<data dir>/tenants/{tenant}`";
    /// Absolute folders a tenant's local program repositories may be in.
    tenant_program_roots: List, shown "`<data dir>/tenants/{tenant}`";
    /// Prefix of the variables a tenant's `env://` secrets may name; `{tenant}` becomes the
    /// tenant with `_` `.` `-` `:` written `_5F` `_2E` `_2D` `_3A`, then `__` (tenant `acme`:
    /// `env://TENANT_acme__DB_PASSWORD`).
    tenant_env_prefix: String = "TENANT_{tenant}";
    /// Vault path prefix (`mount/path/`) of a tenant's `vault://` secrets; empty = any path.
    tenant_vault_prefix: String = "{tenant}/";
    /// URL prefixes a tenant's remote program repositories must start with (`https://`,
    /// `http://`, `ssh://`, `git://`), e.g. `https://git.example.com/{tenant}/`.
    tenant_program_url_prefixes: List, shown "none";
    /// URL prefixes a tenant's `http(s)://` configuration must start with.
    tenant_config_url_prefixes: List, shown "none";
    /// URL prefixes the URLs verification probes (environments' health URLs, releases' smoke
    /// checks) must start with, e.g. `https://{tenant}.apps.example.com/`. Set or not, probes
    /// reach only public addresses, except the literal address a prefix's host names
    /// (`http://127.0.0.1:8080/` lets them reach Ferry's own port).
    tenant_probe_url_prefixes: List, shown "unset: any URL of a public address";
    /// Environment classes in promotion order (`PromotionPath`): a release enters a class
    /// only after it completed in the one before.
    promotion_path: List, shown "`development,test,staging,production`";
    /// How long verification watches an applied release before completing it
    /// (`VerificationWindow`), e.g. `15m`, `90s` (1 second to 24 hours). Reloadable, as are
    /// the promotion path and automatic rollback (SIGHUP re-reads the configuration).
    verification_window: String = "15m";
    /// Roll back to the release last completed in the environment when verification fails
    /// (`AutoRollbackOnVerificationFailure`).
    auto_rollback_on_verification_failure: Flag = true;
    /// Prometheus (its base URL, e.g. `http://prometheus:9090`) that verification sends an
    /// environment's SLO query to (`/api/v1/query`). Without it, an SLO cannot be checked
    /// and its verification is held for an Operator.
    prometheus_url: String, shown "unset";
    /// The Prometheus label naming a series' tenant: every selector of an environment's SLO
    /// query gets `<label>="<tenant>"`, and a query naming the label otherwise (another
    /// tenant, `!=`, a regular expression) is refused, so one tenant never reads another's
    /// series from the shared Prometheus.
    prometheus_tenant_label: String = "tenant";
    /// Reconciliation applies adds and in-place changes outside production without a
    /// proposal (`AutoApplyNonDestructive`); off, every difference is a proposal. Reloadable.
    auto_apply_non_destructive: Flag = true;
    /// When the reconciler re-plans every environment's applied specifications, cron syntax
    /// in UTC (five fields); `off` = only on demand.
    reconcile_schedule: String = "0 */4 * * *";
}

/// A whole number: an integer in the file, its digits in a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
struct Whole(u64);

impl From<u64> for Whole {
    fn from(value: u64) -> Self {
        Self(value)
    }
}

impl<'de> Deserialize<'de> for Whole {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Whole;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a whole number")
            }
            fn visit_u64<E: serde::de::Error>(self, value: u64) -> Result<Whole, E> {
                Ok(Whole(value))
            }
            fn visit_i64<E: serde::de::Error>(self, value: i64) -> Result<Whole, E> {
                u64::try_from(value)
                    .map(Whole)
                    .map_err(|_| E::custom(format!("{value} is not a whole number")))
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Whole, E> {
                text.trim()
                    .parse()
                    .map(Whole)
                    .map_err(|_| E::custom(format!("{text:?} is not a whole number")))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// Yes or no: a boolean in the file; `true`, `1`, `yes` or `false`, `0`, `no` in a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
struct Flag(bool);

impl From<bool> for Flag {
    fn from(value: bool) -> Self {
        Self(value)
    }
}

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Flag;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("true or false")
            }
            fn visit_bool<E: serde::de::Error>(self, value: bool) -> Result<Flag, E> {
                Ok(Flag(value))
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Flag, E> {
                match text {
                    "true" | "1" | "yes" => Ok(Flag(true)),
                    "false" | "0" | "no" => Ok(Flag(false)),
                    other => Err(E::custom(format!("{other:?} is not true or false"))),
                }
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// A JSON document: JSON text in a variable, or a table in the file.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
struct Json(serde_json::Value);

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match serde_json::Value::deserialize(deserializer)? {
            serde_json::Value::String(text) => serde_json::from_str(&text)
                .map(Json)
                .map_err(|e| serde::de::Error::custom(format!("not JSON: {e}"))),
            other => Ok(Json(other)),
        }
    }
}

/// A list: an array of strings in the file, or one comma-separated string (a variable's only
/// form). Items are trimmed and blanks dropped, so "" is the empty list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
struct List(Vec<String>);

impl List {
    fn new<I: IntoIterator<Item = S>, S: AsRef<str>>(items: I) -> Self {
        Self(
            items
                .into_iter()
                .map(|item| item.as_ref().trim().to_string())
                .filter(|item| !item.is_empty())
                .collect(),
        )
    }
}

impl<'de> Deserialize<'de> for List {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = List;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array of strings or one comma-separated string")
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<List, E> {
                Ok(List::new(text.split(',')))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<List, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<String>()? {
                    items.push(item);
                }
                Ok(List::new(items))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// The name of the environment layer, as errors give it.
const ENVIRONMENT: &str = "environment";

/// The variable of the setting `key` (its declared one, or `FERRY_` and the key in upper
/// case for a key not declared).
fn variable_of(key: &str) -> String {
    SETTINGS.iter().find(|(k, _, _, _)| *k == key).map_or_else(
        || format!("{FERRY_PREFIX}{}", key.to_ascii_uppercase()),
        |(_, variable, _, _)| variable.to_string(),
    )
}

/// The environment layer: each declared setting's variable, read from the variables `load`
/// is handed (figment's own `Env` reads only the process's environment, and callers and
/// tests decide what Ferry sees). Values stay text, never guessed into numbers or lists:
/// each setting's raw type reads its text.
struct Environment<'a>(&'a HashMap<String, String>);

impl Provider for Environment<'_> {
    fn metadata(&self) -> Metadata {
        // A value from here is named by its variable, e.g. `FERRY_HTTP_ADDR`, `DATABASE_URL`.
        Metadata::named(ENVIRONMENT).interpolater(|_: &Profile, keys: &[&str]| {
            keys.first()
                .map_or_else(String::new, |key| variable_of(key))
        })
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        let values: Dict = SETTINGS
            .iter()
            .filter_map(|(key, variable, _, _)| {
                let value = self.0.get(*variable)?;
                Some((key.to_string(), Value::from(value.clone())))
            })
            .collect();
        Ok(Profile::Default.collect(values))
    }
}

/// The setting `key` as the layer that gave it names it, and that layer: the file by the
/// key and its path, the environment by the variable, the built-in defaults by the key.
fn named_by(metadata: Option<&Metadata>, key: &str) -> (String, String) {
    match metadata {
        Some(md) => match &md.source {
            Some(Source::File(path)) => (key.to_string(), path.display().to_string()),
            Some(Source::Code(_)) => (key.to_string(), "default".to_string()),
            _ => (
                md.interpolate(&Profile::Default, &[key]),
                md.name.to_string(),
            ),
        },
        None => (key.to_string(), "configuration".to_string()),
    }
}

/// A value figment could not read into [`RawSettings`] (wrong type, unknown key, a file
/// that is not TOML), named through the error's path and metadata.
fn unreadable(error: figment::Error) -> ConfigError {
    let Some(key) = error.path.first() else {
        // Not one value but a whole layer: the file is not TOML.
        let (_, source_name) = named_by(error.metadata.as_ref(), "");
        return ConfigError {
            setting: "file".to_string(),
            source_name,
            reason: error.kind.to_string(),
        };
    };
    let (setting, source_name) = named_by(error.metadata.as_ref(), key);
    let reason = match &error.kind {
        figment::error::Kind::UnknownField(name, _) => format!("unknown setting `{name}`"),
        kind => kind.to_string(),
    };
    ConfigError {
        setting,
        source_name,
        reason,
    }
}

/// Refuses a `FERRY_*` variable no setting has: a misspelt one would otherwise be ignored.
fn refuse_unknown_variables(env: &HashMap<String, String>) -> Result<(), ConfigError> {
    let unknown = env
        .keys()
        .filter(|name| name.starts_with(FERRY_PREFIX) && name.as_str() != "FERRY_CONFIG")
        .filter(|name| !SETTINGS.iter().any(|(_, variable, _, _)| variable == name))
        .min();
    match unknown {
        Some(name) => Err(ConfigError {
            setting: name.clone(),
            source_name: ENVIRONMENT.to_string(),
            reason: "unknown setting".to_string(),
        }),
        None => Ok(()),
    }
}

/// `(key, value)` of a raw setting, the key spelt by the compiler from the field.
macro_rules! at {
    ($raw:ident . $key:ident) => {
        (stringify!($key), $raw.$key)
    };
}

/// A raw setting's key and value.
type At<T> = (&'static str, T);

/// The checks of single values; a refused value is named by the layer that gave it.
struct Check<'a>(&'a Figment);

impl Check<'_> {
    fn refuse(&self, key: &str, reason: impl Into<String>) -> ConfigError {
        let (setting, source_name) = named_by(self.0.find_metadata(key), key);
        ConfigError {
            setting,
            source_name,
            reason: reason.into(),
        }
    }

    /// `check` applied to the value when the setting is set.
    fn opt<T, U>(
        &self,
        (key, value): At<Option<T>>,
        check: impl FnOnce(&Self, At<T>) -> Result<U, ConfigError>,
    ) -> Result<Option<U>, ConfigError> {
        value.map(|value| check(self, (key, value))).transpose()
    }

    fn non_empty(&self, (key, value): At<String>) -> Result<String, ConfigError> {
        if value.trim().is_empty() {
            Err(self.refuse(key, "must not be empty"))
        } else {
            Ok(value)
        }
    }

    fn url(&self, at: At<String>, schemes: &[&str], what: &str) -> Result<String, ConfigError> {
        let key = at.0;
        let value = self.non_empty(at)?;
        if schemes.iter().any(|scheme| value.starts_with(scheme)) {
            Ok(value)
        } else {
            Err(self.refuse(key, format!("must be {what}")))
        }
    }

    fn one_of<T: Copy>(
        &self,
        (key, value): At<String>,
        names: &[(&str, T)],
    ) -> Result<T, ConfigError> {
        names
            .iter()
            .find(|(name, _)| *name == value)
            .map(|(_, it)| *it)
            .ok_or_else(|| {
                let names: Vec<&str> = names.iter().map(|(name, _)| *name).collect();
                let (last, others) = names.split_last().unwrap_or((&"", &[]));
                self.refuse(
                    key,
                    format!("{value:?} is not {} or {last}", others.join(", ")),
                )
            })
    }

    fn in_range(
        &self,
        (key, Whole(value)): At<Whole>,
        min: u64,
        max: u64,
        unit: &str,
    ) -> Result<u64, ConfigError> {
        if (min..=max).contains(&value) {
            Ok(value)
        } else {
            Err(self.refuse(key, format!("must be between {min} and {max} {unit}")))
        }
    }

    fn millis(&self, at: At<Whole>, min: u64, max: u64) -> Result<Duration, ConfigError> {
        self.in_range(at, min, max, "milliseconds")
            .map(Duration::from_millis)
    }

    fn seconds(&self, at: At<Whole>, min: u64, max: u64) -> Result<Duration, ConfigError> {
        self.in_range(at, min, max, "seconds")
            .map(Duration::from_secs)
    }

    fn template(&self, key: &str, value: &str) -> Result<(), ConfigError> {
        ferry_domain::confinement::Template::parse(value)
            .map(|_| ())
            .map_err(|e| self.refuse(key, e.to_string()))
    }

    /// Templates of absolute folders.
    fn roots(&self, (key, List(roots)): At<List>) -> Result<Vec<String>, ConfigError> {
        for root in &roots {
            self.template(key, root)?;
            if !Path::new(root).is_absolute() {
                return Err(self.refuse(key, format!("{root:?} must be an absolute path")));
            }
        }
        Ok(roots)
    }

    /// Templates of URL prefixes (their schemes are checked with the confinement rules).
    /// Environment classes, each once, in promotion order.
    fn promotion_path(
        &self,
        (key, List(items)): At<List>,
    ) -> Result<ferry_domain::promotion::gates::PromotionPath, ConfigError> {
        let classes = items
            .iter()
            .map(|item| {
                serde_json::from_value(serde_json::Value::String(item.to_lowercase())).map_err(
                    |_| {
                        self.refuse(
                            key,
                            format!("{item:?} is not an environment class (development, test, staging, production)"),
                        )
                    },
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        ferry_domain::promotion::gates::PromotionPath::parse(classes)
            .map_err(|e| self.refuse(key, e.to_string()))
    }

    fn prefixes(&self, (key, List(prefixes)): At<List>) -> Result<Vec<String>, ConfigError> {
        for prefix in &prefixes {
            self.template(key, prefix)?;
        }
        Ok(prefixes)
    }

    /// A file `check` accepts, read when the settings are.
    fn file<T>(
        &self,
        at: At<String>,
        check: impl FnOnce(&Path) -> Result<T, ferry_messaging::nats::CredentialFileError>,
    ) -> Result<(PathBuf, T), ConfigError> {
        let key = at.0;
        let path = PathBuf::from(self.non_empty(at)?);
        let checked = check(&path).map_err(|e| self.refuse(key, e.to_string()))?;
        Ok((path, checked))
    }

    /// Ferry's NATS identity and TLS: at most one identity, each file readable and of its
    /// kind, a user with its password, a certificate with its key.
    fn nats_auth(&self, raw: RawNatsAuth) -> Result<ferry_messaging::nats::NatsAuth, ConfigError> {
        use ferry_domain::ports::SecretValue;
        use ferry_messaging::nats::{self, NatsAuth, NatsCredentials, NatsTls};
        // A setting that is set, as its layer names it; one that is missing, both ways.
        let named = |key: &str| self.refuse(key, "").setting;
        let missing = |key: &str| format!("{} (file key {key})", variable_of(key));
        let mut identities: Vec<(&str, NatsCredentials)> = Vec::new();
        if let Some((path, ())) =
            self.opt(raw.creds_file, |c, at| c.file(at, nats::check_creds_file))?
        {
            identities.push(("nats_creds_file", NatsCredentials::CredsFile(path)));
        }
        if let Some((file, seed)) = self.opt(raw.nkey_seed_file, |c, at| {
            c.file(at, nats::read_nkey_seed_file)
        })? {
            identities.push((
                "nats_nkey_seed_file",
                NatsCredentials::NkeySeed { file, seed },
            ));
        }
        let user = self.opt(raw.user, Check::non_empty)?;
        let password = self.opt(raw.password, Check::non_empty)?;
        match (user, password) {
            (Some(user), Some(password)) => identities.push((
                "nats_user",
                NatsCredentials::UserPassword {
                    user,
                    password: SecretValue::new(password),
                },
            )),
            (Some(_), None) => {
                let needed = missing("nats_password");
                return Err(self.refuse("nats_user", format!("needs {needed} too")));
            }
            (None, Some(_)) => {
                let needed = missing("nats_user");
                return Err(self.refuse("nats_password", format!("needs {needed} too")));
            }
            (None, None) => {}
        }
        if let Some(token) = self.opt(raw.token, Check::non_empty)? {
            identities.push((
                "nats_token",
                NatsCredentials::Token(SecretValue::new(token)),
            ));
        }
        let mut identities = identities.into_iter();
        let credentials = match (identities.next(), identities.next()) {
            (Some((first, _)), Some((second, _))) => {
                let first = named(first);
                return Err(self.refuse(
                    second,
                    format!("Ferry has one NATS identity: {first} is set too"),
                ));
            }
            (Some((_, credentials)), None) => credentials,
            (None, _) => NatsCredentials::Anonymous,
        };
        let ca_file = self
            .opt(raw.tls_ca_file, |c, at| c.file(at, nats::check_pem_file))?
            .map(|(path, ())| path);
        let cert = self
            .opt(raw.tls_cert_file, |c, at| c.file(at, nats::check_pem_file))?
            .map(|(path, ())| path);
        let key = self
            .opt(raw.tls_key_file, |c, at| c.file(at, nats::check_pem_file))?
            .map(|(path, ())| path);
        let client_certificate = match (cert, key) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            (Some(_), None) => {
                let needed = missing("nats_tls_key_file");
                return Err(self.refuse("nats_tls_cert_file", format!("needs {needed} too")));
            }
            (None, Some(_)) => {
                let needed = missing("nats_tls_cert_file");
                return Err(self.refuse("nats_tls_key_file", format!("needs {needed} too")));
            }
        };
        Ok(NatsAuth {
            credentials,
            tls: NatsTls {
                ca_file,
                client_certificate,
                required: raw.tls_required,
            },
        })
    }

    /// Tenant → `{backend, passphrase?, env?}` (the rules across tenants are checked with
    /// the confinement, [`Config::runner_identities`]).
    fn identities(
        &self,
        (key, Json(doc)): At<Json>,
    ) -> Result<BTreeMap<ferry_domain::TenantId, IdentitySpec>, ConfigError> {
        use ferry_domain::ports::identity::VariableName;
        use ferry_domain::SecretRef;
        /// One tenant's entry as written.
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Entry {
            backend: String,
            #[serde(default)]
            passphrase: Option<String>,
            #[serde(default)]
            env: BTreeMap<String, String>,
        }
        let entries: BTreeMap<String, Entry> = serde_json::from_value(doc).map_err(|e| {
            self.refuse(
                key,
                format!("must map each tenant to {{backend, passphrase, env}}: {e}"),
            )
        })?;
        let mut out = BTreeMap::new();
        for (tenant, entry) in entries {
            let fail = |reason: String| self.refuse(key, format!("tenant {tenant}: {reason}"));
            let id =
                ferry_domain::TenantId::parse(tenant.as_str()).map_err(|e| fail(e.to_string()))?;
            let reference = |raw: String| SecretRef::parse(raw).map_err(|e| fail(e.to_string()));
            let env = entry
                .env
                .into_iter()
                .map(|(name, raw)| {
                    Ok((
                        VariableName::parse(&name).map_err(|e| fail(e.to_string()))?,
                        reference(raw)?,
                    ))
                })
                .collect::<Result<_, ConfigError>>()?;
            out.insert(
                id,
                IdentitySpec {
                    backend: entry.backend,
                    passphrase: entry.passphrase.map(reference).transpose()?,
                    env,
                },
            );
        }
        Ok(out)
    }

    /// `<programRef>@<commit>`.
    fn baseline(
        &self,
        class: ferry_domain::EnvironmentClass,
        (key, value): At<String>,
    ) -> Result<(ferry_domain::EnvironmentClass, BaselineProgram), ConfigError> {
        let (program, commit) = value
            .rsplit_once('@')
            .ok_or_else(|| self.refuse(key, "must be <programRef>@<commit>"))?;
        let program_ref = ferry_domain::ProgramRef::parse(program)
            .map_err(|e| self.refuse(key, format!("program: {e}")))?;
        let program_version = ferry_domain::ProgramVersion::parse(commit)
            .map_err(|e| self.refuse(key, format!("commit: {e}")))?;
        Ok((
            class,
            BaselineProgram {
                program_ref,
                program_version,
            },
        ))
    }
}

/// The NATS identity and TLS settings, as [`Check::nats_auth`] takes them.
struct RawNatsAuth {
    creds_file: At<Option<String>>,
    nkey_seed_file: At<Option<String>>,
    user: At<Option<String>>,
    password: At<Option<String>>,
    token: At<Option<String>>,
    tls_ca_file: At<Option<String>>,
    tls_cert_file: At<Option<String>>,
    tls_key_file: At<Option<String>>,
    tls_required: bool,
}

/// The URL schemes of HTTP endpoints.
const HTTP: &[&str] = &["http://", "https://"];

/// The one validation step: every raw setting checked and made into a [`Config`] (without
/// the checks across settings, see [`Config::check_combinations`]).
///
/// The fields are checked in the order written (the NATS identity first), so the first
/// refusal named is always the same one.
fn convert(
    raw: RawSettings,
    layers: &Figment,
    env: &HashMap<String, String>,
) -> Result<Config, ConfigError> {
    use ferry_domain::EnvironmentClass as Class;
    let c = Check(layers);
    let nats_auth = c.nats_auth(RawNatsAuth {
        creds_file: at!(raw.nats_creds_file),
        nkey_seed_file: at!(raw.nats_nkey_seed_file),
        user: at!(raw.nats_user),
        password: at!(raw.nats_password),
        token: at!(raw.nats_token),
        tls_ca_file: at!(raw.nats_tls_ca_file),
        tls_cert_file: at!(raw.nats_tls_cert_file),
        tls_key_file: at!(raw.nats_tls_key_file),
        tls_required: raw.nats_tls_required.0,
    })?;
    let baselines = [
        (Class::Development, at!(raw.baseline_program_development)),
        (Class::Test, at!(raw.baseline_program_test)),
        (Class::Staging, at!(raw.baseline_program_staging)),
        (Class::Production, at!(raw.baseline_program_production)),
    ];
    Ok(Config {
        http_addr: c.socket_addr(at!(raw.http_addr), "127.0.0.1:8080")?,
        grpc_addr: c.grpc_addr(at!(raw.grpc_addr))?,
        data_dir: PathBuf::from(c.non_empty(at!(raw.data_dir))?),
        database_url: c.opt(at!(raw.database_url), Check::database_url)?,
        jwt_hs256_key: c.opt(at!(raw.jwt_hs256_key), Check::signing_key)?,
        jwt_jwks_url: c.opt(at!(raw.jwt_jwks_url), Check::jwks_url)?,
        jwt_issuer: c.opt(at!(raw.jwt_issuer), Check::non_empty)?,
        jwt_audience: c.opt(at!(raw.jwt_audience), Check::non_empty)?,
        poll_interval: c.millis(at!(raw.poll_interval_ms), 10, 60_000)?,
        read_your_writes: c.millis(at!(raw.read_your_writes_ms), 0, 30_000)?,
        log_format: c.one_of(
            at!(raw.log_format),
            &[("json", LogFormat::Json), ("pretty", LogFormat::Pretty)],
        )?,
        log_filter: c.log_filter(at!(raw.log))?,
        runner: c.one_of(
            at!(raw.runner),
            &[
                ("simulated", RunnerKind::Simulated),
                ("pulumi", RunnerKind::Pulumi),
                ("http", RunnerKind::Http),
            ],
        )?,
        pulumi_bin: c.non_empty(at!(raw.pulumi_bin))?,
        runner_url: c.opt(at!(raw.runner_url), Check::http_url)?,
        runner_token: c.opt(at!(raw.runner_token), Check::non_empty)?,
        runner_identities: c
            .opt(at!(raw.runner_identities), Check::identities)?
            .unwrap_or_default(),
        runner_shared_identity: c.opt(at!(raw.runner_shared_identity), |c, at| {
            c.shared_identity(at, env)
        })?,
        apply_timeout: Duration::from_secs(
            c.in_range(at!(raw.apply_timeout_minutes), 1, 1440, "minutes")? * 60,
        ),
        approval_expiry: approval_expiry(raw.approval_expiry_minutes),
        policy_dir: c
            .opt(at!(raw.policy_dir), Check::non_empty)?
            .map(PathBuf::from),
        artifacts_url: c.opt(at!(raw.artifacts_url), Check::artifacts_url)?,
        vault_addr: c.opt(at!(raw.vault_addr), Check::http_url)?,
        vault_token: c.opt(at!(raw.vault_token), Check::non_empty)?,
        baseline_programs: baselines
            .into_iter()
            .filter_map(|(class, (key, value))| Some(c.baseline(class, (key, value?))))
            .collect::<Result<_, _>>()?,
        nats_url: c.opt(at!(raw.nats_url), Check::nats_url)?,
        nats_stream: c.nats_stream(at!(raw.nats_stream))?,
        nats_auth,
        workers: raw.workers.0,
        trusted_sources: c.trusted_sources(at!(raw.trusted_sources), at!(raw.source_identities))?,
        idle_in_transaction_timeout: c.millis(
            at!(raw.idle_in_transaction_timeout_ms),
            1_000,
            3_600_000,
        )?,
        store_acquire_timeout: c.millis(at!(raw.store_acquire_timeout_ms), 100, 120_000)?,
        sqlite_busy_timeout: c.millis(at!(raw.sqlite_busy_timeout_ms), 10, 120_000)?,
        stream_hold_warn: c.millis(at!(raw.stream_hold_warn_ms), 100, 3_600_000)?,
        aggregate_cache_events: c.count(
            at!(raw.aggregate_cache_events),
            0,
            10_000_000,
            "events",
        )?,
        max_program_bytes: c.in_range(at!(raw.max_program_bytes), 1024, 1 << 30, "bytes")?,
        max_plan_resources: c.count(at!(raw.max_plan_resources), 1, 1_000_000, "resources")?,
        max_receipt_bytes: c.count(at!(raw.max_receipt_bytes), 1024, 1 << 28, "bytes")?,
        worker_lease: c.seconds(at!(raw.worker_lease_seconds), 3, 3600)?,
        worker_recovery_grace: c.seconds(at!(raw.worker_recovery_grace_seconds), 0, 3600)?,
        tenant_file_roots: c.opt(at!(raw.tenant_file_roots), Check::roots)?,
        tenant_program_roots: c.opt(at!(raw.tenant_program_roots), Check::roots)?,
        tenant_env_prefix: c.env_prefix(at!(raw.tenant_env_prefix))?,
        tenant_vault_prefix: c.vault_prefix(at!(raw.tenant_vault_prefix))?,
        tenant_program_url_prefixes: c
            .opt(at!(raw.tenant_program_url_prefixes), Check::prefixes)?
            .unwrap_or_default(),
        tenant_probe_url_prefixes: c.opt(at!(raw.tenant_probe_url_prefixes), Check::prefixes)?,
        tenant_config_url_prefixes: c
            .opt(at!(raw.tenant_config_url_prefixes), Check::prefixes)?
            .unwrap_or_default(),
        promotion_path: c
            .opt(at!(raw.promotion_path), Check::promotion_path)?
            .unwrap_or_default(),
        auto_rollback: raw.auto_rollback_on_verification_failure.0,
        auto_apply_non_destructive: raw.auto_apply_non_destructive.0,
        reconcile_schedule: c.reconcile_schedule(at!(raw.reconcile_schedule))?,
        prometheus_url: c.opt(at!(raw.prometheus_url), Check::http_url)?,
        prometheus_tenant_label: c.label_name(at!(raw.prometheus_tenant_label))?,
        verification_window: c.verification_window(at!(raw.verification_window))?,
        config_file: None,
    })
}

/// `FERRY_APPROVAL_EXPIRY_MINUTES`: 0 = never.
fn approval_expiry(Whole(minutes): Whole) -> Option<Duration> {
    (minutes > 0).then(|| Duration::from_secs(minutes.saturating_mul(60)))
}

/// The checks of single values that take more than a line in [`convert`].
impl Check<'_> {
    fn database_url(&self, at: At<String>) -> Result<String, ConfigError> {
        self.url(
            at,
            &["postgres://", "postgresql://"],
            "a postgres:// or postgresql:// URL",
        )
    }

    fn jwks_url(&self, at: At<String>) -> Result<String, ConfigError> {
        self.url(at, HTTP, "an http(s) URL")
    }

    fn artifacts_url(&self, at: At<String>) -> Result<String, ConfigError> {
        self.url(
            at,
            &["s3://", "az://", "gs://", "file://"],
            "an s3://, az://, gs:// or file:// URL",
        )
    }

    fn nats_url(&self, at: At<String>) -> Result<String, ConfigError> {
        self.url(
            at,
            &["nats://", "tls://"],
            "a URL starting with nats:// or tls://",
        )
    }

    /// The shared identity: the named variables with their values in `env`.
    fn shared_identity(
        &self,
        (key, names): At<List>,
        env: &HashMap<String, String>,
    ) -> Result<RunnerIdentity, ConfigError> {
        RunnerIdentity::shared(&names.0, |name| env.get(name).cloned())
            .map_err(|e| self.refuse(key, e.reason))
    }

    /// The `env://` prefix template: never empty.
    fn env_prefix(&self, (key, prefix): At<String>) -> Result<String, ConfigError> {
        let prefix = self.non_empty((key, prefix))?;
        self.template(key, &prefix)?;
        Ok(prefix)
    }

    /// The Vault prefix template (empty = any path).
    fn vault_prefix(&self, (key, prefix): At<String>) -> Result<String, ConfigError> {
        let prefix = prefix.trim().to_string();
        self.template(key, &prefix)?;
        Ok(prefix)
    }

    /// A socket address (`example` shows one in the refusal).
    fn socket_addr(
        &self,
        (key, text): At<String>,
        example: &str,
    ) -> Result<SocketAddr, ConfigError> {
        text.parse().map_err(|_| {
            self.refuse(
                key,
                format!("{text:?} is not a socket address like {example}"),
            )
        })
    }

    /// The gRPC address, or `off`.
    fn grpc_addr(&self, (key, text): At<String>) -> Result<Option<SocketAddr>, ConfigError> {
        match text.trim() {
            "off" => Ok(None),
            addr => addr.parse().map(Some).map_err(|_| {
                self.refuse(
                    key,
                    format!("{addr:?} is not a socket address like 127.0.0.1:50051, or off"),
                )
            }),
        }
    }

    /// An HS256 key: at least 32 bytes.
    fn signing_key(&self, (key, value): At<String>) -> Result<String, ConfigError> {
        if value.len() < 32 {
            Err(self.refuse(key, "must be at least 32 bytes"))
        } else {
            Ok(value)
        }
    }

    fn http_url(&self, at: At<String>) -> Result<String, ConfigError> {
        self.url(at, HTTP, "a URL starting with http:// or https://")
    }

    /// A `tracing` filter.
    fn log_filter(&self, (key, filter): At<String>) -> Result<String, ConfigError> {
        let filter = self.non_empty((key, filter))?;
        tracing_subscriber::EnvFilter::try_new(&filter)
            .map_err(|e| self.refuse(key, format!("not a log filter: {e}")))?;
        Ok(filter)
    }

    /// A JetStream stream name.
    fn nats_stream(&self, (key, stream): At<String>) -> Result<String, ConfigError> {
        let stream = self.non_empty((key, stream))?;
        if !stream
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == '-')
        {
            return Err(self.refuse(key, "may only contain letters, digits, '_' and '-'"));
        }
        Ok(stream)
    }

    /// The trusted sources (any when unset) with the identities bound to them.
    fn trusted_sources(
        &self,
        sources: At<Option<String>>,
        identities: At<Option<String>>,
    ) -> Result<ferry_messaging::TrustedSources, ConfigError> {
        let sources = self
            .opt(sources, |c, (key, sources)| {
                let sources = c.non_empty((key, sources))?;
                ferry_messaging::TrustedSources::parse(&sources)
                    .map_err(|e| c.refuse(key, e.to_string()))
            })?
            .unwrap_or_else(ferry_messaging::TrustedSources::any);
        let identities = self
            .opt(identities, |c, (key, bindings)| {
                let bindings = c.non_empty((key, bindings))?;
                ferry_messaging::SourceIdentities::parse(&bindings)
                    .map_err(|e| c.refuse(key, e.to_string()))
            })?
            .unwrap_or_default();
        Ok(sources.with_identities(identities))
    }

    /// A number in range that sizes something in memory.
    fn count(&self, at: At<Whole>, min: u64, max: u64, unit: &str) -> Result<usize, ConfigError> {
        let key = at.0;
        let n = self.in_range(at, min, max, unit)?;
        usize::try_from(n).map_err(|_| self.refuse(key, "too large for this machine"))
    }

    /// Cron syntax, or `off`.
    fn reconcile_schedule(
        &self,
        (key, pattern): At<String>,
    ) -> Result<Option<String>, ConfigError> {
        let pattern = pattern.trim().to_string();
        if pattern == "off" {
            return Ok(None);
        }
        crate::contexts::provisioning::reconcile::Schedule::parse(&pattern).map_err(|e| {
            self.refuse(
                key,
                format!("must be cron syntax (e.g. `0 */4 * * *`) or `off`: {e}"),
            )
        })?;
        Ok(Some(pattern))
    }

    /// A Prometheus label name.
    fn label_name(&self, (key, label): At<String>) -> Result<String, ConfigError> {
        let label = label.trim().to_string();
        if !ferry_domain::confinement::promql::is_label_name(&label) {
            return Err(self.refuse(
                key,
                "must be a Prometheus label name (letters, digits, `_`; not starting with a digit or `__`)",
            ));
        }
        Ok(label)
    }

    /// A duration from 1s to 24h.
    fn verification_window(&self, (key, text): At<String>) -> Result<Duration, ConfigError> {
        let window = humantime::parse_duration(text.trim())
            .map_err(|e| self.refuse(key, format!("not a duration like 15m or 90s: {e}")))?;
        if window < Duration::from_secs(1) || window > Duration::from_secs(24 * 60 * 60) {
            return Err(self.refuse(key, "must be from 1s to 24h"));
        }
        Ok(window)
    }
}

/// The built-in defaults, the first layer.
fn defaults() -> Figment {
    Figment::from(Serialized::defaults(RawSettings::default()))
}

impl Default for Config {
    /// The declared defaults.
    fn default() -> Self {
        // They pass every check (a test loads them): a refusal here is a mistake in the
        // declarations above, not something a user can cause.
        convert(RawSettings::default(), &defaults(), &HashMap::new())
            .unwrap_or_else(|e| panic!("a declared default is refused: {e}"))
    }
}

/// Where the configuration table of `docs/configuration.md` starts; [`markdown_table`] follows.
pub const TABLE_START: &str = "<!-- config-table -->";
/// Where the configuration table of `docs/configuration.md` ends.
pub const TABLE_END: &str = "<!-- /config-table -->";

/// The configuration table (Markdown, one line per row), from [`SETTINGS`].
pub fn markdown_table() -> String {
    let rows: String = SETTINGS
        .iter()
        .zip(ROWS)
        .filter_map(|((key, variable, default, meaning), row)| {
            let (key, variable) = match row {
                Row::Own => (format!("`{key}`"), format!("`{variable}`")),
                Row::Named(key, variable) => (key.to_string(), variable.to_string()),
                Row::Folded => return None,
            };
            Some(format!("| {key} | {variable} | {default} | {meaning} |\n"))
        })
        .collect();
    format!("| File key | Variable | Default | |\n|---|---|---|---|\n{rows}")
}

/// `readme` with the text between [`TABLE_START`] and [`TABLE_END`] replaced by
/// [`markdown_table`]; `None` when it lacks the markers.
pub fn with_markdown_table(readme: &str) -> Option<String> {
    let start = readme.find(TABLE_START)? + TABLE_START.len();
    let end = start + readme[start..].find(TABLE_END)?;
    Some(format!(
        "{}\n{}{}",
        &readme[..start],
        markdown_table(),
        &readme[end..]
    ))
}

/// The settings a running process takes up on reload (SIGHUP) without a restart.
#[derive(Debug, Clone, PartialEq)]
pub struct Reloadable {
    /// `FERRY_PROMOTION_PATH`.
    pub promotion_path: ferry_domain::promotion::gates::PromotionPath,
    /// `FERRY_VERIFICATION_WINDOW`.
    pub verification_window: Duration,
    /// `FERRY_AUTO_ROLLBACK_ON_VERIFICATION_FAILURE`.
    pub auto_rollback: bool,
    /// `FERRY_AUTO_APPLY_NON_DESTRUCTIVE`.
    pub auto_apply_non_destructive: bool,
}

impl Config {
    /// The reloadable settings.
    pub fn reloadable(&self) -> Reloadable {
        Reloadable {
            promotion_path: self.promotion_path.clone(),
            verification_window: self.verification_window,
            auto_rollback: self.auto_rollback,
            auto_apply_non_destructive: self.auto_apply_non_destructive,
        }
    }

    /// True when `newer` differs from this configuration in a setting that is not
    /// reloadable (it takes effect only at the next start).
    pub fn needs_restart_for(&self, newer: &Config) -> bool {
        let mut same = newer.clone();
        same.promotion_path = self.promotion_path.clone();
        same.verification_window = self.verification_window;
        same.auto_rollback = self.auto_rollback;
        same.auto_apply_non_destructive = self.auto_apply_non_destructive;
        same != *self
    }

    /// Defaults, then the file (if any: `file`, else `FERRY_CONFIG`), then the environment.
    pub fn load(file: Option<&Path>, env: &HashMap<String, String>) -> Result<Self, ConfigError> {
        refuse_unknown_variables(env)?;
        let file = file
            .map(Path::to_path_buf)
            .or_else(|| env.get("FERRY_CONFIG").map(PathBuf::from));
        let mut layers = defaults();
        if let Some(path) = &file {
            // figment would tell a missing file like a malformed one; say which it is.
            std::fs::read_to_string(path).map_err(|e| ConfigError {
                setting: "FERRY_CONFIG".to_string(),
                source_name: path.display().to_string(),
                reason: format!("cannot read the file: {e}"),
            })?;
            // `file_exact`: a relative path is not looked for in the parent folders.
            layers = layers.merge(Toml::file_exact(path));
        }
        let layers = layers.merge(Environment(env));
        let raw: RawSettings = layers.extract().map_err(unreadable)?;
        let mut config = convert(raw, &layers, env)?;
        config.config_file = file;
        config.check_combinations()?;
        config.confinement()?;
        config.runner_identities()?;
        Ok(config)
    }

    /// Ferry's NATS credential, key and certificate files, as they really are: a tenant
    /// that read them could publish as Ferry.
    fn nats_secret_files(&self) -> Vec<(PathBuf, &'static str)> {
        use ferry_messaging::nats::NatsCredentials;
        let auth = &self.nats_auth;
        let credentials = match &auth.credentials {
            NatsCredentials::CredsFile(path) => Some((path.clone(), "NATS credentials")),
            NatsCredentials::NkeySeed { file, .. } => Some((file.clone(), "NATS nkey seed")),
            _ => None,
        };
        let (cert, key) = auth.tls.client_certificate.clone().unzip();
        [
            credentials,
            key.map(|path| (path, "NATS client key")),
            cert.map(|path| (path, "NATS client certificate")),
        ]
        .into_iter()
        .flatten()
        .map(|(path, what)| (real_path(&path), what))
        .collect()
    }

    /// The checks across settings.
    fn check_combinations(&self) -> Result<(), ConfigError> {
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
        Ok(())
    }

    /// Each tenant's runner identity and the shared one, checked against the confinement
    /// (references in each tenant's own scope, nothing shared between tenants).
    pub fn runner_identities(&self) -> Result<RunnerIdentities, ConfigError> {
        RunnerIdentities::new(
            self.runner_identities.clone(),
            self.runner_shared_identity.clone(),
            &self.confinement()?,
        )
        .map_err(|e| ConfigError {
            setting: e.setting.to_string(),
            source_name: "configuration".to_string(),
            reason: e.reason,
        })
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
            .map(|(_, b)| (b.program_ref.clone(), b.program_version.clone()))
            .collect();
        let settings = ConfinementSettings {
            ferry: FerryFiles {
                data_dir: data_dir.clone(),
                config_file: self.config_file.as_deref().map(absolute),
                policy_dir: self.policy_dir.as_deref().map(absolute),
                artifacts_dir,
                secret_files: self.nats_secret_files(),
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
            probe_url_prefixes: self.tenant_probe_url_prefixes.clone(),
            trusted_programs,
        };
        let rules = Confinement::new(settings).map_err(|e| match e {
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
        })?;
        rules
            .with_metric_tenant_label(&self.prometheus_tenant_label)
            .ok_or_else(|| ConfigError {
                setting: "FERRY_PROMETHEUS_TENANT_LABEL".to_string(),
                source_name: "configuration".to_string(),
                reason: "must be a Prometheus label name".to_string(),
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

    /// Runner identities: JSON in the variable or a table in the file; references in each
    /// tenant's own scope; nothing shared between tenants; the shared identity only as
    /// declared, never with Ferry's own variables.
    #[test]
    fn runner_identities_are_per_tenant_and_the_shared_one_is_declared() {
        let acme = r#""acme": {"backend": "s3://state-acme", "passphrase": "vault://acme/pulumi#passphrase", "env": {"AWS_ACCESS_KEY_ID": "env://TENANT_acme__AWS_KEY"}}"#;
        let c = Config::load(
            None,
            &env(&[("FERRY_RUNNER_IDENTITIES", &format!("{{{acme}}}"))]),
        )
        .unwrap();
        let tenant = ferry_domain::TenantId::parse("acme").unwrap();
        assert_eq!(c.runner_identities[&tenant].backend, "s3://state-acme");
        assert_eq!(c.runner_shared_identity, None);
        assert!(!c.runner_identities().unwrap().has_shared());
        assert!(Config::default().runner_identities.is_empty());

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ferry.toml");
        std::fs::write(
            &file,
            "[runner_identities.globex]\nbackend = \"s3://state-globex\"\nenv = { AWS_SECRET_ACCESS_KEY = \"vault://globex/aws#secret\" }\n",
        )
        .unwrap();
        let c = Config::load(Some(&file), &env(&[])).unwrap();
        let globex = ferry_domain::TenantId::parse("globex").unwrap();
        assert_eq!(c.runner_identities[&globex].env.len(), 1);

        let refused = |value: String, why: &str| {
            let e = Config::load(None, &env(&[("FERRY_RUNNER_IDENTITIES", &value)])).unwrap_err();
            assert_eq!(e.setting, "FERRY_RUNNER_IDENTITIES", "{why}: {e}");
            e.reason
        };
        refused("not json".into(), "not JSON");
        refused(
            r#"{"acme": {"backend": "s3://a", "token": "x"}}"#.into(),
            "unknown field",
        );
        refused(
            r#"{"acme": {"backend": "s3://a", "env": {"FERRY_VAULT_TOKEN": "vault://acme/x#y"}}}"#
                .into(),
            "Ferry's own variable",
        );
        refused(
            r#"{"acme": {"backend": "s3://a", "env": {"HOME": "vault://acme/x#y"}}}"#.into(),
            "a variable the runner sets",
        );
        let reason = refused(
            r#"{"acme": {"backend": "s3://a", "passphrase": "vault://globex/p#p"}}"#.into(),
            "another tenant's scope",
        );
        assert!(reason.contains("tenant acme"), "{reason}");
        let reason = refused(
            format!(r#"{{{acme}, "globex": {{"backend": "s3://state-acme"}}}}"#),
            "a shared backend",
        );
        assert!(reason.contains("share the backend"), "{reason}");

        let server = [
            (
                "FERRY_RUNNER_SHARED_IDENTITY",
                "PULUMI_BACKEND_URL, AWS_PROFILE",
            ),
            ("PULUMI_BACKEND_URL", "file:///srv/state"),
            ("AWS_PROFILE", "ops"),
            ("AWS_SECRET_ACCESS_KEY", "not-shared"),
        ];
        let c = Config::load(None, &env(&server)).unwrap();
        let shared = c.runner_shared_identity.clone().unwrap();
        let names: Vec<&str> = shared.vars().keys().map(String::as_str).collect();
        assert_eq!(names, ["AWS_PROFILE", "PULUMI_BACKEND_URL"]);
        assert!(c.runner_identities().unwrap().has_shared());
        for bad in ["FERRY_VAULT_TOKEN", "DATABASE_URL", "NATS_URL", "PATH"] {
            let e = Config::load(None, &env(&[("FERRY_RUNNER_SHARED_IDENTITY", bad)])).unwrap_err();
            assert_eq!(e.setting, "FERRY_RUNNER_SHARED_IDENTITY", "{bad}");
        }
    }

    #[test]
    fn the_promotion_path_is_classes_in_order_each_once() {
        use ferry_domain::EnvironmentClass as C;
        let c = Config::load(None, &env(&[])).unwrap();
        assert_eq!(
            c.promotion_path.classes(),
            [C::Development, C::Test, C::Staging, C::Production]
        );
        let c = Config::load(
            None,
            &env(&[("FERRY_PROMOTION_PATH", "development, Production")]),
        )
        .unwrap();
        assert_eq!(c.promotion_path.classes(), [C::Development, C::Production]);
        let e = Config::load(None, &env(&[("FERRY_PROMOTION_PATH", "dev,prod")])).unwrap_err();
        assert_eq!(e.setting, "FERRY_PROMOTION_PATH");
        assert!(
            e.reason.contains("\"dev\" is not an environment class"),
            "{e}"
        );
        let e = Config::load(None, &env(&[("FERRY_PROMOTION_PATH", "test,test")])).unwrap_err();
        assert_eq!(
            (e.setting.as_str(), e.reason.as_str()),
            ("FERRY_PROMOTION_PATH", "names Test twice")
        );
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
        let e = Config::load(
            None,
            &env(&[("FERRY_SOURCE_IDENTITIES", "urn:runcontrol=svc\u{200B}")]),
        )
        .unwrap_err();
        assert_eq!(e.setting, "FERRY_SOURCE_IDENTITIES");
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

    #[test]
    fn a_bad_value_in_the_file_is_named_by_its_key_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ferry.toml");
        let source = file.display().to_string();
        for (text, setting, reason) in [
            ("http_addr = \"nowhere\"\n", "http_addr", "socket address"),
            // Wrong types are figment's to refuse, named by its error's path.
            ("http_addr = 8080\n", "http_addr", "string"),
            (
                "poll_interval_ms = -5\n",
                "poll_interval_ms",
                "whole number",
            ),
            ("workers = \"maybe\"\n", "workers", "true or false"),
            (
                "tenant_file_roots = [\"/srv/a\", 7]\n",
                "tenant_file_roots",
                "string",
            ),
            (
                "worker_lease_seconds = 1\n",
                "worker_lease_seconds",
                "between 3 and 3600",
            ),
            ("log_format = \"xml\"\n", "log_format", "json or pretty"),
            ("htp_addr = \"x\"\n", "htp_addr", "unknown setting"),
        ] {
            std::fs::write(&file, text).unwrap();
            let e = Config::load(Some(&file), &env(&[])).unwrap_err();
            assert_eq!(
                (e.setting.as_str(), e.source_name.as_str()),
                (setting, source.as_str()),
                "{text}: {e}"
            );
            assert!(e.reason.contains(reason), "{text}: {e}");
        }
        std::fs::write(&file, "http_addr = \n").unwrap();
        let e = Config::load(Some(&file), &env(&[])).unwrap_err();
        assert_eq!(
            (e.setting.as_str(), e.source_name.as_str()),
            ("file", source.as_str()),
            "{e}"
        );
        let e = Config::load(Some(&dir.path().join("missing.toml")), &env(&[])).unwrap_err();
        assert_eq!(e.setting, "FERRY_CONFIG", "{e}");
    }

    #[test]
    fn a_bad_value_in_the_environment_is_named_by_its_variable() {
        for (name, value, reason) in [
            ("FERRY_WORKER_LEASE_SECONDS", "1", "between 3 and 3600"),
            ("FERRY_READ_YOUR_WRITES_MS", "-1", "whole number"),
            ("FERRY_WORKERS", "maybe", "true or false"),
            ("FERRY_LOG_FORMAT", "xml", "json or pretty"),
            ("FERRY_TENANT_FILE_ROOTS", "/srv/a, relative", "absolute"),
            ("NATS_URL", "", "empty"),
            ("FERRY_MAX_PROGRAM_BYTES", "10", "between 1024 and"),
            ("FERRY_MAX_PLAN_RESOURCES", "0", "between 1 and 1000000"),
            ("FERRY_MAX_RECEIPT_BYTES", "many", "whole number"),
        ] {
            let e = Config::load(None, &env(&[(name, value)])).unwrap_err();
            assert_eq!(
                (e.setting.as_str(), e.source_name.as_str()),
                (name, "environment"),
                "{name}={value}: {e}"
            );
            assert!(e.reason.contains(reason), "{name}={value}: {e}");
        }
        // Only the value in force is checked: the environment's, over the file's.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ferry.toml");
        std::fs::write(&file, "workers = false\npoll_interval_ms = 5\n").unwrap();
        let c = Config::load(
            Some(&file),
            &env(&[("FERRY_WORKERS", "yes"), ("FERRY_POLL_INTERVAL_MS", " 20 ")]),
        )
        .unwrap();
        assert!(c.workers);
        assert_eq!(c.poll_interval, Duration::from_millis(20));
        // Neither a variable Ferry does not read nor its own FERRY_CONFIG is a setting.
        std::fs::write(&file, "workers = false\n").unwrap();
        let path = file.display().to_string();
        let c = Config::load(None, &env(&[("HOME", "/root"), ("FERRY_CONFIG", &path)])).unwrap();
        assert_eq!(c.config_file.as_deref(), Some(file.as_path()));
        assert!(!c.workers);
    }

    #[test]
    fn nats_credentials_are_checked_at_start_naming_the_setting() {
        use ferry_messaging::nats::{NatsAuth, NatsCredentials};
        let dir = tempfile::tempdir().unwrap();
        let path = |name: &str| dir.path().join(name).display().to_string();
        let seed = nkeys::KeyPair::new_user().seed().unwrap();
        std::fs::write(path("junk"), "not a key\n").unwrap();
        std::fs::write(path("user.nk"), format!("{seed}\n")).unwrap();
        std::fs::write(
            path("ferry.creds"),
            format!(
                "-----BEGIN NATS USER JWT-----\neyJhbGciOiJlZDI1NTE5In0.e30.c2ln\n------END NATS USER JWT------\n\n\
                 -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
            ),
        )
        .unwrap();
        std::fs::write(
            path("ca.pem"),
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let (missing, junk, ca) = (path("missing"), path("junk"), path("ca.pem"));
        for (pairs, setting, reason) in [
            (
                vec![("FERRY_NATS_CREDS_FILE", missing.as_str())],
                "FERRY_NATS_CREDS_FILE",
                "cannot read",
            ),
            (
                vec![("FERRY_NATS_CREDS_FILE", junk.as_str())],
                "FERRY_NATS_CREDS_FILE",
                "not a NATS credentials file",
            ),
            (
                vec![("FERRY_NATS_NKEY_SEED_FILE", junk.as_str())],
                "FERRY_NATS_NKEY_SEED_FILE",
                "nkey seed",
            ),
            (
                vec![("FERRY_NATS_NKEY_SEED_FILE", missing.as_str())],
                "FERRY_NATS_NKEY_SEED_FILE",
                "cannot read",
            ),
            (
                vec![("FERRY_NATS_USER", "ferry")],
                "FERRY_NATS_USER",
                "needs FERRY_NATS_PASSWORD",
            ),
            (
                vec![("FERRY_NATS_PASSWORD", "pw-never-shown")],
                "FERRY_NATS_PASSWORD",
                "needs FERRY_NATS_USER",
            ),
            (vec![("FERRY_NATS_TOKEN", " ")], "FERRY_NATS_TOKEN", "empty"),
            (
                vec![
                    ("FERRY_NATS_USER", "ferry"),
                    ("FERRY_NATS_PASSWORD", "pw-never-shown"),
                    ("FERRY_NATS_TOKEN", "tok-never-shown"),
                ],
                "FERRY_NATS_TOKEN",
                "FERRY_NATS_USER is set too",
            ),
            (
                vec![("FERRY_NATS_TLS_CA_FILE", missing.as_str())],
                "FERRY_NATS_TLS_CA_FILE",
                "cannot read",
            ),
            (
                vec![("FERRY_NATS_TLS_CA_FILE", junk.as_str())],
                "FERRY_NATS_TLS_CA_FILE",
                "no PEM block",
            ),
            (
                vec![("FERRY_NATS_TLS_CERT_FILE", ca.as_str())],
                "FERRY_NATS_TLS_CERT_FILE",
                "needs FERRY_NATS_TLS_KEY_FILE",
            ),
            (
                vec![("FERRY_NATS_TLS_REQUIRED", "maybe")],
                "FERRY_NATS_TLS_REQUIRED",
                "true or false",
            ),
        ] {
            let e = Config::load(None, &env(&pairs)).unwrap_err();
            assert_eq!(e.setting, setting, "{pairs:?}: {e}");
            assert!(e.reason.contains(reason), "{pairs:?}: {e}");
            let shown = e.to_string();
            assert!(
                !shown.contains("never-shown") && !shown.contains(&seed),
                "{shown}"
            );
        }
        // In the file, a setting is named by its key.
        let file = dir.path().join("ferry.toml");
        std::fs::write(&file, format!("nats_tls_key_file = {ca:?}\n")).unwrap();
        let e = Config::load(Some(&file), &env(&[])).unwrap_err();
        assert_eq!(e.setting, "nats_tls_key_file", "{e}");

        let c = Config::load(None, &env(&[])).unwrap();
        assert_eq!(c.nats_auth, NatsAuth::default());
        let c = Config::load(
            None,
            &env(&[
                ("FERRY_NATS_USER", "ferry"),
                ("FERRY_NATS_PASSWORD", "pw-never-shown"),
            ]),
        )
        .unwrap();
        assert!(matches!(
            &c.nats_auth.credentials,
            NatsCredentials::UserPassword { user, password }
                if user == "ferry" && password.expose() == "pw-never-shown"
        ));
        assert!(!format!("{c:?}").contains("pw-never-shown"));
        let nkey = path("user.nk");
        let c = Config::load(None, &env(&[("FERRY_NATS_NKEY_SEED_FILE", &nkey)])).unwrap();
        assert!(matches!(
            &c.nats_auth.credentials,
            NatsCredentials::NkeySeed { seed: s, .. } if s.expose() == seed
        ));
        let creds = path("ferry.creds");
        let c = Config::load(
            None,
            &env(&[
                ("FERRY_NATS_CREDS_FILE", &creds),
                ("FERRY_NATS_TLS_CA_FILE", &ca),
            ]),
        )
        .unwrap();
        assert_eq!(
            c.nats_auth.credentials,
            NatsCredentials::CredsFile(PathBuf::from(&creds))
        );
        assert!(c.nats_auth.tls.is_required());
        assert!(!c.nats_auth.tls.required);

        // A tenant that could read Ferry's NATS credentials could publish as Ferry: a
        // tenant root holding them stops start-up.
        let data = dir.path().join("data");
        std::fs::create_dir_all(data.join("tenants/acme")).unwrap();
        let inside = data.join("tenants/acme/ferry.creds");
        std::fs::copy(&creds, &inside).unwrap();
        let (data, inside) = (data.display().to_string(), inside.display().to_string());
        let e = Config::load(
            None,
            &env(&[
                ("FERRY_DATA_DIR", &data),
                ("FERRY_NATS_CREDS_FILE", &inside),
            ]),
        )
        .unwrap_err();
        assert_eq!(e.setting, "FERRY_TENANT_FILE_ROOTS", "{e}");
        assert!(e.reason.contains("NATS credentials"), "{e}");
    }

    #[test]
    fn the_declared_defaults_are_the_configs_defaults() {
        assert_eq!(Config::load(None, &env(&[])).unwrap(), Config::default());
        let c = Config::default();
        assert_eq!(c.http_addr.to_string(), "127.0.0.1:8080");
        assert_eq!(c.approval_expiry, Some(Duration::from_secs(24 * 60 * 60)));
        assert_eq!(c.trusted_sources, ferry_messaging::TrustedSources::any());
        assert!(c.workers && c.tenant_file_roots.is_none());
        // The limits the workers use by default are the declared ones.
        let limits = crate::server::worker_settings(&c).limits;
        assert_eq!(
            limits,
            crate::contexts::provisioning::work::limits::Limits::default()
        );
        let c = Config::load(None, &env(&[("FERRY_MAX_PLAN_RESOURCES", "7")])).unwrap();
        assert_eq!(crate::server::worker_settings(&c).limits.plan_resources, 7);
    }

    #[test]
    fn each_variable_is_ferry_and_the_key_but_the_documented_exceptions() {
        assert_eq!(SETTINGS.len(), ROWS.len());
        for (key, variable, default, meaning) in SETTINGS {
            match *variable {
                "DATABASE_URL" | "NATS_URL" => assert_eq!(variable.to_lowercase(), *key),
                _ => assert_eq!(*variable, format!("FERRY_{}", key.to_uppercase())),
            }
            assert!(!default.is_empty() && !meaning.is_empty(), "{key}");
            assert!(
                !meaning.starts_with(' ') && !meaning.contains("  "),
                "{key}"
            );
        }
    }

    #[test]
    fn the_configuration_table_is_the_generated_one() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/configuration.md");
        let readme = std::fs::read_to_string(path).unwrap();
        let fresh = with_markdown_table(&readme)
            .expect("docs/configuration.md marks its table with <!-- config-table -->");
        assert!(
            fresh == readme,
            "docs/configuration.md's table is stale: run `cargo run -- schemas`"
        );
        let table = markdown_table();
        assert!(table.contains(
            "| `baseline_program_<class>` | `FERRY_BASELINE_PROGRAM_DEVELOPMENT`, `_TEST`"
        ));
        assert!(!table.contains("`baseline_program_test`"));
        assert_eq!(with_markdown_table("no markers"), None);
    }
}
