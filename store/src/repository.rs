//! Runs commands against aggregates kept in the event store.
//!
//! cqrs-es's `CqrsFramework` is not used because it cannot return the new state and it
//! dispatches queries in-process (not durable). Instead: load (the cached aggregate plus the
//! events stored after it, see [`crate::cache`]), check the tenant, handle, commit with
//! metadata, keep the new state in the cache, and hand it back.
//!
//! A command decided on other aggregates as well (a run request on its environment's class)
//! names them as its basis ([`Repository::load_basis`], [`Repository::execute_on`]): read
//! from the cache without asking the store, and checked by the append, which stores nothing
//! when one of them changed since ([`CommandError::Moved`]; the caller decides again on the
//! stored state).
//!
//! The commit is Ferry's own insert into the same table (the columns postgres-es and
//! sqlite-es write), so that a [`LinkedWrite`] can commit in the same transaction as the
//! events: a record that the effect happened (e.g. an inbound message marked handled)
//! exists exactly when the effect does.

use crate::cache::{AggregateCache, Cached};
use crate::database::{is_unavailable, Backend, Database};
use crate::events::{events_after, ReadError, StoredAggregate};
use crate::group::{AppendError, Basis, GroupAppender, NewEvent, NewEvents};
use crate::metadata::EventMetadata;
use crate::stream::{Param, Position, Tx};
use cqrs_es::event_sink::EventSink;
use cqrs_es::{Aggregate, AggregateError, DomainEvent};
use ferry_domain::{TenantId, TenantOwned};
use std::sync::Arc;

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
    /// An aggregate of the command's basis changed after the state the command was decided
    /// on; nothing was stored. Deciding again on the stored state ([`Read::Stored`]) may
    /// succeed.
    #[error("a record the command was decided on changed meanwhile; retry")]
    Moved,
    /// The store could not be reached (the cause is kept for the log).
    #[error("event store unavailable: {0}")]
    Unavailable(#[source] BoxError),
    /// Anything else from the store (logged with its cause, not shown to callers).
    #[error("event store error: {0}")]
    Store(#[source] BoxError),
}

/// A failure's cause, kept so that logs show the whole chain.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `error` and each of its sources, joined by `": "` (for logs).
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        // Wrappers often repeat their source's text in their own.
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

impl<E: std::error::Error> From<AggregateError<E>> for CommandError<E> {
    fn from(error: AggregateError<E>) -> Self {
        match error {
            AggregateError::UserError(e) => Self::Domain(e),
            AggregateError::AggregateConflict => Self::Conflict,
            AggregateError::DatabaseConnectionError(e) => Self::Unavailable(e),
            AggregateError::DeserializationError(e) => Self::Store(e),
            AggregateError::UnexpectedError(e) => match e.downcast::<sqlx::Error>() {
                Ok(sql) => Self::from_sql(*sql),
                Err(other) => Self::Store(other),
            },
        }
    }
}

impl<E: std::error::Error> CommandError<E> {
    /// Classifies a store error: a unique violation on the events table, or a transaction
    /// Postgres rolled back for a deadlock with another, is a concurrent command; a busy,
    /// locked or unreachable store is unavailable (retry later).
    pub fn from_sql(error: sqlx::Error) -> Self {
        use crate::database::{is_rolled_back_for_another, is_unique_violation};
        if is_unique_violation(&error) || is_rolled_back_for_another(&error) {
            Self::Conflict
        } else if is_unavailable(&error) {
            Self::Unavailable(Box::new(error))
        } else {
            Self::Store(Box::new(error))
        }
    }

    /// Anything else that went wrong while storing, with its cause.
    pub fn store(error: impl Into<BoxError>) -> Self {
        Self::Store(error.into())
    }

    /// The same failure under another aggregate's error type, e.g. while loading another
    /// aggregate a command depends on: its domain refusal becomes a store error with cause.
    pub fn into_other<F: std::error::Error>(self) -> CommandError<F>
    where
        E: Send + Sync + 'static,
    {
        match self {
            Self::Domain(e) => CommandError::Store(Box::new(e)),
            Self::NotFound => CommandError::NotFound,
            Self::Conflict => CommandError::Conflict,
            Self::Moved => CommandError::Moved,
            Self::Unavailable(e) => CommandError::Unavailable(e),
            Self::Store(e) => CommandError::Store(e),
        }
    }
}

/// A statement committed in the same transaction as a command's events (or alone, when the
/// command produced none). It must affect exactly `expect_rows` rows, else the whole commit
/// is rolled back as [`CommandError::Conflict`]: e.g. "mark this inbound message handled,
/// if the delivery that claimed it still holds the claim".
#[derive(Debug, Clone)]
pub struct LinkedWrite {
    /// The statement, with `$n` placeholders.
    pub sql: String,
    /// Its parameters.
    pub params: Vec<Param>,
    /// How many rows it must affect.
    pub expect_rows: u64,
}

/// Where [`Repository::load_basis`] takes an aggregate from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// The cached state when there is one, without asking the store (it may be behind
    /// another instance's writes; the append checks it).
    Cached,
    /// The stored state: the cached one with the events stored after it.
    Stored,
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
    /// Where the last of them stands in the global stream; `None` when there were none.
    /// A read-your-writes wait waits for its projections to pass it before reading.
    pub position: Option<Position>,
    /// Every event of the aggregate, the new ones included, oldest first, when the
    /// repository keeps histories ([`Repository::with_history`]).
    pub history: Option<Vec<A::Event>>,
}

/// Commands and loads for one aggregate type.
pub struct Repository<A: Aggregate + Send + Sync> {
    db: Database,
    services: A::Services,
    cache: Option<Arc<AggregateCache<A>>>,
    histories: bool,
}

impl<A> Repository<A>
where
    A: StoredAggregate + TenantOwned + Clone + Send + Sync + 'static,
    A::Command: Clone,
{
    /// A repository over `db`. It loads events through `A`'s upcasters, as the global
    /// stream's readers do, and keeps the aggregates it loads in `db`'s aggregate cache.
    pub fn new(db: Database, services: A::Services) -> Self {
        Self::build(db, services, false)
    }

    /// As [`Repository::new`], and every [`Executed`] carries the aggregate's whole history,
    /// which the cache then keeps beside the aggregate: for aggregates with short histories
    /// whose callers fold a view from the events (provisioning runs).
    pub fn with_history(db: Database, services: A::Services) -> Self {
        Self::build(db, services, true)
    }

    fn build(db: Database, services: A::Services, histories: bool) -> Self {
        crate::events::register::<A>();
        let cache = db.caches().of::<A>(histories);
        Self {
            db,
            services,
            cache,
            histories,
        }
    }

    /// The aggregate as stored now: the cached state (if any) with the events stored after
    /// it folded in. Only committed events ever reach the cache, so it always holds a true
    /// prefix of the history and the events after it complete it.
    async fn current(&self, id: &str) -> Result<Cached<A>, CommandError<A::Error>> {
        let mut current = match self.cache.as_ref().and_then(|c| c.get(id)) {
            Some(cached) => Cached::clone(&cached),
            None => Cached {
                aggregate: A::default(),
                sequence: 0,
                history: self.histories.then(Vec::new),
            },
        };
        let tail = events_after::<A>(&self.db, id, current.sequence)
            .await
            .map_err(|e| match e {
                ReadError::Sql(e) => CommandError::from_sql(e),
                other => CommandError::store(other),
            })?;
        if tail.is_empty() {
            return Ok(current);
        }
        for typed in tail {
            if let Some(history) = &mut current.history {
                history.push(typed.event.clone());
            }
            current.aggregate.apply(typed.event);
            current.sequence += 1;
        }
        self.remember(id, &current);
        Ok(current)
    }

    fn remember(&self, id: &str, state: &Cached<A>) {
        if let Some(cache) = &self.cache {
            cache.put(id, state.clone());
        }
    }

    /// The aggregate and its last sequence, or `None` when it has no events or belongs to
    /// another tenant.
    pub async fn load(
        &self,
        tenant: &TenantId,
        id: &str,
    ) -> Result<Option<(A, usize)>, CommandError<A::Error>> {
        let current = self.current(id).await?;
        Ok(match current.aggregate.tenant() {
            Some(owner) if owner == tenant => Some((current.aggregate, current.sequence)),
            _ => None,
        })
    }

    /// The aggregate for deciding a command of another aggregate on it, with the [`Basis`]
    /// to name in that command's [`Repository::execute_on`]. `None` (and a basis at
    /// sequence 0 when nothing is stored) as for [`Repository::load`].
    pub async fn load_basis(
        &self,
        tenant: &TenantId,
        id: &str,
        read: Read,
    ) -> Result<(Option<A>, Basis), CommandError<A::Error>> {
        let cached = match read {
            Read::Cached => self.cache.as_ref().and_then(|c| c.get(id)),
            Read::Stored => None,
        };
        let current = match cached {
            Some(cached) => Cached::clone(&cached),
            None => self.current(id).await?,
        };
        let sequence = i64::try_from(current.sequence).map_err(CommandError::store)?;
        let aggregate = match current.aggregate.tenant() {
            Some(owner) if owner == tenant => Some(current.aggregate),
            _ => None,
        };
        Ok((aggregate, Basis::new(A::TYPE, id, sequence)))
    }

    /// Every event of the aggregate as stored (with its sequence, time and metadata),
    /// oldest first, or `None` as for [`Repository::load`]: its history, for a timeline.
    pub async fn load_history(
        &self,
        tenant: &TenantId,
        id: &str,
    ) -> Result<Option<Vec<crate::events::Typed<A::Event>>>, CommandError<A::Error>> {
        let events = events_after::<A>(&self.db, id, 0)
            .await
            .map_err(|e| match e {
                ReadError::Sql(e) => CommandError::from_sql(e),
                other => CommandError::store(other),
            })?;
        let mut aggregate = A::default();
        for typed in &events {
            aggregate.apply(typed.event.clone());
        }
        Ok(match aggregate.tenant() {
            Some(owner) if owner == tenant && !events.is_empty() => Some(events),
            _ => None,
        })
    }

    /// Every event of the aggregate, oldest first, read from the store (not the cache), or
    /// `None` as for [`Repository::load`].
    pub async fn load_events(
        &self,
        tenant: &TenantId,
        id: &str,
    ) -> Result<Option<Vec<A::Event>>, CommandError<A::Error>> {
        Ok(self
            .load_history(tenant, id)
            .await?
            .map(|history| history.into_iter().map(|typed| typed.event).collect()))
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
        self.run(tenant, id, command, metadata, may_create, None, &[])
            .await
    }

    /// As [`Repository::execute`], for a command decided on other aggregates as well: it
    /// is stored only if none of `basis` changed after the state it names, else nothing is
    /// and the answer is [`CommandError::Moved`].
    pub async fn execute_on(
        &self,
        tenant: &TenantId,
        id: &str,
        command: A::Command,
        metadata: &EventMetadata,
        may_create: bool,
        basis: &[Basis],
    ) -> Result<Executed<A>, CommandError<A::Error>> {
        if basis.len() > crate::group::BASIS_SLOTS {
            return Err(CommandError::store(format!(
                "a command names {} bases; at most {} are checked",
                basis.len(),
                crate::group::BASIS_SLOTS
            )));
        }
        self.run(tenant, id, command, metadata, may_create, None, basis)
            .await
    }

    /// As [`Repository::execute`], committing `linked` in the same transaction as the
    /// command's events.
    ///
    /// The command runs first on the cached state (a new aggregate's empty one) without
    /// reading the store: the append names the sequence it follows, so when another writer
    /// went first the store refuses it as a conflict. Only a committed change is kept that
    /// way; a refusal, a command with nothing to record or a conflict is decided again on
    /// the stored state, since the cached one may be behind another instance's writes.
    pub async fn execute_linked(
        &self,
        tenant: &TenantId,
        id: &str,
        command: A::Command,
        metadata: &EventMetadata,
        may_create: bool,
        linked: Option<&LinkedWrite>,
    ) -> Result<Executed<A>, CommandError<A::Error>> {
        self.run(tenant, id, command, metadata, may_create, linked, &[])
            .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn run(
        &self,
        tenant: &TenantId,
        id: &str,
        command: A::Command,
        metadata: &EventMetadata,
        may_create: bool,
        linked: Option<&LinkedWrite>,
        basis: &[Basis],
    ) -> Result<Executed<A>, CommandError<A::Error>> {
        if let Some(cached) = self.cached_for_command(id, may_create) {
            let attempt = self
                .attempt(
                    tenant,
                    id,
                    cached,
                    command.clone(),
                    metadata,
                    may_create,
                    linked,
                    basis,
                    true,
                )
                .await;
            match attempt {
                Ok(Some(done)) => return Ok(done),
                // Decided again on the stored state (a moved basis is the caller's to
                // read again: it is returned).
                Ok(None) | Err(CommandError::Domain(_) | CommandError::Conflict) => {}
                Err(other) => return Err(other),
            }
        }
        let current = self.current(id).await?;
        match self
            .attempt(
                tenant, id, current, command, metadata, may_create, linked, basis, false,
            )
            .await?
        {
            Some(done) => Ok(done),
            None => Err(CommandError::NotFound),
        }
    }

    /// The state a command may run on without reading the store: the cached one, or, for a
    /// command that may create the aggregate, an empty one when nothing is cached (the
    /// append at sequence 1 is refused if the aggregate exists). None without a cache.
    fn cached_for_command(&self, id: &str, may_create: bool) -> Option<Cached<A>> {
        match self.cache.as_ref()?.get(id) {
            Some(cached) => Some(Cached::clone(&cached)),
            None if may_create => Some(Cached {
                aggregate: A::default(),
                sequence: 0,
                history: self.histories.then(Vec::new),
            }),
            None => None,
        }
    }

    /// Runs `command` on `state` and commits what it produced after `state`'s sequence.
    /// `None` when the aggregate is another tenant's or missing and not to be created, and,
    /// when `optimistic` (`state` may be behind the store), when the command produced no
    /// events: nothing is committed then, not even `linked`.
    #[allow(clippy::too_many_arguments)]
    async fn attempt(
        &self,
        tenant: &TenantId,
        id: &str,
        state: Cached<A>,
        command: A::Command,
        metadata: &EventMetadata,
        may_create: bool,
        linked: Option<&LinkedWrite>,
        basis: &[Basis],
        optimistic: bool,
    ) -> Result<Option<Executed<A>>, CommandError<A::Error>> {
        // The command runs on a copy: a refused command may have changed it half-way, and
        // only a committed state may reach the cache.
        let Cached {
            mut aggregate,
            sequence: current_sequence,
            mut history,
        } = state;
        match aggregate.tenant() {
            Some(owner) if owner != tenant => return Ok(None),
            None if !may_create => return Ok(None),
            _ => {}
        }
        let sink = EventSink::default();
        aggregate
            .handle(command, &self.services, &sink)
            .await
            .map_err(CommandError::Domain)?;
        let events = sink.collect().await;
        if optimistic && events.is_empty() {
            return Ok(None);
        }
        let sequence = current_sequence + events.len();
        let mut position = None;
        if !events.is_empty() || linked.is_some() {
            position = self
                .commit(id, current_sequence, &events, metadata, linked, basis)
                .await?;
        }
        if !events.is_empty() {
            self.db.signal_commit();
            if let Some(history) = &mut history {
                history.extend(events.iter().cloned());
            }
            let state = Cached {
                aggregate,
                sequence,
                history,
            };
            self.remember(id, &state);
            (aggregate, history) = (state.aggregate, state.history);
        }
        Ok(Some(Executed {
            aggregate,
            sequence,
            events,
            position,
            history,
        }))
    }

    /// Inserts `events` after `current_sequence` (the columns postgres-es and sqlite-es
    /// write; the stream columns take their defaults) and runs `linked`, atomically. The
    /// events are one statement, the transaction's first write (the global stream relies on
    /// it); without a linked write that statement is the whole transaction, one round trip,
    /// which on Postgres it shares with the events of concurrent commands ([`crate::group`])
    /// and which checks `basis` there. Elsewhere `basis` is checked by a read in the same
    /// transaction, before the events. Returns the position of the last event inserted.
    async fn commit(
        &self,
        id: &str,
        current_sequence: usize,
        events: &[A::Event],
        metadata: &EventMetadata,
        linked: Option<&LinkedWrite>,
        basis: &[Basis],
    ) -> Result<Option<Position>, CommandError<A::Error>> {
        let sql = CommandError::from_sql;
        let serialize = |e: serde_json::Error| CommandError::store(e);
        if let (None, false, Some(appender)) = (linked, events.is_empty(), self.db.group_appender())
        {
            return self
                .commit_grouped(appender, id, current_sequence, events, metadata, basis)
                .await
                .map(Some);
        }
        let metadata = serde_json::to_value(metadata.to_map()).map_err(serialize)?;
        let mut insert = String::from(
            "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata) VALUES ",
        );
        let mut params = Vec::with_capacity(events.len() * 7);
        for (offset, event) in events.iter().enumerate() {
            let sequence =
                i64::try_from(current_sequence + offset + 1).map_err(CommandError::store)?;
            let n = offset * 7;
            if offset > 0 {
                insert.push_str(", ");
            }
            // Rows take their global positions in the order they are listed.
            insert.push_str(&format!(
                "(${}, ${}, ${}, ${}, ${}, ${}, ${})",
                n + 1,
                n + 2,
                n + 3,
                n + 4,
                n + 5,
                n + 6,
                n + 7
            ));
            params.extend([
                Param::Text(Some(A::TYPE.to_string())),
                Param::Text(Some(id.to_string())),
                Param::Int(Some(sequence)),
                Param::Text(Some(event.event_type())),
                Param::Text(Some(event.event_version())),
                Param::Json(Some(serde_json::to_value(event).map_err(serialize)?)),
                Param::Json(Some(metadata.clone())),
            ]);
        }
        insert.push_str(match self.db.backend() {
            Backend::Postgres => " RETURNING transaction_id::text::bigint, global_position",
            Backend::Sqlite => " RETURNING 0, global_position",
        });
        if linked.is_none() && events.is_empty() {
            return Ok(None);
        }
        if linked.is_none() && basis.is_empty() {
            return self
                .db
                .insert_returning_last(&insert, &params)
                .await
                .map_err(sql);
        }
        let mut tx = Tx::begin(&self.db).await.map_err(sql)?;
        for seen in basis {
            let later = tx
                .count(
                    "SELECT COUNT(*) FROM events WHERE aggregate_type = $1 AND aggregate_id = $2 AND sequence > $3",
                    &[
                        Param::Text(Some(seen.aggregate_type().to_string())),
                        Param::Text(Some(seen.aggregate_id().to_string())),
                        Param::Int(Some(seen.sequence())),
                    ],
                )
                .await
                .map_err(sql)?;
            if later > 0 {
                return Err(CommandError::Moved);
            }
        }
        let mut position = None;
        if !events.is_empty() {
            position = tx
                .insert_returning_last(&insert, &params)
                .await
                .map_err(sql)?;
        }
        if let Some(write) = linked {
            let affected = tx.execute(&write.sql, &write.params).await.map_err(sql)?;
            if affected != write.expect_rows {
                // Dropping the transaction rolls the events back with it.
                return Err(CommandError::Conflict);
            }
        }
        tx.commit().await.map_err(sql)?;
        Ok(position)
    }

    /// Postgres, events and nothing else to commit: the events go with those of concurrent
    /// commands, one `INSERT` for all ([`crate::group`]).
    async fn commit_grouped(
        &self,
        appender: &Arc<GroupAppender>,
        id: &str,
        current_sequence: usize,
        events: &[A::Event],
        metadata: &EventMetadata,
        basis: &[Basis],
    ) -> Result<Position, CommandError<A::Error>> {
        let serialize = |e: serde_json::Error| CommandError::store(e);
        let first_sequence = i64::try_from(current_sequence + 1).map_err(CommandError::store)?;
        let events = events
            .iter()
            .map(|event| {
                Ok(NewEvent {
                    event_type: event.event_type(),
                    event_version: event.event_version(),
                    payload: serde_json::to_string(event).map_err(serialize)?,
                })
            })
            .collect::<Result<Vec<_>, CommandError<A::Error>>>()?;
        let metadata = serde_json::to_string(&metadata.to_map()).map_err(serialize)?;
        let appended = appender
            .append(NewEvents {
                aggregate_type: A::TYPE,
                aggregate_id: id.to_string(),
                first_sequence,
                events,
                metadata,
                basis: basis.to_vec(),
            })
            .await;
        appended.map_err(|error| match error {
            AppendError::Own(error) => CommandError::from_sql(error),
            AppendError::Group(error) if is_unavailable(&error) => {
                CommandError::Unavailable(Box::new(error))
            }
            // The outcome is unknown: a retry later finds the events stored or not.
            error @ AppendError::Lost => CommandError::Unavailable(Box::new(error)),
            AppendError::Moved => CommandError::Moved,
            error @ AppendError::Group(_) => CommandError::store(error),
        })
    }
}

#[cfg(test)]
mod error_tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("refused")]
    struct Refused;

    #[test]
    fn a_store_error_keeps_its_cause_for_the_log() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset");
        let error: CommandError<Refused> = CommandError::from_sql(sqlx::Error::Io(io));
        let CommandError::Unavailable(cause) = &error else {
            panic!("a reset connection is unavailable: {error:?}")
        };
        assert!(std::error::Error::source(&error).is_some());
        assert!(
            error_chain(&error).contains("connection reset"),
            "{}",
            error_chain(&error)
        );
        assert!(error_chain(cause.as_ref()).contains("connection reset"));
        // Another aggregate's refusal, met while loading it, becomes a store error with cause.
        let other: CommandError<Refused> = CommandError::Domain(Refused);
        let moved: CommandError<std::io::Error> = other.into_other();
        assert!(matches!(&moved, CommandError::Store(e) if e.to_string() == "refused"));
    }
}
