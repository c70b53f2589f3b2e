//! Identifier newtypes. Each is validated once, at the edge, and is then just a value:
//! a `TenantId` cannot be passed where an `EnvironmentId` is wanted.

use serde::{Deserialize, Serialize};
use std::fmt;
use uuid::Uuid;

/// Why a text identifier was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The identifier was empty.
    #[error("must not be empty")]
    Empty,
    /// The identifier was longer than allowed.
    #[error("must be at most {max} characters")]
    TooLong {
        /// The limit.
        max: usize,
    },
    /// The identifier held a character outside `[A-Za-z0-9._:-]`.
    #[error("may only contain letters, digits, '.', '_', ':' and '-' (found {found:?})")]
    BadCharacter {
        /// The first offending character.
        found: char,
    },
    /// A name held a control, format (zero-width, bidirectional) or other invisible
    /// character.
    #[error("must not contain control, format or invisible characters (found U+{:04X})", u32::from(*found))]
    HiddenCharacter {
        /// The first offending character.
        found: char,
    },
    /// A uuid identifier did not parse.
    #[error("must be a UUID")]
    NotUuid,
}

fn check_slug(value: &str, max: usize) -> Result<(), IdError> {
    if value.is_empty() {
        return Err(IdError::Empty);
    }
    if value.chars().count() > max {
        return Err(IdError::TooLong { max });
    }
    if let Some(found) = value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')))
    {
        return Err(IdError::BadCharacter { found });
    }
    Ok(())
}

macro_rules! text_id {
    ($(#[$doc:meta])* $name:ident, $max:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Validates and wraps an identifier.
            pub fn parse(value: impl Into<String>) -> Result<Self, IdError> {
                let value = value.into();
                check_slug(&value, $max)?;
                Ok(Self(value))
            }
            /// The identifier as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
            /// The identifier as one path component (a folder of its own): itself, except
            /// that `.` and `..`, valid identifiers but not folder names, are written
            /// `%2E` and `%2E%2E`. Injective, since `%` is not an identifier character.
            pub fn path_component(&self) -> String {
                if self.0.chars().all(|c| c == '.') {
                    "%2E".repeat(self.0.len())
                } else {
                    self.0.clone()
                }
            }
        }
        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(value: String) -> Result<Self, IdError> {
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

text_id!(
    /// The tenant a record belongs to; it comes from the caller's token, never from a body.
    TenantId,
    64
);
text_id!(
    /// An environment, as named by the environment service (e.g. `payments-prod`).
    EnvironmentId,
    128
);
text_id!(
    /// A project, as named by the project catalogue.
    ProjectId,
    128
);

// Two actors are equal when they name the same person (`Actor::same_person`): after
// Unicode compatibility normalisation and case folding, trimmed, without invisible
// characters, so every separation of duties (the requester never approves) holds against
// `Alice`, `alice ` or `alice` with a zero-width space. `Actor::parse`, used where a name
// arrives (a token, an inbound event), refuses invisible, bidirectional and control
// characters; names read back from stored events are taken as they were stored
// (`Deserialize`, through `TryFrom<String>`), so that old events keep loading. (Not a doc
// comment: the event schemas carry the type's doc.)
/// The identity that issued a command: the `sub` of the caller's token, or `system:<worker>`.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct Actor(String);

impl Actor {
    /// Validates an actor name that arrives: non-empty once trimmed, at most 256
    /// characters, and no control, format (zero-width, bidirectional) or other hidden
    /// characters (`crate::text::is_hidden_or_control`).
    pub fn parse(value: impl Into<String>) -> Result<Self, IdError> {
        let actor = Self::stored(value.into())?;
        if let Some(found) = crate::text::first_hidden_or_control(&actor.0) {
            return Err(IdError::HiddenCharacter { found });
        }
        Ok(actor)
    }
    /// An actor name read back from a stored event: non-empty, at most 256 characters, no
    /// control characters (what was refused when it was recorded).
    fn stored(value: String) -> Result<Self, IdError> {
        if value.trim().is_empty() {
            return Err(IdError::Empty);
        }
        if value.chars().count() > 256 {
            return Err(IdError::TooLong { max: 256 });
        }
        if let Some(found) = value.chars().find(|c| c.is_control()) {
            return Err(IdError::HiddenCharacter { found });
        }
        Ok(Self(value))
    }
    /// The actor as text, as it was given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// Whether `self` and `other` name the same person (see the type's documentation); the
    /// comparison every separation of duties makes.
    pub fn same_person(&self, other: &Actor) -> bool {
        self.person_key() == other.person_key()
    }
    /// The name in the form two names of one person share (`crate::text::person_key`).
    pub fn person_key(&self) -> String {
        crate::text::person_key(&self.0)
    }
    /// The prefix of Ferry's own actor names (`system:` for its workers, `nats:` for the
    /// sender of a NATS event) this name starts with, compared as people are. A token's
    /// subject or an approver an event names must not: it would pass for Ferry itself in
    /// the record.
    pub fn reserved_prefix(&self) -> Option<&'static str> {
        let key = self.person_key();
        ["system:", "nats:"]
            .into_iter()
            .find(|prefix| key.starts_with(prefix))
    }
}
impl PartialEq for Actor {
    fn eq(&self, other: &Self) -> bool {
        self.same_person(other)
    }
}
impl Eq for Actor {}
impl std::hash::Hash for Actor {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.person_key().hash(state);
    }
}
/// As stored: deserialising (stored events, payloads) takes the name as it was recorded;
/// where a name arrives, use [`Actor::parse`].
impl TryFrom<String> for Actor {
    type Error = IdError;
    fn try_from(value: String) -> Result<Self, IdError> {
        Self::stored(value)
    }
}
impl From<Actor> for String {
    fn from(value: Actor) -> String {
        value.0
    }
}
impl fmt::Display for Actor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

macro_rules! uuid_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema)]
        #[serde(transparent)]
        pub struct $name(Uuid);

        impl $name {
            /// Wraps an existing uuid.
            pub fn from_uuid(id: Uuid) -> Self {
                Self(id)
            }
            /// A fresh random id.
            pub fn new_random() -> Self {
                Self(Uuid::new_v4())
            }
            /// Parses the textual form.
            pub fn parse(value: &str) -> Result<Self, IdError> {
                Uuid::parse_str(value).map(Self).map_err(|_| IdError::NotUuid)
            }
            /// The inner uuid.
            pub fn as_uuid(&self) -> Uuid {
                self.0
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

uuid_id!(
    /// A deployment specification: one per tenant, environment and kind (see [`SpecificationId::for_environment`]).
    SpecificationId
);
uuid_id!(
    /// One provisioning run.
    ProvisioningRunId
);
uuid_id!(
    /// A promotion of the promotions context.
    PromotionId
);
uuid_id!(
    /// An approval decision of the run-control context.
    ApprovalId
);
uuid_id!(
    /// A release of the releases context.
    ReleaseId
);
uuid_id!(
    /// A drift ignore rule of an environment (see `crate::drift`).
    IgnoreRuleId
);
uuid_id!(
    /// A Factory run (an agent's run that asked for something, e.g. a promotion through the
    /// deploy-environment tool).
    FactoryRunId
);

/// Namespace of the name-based ids Ferry derived before issue 37 (uuid v5 of a `/`-joined
/// name). Only the specification id and the `legacy_*` functions still use it.
const FERRY_NAMESPACE: Uuid = Uuid::from_u128(0x6f1b_5c2e_7d7a_4f0e_9c3b_2a1d_0e5f_4a11);

/// Root of the name-based ids: each [`IdPurpose`] has a namespace of its own under it.
const NAMED_ID_ROOT: Uuid = Uuid::from_u128(0x3c8e_91d4_5b27_4a6f_8e10_d2c7_49b3_a605);

/// What a name-based id is for. Each purpose names its ids in a namespace of its own, so no
/// id of one purpose is ever another's, whatever its parts hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdPurpose {
    /// A run requested with an `Idempotency-Key`.
    IdempotentRun,
    /// The baseline run of an environment's specification version.
    BaselineRun,
    /// The `Release` run a promotion hands its desired state to.
    PromotionRun,
    /// A `Reconciliation` run of one window.
    ReconciliationRun,
    /// A promotion requested with an `Idempotency-Key`.
    IdempotentPromotion,
    /// The promotion that rolls another back.
    Rollback,
}

impl IdPurpose {
    fn namespace(self) -> Uuid {
        let label = match self {
            Self::IdempotentRun => "run:idempotency-key",
            Self::BaselineRun => "run:baseline",
            Self::PromotionRun => "run:promotion",
            Self::ReconciliationRun => "run:reconciliation",
            Self::IdempotentPromotion => "promotion:idempotency-key",
            Self::Rollback => "promotion:rollback",
        };
        Uuid::new_v5(&NAMED_ID_ROOT, label.as_bytes())
    }
}

/// The name of `(tenant, parts)`: each part prefixed with its length in bytes (8 bytes, big
/// endian), so the name is injective over the sequence of parts: no separator a tenant, a key
/// or an id could hold makes one sequence read as another.
fn encode_name(tenant: &TenantId, parts: &[&str]) -> Vec<u8> {
    let mut name = Vec::new();
    for part in std::iter::once(tenant.as_str()).chain(parts.iter().copied()) {
        name.extend_from_slice(&(part.len() as u64).to_be_bytes());
        name.extend_from_slice(part.as_bytes());
    }
    name
}

/// The id of `(purpose, tenant, parts)`.
fn name_based(purpose: IdPurpose, tenant: &TenantId, parts: &[&str]) -> Uuid {
    Uuid::new_v5(&purpose.namespace(), &encode_name(tenant, parts))
}

/// The id made before issue 37 from a `/`-joined `name`. Ambiguous (a tenant named
/// `promotion` with a key `<P>/0` made promotion `P`'s hand-off run), so it is only ever used
/// to find an aggregate that already exists under it, checked to be the one wanted.
fn legacy(name: &str) -> Uuid {
    Uuid::new_v5(&FERRY_NAMESPACE, name.as_bytes())
}

impl SpecificationId {
    /// The one specification of `kind` for an environment of a tenant. Name-based, so that
    /// declaring again appends a version to the same specification on every instance.
    ///
    /// Unlike the other name-based ids, this one keeps its name from before issue 37, on
    /// purpose: every specification's events are stored under it and every run, read model
    /// and work item names it, so a new derivation would orphan them. The name is already
    /// unambiguous: no other purpose's name starts with `specification/`, the tenant and the
    /// environment are identifiers that cannot hold `/` ([`check_slug`]), and the kind is a
    /// fixed word; ids of the other purposes now live in namespaces of their own.
    pub fn for_environment(
        tenant: &TenantId,
        environment: &EnvironmentId,
        kind: crate::values::SpecificationKind,
    ) -> Self {
        let name = format!("specification/{tenant}/{environment}/{}", kind.as_str());
        Self(Uuid::new_v5(&FERRY_NAMESPACE, name.as_bytes()))
    }
}

impl ProvisioningRunId {
    /// The run created by a request carrying `Idempotency-Key: key`: a retry after a crash
    /// lands on the same run instead of making a second one.
    pub fn for_idempotency_key(tenant: &TenantId, key: &str) -> Self {
        Self(name_based(IdPurpose::IdempotentRun, tenant, &[key]))
    }

    /// The id [`Self::for_idempotency_key`] gave before issue 37. A retry finds the run its
    /// first request made through the key's record, which holds the id; this is for tests
    /// and tools that reproduce what was stored then.
    pub fn legacy_for_idempotency_key(tenant: &TenantId, key: &str) -> Self {
        Self(legacy(&format!("run/{tenant}/{key}")))
    }

    /// The baseline run of version `version` of an environment's specification: planned
    /// once, however often the baseline work item runs.
    pub fn for_baseline(tenant: &TenantId, environment: &EnvironmentId, version: u32) -> Self {
        let version = version.to_string();
        Self(name_based(
            IdPurpose::BaselineRun,
            tenant,
            &[environment.as_str(), &version],
        ))
    }

    /// The id [`Self::for_baseline`] gave before issue 37 (a run keyed as if requested with
    /// `Idempotency-Key: baseline/{environment}/v{version}`): only to find a baseline run
    /// that already exists under it.
    pub fn legacy_for_baseline(
        tenant: &TenantId,
        environment: &EnvironmentId,
        version: u32,
    ) -> Self {
        Self::legacy_for_idempotency_key(tenant, &format!("baseline/{environment}/v{version}"))
    }

    /// The `Release` run a promotion hands its desired state to: one per promotion and
    /// attempt (a plan that went stale before its approval was used starts a new attempt),
    /// so a hand-off repeated after a crash finds the run it started.
    pub fn for_promotion(tenant: &TenantId, promotion: PromotionId, attempt: u32) -> Self {
        let (promotion, attempt) = (promotion.to_string(), attempt.to_string());
        Self(name_based(
            IdPurpose::PromotionRun,
            tenant,
            &[&promotion, &attempt],
        ))
    }

    /// The id [`Self::for_promotion`] gave before issue 37: only to find a hand-off run
    /// that already exists under it, and only if it is that promotion's run.
    pub fn legacy_for_promotion(promotion: PromotionId, attempt: u32) -> Self {
        Self(legacy(&format!("run/promotion/{promotion}/{attempt}")))
    }

    /// The `Reconciliation` run of one specification of a tenant in one window: every
    /// instance and every restart that reconciles that window names the same run, so it is
    /// planned once.
    pub fn for_reconciliation(
        tenant: &TenantId,
        specification: SpecificationId,
        window: &str,
    ) -> Self {
        let specification = specification.to_string();
        Self(name_based(
            IdPurpose::ReconciliationRun,
            tenant,
            &[&specification, window],
        ))
    }

    /// The id [`Self::for_reconciliation`] gave before issue 37: only to find a
    /// reconciliation run of that window that already exists under it.
    pub fn legacy_for_reconciliation(
        tenant: &TenantId,
        specification: SpecificationId,
        window: &str,
    ) -> Self {
        Self(legacy(&format!(
            "run/reconcile/{tenant}/{specification}/{window}"
        )))
    }
}

impl PromotionId {
    /// The promotion that rolls `original` back: one per promotion, so a rollback started
    /// again after a crash finds it.
    pub fn for_rollback(tenant: &TenantId, original: PromotionId) -> Self {
        let original = original.to_string();
        Self(name_based(IdPurpose::Rollback, tenant, &[&original]))
    }

    /// The id [`Self::for_rollback`] gave before issue 37: only to find a rollback that
    /// already exists under it, and only if it rolls `original` back.
    pub fn legacy_for_rollback(original: PromotionId) -> Self {
        Self(legacy(&format!("rollback/{original}")))
    }

    /// The promotion created by a request carrying `Idempotency-Key: key`: a retry after a
    /// crash lands on the same promotion instead of making a second one.
    pub fn for_idempotency_key(tenant: &TenantId, key: &str) -> Self {
        Self(name_based(IdPurpose::IdempotentPromotion, tenant, &[key]))
    }

    /// The id [`Self::for_idempotency_key`] gave before issue 37 (a retry finds its first
    /// request's promotion through the key's record, which holds the id).
    pub fn legacy_for_idempotency_key(tenant: &TenantId, key: &str) -> Self {
        Self(legacy(&format!("promotion/{tenant}/{key}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_ids_are_validated() {
        assert!(TenantId::parse("acme").is_ok());
        assert_eq!(TenantId::parse(""), Err(IdError::Empty));
        assert_eq!(
            EnvironmentId::parse("prod east"),
            Err(IdError::BadCharacter { found: ' ' })
        );
        assert_eq!(
            TenantId::parse("x".repeat(65)),
            Err(IdError::TooLong { max: 64 })
        );
        let parsed: Result<TenantId, _> = serde_json::from_str("\"a/b\"");
        assert!(parsed.is_err());
    }

    #[test]
    fn actors_are_compared_as_people_and_refused_when_hidden() {
        let alice = Actor::parse("alice").unwrap_or_else(|e| panic!("{e}"));
        for same in ["Alice", "alice ", "ALICE", "ａｌｉｃｅ"] {
            let other = Actor::parse(same).unwrap_or_else(|e| panic!("{e}"));
            assert!(alice.same_person(&other), "{same:?}");
            assert_eq!(alice, other, "{same:?}");
        }
        assert_ne!(alice, Actor::parse("bob").unwrap_or_else(|e| panic!("{e}")));
        // Arriving, a name holding hidden characters is refused ...
        for hidden in [
            "alice\u{200B}",
            "\u{202E}ecila",
            "al\u{2066}ice",
            "alice\u{1B}[31m",
        ] {
            assert!(
                matches!(Actor::parse(hidden), Err(IdError::HiddenCharacter { .. })),
                "{hidden:?}"
            );
        }
        // ... but one stored before it was refused still loads, as the same person.
        let stored: Actor =
            serde_json::from_str("\"alice\\u200b\"").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(stored.as_str(), "alice\u{200B}");
        assert_eq!(stored, alice);
        assert_eq!(
            serde_json::to_string(&stored).ok().as_deref(),
            Some("\"alice\u{200B}\"")
        );
        let control: Result<Actor, _> = serde_json::from_str("\"alice\\u001b\"");
        assert!(control.is_err());
    }

    #[test]
    fn path_components_are_folder_names() {
        let id = |s: &str| TenantId::parse(s).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(id("acme").path_component(), "acme");
        assert_eq!(id("a.b:c").path_component(), "a.b:c");
        assert_eq!(id(".").path_component(), "%2E");
        assert_eq!(id("..").path_component(), "%2E%2E");
        assert_eq!(id("...").path_component(), "%2E%2E%2E");
    }

    #[test]
    fn specification_ids_are_stable_and_tenant_scoped() {
        let env = EnvironmentId::parse("dev").unwrap_or_else(|e| panic!("{e}"));
        let a = TenantId::parse("a").unwrap_or_else(|e| panic!("{e}"));
        let b = TenantId::parse("b").unwrap_or_else(|e| panic!("{e}"));
        let kind = crate::values::SpecificationKind::Environment;
        assert_eq!(
            SpecificationId::for_environment(&a, &env, kind),
            SpecificationId::for_environment(&a, &env, kind)
        );
        assert_ne!(
            SpecificationId::for_environment(&a, &env, kind),
            SpecificationId::for_environment(&b, &env, kind)
        );
    }

    fn tenant(s: &str) -> TenantId {
        TenantId::parse(s).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_specification_keeps_the_id_its_events_are_stored_under() {
        // Pinned: the specifications stored before issue 37 must keep resolving.
        let env = EnvironmentId::parse("dev").unwrap_or_else(|e| panic!("{e}"));
        let id = |kind| SpecificationId::for_environment(&tenant("acme"), &env, kind).to_string();
        use crate::values::SpecificationKind::{Environment, Workload};
        assert_eq!(id(Workload), "50be8324-5f83-5ab9-8f78-908dd1c4ce6e");
        assert_eq!(id(Environment), "20c972c0-78a0-510d-b9fe-25493bd3c9aa");
    }

    #[test]
    fn a_tenant_named_like_a_purpose_cannot_take_a_hand_off_run() {
        // Issue 37: tenant `promotion` planned with `Idempotency-Key: <P>/0`, P acme's
        // promotion, and took acme's hand-off run.
        let acme = tenant("acme");
        let p = PromotionId::for_idempotency_key(&acme, "release-42");
        let key = format!("{p}/0");
        // What the old names did (kept only to find what was stored under them).
        assert_eq!(
            ProvisioningRunId::legacy_for_idempotency_key(&tenant("promotion"), &key),
            ProvisioningRunId::legacy_for_promotion(p, 0)
        );
        assert_ne!(
            ProvisioningRunId::for_idempotency_key(&tenant("promotion"), &key),
            ProvisioningRunId::for_promotion(&acme, p, 0)
        );
        // The same with a reconciliation window, through a tenant named `reconcile`.
        let spec = SpecificationId::new_random();
        let window = "2026-01-01T00:00Z";
        let key = format!("acme/{spec}/{window}");
        assert_eq!(
            ProvisioningRunId::legacy_for_idempotency_key(&tenant("reconcile"), &key),
            ProvisioningRunId::legacy_for_reconciliation(&acme, spec, window)
        );
        assert_ne!(
            ProvisioningRunId::for_idempotency_key(&tenant("reconcile"), &key),
            ProvisioningRunId::for_reconciliation(&acme, spec, window)
        );
        // And a key naming a baseline is the tenant's own run, never the baseline.
        let env = EnvironmentId::parse("stg").unwrap_or_else(|e| panic!("{e}"));
        assert_ne!(
            ProvisioningRunId::for_idempotency_key(&acme, "baseline/stg/v1"),
            ProvisioningRunId::for_baseline(&acme, &env, 1)
        );
    }

    /// Parts chosen to break a joined name: separators at each end, empty parts, parts that
    /// look like lengths, and the same bytes split differently.
    fn tricky_parts() -> Vec<String> {
        let mut parts: Vec<String> = [
            "",
            "/",
            "//",
            "a",
            "a/",
            "/a",
            "a/b",
            "ab",
            "b",
            ":",
            "a:b",
            "0",
            "00",
            "\0",
            "\0a",
            "%2F",
            "promotion",
            "promotion/x",
            "x/0",
            "\u{1}a",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        // Raw length prefixes as text, so that a part holding another's encoding is tried.
        parts.push(String::from_utf8_lossy(&encode_name(&tenant("a"), &["b"])).into_owned());
        parts.push("\0".repeat(8));
        parts
    }

    #[test]
    fn different_purposes_tenants_or_parts_never_share_a_name() {
        use std::collections::HashMap;
        let purposes = [
            IdPurpose::IdempotentRun,
            IdPurpose::BaselineRun,
            IdPurpose::PromotionRun,
            IdPurpose::ReconciliationRun,
            IdPurpose::IdempotentPromotion,
            IdPurpose::Rollback,
        ];
        let tenants = ["a", "ab", "b", "promotion", "reconcile", "a.b", "a:b"];
        let parts = tricky_parts();
        let mut lists: Vec<Vec<&str>> = vec![Vec::new()];
        for x in &parts {
            lists.push(vec![x]);
            for y in &parts {
                lists.push(vec![x, y]);
            }
        }
        for x in parts.iter().take(8) {
            for y in parts.iter().take(8) {
                for z in parts.iter().take(8) {
                    lists.push(vec![x, y, z]);
                }
            }
        }
        // The encoding alone is injective over (tenant, parts)...
        let mut names: HashMap<Vec<u8>, (&str, &Vec<&str>)> = HashMap::new();
        for t in tenants {
            for list in &lists {
                let name = encode_name(&tenant(t), list);
                if let Some(other) = names.insert(name, (t, list)) {
                    panic!("{other:?} and {:?} share a name", (t, list));
                }
            }
        }
        // ...and each purpose has a namespace of its own, so the ids differ too.
        let mut ids: HashMap<Uuid, (IdPurpose, &str, &Vec<&str>)> = HashMap::new();
        for purpose in purposes {
            for t in tenants {
                for list in lists.iter().take(200) {
                    let id = name_based(purpose, &tenant(t), list);
                    if let Some(other) = ids.insert(id, (purpose, t, list)) {
                        panic!("{other:?} and {:?} share an id", (purpose, t, list));
                    }
                }
            }
        }
        // Nor is any of them a specification's (the one name kept from before).
        let env = EnvironmentId::parse("a").unwrap_or_else(|e| panic!("{e}"));
        let kind = crate::values::SpecificationKind::Workload;
        for t in tenants {
            let spec = SpecificationId::for_environment(&tenant(t), &env, kind).as_uuid();
            assert!(!ids.contains_key(&spec));
        }
    }
}
