//! What each aggregate's events become on NATS and the SSE stream, registered per aggregate.
//!
//! A [`Publisher`] turns the stored events of one aggregate into messages (subject and data)
//! and documents the subjects it publishes on. A bounded context registers one per aggregate
//! it stores; the process collects them into [`Publishers`], which the relay, the SSE stream
//! and `ferry schemas` all read, so a subject cannot be published undocumented.
//! [`DomainEvents`] is the publisher of an aggregate without integration events: every event
//! on `ferry.events.<aggregate>.<event>`, its inner object as data.

use crate::cloudevent::{CloudEvent, JSON, SPEC_VERSION};
use crate::outbound::{domain_message, position_token, stored_inner_payload, Outbound};
use crate::schemas::{domain_event_docs, Documents};
use crate::subjects;
use ferry_store::events::{decode_event, ReadError, StoredAggregate};
use ferry_store::{Database, StoredEvent};
use serde_json::value::RawValue;
use serde_json::Value;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::Arc;

/// A message's subject and data, and why it is degraded if it is.
#[derive(Debug, Clone)]
pub struct Message {
    /// The NATS subject (also the CloudEvent `type`).
    pub subject: String,
    /// The CloudEvent's data as JSON text: written into the envelope as it is, without a
    /// `Value` tree between the event and its bytes (the relay encodes every event).
    pub data: Box<RawValue>,
    /// Set when an integration payload could not be built and the domain event went instead.
    pub degraded: Option<String>,
}

/// Equal when subject, data text and degradation are.
impl PartialEq for Message {
    fn eq(&self, other: &Self) -> bool {
        self.subject == other.subject
            && self.data.get() == other.data.get()
            && self.degraded == other.degraded
    }
}

/// A message as the relay and the SSE stream send it.
#[derive(Debug)]
pub struct Encoded {
    /// The NATS subject (also the CloudEvent `type`).
    pub subject: String,
    /// The CloudEvent's JSON.
    pub body: String,
    /// True when an integration payload could not be built and the domain event went instead.
    pub degraded: bool,
}

/// Why an event could not be encoded.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// Its message could not be built (the store failed, or the event does not decode).
    #[error(transparent)]
    Read(#[from] ReadError),
    /// The envelope did not serialize.
    #[error("the CloudEvent does not serialize: {0}")]
    Serialize(#[from] serde_json::Error),
}

/// [`CloudEvent`]'s fields in its order, borrowed: the same JSON without copying the strings.
#[derive(serde::Serialize)]
struct Envelope<'a> {
    specversion: &'a str,
    id: uuid::Uuid,
    source: &'a str,
    #[serde(rename = "type")]
    event_type: &'a str,
    subject: &'a str,
    time: &'a chrono::DateTime<chrono::Utc>,
    datacontenttype: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    tenantid: Option<&'a str>,
    ferryaggregatetype: &'a str,
    ferrysequence: i64,
    ferryposition: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    correlationid: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    causationid: Option<&'a str>,
    data: &'a RawValue,
}

/// One aggregate's events as Ferry publishes them, with the subjects they go on.
#[async_trait::async_trait]
pub trait Publisher: Send + Sync {
    /// The aggregate type whose events it publishes.
    fn aggregate_type(&self) -> &'static str;

    /// The message for `event`, an event of this aggregate. It decodes the event (through
    /// the aggregate's upcasters): one that does not decode is an error, at which the relay
    /// stops, never a skip. `db` is there for payloads that need more than the event.
    async fn message(&self, db: &Database, event: &StoredEvent) -> Result<Message, ReadError>;

    /// Every subject it publishes on and the schema files they refer to (for `ferry
    /// schemas` and the AsyncAPI document).
    fn documents(&self) -> Documents;
}

/// Publishes every event of `A` on its domain subject, its inner object as data.
pub struct DomainEvents<A>(PhantomData<fn() -> A>);

impl<A> Default for DomainEvents<A> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<A> DomainEvents<A> {
    /// The publisher.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait::async_trait]
impl<A> Publisher for DomainEvents<A>
where
    A: StoredAggregate,
    A::Event: schemars::JsonSchema,
{
    fn aggregate_type(&self) -> &'static str {
        A::TYPE
    }

    async fn message(&self, _db: &Database, event: &StoredEvent) -> Result<Message, ReadError> {
        Ok(domain_message(event, &decode_event::<A>(event)?))
    }

    fn documents(&self) -> Documents {
        domain_event_docs::<A::Event>(A::TYPE, &[])
    }
}

/// The publishers of every aggregate the process stores, by aggregate type.
#[derive(Clone, Default)]
pub struct Publishers(BTreeMap<&'static str, Arc<dyn Publisher>>);

impl std::fmt::Debug for Publishers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.0.keys()).finish()
    }
}

impl Publishers {
    /// None yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `publisher` (replacing an earlier one of the same aggregate).
    pub fn with(mut self, publisher: Arc<dyn Publisher>) -> Self {
        self.0.insert(publisher.aggregate_type(), publisher);
        self
    }

    /// Adds every publisher of `other`.
    pub fn extend(mut self, other: Publishers) -> Self {
        self.0.extend(other.0);
        self
    }

    /// True when events of `aggregate_type` have a publisher.
    pub fn declares(&self, aggregate_type: &str) -> bool {
        self.0.contains_key(aggregate_type)
    }

    /// The CloudEvent for `event`. Fails when the store fails (the caller retries) or when
    /// an event of a registered aggregate does not decode (the relay stops at it). An event
    /// of an aggregate no publisher is registered for (e.g. written by a newer version) is
    /// published as stored on its domain subject: the relay publishes every event, and it
    /// cannot decode this one.
    pub async fn to_outbound(
        &self,
        db: &Database,
        source: &str,
        event: &StoredEvent,
    ) -> Result<Outbound, ReadError> {
        let message = self.message(db, event).await?;
        let metadata = &event.metadata;
        Ok(Outbound {
            event: CloudEvent {
                specversion: SPEC_VERSION.to_string(),
                id: event.event_id.to_string(),
                source: source.to_string(),
                event_type: message.subject.clone(),
                subject: Some(event.aggregate_id.clone()),
                time: Some(event.recorded_at),
                datacontenttype: Some(JSON.to_string()),
                tenantid: metadata.tenant_id().map(str::to_string),
                ferryaggregatetype: Some(event.aggregate_type.clone()),
                ferrysequence: Some(event.sequence),
                ferryposition: Some(position_token(event.position)),
                correlationid: metadata.correlation_id().map(str::to_string),
                causationid: metadata.causation_id().map(str::to_string),
                // Ferry wrote this text; should it not read back, the text still tells.
                data: serde_json::from_str(message.data.get())
                    .unwrap_or_else(|_| Value::String(message.data.get().to_string())),
            },
            subject: message.subject,
            degraded: message.degraded,
        })
    }

    /// The CloudEvent for `event` as JSON bytes, with its subject: the JSON of
    /// [`to_outbound`](Self::to_outbound)'s event, written from borrowed parts and the
    /// data's text (the relay and the SSE stream send only bytes, so neither the envelope's
    /// strings nor a tree of the data are built). The data's keys keep its type's order.
    pub async fn encode(
        &self,
        db: &Database,
        source: &str,
        event: &StoredEvent,
        position: &str,
    ) -> Result<Encoded, EncodeError> {
        let message = self.message(db, event).await?;
        let envelope = Envelope {
            specversion: SPEC_VERSION,
            id: event.event_id,
            source,
            event_type: &message.subject,
            subject: &event.aggregate_id,
            time: &event.recorded_at,
            datacontenttype: JSON,
            tenantid: event.metadata.tenant_id(),
            ferryaggregatetype: &event.aggregate_type,
            ferrysequence: event.sequence,
            ferryposition: position,
            correlationid: event.metadata.correlation_id(),
            causationid: event.metadata.causation_id(),
            data: &message.data,
        };
        Ok(Encoded {
            body: serde_json::to_string(&envelope)?,
            degraded: message.degraded.is_some(),
            subject: message.subject,
        })
    }

    async fn message(&self, db: &Database, event: &StoredEvent) -> Result<Message, ReadError> {
        Ok(match self.0.get(event.aggregate_type.as_str()) {
            Some(publisher) => publisher.message(db, event).await?,
            None => Message {
                subject: subjects::domain_subject(&event.aggregate_type, &event.event_type),
                data: stored_inner_payload(event),
                degraded: None,
            },
        })
    }

    /// What every publisher documents, publisher by publisher (by aggregate type).
    pub fn documents(&self) -> Documents {
        let mut docs = Documents::default();
        for publisher in self.0.values() {
            docs.extend(publisher.documents());
        }
        docs
    }
}
