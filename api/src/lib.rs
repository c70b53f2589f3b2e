//! Ferry's HTTP API: bearer-token auth, problem+json errors, the provisioning, environment
//! and event routes, the OpenAPI document, and the operational endpoints. It is HTTP only:
//! what it needs from NATS, the workers and the adapters comes through the traits in
//! [`ports`], which the application crate (`ferry-app`) implements and wires.
#![forbid(unsafe_code)]

pub mod auth;
pub mod basis;
pub mod environments;
pub mod events;
pub mod extract;
pub mod idempotent;
pub mod openapi;
pub mod ports;
pub mod problem;
pub mod router;
pub mod routes;
pub mod state;

pub use router::{provisioning_routes, router, Api};
