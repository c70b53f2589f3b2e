//! Validated value types of the provisioning context: kinds, states, classes, program
//! references and configuration/secret references.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// Why a value was refused. `field`-free: the caller knows which field it parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    /// The value was empty or blank.
    #[error("must not be empty")]
    Empty,
    /// The value was longer than allowed.
    #[error("must be at most {max} characters")]
    TooLong {
        /// The limit.
        max: usize,
    },
    /// The value contained whitespace or control characters.
    #[error("must not contain whitespace or control characters")]
    Whitespace,
    /// A program version that is not a commit id.
    #[error("must be a Git commit id (7 to 64 hexadecimal characters)")]
    NotACommit,
    /// A reference that is not a URI of an accepted scheme.
    #[error("must be a reference URI ({allowed}), not a value")]
    NotAReference {
        /// The accepted schemes, for the message.
        allowed: &'static str,
    },
    /// A reference whose scheme is known but whose remainder is malformed.
    #[error("{0}")]
    MalformedReference(&'static str),
    /// A map key that is not a usable name.
    #[error("key {key:?} must be 1 to 256 characters without whitespace, control or invisible characters")]
    BadKey {
        /// The offending key.
        key: String,
    },
    /// A reference inside a map that was refused.
    #[error("{key}: {reason}")]
    InMap {
        /// The key whose reference was refused.
        key: String,
        /// Why.
        reason: Box<ValueError>,
    },
}

fn check_token(value: &str, max: usize) -> Result<(), ValueError> {
    if value.trim().is_empty() {
        return Err(ValueError::Empty);
    }
    if value.chars().count() > max {
        return Err(ValueError::TooLong { max });
    }
    if value.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(ValueError::Whitespace);
    }
    Ok(())
}

/// What a specification describes (`SpecificationKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum SpecificationKind {
    /// The environment's own infrastructure (its baseline).
    Environment,
    /// A workload deployed into the environment.
    Workload,
}

impl SpecificationKind {
    /// The stable name used in ids, storage and filters.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Environment => "Environment",
            Self::Workload => "Workload",
        }
    }
}

/// Why a provisioning run exists (`ProvisioningKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ProvisioningKind {
    /// The environment's baseline infrastructure.
    Baseline,
    /// A release handed over by a promotion.
    Release,
    /// A scheduled re-plan that found drift.
    Reconciliation,
    /// Tearing an environment down.
    Decommission,
}

impl ProvisioningKind {
    /// The stable name used in storage and filters.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Baseline => "Baseline",
            Self::Release => "Release",
            Self::Reconciliation => "Reconciliation",
            Self::Decommission => "Decommission",
        }
    }
}

/// The life-cycle state of a provisioning run (`ProvisioningState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ProvisioningState {
    /// Recorded, waiting for the planner.
    Requested,
    /// A plan receipt exists; the run may apply or must wait for approval.
    Planned,
    /// Production apply without an approval: waits for a decision.
    AwaitingApproval,
    /// Authorised; the runner applies the plan.
    Applying,
    /// The runner succeeded; outputs are recorded.
    Applied,
    /// Planning or apply failed; the reason is recorded.
    Failed,
    /// The approval was refused or expired.
    Rejected,
    /// Cancelled before apply.
    Cancelled,
    /// The plan went stale before apply and will never be applied.
    Superseded,
    /// A reconciliation found nothing to change: the environment is as declared.
    InSync,
}

impl ProvisioningState {
    /// Every state, for filters and documentation.
    pub const ALL: [Self; 10] = [
        Self::Requested,
        Self::Planned,
        Self::AwaitingApproval,
        Self::Applying,
        Self::Applied,
        Self::Failed,
        Self::Rejected,
        Self::Cancelled,
        Self::Superseded,
        Self::InSync,
    ];

    /// The stable name used in storage and filters.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Requested => "Requested",
            Self::Planned => "Planned",
            Self::AwaitingApproval => "AwaitingApproval",
            Self::Applying => "Applying",
            Self::Applied => "Applied",
            Self::Failed => "Failed",
            Self::Rejected => "Rejected",
            Self::Cancelled => "Cancelled",
            Self::Superseded => "Superseded",
            Self::InSync => "InSync",
        }
    }

    /// True once nothing more can happen to the run.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Applied
                | Self::Failed
                | Self::Rejected
                | Self::Cancelled
                | Self::Superseded
                | Self::InSync
        )
    }
}

impl fmt::Display for ProvisioningState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The class of an environment; production carries the approval rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EnvironmentClass {
    /// Development.
    Development,
    /// Test.
    Test,
    /// Staging.
    Staging,
    /// Production.
    Production,
}

impl EnvironmentClass {
    /// Its name as serialized (`development`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Development => "development",
            Self::Test => "test",
            Self::Staging => "staging",
            Self::Production => "production",
        }
    }
}

/// Whether production rules apply: an unknown class counts as production, so that a run
/// never escapes approval because Ferry has not heard of its environment yet.
pub fn is_production(class: Option<EnvironmentClass>) -> bool {
    !matches!(
        class,
        Some(EnvironmentClass::Development | EnvironmentClass::Test | EnvironmentClass::Staging)
    )
}

macro_rules! text_value {
    ($(#[$doc:meta])* $name:ident, $check:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Validates and wraps the value.
            pub fn parse(value: impl Into<String>) -> Result<Self, ValueError> {
                let value = value.into();
                let check: fn(&str) -> Result<(), ValueError> = $check;
                check(&value)?;
                Ok(Self(value))
            }
            /// The value as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }
        impl TryFrom<String> for $name {
            type Error = ValueError;
            fn try_from(value: String) -> Result<Self, ValueError> {
                Self::parse(value)
            }
        }
        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.0
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

text_value!(
    /// `<repository>#<folder>`: where the IaC program lives. The repository is a local path,
    /// a `file://` or an `https://` URL; the folder is optional.
    ProgramRef,
    |v| {
        check_token(v, 1024)?;
        let repository = v.split('#').next().unwrap_or_default();
        if repository.is_empty() {
            return Err(ValueError::MalformedReference(
                "the repository part before '#' must not be empty",
            ));
        }
        if v.matches('#').count() > 1 {
            return Err(ValueError::MalformedReference(
                "must be <repository>#<folder> with at most one '#'",
            ));
        }
        Ok(())
    }
);

text_value!(
    /// The Git commit of the program that a specification version acts on.
    ProgramVersion,
    |v| {
        if v.is_empty() {
            return Err(ValueError::Empty);
        }
        if !(7..=64).contains(&v.len()) || !v.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(ValueError::NotACommit);
        }
        Ok(())
    }
);

text_value!(
    /// A Pulumi resource URN as a plan lists it
    /// (`urn:pulumi:<stack>::<project>::<type>::<name>`).
    ResourceUrn,
    |v| {
        check_token(v, 1024)?;
        if !v.starts_with("urn:pulumi:") || v.split("::").count() < 4 {
            return Err(ValueError::MalformedReference(
                "must be a Pulumi URN as the plan lists it: urn:pulumi:<stack>::<project>::<type>::<name>",
            ));
        }
        Ok(())
    }
);

text_value!(
    /// A property of a resource as a plan names its differences (`tags`, `tags.owner`):
    /// names separated by `.`, none empty.
    PropertyPath,
    |v| {
        check_token(v, 256)?;
        if v.split('.').any(str::is_empty) {
            return Err(ValueError::MalformedReference(
                "must be property names separated by '.', none empty (e.g. tags or tags.owner)",
            ));
        }
        Ok(())
    }
);

text_value!(
    /// A reference to the receipt of the Factory run that asked for a promotion (e.g. a URI of
    /// the deploy-environment tool's receipt): evidence kept on the promotion, never authority.
    ReceiptRef,
    |v| check_token(v, 1024)
);

text_value!(
    /// The roll-out strategy named by the specification (e.g. `rolling`, `blue-green`).
    Strategy,
    |v| check_token(v, 64)
);

text_value!(
    /// An `http://` or `https://` URL verification sends a GET to (a health URL, a smoke
    /// check). Set only by a PlatformAdmin or a service (release and environment records).
    ProbeUrl,
    |v| {
        check_token(v, 2048)?;
        if !(v.starts_with("http://") || v.starts_with("https://")) || !v.contains("//") {
            return Err(ValueError::MalformedReference("must be an http:// or https:// URL"));
        }
        Ok(())
    }
);

const SECRET_SCHEMES: &str = "env://NAME, file:///path or vault://mount/path#key";
const CONFIG_SCHEMES: &str = "file:///path, http://… or https://…";

text_value!(
    /// A reference to a secret, resolved only when the runner needs it: `env://NAME`,
    /// `file:///absolute/path` or `vault://mount/path#key`. Never a secret value.
    SecretRef,
    |v| {
        check_token(v, 1024).map_err(|e| match e {
            // A value with spaces is more likely a pasted secret than a reference.
            ValueError::Whitespace => ValueError::NotAReference {
                allowed: SECRET_SCHEMES,
            },
            other => other,
        })?;
        if let Some(name) = v.strip_prefix("env://") {
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_')
            {
                return Err(ValueError::MalformedReference(
                    "env:// must name a variable of letters, digits and '_'",
                ));
            }
            return Ok(());
        }
        if let Some(path) = v.strip_prefix("file://") {
            if !path.starts_with('/') || path.len() < 2 {
                return Err(ValueError::MalformedReference(
                    "file:// must be followed by an absolute path (file:///path)",
                ));
            }
            return Ok(());
        }
        if let Some(rest) = v.strip_prefix("vault://") {
            let (path, key) = rest.split_once('#').unwrap_or((rest, ""));
            if !path.contains('/') || path.starts_with('/') || key.is_empty() {
                return Err(ValueError::MalformedReference(
                    "vault:// must be vault://mount/path#key",
                ));
            }
            return Ok(());
        }
        Err(ValueError::NotAReference {
            allowed: SECRET_SCHEMES,
        })
    }
);

text_value!(
    /// A reference to configuration values: `file:///path` (JSON or YAML) or an
    /// `http(s)://` source.
    ConfigRef,
    |v| {
        check_token(v, 2048)?;
        if let Some(path) = v.strip_prefix("file://") {
            if !path.starts_with('/') || path.len() < 2 {
                return Err(ValueError::MalformedReference(
                    "file:// must be followed by an absolute path (file:///path)",
                ));
            }
            return Ok(());
        }
        for scheme in ["http://", "https://"] {
            if let Some(rest) = v.strip_prefix(scheme) {
                if rest.is_empty() || rest.starts_with('/') {
                    return Err(ValueError::MalformedReference(
                        "http(s):// must be followed by a host",
                    ));
                }
                return Ok(());
            }
        }
        Err(ValueError::NotAReference {
            allowed: CONFIG_SCHEMES,
        })
    }
);

/// Named references, in key order so that equal sets hash equally.
pub type RefMap<T> = BTreeMap<String, T>;

/// Validates a map of raw references into typed ones; the error names the key.
pub fn parse_ref_map<T>(
    raw: BTreeMap<String, String>,
    parse: impl Fn(String) -> Result<T, ValueError>,
) -> Result<RefMap<T>, ValueError> {
    raw.into_iter()
        .map(|(key, value)| {
            if key.is_empty()
                || key.len() > 256
                || key
                    .chars()
                    .any(|c| c.is_whitespace() || crate::text::is_hidden_or_control(c))
            {
                return Err(ValueError::BadKey { key });
            }
            match parse(value) {
                Ok(parsed) => Ok((key, parsed)),
                Err(reason) => Err(ValueError::InMap {
                    key,
                    reason: Box::new(reason),
                }),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_refs_must_be_references() {
        assert!(SecretRef::parse("env://DB_PASSWORD").is_ok());
        assert!(SecretRef::parse("file:///run/secrets/db").is_ok());
        assert!(SecretRef::parse("vault://kv/payments/db#password").is_ok());
        assert!(matches!(
            SecretRef::parse("hunter2"),
            Err(ValueError::NotAReference { .. })
        ));
        assert!(matches!(
            SecretRef::parse("correct horse battery staple"),
            Err(ValueError::NotAReference { .. })
        ));
        assert!(matches!(
            SecretRef::parse("vault://kv"),
            Err(ValueError::MalformedReference(_))
        ));
        assert!(matches!(
            SecretRef::parse("file://relative"),
            Err(ValueError::MalformedReference(_))
        ));
    }

    #[test]
    fn config_refs_and_maps() {
        assert!(ConfigRef::parse("https://config.example/app").is_ok());
        assert!(ConfigRef::parse("file:///etc/ferry/app.yaml").is_ok());
        assert!(ConfigRef::parse("region=eu").is_err());
        let raw = BTreeMap::from([("db".to_string(), "plain-value".to_string())]);
        let err = parse_ref_map(raw, SecretRef::parse).unwrap_err();
        assert!(err.to_string().starts_with("db: must be a reference URI"));
        let raw = BTreeMap::from([("a b".to_string(), "env://X".to_string())]);
        assert!(matches!(
            parse_ref_map(raw, SecretRef::parse),
            Err(ValueError::BadKey { .. })
        ));
    }

    #[test]
    fn program_refs_and_versions() {
        assert!(ProgramRef::parse("https://git.example/infra.git#stacks/web").is_ok());
        assert!(ProgramRef::parse("/srv/repos/infra").is_ok());
        assert!(ProgramRef::parse("#folder").is_err());
        assert!(ProgramRef::parse("a#b#c").is_err());
        assert!(ProgramVersion::parse("3f2a9c1").is_ok());
        assert_eq!(ProgramVersion::parse("main"), Err(ValueError::NotACommit));
    }

    #[test]
    fn unknown_class_counts_as_production() {
        assert!(is_production(None));
        assert!(is_production(Some(EnvironmentClass::Production)));
        assert!(!is_production(Some(EnvironmentClass::Staging)));
    }
}
