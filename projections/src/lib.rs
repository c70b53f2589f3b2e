//! The machinery of Ferry's read models, built from the global stream (ARCHITECTURE.md, The
//! global stream), which knows no bounded context: each context declares its projections
//! (their tables and subscribers) and queries in its own folder of the application crate.
//!
//! A projection writes its rows and its checkpoint in one transaction, a batch of events at
//! a time: each subscriber folds the batch into the stored documents in memory and writes
//! each changed row once (ARCHITECTURE.md, The global stream). [`projection`] runs them;
//! [`queries`] pages the rows and waits for read-your-writes; [`rebuild`] replays the stream
//! into fresh tables and swaps them in.
#![forbid(unsafe_code)]

pub mod projection;
pub mod queries;
pub mod rebuild;

pub use projection::{Progress, Projection, ProjectionRunner, Projector, TableSpec};
pub use queries::{Page, ReadModels};
