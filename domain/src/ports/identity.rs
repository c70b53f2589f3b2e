//! The runner identity: what a tenant's program may act as (its Pulumi backend, its state
//! passphrase, its cloud credentials), and nothing of Ferry's.
//!
//! A runner that runs the program itself (the Pulumi CLI) or hands it to a remote runner
//! (HTTP) gives it only its tenant's identity: the variables of [`RunnerIdentity`], resolved
//! for each run from the operator's [`RunnerIdentities`] (`FERRY_RUNNER_IDENTITIES`: per
//! tenant, a backend and secret references, each resolved through that tenant's own secret
//! scope, so confined like the tenant's own references). The rules, checked when the
//! setting is read:
//!
//! * two tenants never share a backend (an `http(s)://` service such as Pulumi Cloud may be
//!   shared: there the tenant's own token, in its variables, decides what it reaches; any
//!   other backend holds the state itself, so none may equal or contain another's), a
//!   passphrase reference or a credential reference;
//! * every reference is in the tenant's own scope ([`Confinement::check_secret`]);
//! * the variables named are neither Ferry's own nor those the runner sets itself.
//!
//! A tenant without an identity gets none: its runs fail naming the setting, unless the
//! operator declared one shared identity on purpose (`FERRY_RUNNER_SHARED_IDENTITY`: the
//! server's variables handed to every tenant without one; for single-tenant installations).

use super::sources::SecretResolver;
use super::SecretValue;
use crate::confinement::{is_ferry_variable, Confinement};
use crate::ids::TenantId;
use crate::values::SecretRef;
use std::collections::BTreeMap;
use std::fmt;

/// The setting naming each tenant's identity.
pub const IDENTITIES_SETTING: &str = "FERRY_RUNNER_IDENTITIES";
/// The setting declaring one identity shared by the tenants without their own.
pub const SHARED_SETTING: &str = "FERRY_RUNNER_SHARED_IDENTITY";

/// The variable a tenant's backend goes in.
pub const BACKEND_VARIABLE: &str = "PULUMI_BACKEND_URL";
/// The variable a tenant's state passphrase goes in.
pub const PASSPHRASE_VARIABLE: &str = "PULUMI_CONFIG_PASSPHRASE";

/// Variables the runner sets itself for every child (see `runners/src/pulumi.rs`): never
/// part of an identity. `LC_*` are locale variables too.
pub const RUNNER_VARIABLES: &[&str] = &[
    "PATH",
    "HOME",
    "TMPDIR",
    "LANG",
    "TZ",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "PULUMI_HOME",
    "PULUMI_SKIP_UPDATE_CHECK",
];

/// Whether the runner sets `name` itself ([`RUNNER_VARIABLES`], `LC_*`).
pub fn is_runner_variable(name: &str) -> bool {
    RUNNER_VARIABLES.contains(&name) || name.starts_with("LC_")
}

/// Why an identity setting cannot be used (start-up stops naming it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {reason}")]
pub struct IdentitySettingError {
    /// [`IDENTITIES_SETTING`] or [`SHARED_SETTING`].
    pub setting: &'static str,
    /// Why.
    pub reason: String,
}

fn refused(setting: &'static str, reason: impl Into<String>) -> IdentitySettingError {
    IdentitySettingError {
        setting,
        reason: reason.into(),
    }
}

/// Why a name cannot be a variable of an identity ([`VariableName::parse`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VariableNameError {
    /// Not `[A-Za-z_][A-Za-z0-9_]*`.
    #[error("{0:?} is not a variable name")]
    NotAName(String),
    /// One of Ferry's own settings (`FERRY_*`, `NATS_*`, `DATABASE_URL`).
    #[error("{0} is one of Ferry's own settings")]
    Ferrys(String),
    /// One the runner sets itself ([`RUNNER_VARIABLES`], `LC_*`).
    #[error("{0} is set by the runner itself")]
    Runners(String),
}

/// A variable an identity sets: `[A-Za-z_][A-Za-z0-9_]*`, neither Ferry's own
/// (`FERRY_*`, `NATS_*`, `DATABASE_URL`) nor one the runner sets itself.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VariableName(String);

impl VariableName {
    /// Validates a name.
    pub fn parse(name: &str) -> Result<Self, VariableNameError> {
        let mut chars = name.chars();
        let first_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(VariableNameError::NotAName(name.to_string()));
        }
        if is_ferry_variable(name) {
            return Err(VariableNameError::Ferrys(name.to_string()));
        }
        if is_runner_variable(name) {
            return Err(VariableNameError::Runners(name.to_string()));
        }
        Ok(Self(name.to_string()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for VariableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One tenant's identity as the operator declared it: references, not values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentitySpec {
    /// The Pulumi backend URL (`PULUMI_BACKEND_URL`), e.g. `s3://state-acme`.
    pub backend: String,
    /// The state passphrase (`PULUMI_CONFIG_PASSPHRASE`), if the backend's secrets
    /// provider needs one.
    pub passphrase: Option<SecretRef>,
    /// Further variables (cloud credentials), each from a secret reference.
    pub env: BTreeMap<VariableName, SecretRef>,
}

impl IdentitySpec {
    fn references(&self) -> impl Iterator<Item = &SecretRef> {
        self.passphrase.iter().chain(self.env.values())
    }
}

/// A resolved identity: the variables a tenant's program runs with. Values never show in
/// `Debug`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RunnerIdentity {
    vars: BTreeMap<String, SecretValue>,
}

impl RunnerIdentity {
    /// An identity of these variables.
    pub fn new(vars: BTreeMap<String, SecretValue>) -> Self {
        Self { vars }
    }

    /// The shared identity of [`SHARED_SETTING`]: each named variable with the value
    /// `lookup` gives it in the server's environment (unset ones are left out). Ferry's own
    /// variables and those the runner sets are refused.
    pub fn shared<S: AsRef<str>>(
        names: &[S],
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, IdentitySettingError> {
        let mut vars = BTreeMap::new();
        for name in names {
            let name = VariableName::parse(name.as_ref())
                .map_err(|r| refused(SHARED_SETTING, r.to_string()))?;
            if let Some(value) = lookup(name.as_str()) {
                vars.insert(name.0, SecretValue::new(value));
            }
        }
        Ok(Self { vars })
    }

    /// The variables, by name.
    pub fn vars(&self) -> &BTreeMap<String, SecretValue> {
        &self.vars
    }

    /// The values, to redact output with.
    pub fn values(&self) -> impl Iterator<Item = &SecretValue> {
        self.vars.values()
    }
}

/// Why a tenant's identity cannot be had for a run (the run fails with it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The operator named none for the tenant and declared no shared one.
    #[error("{}", missing_identity(.0))]
    Missing(TenantId),
    /// A reference of the identity did not resolve.
    #[error("the runner identity of tenant {tenant} ({IDENTITIES_SETTING}): {reason}")]
    Unresolved {
        /// The tenant.
        tenant: TenantId,
        /// The failed reference and why (never a value).
        reason: String,
    },
}

/// The reason a run of `tenant` fails without an identity: names the settings.
pub fn missing_identity(tenant: &TenantId) -> String {
    format!(
        "tenant {tenant} has no runner identity: {IDENTITIES_SETTING} names none for it, and no shared identity is declared ({SHARED_SETTING})"
    )
}

/// Every tenant's identity, and the shared one if the operator declared it.
#[derive(Debug, Clone, Default)]
pub struct RunnerIdentities {
    tenants: BTreeMap<TenantId, IdentitySpec>,
    shared: Option<RunnerIdentity>,
}

impl RunnerIdentities {
    /// No identity for anyone (the simulated runner needs none).
    pub fn none() -> Self {
        Self::default()
    }

    /// Only `identity`, for every tenant (a single-tenant installation's shared identity).
    pub fn shared(identity: RunnerIdentity) -> Self {
        Self {
            tenants: BTreeMap::new(),
            shared: Some(identity),
        }
    }

    /// Checks the rules of the module doc against `confinement`.
    pub fn new(
        tenants: BTreeMap<TenantId, IdentitySpec>,
        shared: Option<RunnerIdentity>,
        confinement: &Confinement,
    ) -> Result<Self, IdentitySettingError> {
        let fail = |r: String| refused(IDENTITIES_SETTING, r);
        let mut owner_of: BTreeMap<&str, &TenantId> = BTreeMap::new();
        let mut backends: Vec<(&TenantId, &str)> = Vec::new();
        for (tenant, spec) in &tenants {
            check_backend(&spec.backend).map_err(|r| fail(format!("tenant {tenant}: {r}")))?;
            for name in spec.env.keys() {
                if [BACKEND_VARIABLE, PASSPHRASE_VARIABLE].contains(&name.as_str()) {
                    return Err(fail(format!(
                        "tenant {tenant}: {name} comes from `backend` or `passphrase`, not `env`"
                    )));
                }
            }
            for reference in spec.references() {
                confinement
                    .check_secret(tenant, reference)
                    .map_err(|r| fail(format!("tenant {tenant}: {reference}: {r}")))?;
                if let Some(other) = owner_of.insert(reference.as_str(), tenant) {
                    if other != tenant {
                        return Err(fail(format!(
                            "tenants {other} and {tenant} both name {reference}: two tenants never share a passphrase or credentials"
                        )));
                    }
                }
            }
            for (other, theirs) in &backends {
                if backends_overlap(theirs, &spec.backend) {
                    return Err(fail(format!(
                        "tenants {other} and {tenant} share the backend {}: two tenants never share state",
                        spec.backend
                    )));
                }
            }
            backends.push((tenant, &spec.backend));
        }
        Ok(Self { tenants, shared })
    }

    /// Whether a shared identity is declared.
    pub fn has_shared(&self) -> bool {
        self.shared.is_some()
    }

    /// The tenants with an identity of their own.
    pub fn tenants(&self) -> impl Iterator<Item = &TenantId> {
        self.tenants.keys()
    }

    /// The identity a run of `tenant` gets: its own, each reference resolved through its own
    /// secret scope; else the shared one if declared; else [`IdentityError::Missing`].
    pub async fn resolve(
        &self,
        tenant: &TenantId,
        secrets: &dyn SecretResolver,
    ) -> Result<RunnerIdentity, IdentityError> {
        let Some(spec) = self.tenants.get(tenant) else {
            return self
                .shared
                .clone()
                .ok_or_else(|| IdentityError::Missing(tenant.clone()));
        };
        let mut vars = BTreeMap::new();
        vars.insert(
            BACKEND_VARIABLE.to_string(),
            SecretValue::new(spec.backend.clone()),
        );
        let named = spec
            .passphrase
            .iter()
            .map(|r| (PASSPHRASE_VARIABLE, r))
            .chain(spec.env.iter().map(|(n, r)| (n.as_str(), r)));
        for (name, reference) in named {
            let resolved = secrets.resolve(tenant, reference).await.map_err(|e| {
                IdentityError::Unresolved {
                    tenant: tenant.clone(),
                    reason: e.to_string(),
                }
            })?;
            vars.insert(name.to_string(), resolved.value);
        }
        Ok(RunnerIdentity { vars })
    }
}

/// A backend that is not a URL ([`check_backend`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("backend {0:?} is not a URL like s3://bucket or https://api.pulumi.com")]
struct NotABackend(String);

/// A backend URL: `scheme://…`, no control characters, no spaces.
fn check_backend(backend: &str) -> Result<(), NotABackend> {
    let scheme_ok = backend.split_once("://").is_some_and(|(scheme, rest)| {
        !scheme.is_empty()
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
            && !rest.is_empty()
    });
    if !scheme_ok || backend.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(NotABackend(backend.to_string()));
    }
    Ok(())
}

/// Whether two backends would hold each other's state: not for `http(s)://` services
/// (the tenant's token decides there); else when one equals the other or lies under it,
/// compared by scheme and path segments, the query left out.
fn backends_overlap(a: &str, b: &str) -> bool {
    let location = |url: &str| -> (String, Vec<String>) {
        let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
        let rest = rest.split(['?', '#']).next().unwrap_or_default();
        let segments = rest
            .split('/')
            .filter(|s| !s.is_empty() && *s != ".")
            .map(str::to_string)
            .collect();
        (scheme.to_ascii_lowercase(), segments)
    };
    let ((sa, pa), (sb, pb)) = (location(a), location(b));
    if sa != sb || sa == "http" || sa == "https" {
        return false;
    }
    // `..` could climb into the other's folder: treat it as overlapping.
    if pa.iter().chain(&pb).any(|s| s == "..") {
        return true;
    }
    pa.starts_with(&pb) || pb.starts_with(&pa)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::confinement::ConfinementSettings;
    use crate::ports::sources::{ResolvedSecret, SecretError};
    use std::path::PathBuf;

    fn tenant(t: &str) -> TenantId {
        TenantId::parse(t).unwrap_or_else(|e| panic!("{e}"))
    }

    fn secret(r: &str) -> SecretRef {
        SecretRef::parse(r).unwrap_or_else(|e| panic!("{e}"))
    }

    fn confinement() -> Confinement {
        Confinement::new(ConfinementSettings {
            ferry: crate::confinement::FerryFiles {
                data_dir: PathBuf::from("/var/lib/ferry"),
                ..Default::default()
            },
            env_prefix: "TENANT_{tenant}".into(),
            vault_prefix: "{tenant}/".into(),
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn spec(backend: &str, passphrase: &str, key: &str) -> IdentitySpec {
        IdentitySpec {
            backend: backend.into(),
            passphrase: Some(secret(passphrase)),
            env: BTreeMap::from([(
                VariableName::parse("AWS_SECRET_ACCESS_KEY").unwrap_or_else(|e| panic!("{e}")),
                secret(key),
            )]),
        }
    }

    fn acme() -> IdentitySpec {
        spec(
            "s3://state/acme",
            "vault://acme/pulumi#passphrase",
            "vault://acme/aws#secret",
        )
    }

    fn build(specs: Vec<(&str, IdentitySpec)>) -> Result<RunnerIdentities, IdentitySettingError> {
        RunnerIdentities::new(
            specs.into_iter().map(|(t, s)| (tenant(t), s)).collect(),
            None,
            &confinement(),
        )
    }

    /// Resolves `vault://<tenant>/…` to `<reference>@<tenant>`, and refuses anything else.
    struct Scoped;

    #[async_trait::async_trait]
    impl SecretResolver for Scoped {
        async fn resolve(
            &self,
            tenant: &TenantId,
            reference: &SecretRef,
        ) -> Result<ResolvedSecret, SecretError> {
            confinement()
                .check_secret(tenant, reference)
                .map_err(|r| SecretError {
                    reference: reference.to_string(),
                    reason: r.to_string(),
                })?;
            Ok(ResolvedSecret {
                value: SecretValue::new(format!("{reference}@{tenant}")),
                version: "v1".into(),
            })
        }
    }

    #[test]
    fn variables_of_ferry_or_of_the_runner_are_refused() {
        for bad in [
            "FERRY_JWT_HS256_KEY",
            "DATABASE_URL",
            "NATS_URL",
            "PATH",
            "HOME",
            "LC_ALL",
            "PULUMI_HOME",
            "1X",
            "A-B",
            "",
            "A B",
        ] {
            assert!(VariableName::parse(bad).is_err(), "{bad}");
        }
        assert!(VariableName::parse("AWS_ACCESS_KEY_ID").is_ok());
        assert!(VariableName::parse("_X1").is_ok());
    }

    #[test]
    fn two_tenants_never_share_a_backend_a_passphrase_or_credentials() {
        let other = |backend: &str, passphrase: &str, key: &str| {
            build(vec![
                ("acme", acme()),
                ("globex", spec(backend, passphrase, key)),
            ])
        };
        let ok = other(
            "s3://state/globex",
            "vault://globex/pulumi#passphrase",
            "vault://globex/aws#secret",
        );
        assert!(ok.is_ok(), "{ok:?}");
        for (backend, why) in [
            ("s3://state/acme", "the same backend"),
            ("s3://state", "a backend holding acme's"),
            ("S3://state/acme/sub/", "a backend inside acme's"),
            ("s3://state/acme?region=eu-west-1", "the same with a query"),
            ("s3://state/x/../acme", "a climbing path"),
        ] {
            let e = other(
                backend,
                "vault://globex/pulumi#passphrase",
                "vault://globex/aws#secret",
            )
            .unwrap_err();
            assert_eq!(e.setting, IDENTITIES_SETTING, "{why}");
            assert!(e.reason.contains("share the backend"), "{why}: {e}");
        }
        // A service backend is shared by design: the tenant's token decides there.
        let cloud = |t: &str| {
            spec(
                "https://api.pulumi.com",
                &format!("vault://{t}/pulumi#passphrase"),
                &format!("vault://{t}/aws#secret"),
            )
        };
        assert!(build(vec![("acme", cloud("acme")), ("globex", cloud("globex"))]).is_ok());
        // A reference outside the tenant's scope is refused, naming the tenant.
        let e = other(
            "s3://state/globex",
            "vault://acme/pulumi#passphrase",
            "vault://globex/aws#secret",
        )
        .unwrap_err();
        assert!(e.reason.contains("tenant globex"), "{e}");
    }

    #[test]
    fn one_reference_for_two_tenants_is_refused_even_in_scope() {
        // A shared Vault prefix (empty = any path) lets both tenants reach the same path.
        let open = Confinement::new(ConfinementSettings {
            ferry: crate::confinement::FerryFiles {
                data_dir: PathBuf::from("/var/lib/ferry"),
                ..Default::default()
            },
            env_prefix: "TENANT_{tenant}".into(),
            vault_prefix: String::new(),
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let shared = |backend: &str| spec(backend, "vault://kv/pulumi#pass", "vault://kv/aws#key");
        let e = RunnerIdentities::new(
            BTreeMap::from([
                (tenant("acme"), shared("s3://a")),
                (tenant("globex"), shared("s3://g")),
            ]),
            None,
            &open,
        )
        .unwrap_err();
        assert!(e.reason.contains("both name"), "{e}");
    }

    #[test]
    fn the_backend_and_passphrase_come_from_their_fields() {
        let mut s = acme();
        s.env.insert(
            VariableName::parse(PASSPHRASE_VARIABLE).unwrap_or_else(|e| panic!("{e}")),
            secret("vault://acme/other#p"),
        );
        assert!(build(vec![("acme", s)]).is_err());
        let mut s = acme();
        s.backend = "state-acme".into();
        assert!(build(vec![("acme", s)]).is_err());
    }

    #[tokio::test]
    async fn each_tenant_resolves_its_own_identity_and_none_without_one() {
        let ids = build(vec![("acme", acme())]).unwrap_or_else(|e| panic!("{e}"));
        let got = ids
            .resolve(&tenant("acme"), &Scoped)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let vars: BTreeMap<&str, &str> = got
            .vars()
            .iter()
            .map(|(k, v)| (k.as_str(), v.expose()))
            .collect();
        assert_eq!(
            vars,
            BTreeMap::from([
                ("AWS_SECRET_ACCESS_KEY", "vault://acme/aws#secret@acme"),
                (BACKEND_VARIABLE, "s3://state/acme"),
                (PASSPHRASE_VARIABLE, "vault://acme/pulumi#passphrase@acme"),
            ])
        );
        let e = ids.resolve(&tenant("globex"), &Scoped).await.unwrap_err();
        assert_eq!(e, IdentityError::Missing(tenant("globex")));
        assert!(e.to_string().contains(IDENTITIES_SETTING), "{e}");
        assert!(e.to_string().contains(SHARED_SETTING), "{e}");
    }

    #[tokio::test]
    async fn the_shared_identity_serves_only_tenants_without_one_and_only_when_declared() {
        let server = |name: &str| match name {
            "PULUMI_BACKEND_URL" => Some("file:///srv/state".to_string()),
            "AWS_PROFILE" => Some("ops".to_string()),
            _ => None,
        };
        let shared =
            RunnerIdentity::shared(&["PULUMI_BACKEND_URL", "AWS_PROFILE", "UNSET"], server)
                .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(shared.vars().len(), 2);
        let ids = RunnerIdentities::new(
            BTreeMap::from([(tenant("acme"), acme())]),
            Some(shared.clone()),
            &confinement(),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            ids.resolve(&tenant("globex"), &Scoped).await,
            Ok(shared.clone())
        );
        assert_ne!(ids.resolve(&tenant("acme"), &Scoped).await, Ok(shared));
        for bad in ["FERRY_VAULT_TOKEN", "DATABASE_URL", "NATS_CREDS", "HOME"] {
            let e = RunnerIdentity::shared(&[bad], server).unwrap_err();
            assert_eq!(e.setting, SHARED_SETTING, "{bad}");
        }
    }
}
