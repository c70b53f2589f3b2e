//! Ferry's HTTP API and process wiring: configuration, bearer-token auth, problem+json
//! errors, the provisioning routes, the OpenAPI document, and the server that runs the
//! projections beside the API.
#![forbid(unsafe_code)]

pub mod app;
pub mod auth;
pub mod config;
pub mod environments;
pub mod events;
pub mod extract;
pub mod inbound;
pub mod openapi;
pub mod problem;
pub mod routes;
pub mod state;

pub use app::{router, Server, StartError};
pub use config::{Config, ConfigError};
