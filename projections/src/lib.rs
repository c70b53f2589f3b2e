//! Ferry's read models, built from the global stream (ARCHITECTURE.md, The global stream).
//!
//! Three projections, each with its own tables and checkpoint so that each can be rebuilt
//! and swapped on its own:
//!
//! | projection | table | serves |
//! |---|---|---|
//! | `specifications` | `rm_specification_versions` | every declared version |
//! | `runs` | `rm_runs` | runs with state, receipts, approval, timestamps |
//! | `environments` | `rm_environment_specifications` | latest and last applied specification per environment |
//!
//! A projection writes its rows and its checkpoint in one transaction, a batch of events at
//! a time: each subscriber folds the batch into the stored documents in memory and writes
//! each changed row once (ARCHITECTURE.md, The global stream). [`queries`] reads
//! them; [`rebuild`] replays the stream into fresh tables and swaps them in.
#![forbid(unsafe_code)]

pub mod projection;
pub mod queries;
pub mod rebuild;
pub mod views;

pub use projection::{
    provisioning_projections, Progress, Projection, ProjectionRunner, Projector, TableSpec,
};
pub use queries::{Page, ReadModels};
pub use views::RunView;

#[cfg(test)]
mod tests;
