//! The artifact store (run logs, state snapshots) on `object_store`.
//!
//! * No URL (the embedded default) or `file:///path`: a local folder.
//! * `memory://`: in memory, for tests and throwaway instances.
//! * `s3://bucket/prefix`, `az://container/prefix` (and Azure's other schemes),
//!   `gs://bucket/prefix`: the cloud stores, configured from the environment the way their
//!   SDKs are (`AWS_*`, `AZURE_*`, `GOOGLE_*` variables, e.g. `AWS_REGION`,
//!   `AZURE_STORAGE_ACCOUNT_NAME`, `GOOGLE_SERVICE_ACCOUNT`).
//!
//! The cloud stores need `object_store`'s `aws`, `azure` and `gcp` features, which bring a
//! second `reqwest` and `aws-lc` (a C build) into the workspace; they are enabled. Cloud
//! URLs go through `object_store::parse_url_opts` with the store's settings from the
//! environment (`AWS_*`, `AZURE_*`, `GOOGLE_*`).
//!
//! [`ArtifactStore::put`] returns `artifacts:<key>`, the reference kept on the run (e.g.
//! `logsRef`); [`ArtifactStore::get`] reads such a reference back. Keys are relative
//! `/`-separated paths without `.`/`..` segments, so nothing is written outside the store's
//! prefix.

use ferry_domain::ports::sources::{ArtifactError, ArtifactStore};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, ObjectStoreExt, ObjectStoreScheme, PutPayload};
use std::path::Path;
use std::sync::Arc;

/// What a stored artifact's reference starts with.
pub const REFERENCE_PREFIX: &str = "artifacts:";

/// The longest key accepted.
const MAX_KEY_LEN: usize = 1024;

/// Why the artifact store could not be set up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("artifact store {url}: {reason}")]
pub struct ArtifactConfigError {
    /// The configured URL (or the local folder).
    pub url: String,
    /// Why.
    pub reason: String,
}

/// Artifacts in a local folder or an object store.
#[derive(Debug, Clone)]
pub struct ObjectArtifacts {
    store: Arc<dyn ObjectStore>,
    /// Where keys go inside the store (the URL's path; empty for local folders, whose
    /// prefix is the folder itself).
    prefix: StorePath,
    /// For messages and logs: the URL or folder.
    location: String,
}

/// Whether `key` (lower case) is a setting of the cloud store `scheme`.
fn known_setting(scheme: &ObjectStoreScheme, key: &str) -> bool {
    use std::str::FromStr;
    match scheme {
        ObjectStoreScheme::AmazonS3 => object_store::aws::AmazonS3ConfigKey::from_str(key).is_ok(),
        ObjectStoreScheme::MicrosoftAzure => {
            object_store::azure::AzureConfigKey::from_str(key).is_ok()
        }
        ObjectStoreScheme::GoogleCloudStorage => {
            object_store::gcp::GoogleConfigKey::from_str(key).is_ok()
        }
        _ => false,
    }
}

impl ObjectArtifacts {
    /// The store at `url`, or the local folder `local_dir` (created when needed) without one.
    pub fn from_url(url: Option<&str>, local_dir: &Path) -> Result<Self, ArtifactConfigError> {
        Self::from_url_with_options(url, local_dir, std::env::vars())
    }

    /// As [`ObjectArtifacts::from_url`], with the cloud store's settings given explicitly
    /// (`AWS_*`, `AZURE_*`, `GOOGLE_*` names, any case) instead of read from the environment.
    pub fn from_url_with_options(
        url: Option<&str>,
        local_dir: &Path,
        options: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ArtifactConfigError> {
        let Some(url) = url.map(str::trim).filter(|u| !u.is_empty()) else {
            return Self::local(local_dir);
        };
        let fail = |reason: String| ArtifactConfigError {
            url: url.to_string(),
            reason,
        };
        let parsed = url::Url::parse(url).map_err(|e| fail(format!("not a URL: {e}")))?;
        let (scheme, path) = ObjectStoreScheme::parse(&parsed).map_err(|e| fail(e.to_string()))?;
        match scheme {
            ObjectStoreScheme::Local => Self::local(Path::new(parsed.path())),
            ObjectStoreScheme::Memory => Ok(Self {
                store: Arc::new(InMemory::new()),
                prefix: StorePath::parse(path).map_err(|e| fail(e.to_string()))?,
                location: url.to_string(),
            }),
            ObjectStoreScheme::AmazonS3 | ObjectStoreScheme::MicrosoftAzure | ObjectStoreScheme::GoogleCloudStorage => {
                let env_prefix = match scheme {
                    ObjectStoreScheme::AmazonS3 => "AWS_",
                    ObjectStoreScheme::MicrosoftAzure => "AZURE_",
                    _ => "GOOGLE_",
                };
                // Credentials are handed to the builder, never logged. Only the settings the
                // store knows are passed: an unrelated AWS_* variable (AWS_CA_BUNDLE, …) must
                // not stop start-up.
                let options: Vec<(String, String)> = options
                    .into_iter()
                    .filter(|(k, _)| k.to_ascii_uppercase().starts_with(env_prefix))
                    .map(|(k, v)| (k.to_ascii_lowercase(), v))
                    .filter(|(k, _)| known_setting(&scheme, k))
                    .collect();
                let (store, prefix) = object_store::parse_url_opts(&parsed, options).map_err(|e| {
                    let message = e.to_string();
                    if message.contains("not enabled") {
                        fail(format!(
                            "{scheme:?} support is not compiled into this build (object_store's aws, azure and gcp features are off); use a local folder"
                        ))
                    } else {
                        fail(message)
                    }
                })?;
                tracing::info!(store = %url, "artifact store configured");
                Ok(Self {
                    store: Arc::from(store),
                    prefix,
                    location: url.to_string(),
                })
            }
            other => Err(fail(format!(
                "{other:?} is not an artifact store scheme (file://, s3://, az://, gs://, memory://)"
            ))),
        }
    }

    fn local(dir: &Path) -> Result<Self, ArtifactConfigError> {
        let fail = |reason: String| ArtifactConfigError {
            url: dir.display().to_string(),
            reason,
        };
        std::fs::create_dir_all(dir).map_err(|e| fail(format!("cannot create the folder: {e}")))?;
        let store = LocalFileSystem::new_with_prefix(dir).map_err(|e| fail(e.to_string()))?;
        tracing::info!(folder = %dir.display(), "artifact store is a local folder");
        Ok(Self {
            store: Arc::new(store),
            prefix: StorePath::default(),
            location: dir.display().to_string(),
        })
    }

    /// Where the artifacts go: the URL or the local folder.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// The store path of a validated key.
    fn path(&self, key: &str) -> Result<StorePath, ArtifactError> {
        validate_key(key)?;
        let mut path = self.prefix.clone();
        for part in key.split('/') {
            path = path.join(part);
        }
        Ok(path)
    }
}

/// A key is a relative path of plain segments: no empty, `.` or `..` segment, no
/// backslash or control character.
fn validate_key(key: &str) -> Result<(), ArtifactError> {
    let fail = |reason: &str| ArtifactError {
        key: key.to_string(),
        reason: reason.to_string(),
    };
    if key.is_empty() {
        return Err(fail("the key must not be empty"));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(fail("the key is longer than 1024 bytes"));
    }
    if key.chars().any(|c| c.is_control() || c == '\\') {
        return Err(fail(
            "the key must not contain control characters or backslashes",
        ));
    }
    if key
        .split('/')
        .any(|part| part.is_empty() || part == "." || part == "..")
    {
        return Err(fail(
            "the key must be a relative path without empty, '.' or '..' segments",
        ));
    }
    Ok(())
}

#[async_trait::async_trait]
impl ArtifactStore for ObjectArtifacts {
    async fn put(&self, key: &str, bytes: Vec<u8>) -> Result<String, ArtifactError> {
        let path = self.path(key)?;
        let size = bytes.len();
        self.store
            .put(&path, PutPayload::from(bytes))
            .await
            .map_err(|e| ArtifactError {
                key: key.to_string(),
                reason: format!("cannot store in {}: {e}", self.location),
            })?;
        tracing::debug!(key, size, store = %self.location, "artifact stored");
        Ok(format!("{REFERENCE_PREFIX}{key}"))
    }

    async fn get(&self, reference: &str) -> Result<Vec<u8>, ArtifactError> {
        let key = reference
            .strip_prefix(REFERENCE_PREFIX)
            .ok_or_else(|| ArtifactError {
                key: reference.to_string(),
                reason: format!("not an artifact reference (expected {REFERENCE_PREFIX}<key>)"),
            })?;
        let path = self.path(key)?;
        let fail = |e: object_store::Error| ArtifactError {
            key: key.to_string(),
            reason: match e {
                object_store::Error::NotFound { .. } => format!("not found in {}", self.location),
                other => format!("cannot read from {}: {other}", self.location),
            },
        };
        let result = self.store.get(&path).await.map_err(fail)?;
        let bytes = result.bytes().await.map_err(fail)?;
        Ok(bytes.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn local_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let local = dir.path().join("artifacts");
        let store = ObjectArtifacts::from_url(None, &local).unwrap();
        let reference = store
            .put("runs/r-1/plan.log", b"plan output".to_vec())
            .await
            .unwrap();
        assert_eq!(reference, "artifacts:runs/r-1/plan.log");
        assert_eq!(store.get(&reference).await.unwrap(), b"plan output");
        assert_eq!(
            std::fs::read(local.join("runs/r-1/plan.log")).unwrap(),
            b"plan output"
        );
        // Overwriting replaces the content.
        store
            .put("runs/r-1/plan.log", b"v2".to_vec())
            .await
            .unwrap();
        assert_eq!(store.get(&reference).await.unwrap(), b"v2");

        // A file:// URL is a local folder too, and sees the same files.
        let url = format!("file://{}", local.display());
        let same = ObjectArtifacts::from_url(Some(&url), dir.path()).unwrap();
        assert_eq!(same.get(&reference).await.unwrap(), b"v2");
    }

    #[tokio::test]
    async fn bad_keys_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = ObjectArtifacts::from_url(None, dir.path()).unwrap();
        for key in [
            "",
            "../escape",
            "a/../../b",
            "/abs",
            "a//b",
            "a/./b",
            "a\\b",
            "line\nbreak",
        ] {
            let err = store.put(key, b"x".to_vec()).await.unwrap_err();
            assert_eq!(err.key, key);
        }
        let err = store.get("artifacts:../../etc/passwd").await.unwrap_err();
        assert!(err.reason.contains(".."), "{err}");
        assert!(!dir.path().parent().unwrap().join("escape").exists());
    }

    #[tokio::test]
    async fn unknown_references() {
        let dir = tempfile::tempdir().unwrap();
        let store = ObjectArtifacts::from_url(None, dir.path()).unwrap();
        let err = store.get("artifacts:runs/none.log").await.unwrap_err();
        assert_eq!(err.key, "runs/none.log");
        assert!(err.reason.contains("not found"), "{err}");
        let err = store.get("s3://bucket/x").await.unwrap_err();
        assert!(err.reason.contains("not an artifact reference"), "{err}");
    }

    #[tokio::test]
    async fn urls() {
        let dir = tempfile::tempdir().unwrap();
        let memory = ObjectArtifacts::from_url(Some("memory:///ferry"), dir.path()).unwrap();
        let reference = memory.put("a/b.json", b"{}".to_vec()).await.unwrap();
        assert_eq!(memory.get(&reference).await.unwrap(), b"{}");
        assert_eq!(memory.location(), "memory:///ferry");

        // The cloud stores are built from their settings; unrelated variables are ignored.
        let settings = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<Vec<_>>()
        };
        let s3 = ObjectArtifacts::from_url_with_options(
            Some("s3://bucket/ferry"),
            dir.path(),
            settings(&[
                ("AWS_REGION", "eu-west-1"),
                ("AWS_CA_BUNDLE", "/etc/ssl/x.pem"),
            ]),
        );
        assert!(s3.is_ok(), "{s3:?}");
        let az = ObjectArtifacts::from_url_with_options(
            Some("az://container/ferry"),
            dir.path(),
            settings(&[
                ("AZURE_STORAGE_ACCOUNT_NAME", "ferry"),
                ("AZURE_STORAGE_ACCOUNT_KEY", "a2V5"),
            ]),
        );
        assert!(az.is_ok(), "{az:?}");
        // GCS needs credentials to be built at all: without them the error names the URL.
        let gs = ObjectArtifacts::from_url_with_options(
            Some("gs://bucket/ferry"),
            dir.path(),
            settings(&[]),
        );
        if let Err(e) = gs {
            assert_eq!(e.url, "gs://bucket/ferry");
        }
        assert!(ObjectArtifacts::from_url(Some("not a url"), dir.path())
            .unwrap_err()
            .reason
            .contains("not a URL"));
        assert!(ObjectArtifacts::from_url(Some("ftp://host/x"), dir.path()).is_err());
        // Blank means the local default.
        let local = ObjectArtifacts::from_url(Some("  "), dir.path()).unwrap();
        assert_eq!(local.location(), dir.path().display().to_string());
    }

    /// moto's S3 server: the one on `PATH`, else one this test installs once into a virtual
    /// environment of its own (`<temp dir>/ferry-test-moto`), so that the suite needs nothing
    /// installed by hand (python3 and PyPI are on the machine).
    fn moto_server() -> std::path::PathBuf {
        let on_path = std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|p| p.join("moto_server"))
                .find(|p| p.is_file())
        });
        if let Some(found) = on_path {
            return found;
        }
        let venv = std::env::temp_dir().join("ferry-test-moto");
        let (bin, ready) = (venv.join("bin/moto_server"), venv.join(".ready"));
        if bin.is_file() && ready.is_file() {
            return bin;
        }
        // A half-made environment (an interrupted earlier run) is made again.
        let _ = std::fs::remove_dir_all(&venv);
        let run = |program: &std::path::Path, args: &[&str]| {
            let status = std::process::Command::new(program)
                .args(args)
                .status()
                .unwrap_or_else(|e| panic!("{} runs: {e}", program.display()));
            assert!(status.success(), "{} {args:?} failed", program.display());
        };
        let venv_arg = venv.display().to_string();
        run(std::path::Path::new("python3"), &["-m", "venv", &venv_arg]);
        run(&venv.join("bin/pip"), &["install", "-q", "moto[server]"]);
        std::fs::write(&ready, b"").unwrap();
        bin
    }

    /// A real S3 API: moto's server on a local port.
    #[tokio::test]
    async fn an_s3_store_round_trips_against_an_s3_server() {
        let moto = moto_server();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut server = tokio::process::Command::new(&moto)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("moto_server runs");
        let endpoint = format!("http://127.0.0.1:{port}");
        let client = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
        // Wait for it, then create the bucket (moto accepts an unsigned request).
        loop {
            if let Ok(r) = client
                .put(format!("{endpoint}/ferry-artifacts"))
                .send()
                .await
            {
                assert!(r.status().is_success(), "{}", r.status());
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "moto_server did not start"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let dir = tempfile::tempdir().unwrap();
        let options = [
            ("AWS_ENDPOINT", endpoint.as_str()),
            ("AWS_ALLOW_HTTP", "true"),
            ("AWS_REGION", "us-east-1"),
            ("AWS_ACCESS_KEY_ID", "ferry"),
            ("AWS_SECRET_ACCESS_KEY", "ferry-secret"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let store = ObjectArtifacts::from_url_with_options(
            Some("s3://ferry-artifacts/runs"),
            dir.path(),
            options,
        )
        .unwrap();
        let reference = store
            .put("r1/plan.log", b"plan output".to_vec())
            .await
            .unwrap();
        assert_eq!(reference, "artifacts:r1/plan.log");
        assert_eq!(store.get(&reference).await.unwrap(), b"plan output");
        assert!(store.get("artifacts:r1/none.log").await.is_err());
        // The object is in the bucket under the prefix.
        let listing = client
            .get(format!("{endpoint}/ferry-artifacts?list-type=2"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(listing.contains("runs/r1/plan.log"), "{listing}");
        let _ = server.kill().await;
    }
}
