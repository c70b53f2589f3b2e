//! Runs commands against aggregates kept in the event store.
//!
//! cqrs-es's `CqrsFramework` is not used because it cannot return the new state and it
//! dispatches queries in-process (not durable). Instead: load through the plain persisted
//! event store, check the tenant, handle, commit with metadata, and hand back the state.

use crate::database::{Database, Pool};
use crate::metadata::EventMetadata;
use cqrs_es::event_sink::EventSink;
use cqrs_es::persist::{EventStoreAggregateContext, PersistedEventStore};
use cqrs_es::{Aggregate, AggregateError, EventStore};
use ferry_domain::{TenantId, TenantOwned};
use postgres_es::PostgresEventRepository;
use sqlite_es::SqliteEventRepository;

/// Why a command did not take effect.
#[derive(Debug, thiserror::Error)]
pub enum CommandError<E: std::error::Error> {
    /// The aggregate refused the command (a domain rule).
    #[error(transparent)]
    Domain(E),
    /// No such aggregate for this tenant.
    #[error("not found")]
    NotFound,
    /// Another command changed the aggregate first; retrying may succeed.
    #[error("the record was changed concurrently; retry")]
    Conflict,
    /// The store could not be reached.
    #[error("event store unavailable: {0}")]
    Unavailable(String),
    /// Anything else from the store (logged, not shown to callers).
    #[error("event store error: {0}")]
    Store(String),
}

impl<E: std::error::Error> From<AggregateError<E>> for CommandError<E> {
    fn from(error: AggregateError<E>) -> Self {
        match error {
            AggregateError::UserError(e) => Self::Domain(e),
            AggregateError::AggregateConflict => Self::Conflict,
            AggregateError::DatabaseConnectionError(e) => Self::Unavailable(e.to_string()),
            AggregateError::DeserializationError(e) => Self::Store(e.to_string()),
            AggregateError::UnexpectedError(e) => {
                // sqlite-es only recognises a primary-key violation as a conflict; our
                // (aggregate, sequence) key is a UNIQUE constraint there.
                let unique = e
                    .downcast_ref::<sqlx::Error>()
                    .and_then(|e| e.as_database_error())
                    .is_some_and(|e| e.kind() == sqlx::error::ErrorKind::UniqueViolation);
                if unique {
                    Self::Conflict
                } else {
                    Self::Store(e.to_string())
                }
            }
        }
    }
}

/// The result of a command that took effect.
#[derive(Debug, Clone)]
pub struct Executed<A: Aggregate> {
    /// The aggregate after the new events.
    pub aggregate: A,
    /// The aggregate's last sequence number after the commit.
    pub sequence: usize,
    /// The events the command produced (possibly none).
    pub events: Vec<A::Event>,
    /// Every event of the aggregate, the new ones included, oldest first.
    pub history: Vec<A::Event>,
}

enum Store<A: Aggregate + Send + Sync> {
    Postgres(PersistedEventStore<PostgresEventRepository, A>),
    Sqlite(PersistedEventStore<SqliteEventRepository, A>),
}

/// Commands and loads for one aggregate type.
pub struct Repository<A: Aggregate + Send + Sync> {
    db: Database,
    store: Store<A>,
    services: A::Services,
}

impl<A> Repository<A>
where
    A: Aggregate + TenantOwned + Clone + Send + Sync,
{
    /// A repository over `db`.
    pub fn new(db: Database, services: A::Services) -> Self {
        let store = match db.pool() {
            Pool::Postgres(pool) => Store::Postgres(PersistedEventStore::new_event_store(
                PostgresEventRepository::new(pool.clone()),
            )),
            Pool::Sqlite(pool) => Store::Sqlite(PersistedEventStore::new_event_store(
                SqliteEventRepository::new(pool.clone()),
            )),
        };
        Self {
            db,
            store,
            services,
        }
    }

    /// The aggregate and its last sequence, or `None` when it has no events or belongs to
    /// another tenant.
    pub async fn load(
        &self,
        tenant: &TenantId,
        id: &str,
    ) -> Result<Option<(A, usize)>, CommandError<A::Error>> {
        let (aggregate, sequence) = match &self.store {
            Store::Postgres(s) => {
                let c = s.load_aggregate(id).await?;
                (c.aggregate, c.current_sequence)
            }
            Store::Sqlite(s) => {
                let c = s.load_aggregate(id).await?;
                (c.aggregate, c.current_sequence)
            }
        };
        Ok(match aggregate.tenant() {
            Some(owner) if owner == tenant => Some((aggregate, sequence)),
            _ => None,
        })
    }

    /// Every event of the aggregate, oldest first, or `None` as for [`Repository::load`].
    pub async fn load_events(
        &self,
        tenant: &TenantId,
        id: &str,
    ) -> Result<Option<Vec<A::Event>>, CommandError<A::Error>> {
        let envelopes = match &self.store {
            Store::Postgres(s) => s.load_events(id).await?,
            Store::Sqlite(s) => s.load_events(id).await?,
        };
        let mut aggregate = A::default();
        let events: Vec<A::Event> = envelopes.into_iter().map(|e| e.payload).collect();
        for event in &events {
            aggregate.apply(event.clone());
        }
        Ok(match aggregate.tenant() {
            Some(owner) if owner == tenant && !events.is_empty() => Some(events),
            _ => None,
        })
    }

    /// Runs `command` on aggregate `id` for `tenant`. An aggregate of another tenant is
    /// `NotFound`; so is a missing one unless `may_create`.
    pub async fn execute(
        &self,
        tenant: &TenantId,
        id: &str,
        command: A::Command,
        metadata: &EventMetadata,
        may_create: bool,
    ) -> Result<Executed<A>, CommandError<A::Error>> {
        match &self.store {
            Store::Postgres(s) => {
                self.execute_in(s, tenant, id, command, metadata, may_create)
                    .await
            }
            Store::Sqlite(s) => {
                self.execute_in(s, tenant, id, command, metadata, may_create)
                    .await
            }
        }
    }

    async fn execute_in<R: cqrs_es::persist::PersistedEventRepository>(
        &self,
        store: &PersistedEventStore<R, A>,
        tenant: &TenantId,
        id: &str,
        command: A::Command,
        metadata: &EventMetadata,
        may_create: bool,
    ) -> Result<Executed<A>, CommandError<A::Error>> {
        // Load the events ourselves (not `load_aggregate`) so the caller also gets the
        // history, e.g. to fold the view it returns.
        let mut history: Vec<A::Event> = store
            .load_events(id)
            .await?
            .into_iter()
            .map(|e| e.payload)
            .collect();
        let mut aggregate = A::default();
        for event in &history {
            aggregate.apply(event.clone());
        }
        match aggregate.tenant() {
            Some(owner) if owner != tenant => return Err(CommandError::NotFound),
            None if !may_create => return Err(CommandError::NotFound),
            _ => {}
        }
        let current_sequence = history.len();
        let sink = EventSink::default();
        aggregate
            .handle(command, &self.services, &sink)
            .await
            .map_err(CommandError::Domain)?;
        let events = sink.collect().await;
        let sequence = current_sequence + events.len();
        if !events.is_empty() {
            let context = EventStoreAggregateContext {
                aggregate_id: id.to_string(),
                aggregate: aggregate.clone(),
                current_sequence,
                current_snapshot: None,
            };
            store
                .commit(events.clone(), context, metadata.to_map())
                .await?;
            self.db.signal_commit();
            history.extend(events.iter().cloned());
        }
        Ok(Executed {
            aggregate,
            sequence,
            events,
            history,
        })
    }
}
