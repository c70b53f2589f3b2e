//! Ferry's event store and the global stream over it.
//!
//! * [`Database`]: a Postgres pool (production) or an SQLite file (the embedded default),
//!   with the migrations of `migrations/`.
//! * [`Repository`]: loads an aggregate for a tenant (from this process's aggregate cache
//!   plus the events stored after it), runs a command through the cqrs-es aggregate, commits
//!   with the event metadata, and returns the new state. cqrs-es's snapshot and aggregate
//!   stores are never used (ARCHITECTURE.md, Crates).
//! * [`stream`]: the durable, globally ordered stream of stored events that projections and
//!   other subscriptions read with their own checkpoints (ARCHITECTURE.md, The global stream).
//! * [`events`]: the same events decoded once, through each aggregate's upcasters, into the
//!   aggregate's event type; subscriptions made of one subscriber per aggregate.
//! * [`group`]: on Postgres, the events of concurrent commands written as one transaction.
#![forbid(unsafe_code)]

mod cache;
pub mod database;
pub mod events;
pub mod group;
pub mod idempotency;
pub mod items;
pub mod metadata;
pub mod repository;
pub mod stream;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use database::{is_unavailable, Backend, Database, DatabaseError, StoreOptions};
pub use events::{DecodeError, StoredAggregate, Subscriber, Subscription, Typed};
pub use group::Basis;
pub use metadata::{EventMetadata, StoredMetadata};
pub use repository::{
    error_chain, BoxError, CommandError, Executed, LinkedWrite, Read, Repository,
};
pub use stream::{Handler, HandlerError, Param, Payload, Position, StoredEvent, Tx};

#[cfg(test)]
mod tests;
