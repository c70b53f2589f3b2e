//! The metadata stored with every event: who did it, for which tenant, and which request,
//! correlation and causation it belongs to. [`EventMetadata`] is what a command writes,
//! [`StoredMetadata`] what a reader of the stream gets back.

use ferry_domain::{Actor, TenantId};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;
use uuid::Uuid;

/// Metadata of one command's events (ARCHITECTURE.md, The path of one request). The event id is a column of its own,
/// unique per event; the stream reader puts it back beside these fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EventMetadata {
    /// The tenant the command ran for.
    pub tenant_id: TenantId,
    /// The `sub` of the caller's token, or `system:<worker>`.
    pub actor: Actor,
    /// Ties together everything done for one business operation.
    pub correlation_id: Uuid,
    /// The event or request that caused this command.
    pub causation_id: Uuid,
    /// The HTTP request (or message) id.
    pub request_id: Uuid,
}

impl EventMetadata {
    /// Metadata for a command caused directly by request `request_id`.
    pub fn for_request(tenant_id: TenantId, actor: Actor, request_id: Uuid) -> Self {
        Self {
            tenant_id,
            actor,
            correlation_id: request_id,
            causation_id: request_id,
            request_id,
        }
    }

    /// The flat map cqrs-es stores.
    pub fn to_map(&self) -> HashMap<String, String> {
        HashMap::from([
            ("tenantId".to_string(), self.tenant_id.to_string()),
            ("actor".to_string(), self.actor.to_string()),
            ("correlationId".to_string(), self.correlation_id.to_string()),
            ("causationId".to_string(), self.causation_id.to_string()),
            ("requestId".to_string(), self.request_id.to_string()),
        ])
    }
}

/// A stored event's metadata as a reader gets it: the JSON as stored, and the text fields
/// Ferry reads (tenant, actor, correlation, causation, request) taken out once, when the
/// event is read. Shared: a copy (each projection's decoded event holds one) is a count, not
/// a tree. Metadata written by something else (not an object, other keys, a field that is
/// not text) reads as it is, without those fields; [`to_value`](Self::to_value) gives all.
#[derive(Clone)]
pub struct StoredMetadata(Arc<Stored>);

struct Stored {
    json: Box<RawValue>,
    fields: Fields,
}

#[derive(Debug, Default, PartialEq)]
struct Fields {
    tenant_id: Option<String>,
    actor: Option<String>,
    correlation_id: Option<String>,
    causation_id: Option<String>,
    request_id: Option<String>,
}

impl StoredMetadata {
    /// The metadata of stored JSON.
    pub fn parse(json: Box<RawValue>) -> Self {
        // Not an object (written by hand): no fields, as a map lookup would find none.
        let fields = serde_json::from_str(json.get()).unwrap_or_default();
        Self(Arc::new(Stored { json, fields }))
    }

    /// The metadata of a JSON value (tests and hand-made events).
    pub fn from_value(value: &Value) -> Self {
        // A `Value` always serializes (its keys are strings).
        Self::parse(
            serde_json::value::to_raw_value(value).unwrap_or_else(|_| RawValue::NULL.to_owned()),
        )
    }

    /// `tenantId`.
    pub fn tenant_id(&self) -> Option<&str> {
        self.0.fields.tenant_id.as_deref()
    }

    /// `actor`.
    pub fn actor(&self) -> Option<&str> {
        self.0.fields.actor.as_deref()
    }

    /// `correlationId`.
    pub fn correlation_id(&self) -> Option<&str> {
        self.0.fields.correlation_id.as_deref()
    }

    /// `causationId`.
    pub fn causation_id(&self) -> Option<&str> {
        self.0.fields.causation_id.as_deref()
    }

    /// `requestId`.
    pub fn request_id(&self) -> Option<&str> {
        self.0.fields.request_id.as_deref()
    }

    /// The JSON text as stored.
    pub fn get(&self) -> &str {
        self.0.json.get()
    }

    /// The whole metadata as a JSON tree (for upcasters, and keys other than the five).
    pub fn to_value(&self) -> Value {
        // The text was read as JSON; should it not parse as a tree (too deep), it is kept as
        // a string rather than lost.
        serde_json::from_str(self.get()).unwrap_or_else(|_| Value::String(self.get().into()))
    }
}

/// Equal when the stored texts are.
impl PartialEq for StoredMetadata {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl std::fmt::Debug for StoredMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.get())
    }
}

/// The five fields, read from an object in one pass without a tree: other keys are skipped,
/// a field that is not text is absent, a repeated key keeps its last value (as a tree would).
impl<'de> Deserialize<'de> for Fields {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(field_identifier, rename_all = "camelCase")]
        enum Key {
            TenantId,
            Actor,
            CorrelationId,
            CausationId,
            RequestId,
            #[serde(other)]
            Other,
        }

        struct FieldsVisitor;
        impl<'de> Visitor<'de> for FieldsVisitor {
            type Value = Fields;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a metadata object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields, A::Error> {
                let mut fields = Fields::default();
                while let Some(key) = map.next_key::<Key>()? {
                    let slot = match key {
                        Key::TenantId => &mut fields.tenant_id,
                        Key::Actor => &mut fields.actor,
                        Key::CorrelationId => &mut fields.correlation_id,
                        Key::CausationId => &mut fields.causation_id,
                        Key::RequestId => &mut fields.request_id,
                        Key::Other => {
                            map.next_value::<IgnoredAny>()?;
                            continue;
                        }
                    };
                    *slot = map.next_value::<Text>()?.0;
                }
                Ok(fields)
            }
        }
        deserializer.deserialize_map(FieldsVisitor)
    }
}

/// A value kept when it is text, skipped otherwise.
struct Text(Option<String>);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextVisitor;
        impl<'de> Visitor<'de> for TextVisitor {
            type Value = Text;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Text, E> {
                Ok(Text(Some(v.to_string())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Text, E> {
                Ok(Text(Some(v)))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Text, E> {
                Ok(Text(None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Text, E> {
                Ok(Text(None))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Text, E> {
                Ok(Text(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Text, E> {
                Ok(Text(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Text, E> {
                Ok(Text(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Text, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Text(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Text, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Text(None))
            }
        }
        deserializer.deserialize_any(TextVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_five_fields_are_read_as_a_tree_would_read_them() {
        let cases = [
            json!({"tenantId": "acme", "actor": "alice", "correlationId": "c-1",
                   "causationId": "k-1", "requestId": "r-1", "other": {"deep": [1, 2]}}),
            // Not text: absent. Escapes are read.
            json!({"tenantId": 7, "actor": null, "correlationId": ["x"], "causationId": {"a": "b"},
                   "requestId": "q\"\\u00e9"}),
            json!({}),
            json!(["tenantId", "acme"]),
            json!("acme"),
            json!(null),
        ];
        for value in cases {
            let read = StoredMetadata::from_value(&value);
            let text = |key: &str| value.get(key).and_then(Value::as_str);
            assert_eq!(read.tenant_id(), text("tenantId"), "{value}");
            assert_eq!(read.actor(), text("actor"), "{value}");
            assert_eq!(read.correlation_id(), text("correlationId"), "{value}");
            assert_eq!(read.causation_id(), text("causationId"), "{value}");
            assert_eq!(read.request_id(), text("requestId"), "{value}");
            assert_eq!(read.to_value(), value);
        }
        // A repeated key keeps its last value, as a tree does (SQLite keeps the text as
        // written; Postgres' jsonb keeps the last one).
        let repeated = r#"{"tenantId":"a","tenantId":"b"}"#;
        let read = StoredMetadata::parse(RawValue::from_string(repeated.into()).unwrap());
        assert_eq!(read.tenant_id(), Some("b"));
        assert_eq!(read.get(), repeated);
    }

    #[test]
    fn what_a_command_writes_reads_back() {
        let written = EventMetadata::for_request(
            TenantId::parse("acme").unwrap(),
            Actor::parse("alice").unwrap(),
            Uuid::nil(),
        );
        let read = StoredMetadata::from_value(&serde_json::to_value(&written).unwrap());
        assert_eq!(read.tenant_id(), Some("acme"));
        assert_eq!(read.actor(), Some("alice"));
        let nil = Uuid::nil().to_string();
        assert_eq!(read.correlation_id(), Some(nil.as_str()));
        assert_eq!(read.causation_id(), Some(nil.as_str()));
        assert_eq!(read.request_id(), Some(nil.as_str()));
    }
}
