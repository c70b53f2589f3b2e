//! Ferry's domain: the aggregates (deployment specifications and provisioning runs), their
//! commands, events, typed errors and the validated value types they are made of.
//!
//! This crate is pure: no HTTP, no database, no messaging. The stores and the API drive the
//! aggregates through cqrs-es; everything they may decide lives here and is tested here.
#![forbid(unsafe_code)]

pub mod cloudevent;
pub mod confinement;
pub mod drift;
pub mod environment;
pub mod event_type;
pub mod ids;
pub mod ports;
pub mod promotion;
pub mod receipts;
pub mod release;
pub mod run;
pub mod specification;
pub mod text;
pub mod values;

pub use event_type::{EventType, StoredAggregate};
pub use ids::*;
pub use values::*;

/// Implemented by aggregates whose records belong to one tenant, so that stores can refuse to
/// load a tenant's aggregate on behalf of another.
pub trait TenantOwned {
    /// The owning tenant, or `None` when the aggregate has no events yet.
    fn tenant(&self) -> Option<&TenantId>;
}
