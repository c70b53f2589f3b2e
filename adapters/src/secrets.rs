//! Secret resolution: `env://NAME`, `file:///path` and `vault://mount/path#key`
//! (HashiCorp Vault KV version 2).
//!
//! A resolved secret carries a *version* that goes into the plan's inputs hash, so that a
//! changed secret changes the hash without the hash revealing the secret:
//!
//! * Vault: `vault:v<metadata.version>`, Vault's own version of the secret;
//! * env and file: `hmac:<hex HMAC-SHA256 of the value>` keyed with the service's
//!   fingerprint key; without the key the fingerprint cannot be used to test guesses.
//!
//! Every reference is checked for its tenant first, with the live rules
//! ([`ferry_domain::confinement`]): its prefix for `env://` (and never a variable Ferry
//! reads), its file roots for `file://` (the real path, links resolved), its Vault prefix
//! for `vault://`. A refusal fails the resolution naming the reference and the rule.
//!
//! Errors name the reference and the reason, never the value (nor a Vault response body,
//! which may hold other secrets), and nothing here logs a value.

use crate::confined;
use ferry_domain::confinement::Confinement;
use ferry_domain::ports::sources::{ResolvedSecret, SecretError, SecretResolver};
use ferry_domain::ports::SecretValue;
use ferry_domain::values::SecretRef;
use ferry_domain::TenantId;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Where Vault is and the token to read it with.
#[derive(Clone)]
pub struct VaultConfig {
    /// E.g. `https://vault.internal:8200` (no trailing `/v1`).
    pub address: String,
    /// The `X-Vault-Token`.
    pub token: SecretValue,
}

impl fmt::Debug for VaultConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VaultConfig")
            .field("address", &self.address)
            .field("token", &self.token)
            .finish()
    }
}

/// Why a `vault://` reference did not resolve, or a value could not be fingerprinted; the
/// text is the `reason` of [`SecretError`] (never a value, nor a Vault response body).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum ResolveError {
    /// The HMAC refused the fingerprint key.
    #[error("the fingerprint key is unusable")]
    FingerprintKey,
    /// `vault://` without a Vault.
    #[error("no Vault is configured for vault:// references")]
    NoVault,
    /// Not `vault://mount/path#key`.
    #[error("must be vault://mount/path#key")]
    Malformed,
    /// Vault could not be reached.
    #[error("Vault at {address} unreachable: {reason}")]
    Unreachable {
        /// Vault's address.
        address: String,
        /// The client's reason (without the URL).
        reason: String,
    },
    /// Vault refused the token.
    #[error("Vault refused the token (403 permission denied)")]
    Forbidden,
    /// Nothing at the path.
    #[error("no secret at {mount}/{path} in Vault (404)")]
    NotFound {
        /// The mount.
        mount: String,
        /// The path.
        path: String,
    },
    /// Another HTTP status.
    #[error("Vault answered HTTP {0}")]
    Status(u16),
    /// The answer is not JSON.
    #[error("Vault's answer is not KV v2 JSON")]
    NotJson,
    /// The answer has no version.
    #[error("Vault's answer has no data.metadata.version (is the mount KV v2?)")]
    NoVersion,
    /// The key's value is an object, an array or null.
    #[error("key {0} is not a string, number or boolean")]
    NotScalar(String),
    /// The secret has no such key.
    #[error("key {key} not found at {mount}/{path} (version {version})")]
    NoKey {
        /// The key.
        key: String,
        /// The mount.
        mount: String,
        /// The path.
        path: String,
        /// The secret's version.
        version: u64,
    },
}

/// Resolves `env://`, `file://` and (when configured) `vault://` references.
#[derive(Clone)]
pub struct SecretResolvers {
    fingerprint_key: SecretValueBytes,
    vault: Option<VaultConfig>,
    http: reqwest::Client,
    confinement: Arc<Confinement>,
}

/// The fingerprint key, kept out of `Debug`.
#[derive(Clone)]
struct SecretValueBytes(Vec<u8>);

impl fmt::Debug for SecretResolvers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecretResolvers")
            .field("fingerprint_key", &"***")
            .field("vault", &self.vault)
            .finish()
    }
}

impl SecretResolvers {
    /// `fingerprint_key` keys the HMAC of env and file values; `vault` enables `vault://`;
    /// `confinement` says what each tenant may reach.
    pub fn new(
        fingerprint_key: Vec<u8>,
        vault: Option<VaultConfig>,
        confinement: Arc<Confinement>,
    ) -> Self {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            // A redirect could lead the token to another server.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            // Building only fails when the TLS backend cannot initialise; the default
            // client then still serves plain HTTP and reports TLS errors per request.
            .unwrap_or_default();
        Self {
            fingerprint_key: SecretValueBytes(fingerprint_key),
            vault,
            http,
            confinement,
        }
    }

    /// `hmac:<hex>` of `value` under the fingerprint key.
    fn fingerprint(&self, value: &str) -> Result<String, ResolveError> {
        // HMAC takes keys of any length; the error exists only for fixed-key MACs.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.fingerprint_key.0)
            .map_err(|_| ResolveError::FingerprintKey)?;
        mac.update(value.as_bytes());
        Ok(format!("hmac:{}", hex::encode(mac.finalize().into_bytes())))
    }

    async fn resolve_vault(
        &self,
        reference: &str,
        rest: &str,
    ) -> Result<ResolvedSecret, ResolveError> {
        let vault = self.vault.as_ref().ok_or(ResolveError::NoVault)?;
        let (location, key) = rest.split_once('#').ok_or(ResolveError::Malformed)?;
        let (mount, path) = location
            .split_once('/')
            .filter(|(m, p)| !m.is_empty() && !p.is_empty())
            .ok_or(ResolveError::Malformed)?;
        let url = format!(
            "{}/v1/{mount}/data/{path}",
            vault.address.trim_end_matches('/')
        );
        tracing::debug!(reference, "reading secret from Vault");
        let response = self
            .http
            .get(&url)
            .header("X-Vault-Token", vault.token.expose())
            .send()
            .await
            .map_err(|e| ResolveError::Unreachable {
                address: vault.address.clone(),
                reason: e.without_url().to_string(),
            })?;
        let status = response.status();
        if !status.is_success() {
            // The body is not included: it may echo request data.
            return Err(match status.as_u16() {
                403 => ResolveError::Forbidden,
                404 => ResolveError::NotFound {
                    mount: mount.to_string(),
                    path: path.to_string(),
                },
                code => ResolveError::Status(code),
            });
        }
        let body: serde_json::Value = response.json().await.map_err(|_| ResolveError::NotJson)?;
        let version = body
            .pointer("/data/metadata/version")
            .and_then(serde_json::Value::as_u64)
            .ok_or(ResolveError::NoVersion)?;
        let value = match body.pointer("/data/data").and_then(|d| d.get(key)) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_))) => v.to_string(),
            Some(_) => return Err(ResolveError::NotScalar(key.to_string())),
            None => {
                return Err(ResolveError::NoKey {
                    key: key.to_string(),
                    mount: mount.to_string(),
                    path: path.to_string(),
                    version,
                })
            }
        };
        Ok(ResolvedSecret {
            value: SecretValue::new(value),
            version: format!("vault:v{version}"),
        })
    }
}

#[async_trait::async_trait]
impl SecretResolver for SecretResolvers {
    async fn resolve(
        &self,
        tenant: &TenantId,
        reference: &SecretRef,
    ) -> Result<ResolvedSecret, SecretError> {
        let checked = self.confinement.check_secret(tenant, reference);
        let reference = reference.as_str();
        let fail = |reason: String| SecretError {
            reference: reference.to_string(),
            reason,
        };
        if let Err(refusal) = checked {
            tracing::warn!(%tenant, reference, %refusal, "secret reference refused");
            return Err(fail(refusal.to_string()));
        }
        if let Some(name) = reference.strip_prefix("env://") {
            let value = std::env::var(name).map_err(|e| {
                fail(match e {
                    std::env::VarError::NotPresent => {
                        format!("environment variable {name} is not set")
                    }
                    std::env::VarError::NotUnicode(_) => {
                        format!("environment variable {name} is not valid UTF-8")
                    }
                })
            })?;
            let version = self.fingerprint(&value).map_err(|e| fail(e.to_string()))?;
            return Ok(ResolvedSecret {
                value: SecretValue::new(value),
                version,
            });
        }
        if let Some(path) = reference.strip_prefix("file://") {
            let (rules, who, at) = (self.confinement.clone(), tenant.clone(), path.to_string());
            // io::Error's message never quotes the file's content.
            let mut value =
                tokio::task::spawn_blocking(move || confined::read_file(&rules, &who, &at))
                    .await
                    .map_err(|e| fail(format!("the read task failed: {e}")))?
                    .map_err(|e| fail(e.to_string()))?;
            // Files written by `echo` or editors end with one newline that is not part of
            // the secret.
            if value.ends_with('\n') {
                value.pop();
                if value.ends_with('\r') {
                    value.pop();
                }
            }
            let version = self.fingerprint(&value).map_err(|e| fail(e.to_string()))?;
            return Ok(ResolvedSecret {
                value: SecretValue::new(value),
                version,
            });
        }
        if let Some(rest) = reference.strip_prefix("vault://") {
            return self
                .resolve_vault(reference, rest)
                .await
                .map_err(|e| fail(e.to_string()));
        }
        Err(fail(
            "unsupported scheme (env://, file://, vault://)".to_string(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::confined::testing::{rules, DATA_DIR};
    use axum::extract::Path as AxPath;
    use axum::http::{HeaderMap, StatusCode};
    use axum::routing::get;
    use axum::{Json, Router};

    const VALUE: &str = "s3cr3t-Value-42";
    const GLOBEX_VALUE: &str = "globex-0nly-Value";

    fn sref(s: &str) -> SecretRef {
        SecretRef::parse(s).unwrap()
    }

    fn acme() -> TenantId {
        TenantId::parse("acme").unwrap()
    }

    fn globex() -> TenantId {
        TenantId::parse("globex").unwrap()
    }

    /// Resolvers whose tenants' file roots are `<root>/{tenant}`.
    fn resolvers(
        key: &[u8],
        vault: Option<VaultConfig>,
        root: &std::path::Path,
    ) -> SecretResolvers {
        let roots = [format!("{}/{{tenant}}", root.display())];
        SecretResolvers::new(key.to_vec(), vault, rules(&roots, &[], &[]))
    }

    fn no_root() -> std::path::PathBuf {
        std::path::PathBuf::from("/nonexistent/tenant-roots")
    }

    #[tokio::test]
    async fn env_secrets_resolve_with_an_hmac_fingerprint() {
        // A name no other test uses: the environment is process-wide.
        std::env::set_var("TENANT_acme__ADAPTERS_TEST_ENV_SECRET", VALUE);
        let r = resolvers(b"key-1", None, &no_root());
        let s = r
            .resolve(
                &acme(),
                &sref("env://TENANT_acme__ADAPTERS_TEST_ENV_SECRET"),
            )
            .await
            .unwrap();
        assert_eq!(s.value.expose(), VALUE);
        assert!(s.version.starts_with("hmac:"));
        assert_eq!(s.version.len(), "hmac:".len() + 64);
        assert!(!s.version.contains(VALUE));
        // Same value and key: same fingerprint; another key: another one.
        let again = r
            .resolve(
                &acme(),
                &sref("env://TENANT_acme__ADAPTERS_TEST_ENV_SECRET"),
            )
            .await
            .unwrap();
        assert_eq!(again.version, s.version);
        let other_key = resolvers(b"key-2", None, &no_root());
        assert_ne!(other_key.fingerprint(VALUE).unwrap(), s.version);
        assert_ne!(r.fingerprint("another value").unwrap(), s.version);

        let err = r
            .resolve(&acme(), &sref("env://TENANT_acme__ADAPTERS_TEST_UNSET_VAR"))
            .await
            .unwrap_err();
        assert_eq!(err.reference, "env://TENANT_acme__ADAPTERS_TEST_UNSET_VAR");
        assert!(err.reason.contains("not set"), "{err}");
    }

    #[tokio::test]
    async fn file_secrets_trim_one_newline() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("acme")).unwrap();
        let path = dir.path().join("acme/db");
        std::fs::write(&path, format!("{VALUE}\n")).unwrap();
        let r = resolvers(b"k", None, dir.path());
        let s = r
            .resolve(&acme(), &sref(&format!("file://{}", path.display())))
            .await
            .unwrap();
        assert_eq!(s.value.expose(), VALUE);
        assert_eq!(s.version, r.fingerprint(VALUE).unwrap());

        std::fs::write(&path, format!("{VALUE}\n\n")).unwrap();
        let s = r
            .resolve(&acme(), &sref(&format!("file://{}", path.display())))
            .await
            .unwrap();
        assert_eq!(
            s.value.expose(),
            format!("{VALUE}\n"),
            "only one newline is trimmed"
        );

        let missing = format!("file://{}", dir.path().join("acme/nope").display());
        let err = r.resolve(&acme(), &sref(&missing)).await.unwrap_err();
        assert_eq!(err.reference, missing);
        assert!(err.reason.contains("cannot read"), "{err}");
    }

    /// A fake Vault KV v2: `acme/payments/db` holds `password` at version 3, and
    /// `globex/payments/db` holds globex's.
    async fn fake_vault() -> String {
        async fn read(
            AxPath((mount, path)): AxPath<(String, String)>,
            headers: HeaderMap,
        ) -> (StatusCode, Json<serde_json::Value>) {
            if headers.get("X-Vault-Token").and_then(|v| v.to_str().ok()) != Some("root-token") {
                return (
                    StatusCode::FORBIDDEN,
                    Json(serde_json::json!({"errors": ["permission denied"]})),
                );
            }
            let value = match (mount.as_str(), path.as_str()) {
                ("acme", "payments/db") => VALUE,
                ("globex", "payments/db") => GLOBEX_VALUE,
                _ => {
                    return (
                        StatusCode::NOT_FOUND,
                        Json(serde_json::json!({"errors": []})),
                    )
                }
            };
            (
                StatusCode::OK,
                Json(serde_json::json!({
                    "data": {
                        "data": {"password": value, "port": 5432},
                        "metadata": {"version": 3, "created_time": "2026-12-01T00:00:00Z"}
                    }
                })),
            )
        }
        let app = Router::new().route("/v1/{mount}/data/{*path}", get(read));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        address
    }

    fn vault(address: &str, token: &str) -> SecretResolvers {
        resolvers(
            b"k",
            Some(VaultConfig {
                address: address.to_string(),
                token: SecretValue::new(token),
            }),
            &no_root(),
        )
    }

    #[tokio::test]
    async fn vault_kv2_secrets() {
        let address = fake_vault().await;
        let r = vault(&address, "root-token");
        let s = r
            .resolve(&acme(), &sref("vault://acme/payments/db#password"))
            .await
            .unwrap();
        assert_eq!(s.value.expose(), VALUE);
        assert_eq!(s.version, "vault:v3");
        let port = r
            .resolve(&acme(), &sref("vault://acme/payments/db#port"))
            .await
            .unwrap();
        assert_eq!(port.value.expose(), "5432");

        let err = r
            .resolve(&acme(), &sref("vault://acme/payments/db#missing"))
            .await
            .unwrap_err();
        assert!(err.reason.contains("key missing not found"), "{err}");
        let err = r
            .resolve(&acme(), &sref("vault://acme/payments/other#password"))
            .await
            .unwrap_err();
        assert!(err.reason.contains("404"), "{err}");

        let wrong = vault(&address, "wrong-token");
        let err = wrong
            .resolve(&acme(), &sref("vault://acme/payments/db#password"))
            .await
            .unwrap_err();
        assert_eq!(err.reference, "vault://acme/payments/db#password");
        assert!(err.reason.contains("403"), "{err}");

        let none = resolvers(b"k", None, &no_root());
        let err = none
            .resolve(&acme(), &sref("vault://acme/payments/db#password"))
            .await
            .unwrap_err();
        assert!(err.reason.contains("no Vault"), "{err}");
    }

    /// Tenant globex names each of acme's secrets, by every scheme: each is refused naming
    /// the reference and the rule, and no value comes back.
    #[tokio::test]
    async fn a_tenant_cannot_resolve_another_tenants_secrets() {
        let address = fake_vault().await;
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("acme")).unwrap();
        std::fs::create_dir(dir.path().join("globex")).unwrap();
        let acme_file = dir.path().join("acme/db");
        std::fs::write(&acme_file, VALUE).unwrap();
        std::env::set_var("TENANT_acme__ADAPTERS_TEST_CROSS", VALUE);
        let r = resolvers(
            b"k",
            Some(VaultConfig {
                address,
                token: SecretValue::new("root-token"),
            }),
            dir.path(),
        );
        let acme_refs = [
            "env://TENANT_acme__ADAPTERS_TEST_CROSS".to_string(),
            format!("file://{}", acme_file.display()),
            "vault://acme/payments/db#password".to_string(),
        ];
        for (reference, rule) in acme_refs.iter().zip([
            "FERRY_TENANT_ENV_PREFIX",
            "FERRY_TENANT_FILE_ROOTS",
            "FERRY_TENANT_VAULT_PREFIX",
        ]) {
            // acme reaches its own.
            let own = r.resolve(&acme(), &sref(reference)).await.unwrap();
            assert_eq!(own.value.expose(), VALUE);
            let err = r.resolve(&globex(), &sref(reference)).await.unwrap_err();
            assert_eq!(&err.reference, reference);
            assert!(err.reason.contains(rule), "{reference}: {err}");
            assert!(!format!("{err:?}").contains(VALUE));
        }
        // globex reaches its own Vault path, and only that.
        let theirs = r
            .resolve(&globex(), &sref("vault://globex/payments/db#password"))
            .await
            .unwrap();
        assert_eq!(theirs.value.expose(), GLOBEX_VALUE);
        // A link inside globex's root to acme's file is followed, then refused.
        #[cfg(unix)]
        {
            let link = dir.path().join("globex/stolen");
            std::os::unix::fs::symlink(&acme_file, &link).unwrap();
            let reference = format!("file://{}", link.display());
            let err = r.resolve(&globex(), &sref(&reference)).await.unwrap_err();
            assert_eq!(err.reference, reference);
            assert!(
                err.reason.contains(&format!(
                    "{} is outside this tenant's roots",
                    std::fs::canonicalize(&acme_file).unwrap().display()
                )),
                "{err}"
            );
        }
    }

    /// Ferry's own key file and variables, as a specification stored before the rules could
    /// carry them: refused at resolution, whatever the tenant's roots.
    #[tokio::test]
    async fn ferrys_own_secrets_are_refused_at_resolution() {
        std::env::set_var("FERRY_ADAPTERS_TEST_OWN", VALUE);
        let r = resolvers(b"k", None, &no_root());
        for reference in [
            format!("file://{DATA_DIR}/jwt-hs256.key"),
            format!("file://{DATA_DIR}/secret-fingerprint.key"),
            "env://FERRY_ADAPTERS_TEST_OWN".to_string(),
            "env://FERRY_JWT_HS256_KEY".to_string(),
            "env://DATABASE_URL".to_string(),
            "env://AWS_SECRET_ACCESS_KEY".to_string(),
        ] {
            let err = r.resolve(&acme(), &sref(&reference)).await.unwrap_err();
            assert_eq!(err.reference, reference);
            assert!(err.reason.contains("never resolvable"), "{err}");
        }
        // A link in the tenant's root to Ferry's key file is refused as Ferry's.
        #[cfg(unix)]
        {
            let dir = tempfile::tempdir().unwrap();
            let data = tempfile::tempdir().unwrap();
            let key = data.path().join("jwt-hs256.key");
            std::fs::write(&key, VALUE).unwrap();
            std::fs::create_dir(dir.path().join("acme")).unwrap();
            let link = dir.path().join("acme/key");
            std::os::unix::fs::symlink(&key, &link).unwrap();
            let confinement = Confinement::new(ferry_domain::confinement::ConfinementSettings {
                ferry: ferry_domain::confinement::FerryFiles {
                    data_dir: data.path().to_path_buf(),
                    ..Default::default()
                },
                file_roots: vec![format!("{}/{{tenant}}", dir.path().display())],
                env_prefix: "TENANT_{tenant}".into(),
                ..Default::default()
            })
            .unwrap();
            let r = SecretResolvers::new(b"k".to_vec(), None, Arc::new(confinement));
            let reference = format!("file://{}", link.display());
            let err = r.resolve(&acme(), &sref(&reference)).await.unwrap_err();
            assert!(err.reason.contains("token signing key"), "{err}");
        }
    }

    #[tokio::test]
    async fn values_never_show_in_debug_or_errors() {
        let address = fake_vault().await;
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("acme")).unwrap();
        let path = dir.path().join("acme/s");
        std::fs::write(&path, VALUE).unwrap();
        std::env::set_var("TENANT_acme__ADAPTERS_TEST_DEBUG_SECRET", VALUE);
        let r = resolvers(
            b"k",
            Some(VaultConfig {
                address: address.clone(),
                token: SecretValue::new(VALUE),
            }),
            dir.path(),
        );
        let mut shown = format!("{r:?}");
        for reference in [
            "env://TENANT_acme__ADAPTERS_TEST_DEBUG_SECRET".to_string(),
            format!("file://{}", path.display()),
        ] {
            let resolved = r.resolve(&acme(), &sref(&reference)).await.unwrap();
            assert_eq!(resolved.value.expose(), VALUE);
            shown.push_str(&format!("{resolved:?}"));
        }
        // The token is the secret value here: Vault refuses it, and the error must not echo it.
        let err = r
            .resolve(&acme(), &sref("vault://acme/payments/db#password"))
            .await
            .unwrap_err();
        shown.push_str(&format!("{err:?} {err}"));
        let good = vault(&address, "root-token");
        shown.push_str(&format!(
            "{:?}",
            good.resolve(&acme(), &sref("vault://acme/payments/db#password"))
                .await
                .unwrap()
        ));
        let err = good
            .resolve(&acme(), &sref("vault://acme/payments/db#nope"))
            .await
            .unwrap_err();
        shown.push_str(&format!("{err:?} {err}"));
        assert!(shown.contains("***"), "{shown}");
        assert!(!shown.contains(VALUE), "{shown}");
    }
}
