//! Ferry's HTTP API machinery, which knows no bounded context: bearer-token auth,
//! problem+json errors, extractors, creation under an `Idempotency-Key` ([`idempotent`]),
//! commands decided on a basis ([`basis`]), the event routes, the router and the OpenAPI
//! document built from every context's routes, and the operational endpoints. Each context's
//! routes and use cases live in its folder of the application crate (`ferry-app`). It is
//! HTTP only: what it needs from NATS, the workers and the adapters comes through the traits
//! in [`ports`], which the application crate implements and wires.
#![forbid(unsafe_code)]

pub mod auth;
pub mod basis;
pub mod events;
pub mod extract;
pub mod idempotent;
pub mod openapi;
pub mod ports;
pub mod problem;
pub mod router;
pub mod state;

pub use router::{router, Api};
