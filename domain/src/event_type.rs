//! The names and versions events are stored under.
//!
//! Stored events are never rewritten (ARCHITECTURE.md, Invariants): an event type's name
//! never changes, and a new shape of it is a new version that the store reads back through
//! an upcaster. Each aggregate's event enum says, variant by variant, which [`EventType`] it
//! is; `DomainEvent::event_type` and `event_version` come from there and nowhere else.

/// The version every event type Ferry stores has had so far.
pub const FIRST_VERSION: &str = "1.0";

/// An event type as stored: its stable name and the version of its shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventType {
    /// The stable name (the `event_type` column, and the serde tag of the variant).
    pub name: &'static str,
    /// The version of the payload's shape (the `event_version` column).
    pub version: &'static str,
}

impl EventType {
    /// `name` at `version`.
    pub const fn new(name: &'static str, version: &'static str) -> Self {
        Self { name, version }
    }

    /// `name` at [`FIRST_VERSION`].
    pub const fn first(name: &'static str) -> Self {
        Self::new(name, FIRST_VERSION)
    }
}

/// An aggregate whose events Ferry stores, with the upcasters of its old event versions.
///
/// Declared beside the aggregate (in its module), so that adding an aggregate does not touch
/// the store: the store loads through these upcasters and so does every reader of the
/// global stream, so an upcaster reaches projections too.
pub trait StoredAggregate: cqrs_es::Aggregate + 'static {
    /// Upcasters for stored events of older versions, in the order they apply (an upcaster
    /// to version 2 before one to version 3). Stored events are never rewritten: a new shape
    /// of an event is a new version, and its upcaster goes here. None at first.
    fn upcasters() -> Vec<Box<dyn cqrs_es::persist::EventUpcaster>> {
        Vec::new()
    }
}
