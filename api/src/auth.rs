//! Bearer-token authentication and authorisation.
//!
//! Tokens are JWTs: HS256 with a configured key (the embedded default generates one and
//! keeps it in the data dir), or RS256 verified against a JWKS URL. Claims Ferry reads:
//! `sub` (the actor), `tenant` (every read and write is filtered by it), `scope`
//! (space-separated, OAuth2 style), `roles` (Operator, PlatformAdmin, Observer), `exp`.
//!
//! People act through roles; services through `factory.events.publish` without any role.

use crate::problem::ApiError;
use ferry_domain::{Actor, TenantId};
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::sync::RwLock;

/// Read specifications and runs.
pub const SCOPE_READ: &str = "factory.provisioning.read";
/// Plan, apply, cancel and decide approvals.
pub const SCOPE_APPLY: &str = "factory.provisioning.apply";
/// Post the events of other services (approvals, environments, releases, promotions,
/// provisioning reports) to `POST /factory/events`: for service identities only.
pub const SCOPE_EVENTS_PUBLISH: &str = "factory.events.publish";
/// Every scope Ferry knows.
pub const SCOPES: [&str; 3] = [SCOPE_READ, SCOPE_APPLY, SCOPE_EVENTS_PUBLISH];

/// The human roles Ferry knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Runs and approves changes.
    Operator,
    /// Administers the platform.
    PlatformAdmin,
    /// Reads only.
    Observer,
    /// Decides approvals (e.g. of production promotions).
    Reviewer,
    /// Administers a workspace of a tenant.
    WorkspaceAdmin,
}

impl Role {
    /// Every role a token may carry.
    pub const ALL: [Self; 5] = [
        Self::Operator,
        Self::PlatformAdmin,
        Self::Observer,
        Self::Reviewer,
        Self::WorkspaceAdmin,
    ];

    /// Its name in a token's `roles` claim.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Operator => "Operator",
            Self::PlatformAdmin => "PlatformAdmin",
            Self::Observer => "Observer",
            Self::Reviewer => "Reviewer",
            Self::WorkspaceAdmin => "WorkspaceAdmin",
        }
    }

    /// The role a claim names, if it is one.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|role| role.as_str() == s)
    }
}

/// The claims Ferry issues and reads.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Claims {
    /// The caller.
    pub sub: String,
    /// The caller's tenant.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Space-separated scopes.
    #[serde(default)]
    pub scope: Option<String>,
    /// Roles.
    #[serde(default)]
    pub roles: Vec<String>,
    /// Expiry (seconds since the epoch).
    pub exp: u64,
    /// Issued at.
    #[serde(default)]
    pub iat: Option<u64>,
    /// Issuer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iss: Option<String>,
    /// Audience.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aud: Option<String>,
}

/// The authenticated caller of a request.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The tenant every read and write is limited to.
    pub tenant: TenantId,
    /// The token's subject.
    pub actor: Actor,
    scopes: BTreeSet<String>,
    roles: BTreeSet<Role>,
    expires_at: u64,
}

impl Caller {
    /// The metadata of the events this caller's request appends: the token's tenant and
    /// subject, and the request's ids.
    pub fn metadata(&self, ids: crate::extract::RequestIds) -> ferry_store::EventMetadata {
        ferry_store::EventMetadata {
            tenant_id: self.tenant.clone(),
            actor: self.actor.clone(),
            correlation_id: ids.correlation_id,
            causation_id: ids.request_id,
            request_id: ids.request_id,
        }
    }

    /// When the token ends (seconds since the epoch): a console session ends with it.
    pub fn expires_at(&self) -> u64 {
        self.expires_at
    }

    /// True when the token carries `role`.
    pub fn has_role(&self, role: Role) -> bool {
        self.roles.contains(&role)
    }

    /// True for a service identity: a token without any human role.
    pub fn is_service(&self) -> bool {
        self.roles.is_empty()
    }

    /// 403 unless the token carries `scope`.
    pub fn require_scope(&self, scope: &str) -> Result<(), ApiError> {
        if self.scopes.contains(scope) {
            Ok(())
        } else {
            Err(ApiError::Forbidden(format!(
                "the token lacks the scope {scope}"
            )))
        }
    }

    /// Reads need the read scope.
    pub fn require_read(&self) -> Result<(), ApiError> {
        self.require_scope(SCOPE_READ)
    }

    /// Recording environments needs the apply scope and the PlatformAdmin role.
    pub fn require_platform_admin(&self) -> Result<(), ApiError> {
        self.require_scope(SCOPE_APPLY)?;
        if self.roles.contains(&Role::PlatformAdmin) {
            Ok(())
        } else {
            Err(ApiError::Forbidden(
                "this needs the PlatformAdmin role".to_string(),
            ))
        }
    }

    /// Posting another service's events needs the `factory.events.publish` scope on a
    /// service identity: a token carrying a human role (Operator, PlatformAdmin, Observer) is
    /// a person's, and a person must not speak for run control or the environment service.
    pub fn require_event_publisher(&self) -> Result<(), ApiError> {
        self.require_scope(SCOPE_EVENTS_PUBLISH)?;
        if self.roles.is_empty() {
            Ok(())
        } else {
            Err(ApiError::Forbidden(
                "events of other services are accepted only from service identities: the token carries a human role"
                    .to_string(),
            ))
        }
    }

    /// Changes need the apply scope and the Operator or PlatformAdmin role.
    pub fn require_apply(&self) -> Result<(), ApiError> {
        self.require_scope(SCOPE_APPLY)?;
        if self.roles.contains(&Role::Operator) || self.roles.contains(&Role::PlatformAdmin) {
            Ok(())
        } else {
            Err(ApiError::Forbidden(
                "this needs the Operator or PlatformAdmin role".to_string(),
            ))
        }
    }
}

/// How tokens are checked.
pub enum Verifier {
    /// Shared HS256 key.
    Hs256 {
        /// The key.
        key: DecodingKey,
        /// Required claims.
        validation: Validation,
        /// Which key it is, for a refusal (the embedded key's file, the configured key).
        source: String,
    },
    /// RS256 keys from a JWKS URL, cached by `kid` and refetched for an unknown one.
    Jwks {
        /// The JWKS document's URL.
        url: String,
        /// Keys by kid.
        keys: RwLock<(HashMap<String, DecodingKey>, Option<Instant>)>,
        /// HTTP client.
        client: reqwest::Client,
        /// Required claims.
        validation: Validation,
    },
}

fn validation(alg: Algorithm, issuer: Option<&str>, audience: Option<&str>) -> Validation {
    let mut v = Validation::new(alg);
    v.leeway = 30;
    v.set_required_spec_claims(&["exp", "sub"]);
    if let Some(iss) = issuer {
        v.set_issuer(&[iss]);
    }
    match audience {
        Some(aud) => v.set_audience(&[aud]),
        None => v.validate_aud = false,
    }
    v
}

impl Verifier {
    /// HS256 with `key`.
    pub fn hs256(key: &[u8], issuer: Option<&str>, audience: Option<&str>) -> Self {
        Self::Hs256 {
            key: DecodingKey::from_secret(key),
            validation: validation(Algorithm::HS256, issuer, audience),
            source: "the configured HS256 key".to_string(),
        }
    }

    /// This verifier, naming its key as `source` when it refuses a token (a token signed
    /// with another key, e.g. by `ferry token` run with another data dir, is told which
    /// key it did not match).
    pub fn described(mut self, described: impl Into<String>) -> Self {
        if let Self::Hs256 { source, .. } = &mut self {
            *source = described.into();
        }
        self
    }

    /// Which key verifies tokens, in words.
    pub fn source(&self) -> String {
        match self {
            Self::Hs256 { source, .. } => source.clone(),
            Self::Jwks { url, .. } => format!("the JWKS at {url}"),
        }
    }

    /// RS256 against the JWKS at `url` (fetched on first use).
    pub fn jwks(url: &str, issuer: Option<&str>, audience: Option<&str>) -> Self {
        Self::Jwks {
            url: url.to_string(),
            keys: RwLock::new((HashMap::new(), None)),
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap_or_default(),
            validation: validation(Algorithm::RS256, issuer, audience),
        }
    }

    /// Verifies a token and returns the caller.
    pub async fn verify(&self, token: &str) -> Result<Caller, ApiError> {
        let bad = |e: jsonwebtoken::errors::Error| {
            ApiError::Unauthorized(format!(
                "the bearer token is not valid: {e} (checked against {})",
                self.source()
            ))
        };
        let claims = match self {
            Self::Hs256 {
                key, validation, ..
            } => {
                jsonwebtoken::decode::<Claims>(token, key, validation)
                    .map_err(bad)?
                    .claims
            }
            Self::Jwks { validation, .. } => {
                let header = jsonwebtoken::decode_header(token).map_err(bad)?;
                let kid = header.kid.ok_or_else(|| {
                    ApiError::Unauthorized("the bearer token has no kid".to_string())
                })?;
                let key = self.jwks_key(&kid).await?;
                jsonwebtoken::decode::<Claims>(token, &key, validation)
                    .map_err(bad)?
                    .claims
            }
        };
        let tenant = claims
            .tenant
            .as_deref()
            .ok_or_else(|| {
                ApiError::Unauthorized("the bearer token has no tenant claim".to_string())
            })
            .and_then(|t| {
                TenantId::parse(t).map_err(|e| {
                    ApiError::Unauthorized(format!("the token's tenant claim is not valid: {e}"))
                })
            })?;
        let actor = Actor::parse(claims.sub.clone())
            .map_err(|e| ApiError::Unauthorized(format!("the token's sub is not valid: {e}")))?;
        // `system:` and `nats:` name Ferry's own workers and the senders of NATS events in
        // the record: a caller spelling itself so would pass for one of them.
        if let Some(prefix) = actor.reserved_prefix() {
            return Err(ApiError::Unauthorized(format!(
                "the token's sub may not start with {prefix:?}: Ferry names its own actors so"
            )));
        }
        Ok(Caller {
            tenant,
            actor,
            scopes: claims
                .scope
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_string)
                .collect(),
            roles: claims.roles.iter().filter_map(|r| Role::parse(r)).collect(),
            expires_at: claims.exp,
        })
    }

    async fn jwks_key(&self, kid: &str) -> Result<DecodingKey, ApiError> {
        let Self::Jwks {
            url, keys, client, ..
        } = self
        else {
            return Err(ApiError::internal("not a JWKS verifier"));
        };
        if let Some(key) = keys.read().await.0.get(kid) {
            return Ok(key.clone());
        }
        let mut guard = keys.write().await;
        // Refetch at most every 30 s, so unknown kids cannot hammer the key server.
        let recently = guard
            .1
            .is_some_and(|t| t.elapsed() < Duration::from_secs(30));
        if !recently || guard.0.is_empty() {
            let fetched = async {
                let set: JwkSet = client
                    .get(url)
                    .send()
                    .await?
                    .error_for_status()?
                    .json()
                    .await?;
                Ok::<_, reqwest::Error>(set)
            }
            .await
            .map_err(|e| {
                ApiError::Unavailable(format!("cannot fetch JWKS from {url}: {e}").into())
            })?;
            guard.0 = fetched
                .keys
                .iter()
                .filter_map(|jwk| {
                    let kid = jwk.common.key_id.clone()?;
                    DecodingKey::from_jwk(jwk).ok().map(|k| (kid, k))
                })
                .collect();
            guard.1 = Some(Instant::now());
        }
        guard
            .0
            .get(kid)
            .cloned()
            .ok_or_else(|| ApiError::Unauthorized(format!("no key {kid:?} in the JWKS")))
    }
}

/// Why a key could not be loaded or made.
#[derive(Debug, thiserror::Error)]
#[error("key file {path}")]
pub struct KeyError {
    path: String,
    source: std::io::Error,
}

/// The file the embedded default keeps its HS256 key in.
pub const KEY_FILE: &str = "jwt-hs256.key";

/// Reads the embedded HS256 key from the data dir, creating it (mode 0600) on first use.
pub fn load_or_create_key(data_dir: &Path) -> Result<Vec<u8>, KeyError> {
    load_or_create_key_file(data_dir, KEY_FILE)
}

/// Reads a 32-byte key kept (base64) in `data_dir/name`, creating it (mode 0600) on first use.
///
/// A key file that is not a regular file of its own (a link), or that the group or others
/// may read or write, is refused naming the file: whoever could read it could sign tokens
/// (or fingerprints) for every tenant, and whoever could write it could choose the key.
pub fn load_or_create_key_file(data_dir: &Path, name: &str) -> Result<Vec<u8>, KeyError> {
    use base64::Engine;
    let path = data_dir.join(name);
    let err = |source| KeyError {
        path: path.display().to_string(),
        source,
    };
    match std::fs::symlink_metadata(&path) {
        Ok(_) => {
            let text = read_owner_only(&path).map_err(err)?;
            return base64::engine::general_purpose::STANDARD
                .decode(text.trim())
                .map_err(|e| err(std::io::Error::new(std::io::ErrorKind::InvalidData, e)));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    std::fs::create_dir_all(data_dir).map_err(err)?;
    let key: [u8; 32] = rand::random();
    let text = base64::engine::general_purpose::STANDARD.encode(key);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        // Owner-only from its first byte: never readable by others, not even for a moment.
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    match options.open(&path) {
        Ok(mut f) => {
            use std::io::Write;
            f.write_all(text.as_bytes()).map_err(err)?;
            Ok(key.to_vec())
        }
        // Another process created it first: use theirs.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            load_or_create_key_file(data_dir, name)
        }
        Err(e) => Err(err(e)),
    }
}

/// Reads a secret file that must be a regular file only its owner may read or write.
fn read_owner_only(path: &Path) -> std::io::Result<String> {
    use std::io::{Error, ErrorKind, Read};
    let named = std::fs::symlink_metadata(path)?;
    if !named.file_type().is_file() {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "is not a regular file (a link or a folder); Ferry reads its keys only from its own files",
        ));
    }
    let mut file = std::fs::File::open(path)?;
    let opened = file.metadata()?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        // The file opened must be the one checked (not swapped for another in between).
        if (opened.dev(), opened.ino()) != (named.dev(), named.ino()) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "changed while it was being read",
            ));
        }
        let mode = opened.mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "the group or others may use it (mode {mode:o}); a key others can read or write is refused: \
                     make it owner-only (chmod 600), or replace it if others may have read it"
                ),
            ));
        }
    }
    let mut text = String::new();
    file.read_to_string(&mut text)?;
    Ok(text)
}

/// Signs an HS256 token (for `ferry token` and tests).
pub fn issue_hs256(
    key: &[u8],
    tenant: &str,
    sub: &str,
    scopes: &[&str],
    roles: &[&str],
    ttl: Duration,
) -> Result<String, jsonwebtoken::errors::Error> {
    let now = chrono::Utc::now().timestamp().max(0) as u64;
    let claims = Claims {
        sub: sub.to_string(),
        tenant: Some(tenant.to_string()),
        scope: Some(scopes.join(" ")),
        roles: roles.iter().map(|r| r.to_string()).collect(),
        exp: now + ttl.as_secs(),
        iat: Some(now),
        iss: None,
        aud: None,
    };
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(key),
    )
}

#[cfg(test)]
#[cfg(unix)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(path: &Path) -> u32 {
        std::fs::symlink_metadata(path)
            .unwrap()
            .permissions()
            .mode()
            & 0o777
    }

    #[test]
    fn a_new_key_file_is_owner_only_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let key = load_or_create_key(&data).unwrap();
        assert_eq!(key.len(), 32);
        assert_eq!(mode(&data.join(KEY_FILE)), 0o600);
        assert_eq!(load_or_create_key(&data).unwrap(), key);
        load_or_create_key_file(&data, "secret-fingerprint.key").unwrap();
        assert_eq!(mode(&data.join("secret-fingerprint.key")), 0o600);
    }

    /// A key file the group or others may read or write is refused, naming the file; so is
    /// one that is a link (to wherever it leads).
    #[test]
    fn a_key_file_others_can_reach_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        for name in [KEY_FILE, "secret-fingerprint.key"] {
            let path = dir.path().join(name);
            load_or_create_key_file(dir.path(), name).unwrap();
            for loose in [0o644, 0o640, 0o604, 0o620, 0o602, 0o666] {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(loose)).unwrap();
                let err = load_or_create_key_file(dir.path(), name).unwrap_err();
                let text = format!("{err}: {}", err.source);
                assert!(text.contains(&path.display().to_string()), "{text}");
                assert!(text.contains(&format!("mode {loose:o}")), "{text}");
                assert_eq!(err.source.kind(), std::io::ErrorKind::PermissionDenied);
            }
            for owner_only in [0o600, 0o400] {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(owner_only))
                    .unwrap();
                assert!(load_or_create_key_file(dir.path(), name).is_ok());
            }
        }
        let elsewhere = dir.path().join("elsewhere.key");
        std::fs::copy(dir.path().join(KEY_FILE), &elsewhere).unwrap();
        std::fs::remove_file(dir.path().join(KEY_FILE)).unwrap();
        std::os::unix::fs::symlink(&elsewhere, dir.path().join(KEY_FILE)).unwrap();
        let err = load_or_create_key(dir.path()).unwrap_err();
        assert!(
            err.source.to_string().contains("not a regular file"),
            "{err:?}"
        );
    }
}
