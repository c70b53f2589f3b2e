//! The CloudEvents 1.0 envelope (JSON structured mode) of every message in and out.
//!
//! Outbound messages carry Ferry's extensions: `tenantid`, `ferryaggregatetype`,
//! `ferrysequence` (the event's sequence in its aggregate: consumers check per-aggregate
//! order and gaps with it), `ferryposition` (the global stream position, `txid.position`),
//! and the `correlationid` / `causationid` of the command that caused the event.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The only spec version Ferry reads and writes.
pub const SPEC_VERSION: &str = "1.0";
/// The `datacontenttype` of every message.
pub const JSON: &str = "application/json";

/// A CloudEvent 1.0 in JSON structured mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CloudEvent {
    /// Always `1.0`.
    pub specversion: String,
    /// Unique per source; for Ferry's events the stored event id (also `Nats-Msg-Id`).
    pub id: String,
    /// Who produced it (a URI reference; Ferry's default is `urn:ferry`).
    pub source: String,
    /// The event type; for Ferry's events the NATS subject.
    #[serde(rename = "type")]
    pub event_type: String,
    /// The aggregate the event is about (its id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// When it happened (Ferry: when the store recorded it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<DateTime<Utc>>,
    /// `application/json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datacontenttype: Option<String>,
    /// Extension: the tenant the event belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenantid: Option<String>,
    /// Extension: the aggregate type (`ProvisioningRun`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ferryaggregatetype: Option<String>,
    /// Extension: the event's sequence number within its aggregate (1, 2, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ferrysequence: Option<i64>,
    /// Extension: the global stream position, `<transaction id>.<global position>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ferryposition: Option<String>,
    /// Extension: the correlation id of the business operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlationid: Option<String>,
    /// Extension: the event or request that caused this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causationid: Option<String>,
    /// The payload.
    pub data: Value,
}

/// Why a message is not an acceptable CloudEvent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    /// Not JSON, or not an object with the CloudEvent attributes.
    #[error("not a CloudEvent in JSON structured mode: {0}")]
    NotCloudEvent(String),
    /// `specversion` other than 1.0.
    #[error("unsupported specversion {0:?} (expected \"1.0\")")]
    SpecVersion(String),
    /// A required attribute is empty.
    #[error("attribute {0} must not be empty")]
    Empty(&'static str),
    /// A `datacontenttype` other than JSON.
    #[error("unsupported datacontenttype {0:?} (expected application/json)")]
    ContentType(String),
    /// No `tenantid` extension.
    #[error("the tenantid extension is required")]
    NoTenant,
}

impl CloudEvent {
    /// Parses and checks a structured-mode CloudEvent.
    pub fn parse(body: &[u8]) -> Result<Self, EnvelopeError> {
        let event: CloudEvent = serde_json::from_slice(body)
            .map_err(|e| EnvelopeError::NotCloudEvent(e.to_string()))?;
        if event.specversion != SPEC_VERSION {
            return Err(EnvelopeError::SpecVersion(event.specversion));
        }
        if event.id.trim().is_empty() {
            return Err(EnvelopeError::Empty("id"));
        }
        if event.source.trim().is_empty() {
            return Err(EnvelopeError::Empty("source"));
        }
        if event.event_type.trim().is_empty() {
            return Err(EnvelopeError::Empty("type"));
        }
        if let Some(ct) = &event.datacontenttype {
            // `application/json; charset=utf-8` and `+json` types are JSON too.
            let base = ct.split(';').next().unwrap_or_default().trim();
            if base != JSON && !base.ends_with("+json") {
                return Err(EnvelopeError::ContentType(ct.clone()));
            }
        }
        match event.tenantid.as_deref() {
            Some(t) if !t.trim().is_empty() => Ok(event),
            _ => Err(EnvelopeError::NoTenant),
        }
    }

    /// The JSON bytes of the event.
    pub fn to_bytes(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }
}

/// Who posted an event over HTTP (`POST /factory/events`): the verified token's tenant and
/// subject, never the body's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Poster {
    /// The token's tenant: the event must be for it.
    pub tenant: crate::TenantId,
    /// The token's subject: the actor of the event's effects.
    pub actor: crate::Actor,
}

/// An event posted over HTTP and taken in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Accepted {
    /// The CloudEvent id.
    pub id: String,
    /// The event name (`ReleaseReady`, …).
    pub event: String,
    /// True when the id was handled before (nothing happened this time).
    pub duplicate: bool,
}

/// Why an event posted over HTTP was not taken in; the API answers each with one status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IntakeError {
    /// Not a valid CloudEvent or payload, or an unknown type (dead-lettered): 400.
    #[error("malformed event: {0}")]
    Malformed(String),
    /// Another tenant's event, or an untrusted source: 403.
    #[error("{0}")]
    Forbidden(String),
    /// A domain rule refused it (dead-lettered): 422.
    #[error("event refused: {0}")]
    Rejected(String),
    /// The same id is being handled right now: 409, retry later.
    #[error("event {0} is being handled; retry later")]
    InProgress(String),
    /// The store or a dependency is unavailable: 503, retry later.
    #[error("temporarily unavailable: {0}")]
    Unavailable(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> Vec<u8> {
        serde_json::to_vec(&v).unwrap()
    }

    #[test]
    fn a_valid_event_parses() {
        let e = CloudEvent::parse(&body(serde_json::json!({
            "specversion": "1.0", "id": "1", "source": "urn:x", "type": "t",
            "tenantid": "acme", "datacontenttype": "application/json; charset=utf-8",
            "data": {"a": 1}, "unknownext": "ignored"
        })))
        .unwrap();
        assert_eq!(e.tenantid.as_deref(), Some("acme"));
        assert_eq!(e.data["a"], 1);
    }

    #[test]
    fn bad_envelopes_say_why() {
        let cases = [
            (
                serde_json::json!({"specversion": "0.3", "id": "1", "source": "s", "type": "t", "tenantid": "a", "data": {}}),
                "specversion",
            ),
            (
                serde_json::json!({"specversion": "1.0", "id": " ", "source": "s", "type": "t", "tenantid": "a", "data": {}}),
                "id",
            ),
            (
                serde_json::json!({"specversion": "1.0", "id": "1", "source": "s", "type": "t", "data": {}}),
                "tenantid",
            ),
            (
                serde_json::json!({"specversion": "1.0", "id": "1", "source": "s", "type": "t", "tenantid": "a", "datacontenttype": "text/xml", "data": {}}),
                "datacontenttype",
            ),
            (
                serde_json::json!({"specversion": "1.0", "source": "s", "type": "t", "tenantid": "a", "data": {}}),
                "CloudEvent",
            ),
        ];
        for (v, word) in cases {
            let err = CloudEvent::parse(&body(v)).unwrap_err().to_string();
            assert!(err.contains(word), "{err} should mention {word}");
        }
        assert!(CloudEvent::parse(b"\xff not json").is_err());
    }
}
