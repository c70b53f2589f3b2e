//! The Ferry application: its configuration, the wiring of one process (store, projections,
//! workers, adapters, runners, the NATS relay and inbound consumers, the HTTP API), the
//! handler of other services' events, and the process's telemetry. The `ferry` binary is a
//! thin command line over it.
#![forbid(unsafe_code)]

pub mod config;
pub mod console;
pub mod contexts;
pub mod demo;
pub mod events;
pub mod grpc;
pub mod inbound;
pub mod server;
pub mod telemetry;

pub use config::{Config, ConfigError, Reloadable};
pub use contexts::{BoundedContext, Contexts, Process};
pub use server::{Server, StartError};
