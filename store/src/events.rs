//! Typed events: every stored event is decoded once, through its aggregate's upcasters, into
//! the aggregate's event type, and handed on as a [`Typed`] envelope (ARCHITECTURE.md, The
//! global stream).
//!
//! * [`StoredAggregate`] declares, once per aggregate, the upcasters that bring old versions
//!   of its events to the current shape. The [`crate::Repository`] loads through them and so
//!   does every reader of the global stream, so an upcaster reaches projections too.
//! * [`Subscription`] is a [`Handler`] made of one [`Subscriber`] per aggregate it reads.
//!   An event of an aggregate it did not declare is not its business and is passed over; an
//!   event of a declared aggregate that does not decode, or of an aggregate type Ferry does
//!   not know at all, is an error: the subscription stops there, reports it and retries.
//! * [`Decoder`] does the same decoding for readers outside a subscription's transaction
//!   (the relay, the SSE stream).
//! * [`Tx::first_event`] and [`first_event`] read an aggregate's first event, typed.

use crate::database::{Database, Pool};
use crate::metadata::StoredMetadata;
use crate::stream::{pg_event, sqlite_event, Handler, HandlerError, Position, StoredEvent, Tx};
use chrono::{DateTime, Utc};
use cqrs_es::persist::{EventUpcaster, SemanticVersion, SerializedEvent};
use cqrs_es::{Aggregate, DomainEvent};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;

use std::sync::{Arc, Mutex};
use uuid::Uuid;

pub use ferry_domain::StoredAggregate;

/// The aggregate types this process stores or reads. An aggregate becomes known when a
/// repository of it is made, a [`Subscription`] or [`Decoder`] declares it, or its bounded
/// context registers it at start ([`register`]); nothing keeps a separate list.
static KNOWN: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());

fn known() -> std::sync::MutexGuard<'static, BTreeSet<&'static str>> {
    // The set is only ever inserted into; a panic elsewhere cannot leave it half-written.
    KNOWN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Makes `A`'s aggregate type known to every reader of the stream in this process.
pub fn register<A: StoredAggregate>() {
    known().insert(A::TYPE);
}

/// True when `aggregate_type` was [`register`]ed: events of it are some reader's business
/// even if not every reader's. Events of an aggregate type that is not known (e.g. written
/// by a newer version) cannot be told apart from a bug, and stop a subscription.
pub fn is_known(aggregate_type: &str) -> bool {
    known().contains(aggregate_type)
}

/// Every known aggregate type, sorted.
pub fn known_aggregates() -> Vec<&'static str> {
    known().iter().copied().collect()
}

/// A stored event decoded into its aggregate's event type `E`, with its place in the stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Typed<E> {
    /// Where it is in the stream.
    pub position: Position,
    /// Unique per event; the CloudEvent id and `Nats-Msg-Id` downstream.
    pub event_id: Uuid,
    /// The aggregate's id.
    pub aggregate_id: String,
    /// The aggregate's sequence number of this event.
    pub sequence: i64,
    /// The metadata (tenantId, actor, correlationId, causationId, requestId), shared with
    /// the stored event it was decoded from.
    pub metadata: StoredMetadata,
    /// When the store recorded it.
    pub recorded_at: DateTime<Utc>,
    /// The event, in its current version.
    pub event: E,
}

impl<E> Typed<E> {
    /// The tenant from the metadata.
    pub fn tenant_id(&self) -> Option<&str> {
        self.metadata.tenant_id()
    }
}

/// Which stored event failed to decode, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventRef {
    /// Its aggregate type.
    pub aggregate_type: String,
    /// Its aggregate's id.
    pub aggregate_id: String,
    /// Its sequence in the aggregate.
    pub sequence: i64,
    /// Its stored type.
    pub event_type: String,
    /// Its stored version.
    pub event_version: String,
}

impl EventRef {
    fn of(event: &StoredEvent) -> Box<Self> {
        Box::new(Self {
            aggregate_type: event.aggregate_type.clone(),
            aggregate_id: event.aggregate_id.clone(),
            sequence: event.sequence,
            event_type: event.event_type.clone(),
            event_version: event.event_version.clone(),
        })
    }
}

impl std::fmt::Display for EventRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} event {} ({} {})",
            self.aggregate_type,
            self.aggregate_id,
            self.sequence,
            self.event_type,
            self.event_version
        )
    }
}

/// A stored event that cannot be read as its aggregate's event type.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The payload (after the upcasters) does not deserialize into the event type.
    #[error("{event} does not decode: {source}")]
    Payload {
        /// The event.
        event: Box<EventRef>,
        /// Why.
        source: serde_json::Error,
    },
    /// The payload decodes, but as another type or version than stored (after the
    /// upcasters): an old version no upcaster brings to the current one, or a payload stored
    /// under the wrong type.
    #[error("{event} decodes as {decoded_type} {decoded_version}; no upcaster brings it there")]
    Version {
        /// The event.
        event: Box<EventRef>,
        /// The type the payload decoded as.
        decoded_type: String,
        /// That type's current version.
        decoded_version: String,
    },
    /// The event's aggregate type is none that Ferry knows (e.g. written by a newer
    /// version): whether it concerns the reader cannot be told.
    #[error("{event} is of an aggregate type Ferry does not know")]
    UnknownAggregate {
        /// The event.
        event: Box<EventRef>,
    },
}

/// Why a typed read of stored events failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The store failed.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    /// An event does not decode.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// An aggregate's events skip a sequence number.
    #[error("{event} follows a gap: sequence {expected} is missing")]
    Gap {
        /// The first event after the gap.
        event: Box<EventRef>,
        /// The sequence that is missing.
        expected: i64,
    },
}

impl From<ReadError> for HandlerError {
    fn from(error: ReadError) -> Self {
        match error {
            ReadError::Sql(e) => HandlerError::Sql(e),
            ReadError::Decode(e) => HandlerError::Decode(e),
            gap @ ReadError::Gap { .. } => HandlerError::Record {
                what: "an aggregate's history".to_string(),
                source: Box::new(gap),
            },
        }
    }
}

/// Decodes `event` as an event of aggregate `A`, through `A`'s upcasters.
pub fn decode<A: StoredAggregate>(event: &StoredEvent) -> Result<Typed<A::Event>, DecodeError> {
    decode_with::<A>(&A::upcasters(), event)
}

/// Decodes `event`'s payload as an event of aggregate `A`, through `A`'s upcasters, without
/// the envelope [`decode`] copies around it (for readers that have the stored event at hand).
pub fn decode_event<A: StoredAggregate>(event: &StoredEvent) -> Result<A::Event, DecodeError> {
    decode_payload::<A>(&A::upcasters(), event)
}

fn decode_with<A: StoredAggregate>(
    upcasters: &[Box<dyn EventUpcaster>],
    event: &StoredEvent,
) -> Result<Typed<A::Event>, DecodeError> {
    let decoded = decode_payload::<A>(upcasters, event)?;
    Ok(Typed {
        position: event.position,
        event_id: event.event_id,
        aggregate_id: event.aggregate_id.clone(),
        sequence: event.sequence,
        metadata: event.metadata.clone(),
        recorded_at: event.recorded_at,
        event: decoded,
    })
}

fn decode_payload<A: StoredAggregate>(
    upcasters: &[Box<dyn EventUpcaster>],
    event: &StoredEvent,
) -> Result<A::Event, DecodeError> {
    let payload_error = |source| DecodeError::Payload {
        event: EventRef::of(event),
        source,
    };
    // The payload becomes a tree only when an upcaster has something to do; otherwise it is
    // read from its text straight into the event's type.
    let upcast = if upcasters
        .iter()
        .any(|u| u.can_upcast(&event.event_type, &event.event_version))
    {
        let stored = SerializedEvent::new(
            event.aggregate_id.clone(),
            usize::try_from(event.sequence).unwrap_or_default(),
            event.aggregate_type.clone(),
            event.event_type.clone(),
            event.event_version.clone(),
            event.payload.to_value().map_err(payload_error)?,
            event.metadata.to_value(),
        );
        Some(upcasters.iter().fold(stored, |e, u| {
            if u.can_upcast(&e.event_type, &e.event_version) {
                u.upcast(e)
            } else {
                e
            }
        }))
    } else {
        None
    };
    let (event_type, event_version, decoded) = match &upcast {
        Some(e) => (
            &e.event_type,
            &e.event_version,
            A::Event::deserialize(&e.payload),
        ),
        None => (
            &event.event_type,
            &event.event_version,
            serde_json::from_str::<A::Event>(event.payload.get()),
        ),
    };
    let decoded = decoded.map_err(payload_error)?;
    // Versions come from the event type: what the stored (upcast) event says it is must be
    // what it decoded as, else its payload would be read with another version's meaning.
    let (decoded_type, decoded_version) = (decoded.event_type(), decoded.event_version());
    if decoded_type != *event_type || !same_version(&decoded_version, event_version) {
        return Err(DecodeError::Version {
            event: EventRef::of(event),
            decoded_type,
            decoded_version,
        });
    }
    Ok(decoded)
}

/// `1.0` and `1.0.0` are the same version (cqrs-es' semantic-version upcasters write the
/// long form); any other text must match exactly.
fn same_version(a: &str, b: &str) -> bool {
    match (SemanticVersion::from_str(a), SemanticVersion::from_str(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// What a subscription does with the events of aggregate `A`, inside the batch's
/// transaction (see [`Handler::handle`]).
#[async_trait::async_trait]
pub trait Subscriber<A: Aggregate>: Send + Sync {
    /// Applies one event. An error rolls the whole batch back; it is retried later.
    async fn on(&self, tx: &mut Tx, event: &Typed<A::Event>) -> Result<(), HandlerError>;

    /// Applies consecutive events of `A` (no event of another aggregate the subscription
    /// reads comes between them), in stream order. The default hands them to
    /// [`Subscriber::on`] one by one; a subscriber that can write them with fewer statements
    /// overrides it, with the same result.
    async fn on_batch(&self, tx: &mut Tx, events: &[Typed<A::Event>]) -> Result<(), HandlerError> {
        for event in events {
            self.on(tx, event).await?;
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl<A: Aggregate, S: Subscriber<A> + ?Sized> Subscriber<A> for Arc<S> {
    async fn on(&self, tx: &mut Tx, event: &Typed<A::Event>) -> Result<(), HandlerError> {
        self.as_ref().on(tx, event).await
    }
    async fn on_batch(&self, tx: &mut Tx, events: &[Typed<A::Event>]) -> Result<(), HandlerError> {
        self.as_ref().on_batch(tx, events).await
    }
}

/// One aggregate's part of a [`Subscription`]: decode, then hand to the subscriber.
#[async_trait::async_trait]
trait Route: Send + Sync {
    async fn handle(&self, tx: &mut Tx, event: &StoredEvent) -> Result<(), HandlerError>;
    async fn handle_run(&self, tx: &mut Tx, events: &[&StoredEvent]) -> Result<(), HandlerError>;
}

struct AggregateRoute<A: StoredAggregate> {
    upcasters: Vec<Box<dyn EventUpcaster>>,
    subscriber: Box<dyn Subscriber<A>>,
}

#[async_trait::async_trait]
impl<A: StoredAggregate> Route for AggregateRoute<A> {
    async fn handle(&self, tx: &mut Tx, event: &StoredEvent) -> Result<(), HandlerError> {
        let typed = decode_with::<A>(&self.upcasters, event)?;
        self.subscriber.on(tx, &typed).await
    }

    async fn handle_run(&self, tx: &mut Tx, events: &[&StoredEvent]) -> Result<(), HandlerError> {
        let mut typed = Vec::with_capacity(events.len());
        for event in events {
            typed.push(
                decode_with::<A>(&self.upcasters, event)
                    .map_err(|e| HandlerError::at(event, e.into()))?,
            );
        }
        self.subscriber.on_batch(tx, &typed).await
    }
}

/// A subscription of the global stream made of one [`Subscriber`] per aggregate it reads:
/// `Subscription::new("name").on::<ProvisioningRun>(runs).on::<Environment>(environments)`.
///
/// As a [`Handler`] it decodes each event of a declared aggregate (through the aggregate's
/// upcasters) and hands it to that aggregate's subscriber. Events of the other aggregates
/// Ferry knows are not its business and are passed over. An event of a declared aggregate
/// that does not decode, or of an aggregate type Ferry does not know, is a
/// [`HandlerError::Decode`]: the subscription stops there and reports it; nothing is skipped.
pub struct Subscription {
    name: String,
    routes: BTreeMap<&'static str, Box<dyn Route>>,
    /// The aggregates in the order `on` declared them.
    order: Vec<&'static str>,
    by_aggregate: bool,
}

impl Subscription {
    /// A subscription with checkpoint `name` that reads no aggregate yet.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            routes: BTreeMap::new(),
            order: Vec::new(),
            by_aggregate: false,
        }
    }

    /// Hands all of a batch's events of one aggregate to its subscriber at once, the
    /// aggregates in the order `on` declared them, instead of keeping the stream's order
    /// across aggregates. Only for subscribers whose writes for different aggregates
    /// commute, or for which the declared order is the right one (a row another aggregate's
    /// events update is written by an aggregate declared before it); each aggregate's own
    /// events keep their order.
    pub fn by_aggregate(mut self) -> Self {
        self.by_aggregate = true;
        self
    }

    /// Hands the events of aggregate `A` to `subscriber` (replacing an earlier subscriber
    /// of `A`).
    pub fn on<A: StoredAggregate>(mut self, subscriber: impl Subscriber<A> + 'static) -> Self {
        register::<A>();
        let route = AggregateRoute::<A> {
            upcasters: A::upcasters(),
            subscriber: Box::new(subscriber),
        };
        if self.routes.insert(A::TYPE, Box::new(route)).is_none() {
            self.order.push(A::TYPE);
        }
        self
    }

    /// True when the subscription reads the events of `aggregate_type`.
    pub fn declares(&self, aggregate_type: &str) -> bool {
        self.routes.contains_key(aggregate_type)
    }
}

#[async_trait::async_trait]
impl Handler for Subscription {
    fn name(&self) -> &str {
        &self.name
    }

    async fn handle(&self, tx: &mut Tx, event: &StoredEvent) -> Result<(), HandlerError> {
        match self.routes.get(event.aggregate_type.as_str()) {
            Some(route) => route.handle(tx, event).await,
            None if is_known(&event.aggregate_type) => Ok(()),
            None => Err(DecodeError::UnknownAggregate {
                event: EventRef::of(event),
            }
            .into()),
        }
    }

    /// Hands each run of consecutive events of one aggregate (passing over the aggregates it
    /// does not read) to that aggregate's subscriber at once, so the order of the events it
    /// reads is kept across aggregates.
    async fn handle_batch(&self, tx: &mut Tx, events: &[StoredEvent]) -> Result<(), HandlerError> {
        if self.by_aggregate {
            return self.handle_by_aggregate(tx, events).await;
        }
        let mut run: Vec<&StoredEvent> = Vec::new();
        let mut route_of_run: Option<(&str, &dyn Route)> = None;
        for event in events {
            let kind = event.aggregate_type.as_str();
            let route = match self.routes.get(kind) {
                Some(route) => route.as_ref(),
                None if is_known(kind) => continue,
                None => {
                    let error = DecodeError::UnknownAggregate {
                        event: EventRef::of(event),
                    };
                    return Err(HandlerError::at(event, error.into()));
                }
            };
            match route_of_run {
                Some((current, _)) if current == kind => {}
                Some((_, previous)) => {
                    previous.handle_run(tx, &run).await?;
                    run.clear();
                    route_of_run = Some((kind, route));
                }
                None => route_of_run = Some((kind, route)),
            }
            run.push(event);
        }
        if let Some((_, route)) = route_of_run {
            route.handle_run(tx, &run).await?;
        }
        Ok(())
    }
}

impl Subscription {
    /// [`Subscription::by_aggregate`]'s way through a batch.
    async fn handle_by_aggregate(
        &self,
        tx: &mut Tx,
        events: &[StoredEvent],
    ) -> Result<(), HandlerError> {
        let mut groups: BTreeMap<&str, Vec<&StoredEvent>> = BTreeMap::new();
        for event in events {
            let kind = event.aggregate_type.as_str();
            if self.routes.contains_key(kind) {
                groups.entry(kind).or_default().push(event);
            } else if !is_known(kind) {
                let error = DecodeError::UnknownAggregate {
                    event: EventRef::of(event),
                };
                return Err(HandlerError::at(event, error.into()));
            }
        }
        for kind in &self.order {
            if let (Some(group), Some(route)) = (groups.get(kind), self.routes.get(kind)) {
                route.handle_run(tx, group).await?;
            }
        }
        Ok(())
    }
}

type Decode<T> = Box<dyn Fn(&StoredEvent) -> Result<T, DecodeError> + Send + Sync>;

/// Decodes stored events of the aggregates it declares into one type `T`, for readers that
/// are not a [`Subscription`] (the relay, the SSE stream):
/// `Decoder::new().on::<ProvisioningRun>(Message::Run).on::<Environment>(Message::Environment)`.
pub struct Decoder<T> {
    routes: BTreeMap<&'static str, Decode<T>>,
}

impl<T> Default for Decoder<T> {
    fn default() -> Self {
        Self {
            routes: BTreeMap::new(),
        }
    }
}

impl<T: 'static> Decoder<T> {
    /// A decoder that declares no aggregate yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Decodes the events of aggregate `A` (through its upcasters) and wraps them with `wrap`.
    pub fn on<A: StoredAggregate>(mut self, wrap: fn(Typed<A::Event>) -> T) -> Self {
        register::<A>();
        let upcasters = A::upcasters();
        self.routes.insert(
            A::TYPE,
            Box::new(move |event| decode_with::<A>(&upcasters, event).map(wrap)),
        );
        self
    }

    /// The decoded event, or `None` when its aggregate is not declared here (what that
    /// means is the caller's to say).
    pub fn decode(&self, event: &StoredEvent) -> Result<Option<T>, DecodeError> {
        self.routes
            .get(event.aggregate_type.as_str())
            .map(|decode| decode(event))
            .transpose()
    }

    /// True when the decoder reads the events of `aggregate_type`.
    pub fn declares(&self, aggregate_type: &str) -> bool {
        self.routes.contains_key(aggregate_type)
    }
}

const PG_FIRST: &str = "
SELECT global_position, transaction_id::text::bigint AS transaction_id, event_id::text AS event_id,
       aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata, recorded_at
  FROM events
 WHERE aggregate_type = $1 AND aggregate_id = $2
 ORDER BY sequence
 LIMIT 1";

const SQLITE_FIRST: &str = "
SELECT global_position, 0 AS transaction_id, event_id, aggregate_type, aggregate_id, sequence,
       event_type, event_version, payload, metadata, recorded_at
  FROM events
 WHERE aggregate_type = ?1 AND aggregate_id = ?2
 ORDER BY sequence
 LIMIT 1";

impl Tx {
    /// The first event of aggregate `A` with id `aggregate_id`, decoded, if it has any:
    /// read in this transaction (e.g. a subscription's, to find a run's request).
    pub async fn first_event<A: StoredAggregate>(
        &mut self,
        aggregate_id: &str,
    ) -> Result<Option<Typed<A::Event>>, ReadError> {
        let stored = match self {
            Tx::Postgres(t) => sqlx::query(PG_FIRST)
                .bind(A::TYPE)
                .bind(aggregate_id)
                .fetch_optional(&mut **t)
                .await?
                .as_ref()
                .map(pg_event)
                .transpose()?,
            Tx::Sqlite(t) => sqlx::query(SQLITE_FIRST)
                .bind(A::TYPE)
                .bind(aggregate_id)
                .fetch_optional(&mut **t)
                .await?
                .as_ref()
                .map(sqlite_event)
                .transpose()?,
        };
        Ok(stored.as_ref().map(decode::<A>).transpose()?)
    }
}

/// As [`Tx::first_event`], outside any transaction.
pub async fn first_event<A: StoredAggregate>(
    db: &Database,
    aggregate_id: &str,
) -> Result<Option<Typed<A::Event>>, ReadError> {
    let stored = match db.pool() {
        Pool::Postgres(p) => sqlx::query(PG_FIRST)
            .bind(A::TYPE)
            .bind(aggregate_id)
            .fetch_optional(p)
            .await?
            .as_ref()
            .map(pg_event)
            .transpose()?,
        Pool::Sqlite(p) => sqlx::query(SQLITE_FIRST)
            .bind(A::TYPE)
            .bind(aggregate_id)
            .fetch_optional(p)
            .await?
            .as_ref()
            .map(sqlite_event)
            .transpose()?,
    };
    Ok(stored.as_ref().map(decode::<A>).transpose()?)
}

const PG_AFTER: &str = "
SELECT global_position, transaction_id::text::bigint AS transaction_id, event_id::text AS event_id,
       aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata, recorded_at
  FROM events
 WHERE aggregate_type = $1 AND aggregate_id = $2 AND sequence > $3
 ORDER BY sequence";

const SQLITE_AFTER: &str = "
SELECT global_position, 0 AS transaction_id, event_id, aggregate_type, aggregate_id, sequence,
       event_type, event_version, payload, metadata, recorded_at
  FROM events
 WHERE aggregate_type = ?1 AND aggregate_id = ?2 AND sequence > ?3
 ORDER BY sequence";

/// The events of aggregate `A` with id `aggregate_id` stored after its sequence `after`
/// (0: all of them), oldest first, decoded through `A`'s upcasters. A gap in the sequence is
/// an error: the aggregate would be folded from a partial history.
pub async fn events_after<A: StoredAggregate>(
    db: &Database,
    aggregate_id: &str,
    after: usize,
) -> Result<Vec<Typed<A::Event>>, ReadError> {
    let after = i64::try_from(after).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    let stored = match db.pool() {
        Pool::Postgres(p) => sqlx::query(PG_AFTER)
            .bind(A::TYPE)
            .bind(aggregate_id)
            .bind(after)
            .fetch_all(p)
            .await?
            .iter()
            .map(pg_event)
            .collect::<Result<Vec<_>, _>>()?,
        Pool::Sqlite(p) => sqlx::query(SQLITE_AFTER)
            .bind(A::TYPE)
            .bind(aggregate_id)
            .bind(after)
            .fetch_all(p)
            .await?
            .iter()
            .map(sqlite_event)
            .collect::<Result<Vec<_>, _>>()?,
    };
    let upcasters = A::upcasters();
    let mut events = Vec::with_capacity(stored.len());
    for (expected, event) in (after + 1..).zip(&stored) {
        if event.sequence != expected {
            return Err(ReadError::Gap {
                event: EventRef::of(event),
                expected,
            });
        }
        events.push(decode_with::<A>(&upcasters, event)?);
    }
    Ok(events)
}

#[cfg(test)]
mod tests;
