//! Configuration sources: `file:///path` and `http(s)://` references, with the *degrade*
//! failure mode of the Config Platform dependency.
//!
//! Each named reference's document (JSON or YAML) becomes `values[name]`:
//!
//! * files are parsed by extension (`.json`, `.yaml`/`.yml`), otherwise JSON then YAML;
//! * HTTP answers by content type (`json`, `yaml`), otherwise JSON then YAML; requests
//!   time out after 10 seconds.
//!
//! Every reference is first checked for its tenant with the live rules
//! ([`ferry_domain::confinement`]): a file must really (links resolved) be in the tenant's
//! file roots, a URL under the tenant's allowed prefixes; redirects are not followed. A
//! refused reference fails the resolution naming it and the rule, and never degrades.
//!
//! Degrade: every value read successfully is stored as the *last known good* (LKG) value in
//! `last_known_good_dir/<tenant>/<environmentId>/<name>.json`, with the reference and the
//! time it was stored. When a source fails later, the LKG value is used — only if it was stored
//! for the same reference, so that changing a reference never silently serves the old
//! source — and a warning names the reference, the error and when the LKG was stored.
//! With no usable LKG the resolution fails with a [`ConfigError`] naming the name, the
//! reference and the reason.

use crate::confined;
use chrono::{DateTime, SecondsFormat, Utc};
use ferry_domain::confinement::Confinement;
use ferry_domain::ports::sources::{ConfigError, ConfigSource, ResolvedConfig};
use ferry_domain::values::ConfigRef;
use ferry_domain::TenantId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// How long an HTTP configuration source may take.
const HTTP_TIMEOUT: Duration = Duration::from_secs(10);

/// Reads configuration from files and HTTP, degrading to the last known good values.
#[derive(Debug, Clone)]
pub struct ConfigSources {
    last_known_good_dir: PathBuf,
    http: reqwest::Client,
    confinement: Arc<Confinement>,
}

/// What is stored for a last known good value.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LastKnownGood {
    reference: String,
    stored_at: DateTime<Utc>,
    value: serde_json::Value,
}

/// The document formats a source may be in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Json,
    Yaml,
    /// Unknown: JSON, then YAML.
    Guess,
}

/// Why a source could not be read; the text goes into the [`ConfigError`]'s reason or the
/// degraded warning.
#[derive(Debug, thiserror::Error)]
enum FetchError {
    /// The blocking read did not finish.
    #[error("the read task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    /// The file could not be read, or a rule refused it.
    #[error(transparent)]
    Read(#[from] confined::ReadError),
    /// The server could not be reached.
    #[error("unreachable: {0}")]
    Unreachable(#[source] reqwest::Error),
    /// A redirect, which is not followed.
    #[error("HTTP {0}: redirects are not followed")]
    Redirect(reqwest::StatusCode),
    /// Another unsuccessful status.
    #[error("HTTP {0}")]
    Status(reqwest::StatusCode),
    /// The body could not be read.
    #[error("cannot read the body: {0}")]
    Body(#[source] reqwest::Error),
    /// The document is not of its format.
    #[error(transparent)]
    Parse(#[from] ParseError),
    /// Neither `file://` nor `http(s)://`.
    #[error("unsupported scheme (file://, http://, https://)")]
    Scheme,
}

/// Why a document is not JSON or YAML.
#[derive(Debug, thiserror::Error)]
enum ParseError {
    /// Not JSON.
    #[error("invalid JSON: {0}")]
    Json(#[source] serde_json::Error),
    /// Not YAML.
    #[error("invalid YAML: {0}")]
    Yaml(#[source] serde_yaml::Error),
    /// Of no known format: neither.
    #[error("neither JSON (invalid JSON: {json}) nor YAML (invalid YAML: {yaml})")]
    Neither {
        /// Why not JSON.
        json: serde_json::Error,
        /// Why not YAML.
        yaml: serde_yaml::Error,
    },
}

/// Why a last known good value could not be stored.
#[derive(Debug, thiserror::Error)]
enum StoreError {
    /// The path has no folder.
    #[error("no parent folder")]
    NoParent,
    /// The record could not be written.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The record could not be serialised.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

impl ConfigSources {
    /// Stores last known good values under `last_known_good_dir` (created when needed);
    /// `confinement` says what each tenant may reach.
    pub fn new(last_known_good_dir: impl Into<PathBuf>, confinement: Arc<Confinement>) -> Self {
        let http = reqwest::Client::builder()
            .timeout(HTTP_TIMEOUT)
            // A redirect would leave the allowed prefixes.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            // Only fails when TLS cannot initialise; requests then report the error.
            .unwrap_or_default();
        Self {
            last_known_good_dir: last_known_good_dir.into(),
            http,
            confinement,
        }
    }

    fn lkg_path(&self, tenant: &TenantId, environment_id: &str, name: &str) -> PathBuf {
        self.last_known_good_dir
            .join(path_safe(tenant.as_str()))
            .join(path_safe(environment_id))
            .join(format!("{}.json", path_safe(name)))
    }

    /// Reads one source.
    async fn fetch(
        &self,
        tenant: &TenantId,
        reference: &str,
    ) -> Result<serde_json::Value, FetchError> {
        if let Some(path) = reference.strip_prefix("file://") {
            let (rules, who, at) = (self.confinement.clone(), tenant.clone(), path.to_string());
            let text = tokio::task::spawn_blocking(move || confined::read_file(&rules, &who, &at))
                .await
                .map_err(FetchError::Task)??;
            let format = match Path::new(path).extension().and_then(|e| e.to_str()) {
                Some("json") => Format::Json,
                Some("yaml" | "yml") => Format::Yaml,
                _ => Format::Guess,
            };
            return Ok(parse(&text, format)?);
        }
        if reference.starts_with("http://") || reference.starts_with("https://") {
            let response = self
                .http
                .get(reference)
                .send()
                .await
                .map_err(|e| FetchError::Unreachable(e.without_url()))?;
            let status = response.status();
            if status.is_redirection() {
                return Err(FetchError::Redirect(status));
            }
            if !status.is_success() {
                return Err(FetchError::Status(status));
            }
            let content_type = response
                .headers()
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_ascii_lowercase();
            let format = if content_type.contains("json") {
                Format::Json
            } else if content_type.contains("yaml") || content_type.contains("yml") {
                Format::Yaml
            } else {
                Format::Guess
            };
            let text = response
                .text()
                .await
                .map_err(|e| FetchError::Body(e.without_url()))?;
            return Ok(parse(&text, format)?);
        }
        Err(FetchError::Scheme)
    }

    async fn store_lkg(
        &self,
        tenant: &TenantId,
        environment_id: &str,
        name: &str,
        reference: &str,
        value: &serde_json::Value,
    ) {
        let path = self.lkg_path(tenant, environment_id, name);
        let record = LastKnownGood {
            reference: reference.to_string(),
            stored_at: Utc::now(),
            value: value.clone(),
        };
        // A failure to store is logged, not fatal: the values just read are good.
        if let Err(e) = write_atomically(&path, &record).await {
            tracing::warn!(environment_id, name, path = %path.display(), error = %e, "cannot store the last known good configuration");
        }
    }

    async fn load_lkg(
        &self,
        tenant: &TenantId,
        environment_id: &str,
        name: &str,
        reference: &str,
    ) -> Option<LastKnownGood> {
        let path = self.lkg_path(tenant, environment_id, name);
        let bytes = tokio::fs::read(&path).await.ok()?;
        match serde_json::from_slice::<LastKnownGood>(&bytes) {
            Ok(record) if record.reference == reference => Some(record),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "ignoring an unreadable last known good file");
                None
            }
        }
    }

    async fn resolve_one(
        &self,
        tenant: &TenantId,
        environment_id: &str,
        name: &str,
        reference: &ConfigRef,
    ) -> Result<(serde_json::Value, Option<String>), ConfigError> {
        // Refused is final: no last known good value of a source the tenant may not read.
        if let Err(refusal) = self.confinement.check_config(tenant, reference) {
            tracing::warn!(%tenant, environment_id, name, reference = reference.as_str(), %refusal, "configuration reference refused");
            return Err(ConfigError {
                name: name.to_string(),
                reference: reference.to_string(),
                reason: refusal.to_string(),
            });
        }
        let reference = reference.as_str();
        match self.fetch(tenant, reference).await {
            Ok(value) => {
                self.store_lkg(tenant, environment_id, name, reference, &value)
                    .await;
                Ok((value, None))
            }
            Err(reason) => match self.load_lkg(tenant, environment_id, name, reference).await {
                Some(lkg) => {
                    let warning = format!(
                        "{name}: {reference} failed ({reason}); using the last known good values stored at {}",
                        lkg.stored_at.to_rfc3339_opts(SecondsFormat::Secs, true)
                    );
                    tracing::warn!(environment_id, %warning, "configuration degraded");
                    Ok((lkg.value, Some(warning)))
                }
                None => Err(ConfigError {
                    name: name.to_string(),
                    reference: reference.to_string(),
                    reason: format!("{reason}; no last known good values"),
                }),
            },
        }
    }
}

#[async_trait::async_trait]
impl ConfigSource for ConfigSources {
    async fn resolve(
        &self,
        tenant: &TenantId,
        environment_id: &str,
        refs: &BTreeMap<String, ConfigRef>,
    ) -> Result<ResolvedConfig, ConfigError> {
        // Concurrently: a plan should wait for its slowest source, not for their sum.
        let results =
            futures::future::join_all(refs.iter().map(|(name, reference)| {
                self.resolve_one(tenant, environment_id, name, reference)
            }))
            .await;
        let mut resolved = ResolvedConfig::default();
        for ((name, _), result) in refs.iter().zip(results) {
            let (value, warning) = result?;
            resolved.values.insert(name.clone(), value);
            resolved.warnings.extend(warning);
        }
        Ok(resolved)
    }
}

fn parse(text: &str, format: Format) -> Result<serde_json::Value, ParseError> {
    let json = || serde_json::from_str::<serde_json::Value>(text);
    let yaml = || serde_yaml::from_str::<serde_json::Value>(text);
    match format {
        Format::Json => json().map_err(ParseError::Json),
        Format::Yaml => yaml().map_err(ParseError::Yaml),
        Format::Guess => {
            json().or_else(|json| yaml().map_err(|yaml| ParseError::Neither { json, yaml }))
        }
    }
}

/// One path component from an environment id or a configuration name: characters other
/// than `[A-Za-z0-9_-]` (and a dot that is not leading) are written as `%XX`, so that no
/// name can climb out of the folder or collide with another.
fn path_safe(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for (i, byte) in name.bytes().enumerate() {
        let keep =
            byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-' || (byte == b'.' && i > 0);
        if keep {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

async fn write_atomically(path: &Path, record: &LastKnownGood) -> Result<(), StoreError> {
    let dir = path.parent().ok_or(StoreError::NoParent)?;
    tokio::fs::create_dir_all(dir).await?;
    let bytes = serde_json::to_vec_pretty(record)?;
    // Write then rename: a crash never leaves a half-written last known good file.
    let tmp = path.with_extension(format!("json.tmp-{}", std::process::id()));
    tokio::fs::write(&tmp, bytes).await?;
    Ok(tokio::fs::rename(&tmp, path).await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::confined::testing::rules;
    use axum::http::header;
    use axum::routing::get;
    use axum::Router;
    use serde_json::json;

    fn refs(pairs: &[(&str, &str)]) -> BTreeMap<String, ConfigRef> {
        pairs
            .iter()
            .map(|(n, r)| (n.to_string(), ConfigRef::parse(*r).unwrap()))
            .collect()
    }

    fn acme() -> TenantId {
        TenantId::parse("acme").unwrap()
    }

    fn globex() -> TenantId {
        TenantId::parse("globex").unwrap()
    }

    /// Sources whose tenants may read files under `files` and URLs under `urls`.
    fn sources(lkg: &Path, files: &[&Path], urls: &[&str]) -> ConfigSources {
        let files: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
        let urls: Vec<String> = urls.iter().map(|u| u.to_string()).collect();
        ConfigSources::new(lkg, rules(&files, &[], &urls))
    }

    #[tokio::test]
    async fn files_in_json_and_yaml() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("acme");
        std::fs::create_dir(&root).unwrap();
        std::fs::write(root.join("app.json"), r#"{"replicas": 3, "region": "eu"}"#).unwrap();
        std::fs::write(root.join("db.yaml"), "host: db.internal\nport: 5432\n").unwrap();
        std::fs::write(root.join("plain"), "- a\n- b\n").unwrap();
        let sources = sources(&dir.path().join("lkg"), &[&root], &[]);
        let resolved = sources
            .resolve(
                &acme(),
                "env-1",
                &refs(&[
                    ("app", &format!("file://{}/app.json", root.display())),
                    ("db", &format!("file://{}/db.yaml", root.display())),
                    ("list", &format!("file://{}/plain", root.display())),
                ]),
            )
            .await
            .unwrap();
        assert_eq!(
            resolved.values["app"],
            json!({"replicas": 3, "region": "eu"})
        );
        assert_eq!(
            resolved.values["db"],
            json!({"host": "db.internal", "port": 5432})
        );
        assert_eq!(resolved.values["list"], json!(["a", "b"]));
        assert!(resolved.warnings.is_empty());
        assert!(dir.path().join("lkg/acme/env-1/app.json").is_file());
    }

    #[tokio::test]
    async fn a_bad_document_without_lkg_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("bad.json"), "{not json").unwrap();
        let reference = format!("file://{}/bad.json", dir.path().display());
        let sources = sources(&dir.path().join("lkg"), &[dir.path()], &[]);
        let err = sources
            .resolve(&acme(), "env-1", &refs(&[("app", &reference)]))
            .await
            .unwrap_err();
        assert_eq!(err.name, "app");
        assert_eq!(err.reference, reference);
        assert!(err.reason.contains("invalid JSON"), "{err}");
        assert!(err.reason.contains("no last known good"), "{err}");
    }

    /// A refused reference fails naming the rule, even with a last known good value stored
    /// for it under earlier rules; links out of a root are followed, then refused.
    #[tokio::test]
    async fn refused_references_fail_and_never_degrade() {
        let dir = tempfile::tempdir().unwrap();
        let (acme_root, outside) = (dir.path().join("acme"), dir.path().join("outside"));
        std::fs::create_dir(&acme_root).unwrap();
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("app.json"), r#"{"leaked": true}"#).unwrap();
        let lkg = dir.path().join("lkg");
        let reference = format!("file://{}/app.json", outside.display());
        let wanted = refs(&[("app", &reference)]);
        // Earlier rules allowed it: a last known good value exists.
        let broad = sources(&lkg, &[dir.path()], &[]);
        broad.resolve(&acme(), "env-1", &wanted).await.unwrap();

        let narrow = sources(&lkg, &[&acme_root], &[]);
        let err = narrow.resolve(&acme(), "env-1", &wanted).await.unwrap_err();
        assert_eq!(
            (err.name.as_str(), err.reference.as_str()),
            ("app", reference.as_str())
        );
        assert!(
            err.reason
                .contains("outside this tenant's roots (FERRY_TENANT_FILE_ROOTS"),
            "{err}"
        );
        assert!(!err.reason.contains("last known good"), "{err}");

        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(outside.join("app.json"), acme_root.join("app.json"))
                .unwrap();
            let linked = format!("file://{}/app.json", acme_root.display());
            let err = narrow
                .resolve(&acme(), "env-1", &refs(&[("app", &linked)]))
                .await
                .unwrap_err();
            assert!(err.reason.contains("outside this tenant's roots"), "{err}");
        }

        // No URL prefixes configured: http(s) sources are refused, naming the setting.
        let err = narrow
            .resolve(
                &acme(),
                "env-1",
                &refs(&[("app", "http://127.0.0.1:9/app")]),
            )
            .await
            .unwrap_err();
        assert!(
            err.reason
                .contains("FERRY_TENANT_CONFIG_URL_PREFIXES: none configured"),
            "{err}"
        );
    }

    async fn server() -> (
        String,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    ) {
        let app = Router::new()
            .route(
                "/app",
                get(|| async {
                    (
                        [(header::CONTENT_TYPE, "application/json")],
                        r#"{"replicas": 2}"#,
                    )
                }),
            )
            .route(
                "/db",
                get(|| async {
                    (
                        [(header::CONTENT_TYPE, "application/yaml")],
                        "host: db\nport: 1\n",
                    )
                }),
            )
            .route(
                "/moved",
                get(|| async {
                    (
                        axum::http::StatusCode::FOUND,
                        [(header::LOCATION, "http://169.254.169.254/latest/meta-data")],
                    )
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let handle = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        (address, stop, handle)
    }

    #[tokio::test]
    async fn http_sources_then_degrade_when_the_server_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let (address, stop, handle) = server().await;
        let sources = sources(&dir.path().join("lkg"), &[], &[&format!("{address}/")]);
        let wanted = refs(&[
            ("app", &format!("{address}/app")),
            ("db", &format!("{address}/db")),
        ]);
        let first = sources.resolve(&acme(), "prod-1", &wanted).await.unwrap();
        assert_eq!(first.values["app"], json!({"replicas": 2}));
        assert_eq!(first.values["db"], json!({"host": "db", "port": 1}));
        assert!(first.warnings.is_empty());

        // Redirects are not followed: they would leave the allowed prefixes.
        let err = sources
            .resolve(
                &acme(),
                "prod-1",
                &refs(&[("meta", &format!("{address}/moved"))]),
            )
            .await
            .unwrap_err();
        assert!(err.reason.contains("redirects are not followed"), "{err}");

        stop.send(()).unwrap();
        handle.await.unwrap();

        let degraded = sources.resolve(&acme(), "prod-1", &wanted).await.unwrap();
        assert_eq!(degraded.values, first.values);
        assert_eq!(degraded.warnings.len(), 2, "{:?}", degraded.warnings);
        let app_warning = degraded
            .warnings
            .iter()
            .find(|w| w.starts_with("app:"))
            .unwrap();
        assert!(
            app_warning.contains(&format!("{address}/app")),
            "{app_warning}"
        );
        assert!(app_warning.contains("unreachable"), "{app_warning}");
        assert!(
            app_warning.contains("last known good values stored at 20"),
            "{app_warning}"
        );

        // Another environment has no last known good values: error naming name and reference.
        let err = sources
            .resolve(&acme(), "prod-2", &wanted)
            .await
            .unwrap_err();
        assert_eq!(err.name, "app");
        assert_eq!(err.reference, format!("{address}/app"));
        assert!(err.reason.contains("unreachable"), "{err}");

        // Nor has another tenant's environment of the same name, with the same reference.
        let err = sources
            .resolve(&globex(), "prod-1", &wanted)
            .await
            .unwrap_err();
        assert!(err.reason.contains("no last known good"), "{err}");

        // A changed reference does not inherit the old reference's values.
        let moved = refs(&[("app", &format!("{address}/app-v2"))]);
        assert!(sources.resolve(&acme(), "prod-1", &moved).await.is_err());
    }

    #[test]
    fn names_are_safe_path_components() {
        assert_eq!(path_safe("env-1"), "env-1");
        assert_eq!(path_safe("../x"), "%2E.%2Fx");
        assert_eq!(path_safe(".."), "%2E.");
        assert_eq!(path_safe("a/b"), "a%2Fb");
        assert_eq!(path_safe("v1.2"), "v1.2");
    }
}
