//! What every handler shares: the store, the repositories, the read side and the verifier.

use crate::auth::Verifier;
use ferry_domain::run::ProvisioningRun;
use ferry_domain::specification::DeploymentSpecification;
use ferry_projections::ReadModels;
use ferry_store::{Database, Repository};
use std::sync::Arc;
use std::time::Duration;

/// Shared state of the HTTP API.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    db: Database,
    specifications: Repository<DeploymentSpecification>,
    runs: Repository<ProvisioningRun>,
    reads: ReadModels,
    verifier: Verifier,
    read_your_writes: Duration,
}

impl AppState {
    /// Builds the state.
    pub fn new(
        db: Database,
        reads: ReadModels,
        verifier: Verifier,
        read_your_writes: Duration,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                specifications: Repository::new(db.clone(), ()),
                runs: Repository::new(db.clone(), ()),
                db,
                reads,
                verifier,
                read_your_writes,
            }),
        }
    }

    /// The store.
    pub fn db(&self) -> &Database {
        &self.inner.db
    }
    /// Specifications.
    pub fn specifications(&self) -> &Repository<DeploymentSpecification> {
        &self.inner.specifications
    }
    /// Runs.
    pub fn runs(&self) -> &Repository<ProvisioningRun> {
        &self.inner.runs
    }
    /// Read models.
    pub fn reads(&self) -> &ReadModels {
        &self.inner.reads
    }
    /// Token verifier.
    pub fn verifier(&self) -> &Verifier {
        &self.inner.verifier
    }
    /// How long a command waits for its read model before answering.
    pub fn read_your_writes(&self) -> Duration {
        self.inner.read_your_writes
    }
}
