//! The pieces every [`Publisher`](crate::Publisher) shares: the outbound message, stream
//! positions as text, the domain event as a message, and an integration event's payload with
//! its fallback.
//!
//! Events are decoded first, through their upcasters ([`ferry_store::events`]); one that
//! does not decode is an error, at which the relay stops and which it reports until it goes
//! through: nothing is skipped. Integration events get their fixed payloads; every other
//! event goes on `ferry.events.<aggregate>.<event>` with the domain event's inner object as
//! data. An integration event whose payload cannot be built (a bug, logged and counted) goes
//! on its domain subject instead, so the audit trail stays complete. Each bounded context's
//! publishers live in its folder (e.g. `app/src/contexts/provisioning/events.rs`).

use crate::cloudevent::CloudEvent;
use crate::publish::Message;
use crate::schemas::{schema_value, Direction, Documents, SubjectDoc};
use crate::subjects;
use cqrs_es::DomainEvent;
use ferry_store::{Position, StoredEvent};
use serde_json::value::RawValue;
use serde_json::Value;

/// Default CloudEvent `source` of Ferry's events.
pub const DEFAULT_SOURCE: &str = "urn:ferry";

/// One message ready to publish.
#[derive(Debug, Clone, PartialEq)]
pub struct Outbound {
    /// The NATS subject (also the CloudEvent `type`).
    pub subject: String,
    /// The envelope with its data.
    pub event: CloudEvent,
    /// Set when an integration payload could not be built and the domain fallback was used.
    pub degraded: Option<String>,
}

/// `<transaction id>.<global position>`: the position as text, for `ferryposition`, the
/// `Ferry-Position` header and SSE ids.
pub fn position_token(p: Position) -> String {
    format!("{}.{}", p.transaction_id, p.global_position)
}

/// Reads a [`position_token`] back (a bare number is a global position on SQLite).
pub fn parse_position(token: &str) -> Option<Position> {
    let token = token.trim();
    let (tx, pos) = token.split_once('.').unwrap_or(("0", token));
    let transaction_id = tx.parse::<i64>().ok()?;
    let global_position = pos.parse::<i64>().ok()?;
    (transaction_id >= 0 && global_position >= 0).then_some(Position {
        transaction_id,
        global_position,
    })
}

/// The object inside an externally tagged event (`{"Variant": {...}}` → `{...}`).
pub fn inner_payload(payload: &Value) -> Value {
    match payload.as_object() {
        Some(map) if map.len() == 1 => map.values().next().cloned().unwrap_or(Value::Null),
        _ => payload.clone(),
    }
}

/// [`inner_payload`] of a stored event's payload (for an event that was not decoded), as
/// compact JSON text (the store may hold it spaced). The store only holds JSON, so the text
/// is the data only if that JSON is too deep to parse.
pub fn stored_inner_payload(stored: &StoredEvent) -> Box<RawValue> {
    let text = |json: &str| {
        serde_json::value::to_raw_value(json).unwrap_or_else(|_| RawValue::NULL.to_owned())
    };
    match stored.payload.to_value() {
        Ok(value) => serde_json::value::to_raw_value(&into_inner_payload(value))
            .unwrap_or_else(|_| text(stored.payload.get())),
        Err(_) => text(stored.payload.get()),
    }
}

/// [`inner_payload`] of a value the caller owns: nothing is copied.
fn into_inner_payload(payload: Value) -> Value {
    match payload {
        Value::Object(map) if map.len() == 1 => {
            map.into_iter().next().map_or(Value::Null, |(_, v)| v)
        }
        other => other,
    }
}

/// [`inner_payload`] of the compact JSON an event serialized to, read without building a
/// tree: the object of a map with one key (an externally tagged variant), else the whole
/// text (a unit variant is a string).
fn inner_raw(json: String) -> Result<Box<RawValue>, serde_json::Error> {
    let inner = match serde_json::from_str::<std::collections::HashMap<&str, &RawValue>>(&json) {
        Ok(map) if map.len() == 1 => map.values().next().map(|inner| inner.get().to_string()),
        _ => None,
    };
    RawValue::from_string(inner.unwrap_or(json))
}

/// The domain event on `ferry.events.<aggregate>.<event>`, its inner object as data.
pub fn domain_message<E: DomainEvent>(stored: &StoredEvent, event: &E) -> Message {
    let subject = subjects::domain_subject(&stored.aggregate_type, &event.event_type());
    match serde_json::to_string(event).and_then(inner_raw) {
        Ok(data) => Message {
            subject,
            data,
            degraded: None,
        },
        // Ferry's events always serialize; should one not, the stored object still tells.
        Err(e) => {
            let reason = format!("the event does not serialize: {e}");
            log_degraded(stored, &reason);
            Message {
                subject,
                data: stored_inner_payload(stored),
                degraded: Some(reason),
            }
        }
    }
}

/// An integration event whose payload cannot be built goes on its domain subject.
pub fn integration_failed<E: DomainEvent>(
    stored: &StoredEvent,
    event: &E,
    reason: String,
) -> Message {
    log_degraded(stored, &reason);
    Message {
        degraded: Some(reason),
        ..domain_message(stored, event)
    }
}

fn log_degraded(stored: &StoredEvent, reason: &str) {
    tracing::error!(
        event_id = %stored.event_id, event_type = %stored.event_type, %reason,
        "integration payload cannot be built; publishing the domain event instead"
    );
}

/// A built integration payload on `subject`, or the domain event when it cannot be built.
pub fn integration<E: DomainEvent>(
    stored: &StoredEvent,
    event: &E,
    subject: &str,
    data: Result<Box<RawValue>, serde_json::Error>,
) -> Message {
    match data {
        Ok(data) => Message {
            subject: subject.to_string(),
            data,
            degraded: None,
        },
        Err(e) => integration_failed(stored, event, e.to_string()),
    }
}

/// An integration subject's documentation and the schema file of its payload.
pub fn integration_doc<T: schemars::JsonSchema>(
    subject: &str,
    event: &str,
    direction: Direction,
    summary: &str,
) -> Documents {
    let path = format!("events/{}.schema.json", subjects::kebab(event));
    Documents {
        subjects: vec![SubjectDoc {
            subject: subject.to_string(),
            event: event.to_string(),
            schema: path.clone(),
            direction,
            summary: summary.to_string(),
        }],
        files: vec![(path, schema_value::<T>())],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_round_trip() {
        let p = Position {
            transaction_id: 812,
            global_position: 17,
        };
        assert_eq!(parse_position(&position_token(p)), Some(p));
        assert_eq!(
            parse_position("42"),
            Some(Position {
                transaction_id: 0,
                global_position: 42
            })
        );
        assert_eq!(parse_position("x.1"), None);
        assert_eq!(parse_position("-1.1"), None);
        assert_eq!(parse_position(""), None);
    }

    #[test]
    fn the_inner_object_of_a_tagged_event_is_the_data() {
        let v = serde_json::json!({"ProvisioningCancelled": {"cancelledBy": "ann"}});
        assert_eq!(inner_payload(&v), serde_json::json!({"cancelledBy": "ann"}));
        let flat = serde_json::json!({"a": 1, "b": 2});
        assert_eq!(inner_payload(&flat), flat);
        assert_eq!(into_inner_payload(v.clone()), inner_payload(&v));
        assert_eq!(into_inner_payload(flat.clone()), flat);
        // The text route gives the same JSON as the tree route.
        for event in [&v, &flat, &serde_json::json!("ProvisioningCancelled")] {
            let raw = inner_raw(event.to_string()).unwrap();
            let read: Value = serde_json::from_str(raw.get()).unwrap();
            assert_eq!(read, inner_payload(event), "{event}");
        }
    }
}
