//! What each aggregate's events become on NATS and the SSE stream, registered per aggregate.
//!
//! A [`Publisher`] turns the stored events of one aggregate into messages (subject and data)
//! and documents the subjects it publishes on. A bounded context registers one per aggregate
//! it stores; the process collects them into [`Publishers`], which the relay, the SSE stream
//! and `ferry schemas` all read, so a subject cannot be published undocumented.
//! [`DomainEvents`] is the publisher of an aggregate without integration events: every event
//! on `ferry.events.<aggregate>.<event>`, its inner object as data.

use crate::cloudevent::{CloudEvent, JSON, SPEC_VERSION};
use crate::outbound::{domain_message, inner_payload, position_token, Outbound};
use crate::schemas::{domain_event_docs, Documents};
use crate::subjects;
use ferry_store::events::{decode, ReadError, StoredAggregate};
use ferry_store::{Database, StoredEvent};
use serde_json::Value;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::Arc;

/// A message's subject and data, and why it is degraded if it is.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The NATS subject (also the CloudEvent `type`).
    pub subject: String,
    /// The CloudEvent's data.
    pub data: Value,
    /// Set when an integration payload could not be built and the domain event went instead.
    pub degraded: Option<String>,
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
        let typed = decode::<A>(event)?;
        Ok(domain_message(event, &typed.event))
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
        let message = match self.0.get(event.aggregate_type.as_str()) {
            Some(publisher) => publisher.message(db, event).await?,
            None => Message {
                subject: subjects::domain_subject(&event.aggregate_type, &event.event_type),
                data: inner_payload(&event.payload),
                degraded: None,
            },
        };
        let meta = |key: &str| {
            event
                .metadata
                .get(key)
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        Ok(Outbound {
            event: CloudEvent {
                specversion: SPEC_VERSION.to_string(),
                id: event.event_id.to_string(),
                source: source.to_string(),
                event_type: message.subject.clone(),
                subject: Some(event.aggregate_id.clone()),
                time: Some(event.recorded_at),
                datacontenttype: Some(JSON.to_string()),
                tenantid: meta("tenantId"),
                ferryaggregatetype: Some(event.aggregate_type.clone()),
                ferrysequence: Some(event.sequence),
                ferryposition: Some(position_token(event.position)),
                correlationid: meta("correlationId"),
                causationid: meta("causationId"),
                data: message.data,
            },
            subject: message.subject,
            degraded: message.degraded,
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
