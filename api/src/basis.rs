//! Requests whose command is decided on other aggregates as well (its basis, e.g. the
//! environment's class for a run): decided on the cached copies, which the command's append
//! checks, and once more on the stored ones when a copy was behind.

use crate::problem::ApiError;
use ferry_store::{CommandError, Read};
use std::future::Future;

/// What a request decided on its basis, and where it read it.
#[derive(Debug)]
pub struct Decided<D> {
    /// The decision (the values the command is built from, and its bases).
    pub decided: D,
    read: Read,
}

impl<D> Decided<D> {
    /// Decides with `decide` on the cached copies; a refusal is decided again on the stored
    /// ones, since a copy may lack what another instance recorded.
    pub async fn decide<F>(mut decide: impl FnMut(Read) -> F) -> Result<Self, ApiError>
    where
        F: Future<Output = Result<D, ApiError>>,
    {
        match decide(Read::Cached).await {
            Ok(decided) => Ok(Self {
                decided,
                read: Read::Cached,
            }),
            Err(_) => Ok(Self {
                decided: decide(Read::Stored).await?,
                read: Read::Stored,
            }),
        }
    }

    /// Runs the command `execute` builds from the decision. When a basis moved after the
    /// cached copies it was decided on, decides once more on the stored ones (a refusal then
    /// is the outer error) and runs it again; a second move is the command's
    /// [`CommandError::Moved`].
    pub async fn execute<F, G, T, E: std::error::Error>(
        &mut self,
        mut decide: impl FnMut(Read) -> F,
        mut execute: impl FnMut(&D) -> G,
    ) -> Result<Result<T, CommandError<E>>, ApiError>
    where
        F: Future<Output = Result<D, ApiError>>,
        G: Future<Output = Result<T, CommandError<E>>>,
    {
        loop {
            match execute(&self.decided).await {
                Err(CommandError::Moved) if self.read == Read::Cached => {
                    self.read = Read::Stored;
                    self.decided = decide(Read::Stored).await?;
                }
                result => return Ok(result),
            }
        }
    }
}
