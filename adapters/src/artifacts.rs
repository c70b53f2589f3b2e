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
//! second `reqwest` and `aws-lc` (a C build) into the workspace; this build leaves them off,
//! and a cloud URL fails at start-up with an error saying so. Enabling them is a change to
//! `adapters/Cargo.toml` only: this code already routes those URLs through
//! `object_store::parse_url_opts`.
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

impl ObjectArtifacts {
    /// The store at `url`, or the local folder `local_dir` (created when needed) without one.
    pub fn from_url(url: Option<&str>, local_dir: &Path) -> Result<Self, ArtifactConfigError> {
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
                // Credentials come from the environment; they are handed to the builder,
                // never logged.
                let options = std::env::vars().filter(|(k, _)| k.starts_with(env_prefix));
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

        for url in [
            "s3://bucket/ferry",
            "az://container/ferry",
            "gs://bucket/ferry",
        ] {
            let err = ObjectArtifacts::from_url(Some(url), dir.path()).unwrap_err();
            assert_eq!(err.url, url);
            assert!(err.reason.contains("not compiled into this build"), "{err}");
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
}
