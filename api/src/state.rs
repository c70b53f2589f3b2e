//! What every handler shares: the store, the repositories, the read side, the verifier,
//! the metrics, the artifact store and the rules confining tenants' references.

use crate::auth::Verifier;
use crate::ports::{EventFeed, EventIntake, Telemetry};
use ferry_domain::confinement::Confinement;
use ferry_domain::environment::Environment;
use ferry_domain::ports::sources::{ArtifactStore, ProgramSource};
use ferry_domain::run::ProvisioningRun;
use ferry_domain::specification::DeploymentSpecification;
use ferry_domain::{StoredAggregate, TenantOwned};
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
    environments: Repository<Environment>,
    reads: ReadModels,
    services: Services,
}

/// What the state is built from, besides the store.
pub struct Services {
    /// Token verifier.
    pub verifier: Verifier,
    /// How long a command waits for its read model.
    pub read_your_writes: Duration,
    /// The process's counters and background parts' state.
    pub telemetry: Arc<dyn Telemetry>,
    /// Where run logs are kept.
    pub artifacts: Arc<dyn ArtifactStore>,
    /// Inbound event handling, shared with the NATS consumers (`POST /factory/events`).
    pub intake: Arc<dyn EventIntake>,
    /// The live event stream (`GET /factory/events/stream`).
    pub feed: Arc<dyn EventFeed>,
    /// A transaction holding the global stream back longer than this is reported.
    pub stream_hold_warn: Duration,
    /// What each tenant's references may reach.
    pub confinement: Arc<Confinement>,
    /// Where programs are read, to check a declared program exists when it is declared.
    pub programs: Arc<dyn ProgramSource>,
}

impl AppState {
    /// Builds the state.
    pub fn new(db: Database, reads: ReadModels, services: Services) -> Self {
        Self {
            inner: Arc::new(Inner {
                specifications: Repository::new(db.clone(), ()),
                // The run routes answer with the view folded from the run's events.
                runs: Repository::with_history(db.clone(), ()),
                environments: Repository::new(db.clone(), ()),
                db,
                reads,
                services,
            }),
        }
    }

    /// The store.
    pub fn db(&self) -> &Database {
        &self.inner.db
    }
    /// A repository of any aggregate Ferry stores (for a bounded context's routes; cheap:
    /// it holds the store's pool and the aggregate's upcasters).
    pub fn repository<A>(&self) -> Repository<A>
    where
        A: StoredAggregate<Services = ()> + TenantOwned + Clone + Send + Sync,
        A::Command: Clone,
    {
        Repository::new(self.inner.db.clone(), ())
    }
    /// Specifications.
    pub fn specifications(&self) -> &Repository<DeploymentSpecification> {
        &self.inner.specifications
    }
    /// Runs.
    pub fn runs(&self) -> &Repository<ProvisioningRun> {
        &self.inner.runs
    }
    /// Environments.
    pub fn environments(&self) -> &Repository<Environment> {
        &self.inner.environments
    }
    /// Read models.
    pub fn reads(&self) -> &ReadModels {
        &self.inner.reads
    }
    /// Token verifier.
    pub fn verifier(&self) -> &Verifier {
        &self.inner.services.verifier
    }
    /// How long a command waits for its read model before answering.
    pub fn read_your_writes(&self) -> Duration {
        self.inner.services.read_your_writes
    }
    /// The process's counters and background parts' state.
    pub fn telemetry(&self) -> &dyn Telemetry {
        self.inner.services.telemetry.as_ref()
    }
    /// Artifacts (run logs).
    pub fn artifacts(&self) -> &dyn ArtifactStore {
        self.inner.services.artifacts.as_ref()
    }
    /// Inbound event handling.
    pub fn intake(&self) -> &dyn EventIntake {
        self.inner.services.intake.as_ref()
    }
    /// The live event stream.
    pub fn feed(&self) -> &dyn EventFeed {
        self.inner.services.feed.as_ref()
    }
    /// A transaction holding the global stream back longer than this is reported.
    pub fn stream_hold_warn(&self) -> Duration {
        self.inner.services.stream_hold_warn
    }
    /// Where programs are read (a declared program is looked up when it is declared).
    pub fn programs(&self) -> &dyn ProgramSource {
        self.inner.services.programs.as_ref()
    }
    /// The rules confining each tenant's references (checked at declaration).
    pub fn confinement(&self) -> &Confinement {
        &self.inner.services.confinement
    }
}
