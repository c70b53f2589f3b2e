//! The events Ferry hears, as each bounded context declares them: a payload type
//! implements [`InboundEvent`] (its name, its subject, its tenant, its rules), and the
//! context registers it with [`InboundKind::of`]. The transport knows no event by name:
//! it identifies a message by the [`InboundKinds`] its handler hears, decodes the payload
//! through the kind, and hands the typed payload on as a [`Heard`] event, which the
//! context reads back with [`Heard::get`].
//!
//! Payloads tolerate unknown fields (producers may add some), but every field a context
//! reads is validated by its domain type, and [`InboundEvent::check`] holds the rules
//! across fields.

use ferry_domain::TenantId;
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::any::Any;
use std::fmt;
use std::sync::Arc;

/// An event another service publishes that a context handles.
pub trait InboundEvent:
    DeserializeOwned + schemars::JsonSchema + fmt::Debug + Send + Sync + 'static
{
    /// Its name (`ReleaseReady`): accepted as the CloudEvent `type` over HTTP, and how
    /// `FERRY_TRUSTED_SOURCES` names it.
    const NAME: &'static str;
    /// The NATS subject it arrives on (also accepted as the CloudEvent `type`).
    const SUBJECT: &'static str;
    /// What it means to Ferry, in one line (the AsyncAPI document).
    const SUMMARY: &'static str;

    /// The tenant its payload names (it must be the CloudEvent's).
    fn tenant_id(&self) -> &TenantId;

    /// The rules across its fields that its types cannot say.
    fn check(&self) -> Result<(), BrokenRule> {
        Ok(())
    }
}

/// A payload that breaks one of its event's rules: the rule, in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BrokenRule(pub String);

/// Why a payload was not accepted as its event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// It does not have the event's shape (a missing or invalid field).
    #[error("{event} payload is invalid: {reason}")]
    Shape {
        /// The event.
        event: &'static str,
        /// What serde said, naming the field.
        reason: String,
    },
    /// It breaks one of the event's rules.
    #[error("{event} {rule}")]
    Rule {
        /// The event.
        event: &'static str,
        /// The rule.
        rule: BrokenRule,
    },
}

/// One event a context hears: its name and subject, how its payload is decoded and what
/// its schema is.
#[derive(Clone, Copy)]
pub struct InboundKind {
    name: &'static str,
    subject: &'static str,
    summary: &'static str,
    documented: bool,
    payload: std::any::TypeId,
    decode: fn(Value) -> Result<Heard, DecodeError>,
    schema: fn() -> Value,
}

impl fmt::Debug for InboundKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InboundKind")
            .field("name", &self.name)
            .field("subject", &self.subject)
            .finish()
    }
}

impl InboundKind {
    /// The event `E`, documented as one Ferry consumes.
    pub fn of<E: InboundEvent>() -> Self {
        Self {
            name: E::NAME,
            subject: E::SUBJECT,
            summary: E::SUMMARY,
            documented: true,
            payload: std::any::TypeId::of::<E>(),
            decode: decode::<E>,
            schema: || schemars::schema_for!(E).to_value(),
        }
    }

    /// Ferry's own event `E` heard back from its stream: accepted, but documented only as
    /// an event Ferry publishes.
    pub fn echo<E: InboundEvent>() -> Self {
        Self {
            documented: false,
            ..Self::of::<E>()
        }
    }

    /// Its name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Its subject.
    pub fn subject(&self) -> &'static str {
        self.subject
    }

    /// Its one-line meaning.
    pub fn summary(&self) -> &'static str {
        self.summary
    }

    /// Whether the documents list it among the events Ferry consumes.
    pub fn documented(&self) -> bool {
        self.documented
    }

    /// The JSON Schema of its payload.
    pub fn schema(&self) -> Value {
        (self.schema)()
    }

    /// Decodes `data` as this event and checks its rules.
    pub fn decode(&self, data: Value) -> Result<Heard, DecodeError> {
        (self.decode)(data)
    }
}

fn decode<E: InboundEvent>(data: Value) -> Result<Heard, DecodeError> {
    let event: E = serde_json::from_value(data).map_err(|e| DecodeError::Shape {
        event: E::NAME,
        reason: e.to_string(),
    })?;
    event.check().map_err(|rule| DecodeError::Rule {
        event: E::NAME,
        rule,
    })?;
    Ok(Heard {
        name: E::NAME,
        tenant_id: event.tenant_id().clone(),
        payload: Arc::new(event),
    })
}

/// The events a handler hears, each once (by name), in the order first registered.
#[derive(Debug, Clone, Default)]
pub struct InboundKinds(Arc<[InboundKind]>);

/// Two registrations that name one event (or one subject) with different payload types:
/// which of them a message means would depend on the order of registration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the inbound events {first} ({first_subject}) and {second} ({second_subject}) are registered with different payload types under one name or subject")]
pub struct InboundClash {
    /// The first registration's name.
    pub first: &'static str,
    /// Its subject.
    pub first_subject: &'static str,
    /// The clashing registration's name.
    pub second: &'static str,
    /// Its subject.
    pub second_subject: &'static str,
}

impl InboundKinds {
    /// These kinds; the same payload type registered again (e.g. by a second context)
    /// counts once. A name or subject registered with two payload types is refused.
    pub fn new(kinds: impl IntoIterator<Item = InboundKind>) -> Result<Self, InboundClash> {
        let mut unique: Vec<InboundKind> = Vec::new();
        for kind in kinds {
            match unique
                .iter()
                .find(|k| k.name == kind.name || k.subject == kind.subject)
            {
                Some(k) if k.payload == kind.payload && k.name == kind.name => {}
                Some(k) => {
                    return Err(InboundClash {
                        first: k.name,
                        first_subject: k.subject,
                        second: kind.name,
                        second_subject: kind.subject,
                    })
                }
                None => unique.push(kind),
            }
        }
        Ok(Self(unique.into()))
    }

    /// The kind a subject or a CloudEvent `type` (a subject or an event name) identifies.
    pub fn find(&self, subject_or_type: &str) -> Option<&InboundKind> {
        self.0
            .iter()
            .find(|k| k.subject == subject_or_type || k.name == subject_or_type)
    }

    /// Every kind.
    pub fn iter(&self) -> impl Iterator<Item = &InboundKind> {
        self.0.iter()
    }

    /// Every kind's subject (what the NATS consumers consume by default).
    pub fn subjects(&self) -> Vec<String> {
        self.0.iter().map(|k| k.subject.to_string()).collect()
    }
}

/// An event as heard: its name, its tenant and its typed payload.
#[derive(Clone)]
pub struct Heard {
    name: &'static str,
    tenant_id: TenantId,
    payload: Arc<dyn Any + Send + Sync>,
}

impl fmt::Debug for Heard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Heard")
            .field("name", &self.name)
            .field("tenant_id", &self.tenant_id)
            .finish_non_exhaustive()
    }
}

impl Heard {
    /// The event's name (`ReleaseReady`, …).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The tenant its payload names.
    pub fn tenant_id(&self) -> &TenantId {
        &self.tenant_id
    }

    /// The payload, when this is the event `E`.
    pub fn get<E: InboundEvent>(&self) -> Option<&E> {
        self.payload.downcast_ref::<E>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Debug, Deserialize, schemars::JsonSchema)]
    #[serde(rename_all = "camelCase")]
    struct Bumped {
        tenant_id: TenantId,
        by: u32,
    }

    impl InboundEvent for Bumped {
        const NAME: &'static str = "Bumped";
        const SUBJECT: &'static str = "counters.v1.bumped";
        const SUMMARY: &'static str = "A counter was bumped.";
        fn tenant_id(&self) -> &TenantId {
            &self.tenant_id
        }
        fn check(&self) -> Result<(), BrokenRule> {
            if self.by == 0 {
                return Err(BrokenRule("bumps by 0".to_string()));
            }
            Ok(())
        }
    }

    #[derive(Debug, Deserialize, schemars::JsonSchema)]
    struct Other {
        #[serde(rename = "tenantId")]
        tenant_id: TenantId,
    }

    impl InboundEvent for Other {
        const NAME: &'static str = "Other";
        const SUBJECT: &'static str = "others.v1.other";
        const SUMMARY: &'static str = "Something else.";
        fn tenant_id(&self) -> &TenantId {
            &self.tenant_id
        }
    }

    #[test]
    fn names_and_subjects_both_identify_an_event() {
        let kinds = InboundKinds::new([
            InboundKind::of::<Bumped>(),
            InboundKind::of::<Other>(),
            InboundKind::of::<Bumped>(),
        ])
        .unwrap();
        assert_eq!(
            kinds.iter().count(),
            2,
            "a kind registered twice counts once"
        );
        assert_eq!(
            kinds.find("counters.v1.bumped").map(|k| k.name()),
            Some("Bumped")
        );
        assert_eq!(kinds.find("Other").map(|k| k.name()), Some("Other"));
        assert!(kinds.find("counters.v1.burned").is_none());
        assert_eq!(kinds.subjects(), ["counters.v1.bumped", "others.v1.other"]);
    }

    /// A payload type of another context under the same name.
    #[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
    #[serde(rename_all = "camelCase")]
    struct Impostor {
        tenant_id: TenantId,
    }

    impl InboundEvent for Impostor {
        const NAME: &'static str = "Bumped";
        const SUBJECT: &'static str = "impostors.v1.bumped";
        const SUMMARY: &'static str = "Not the counters' event.";
        fn tenant_id(&self) -> &TenantId {
            &self.tenant_id
        }
    }

    #[test]
    fn one_name_or_subject_with_two_payload_types_is_refused() {
        let clash = InboundKinds::new([InboundKind::of::<Bumped>(), InboundKind::of::<Impostor>()])
            .unwrap_err();
        assert_eq!(
            (clash.first, clash.second_subject),
            ("Bumped", "impostors.v1.bumped")
        );
        // Ferry's own event heard back is the same type: it counts once.
        let kinds = InboundKinds::new([InboundKind::of::<Bumped>(), InboundKind::echo::<Bumped>()])
            .unwrap();
        assert_eq!(kinds.iter().count(), 1);
    }

    #[test]
    fn a_payload_decodes_to_its_type_and_only_to_it() {
        let heard = InboundKind::of::<Bumped>()
            .decode(json!({"tenantId": "acme", "by": 2, "someNewField": 1}))
            .unwrap();
        assert_eq!(
            (heard.name(), heard.tenant_id().as_str()),
            ("Bumped", "acme")
        );
        assert_eq!(heard.get::<Bumped>().map(|b| b.by), Some(2));
        assert!(heard.get::<Other>().is_none());
    }

    #[test]
    fn invalid_payloads_are_refused_with_a_reason() {
        let kind = InboundKind::of::<Bumped>();
        let err = kind.decode(json!({"tenantId": "acme"})).unwrap_err();
        assert!(err.to_string().contains("by"), "{err}");
        let err = kind
            .decode(json!({"tenantId": "acme", "by": 0}))
            .unwrap_err();
        assert_eq!(err.to_string(), "Bumped bumps by 0");
    }
}
