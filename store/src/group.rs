//! Group commit on Postgres: the events of concurrent commands that commit nothing else go
//! to the store as one `INSERT`, one transaction, instead of one each.
//!
//! Why: an append's cost in Postgres is mostly its commit (the transaction's start and end,
//! its commit record, its wait for the WAL flush), not its rows; one transaction of eight
//! rows costs little more than one of one (the figures are in `bench/README.md`).
//!
//! A command's events are never split: the group is one statement, stored whole or not at
//! all. When Postgres refuses a group because one of its commands lost a race (a unique
//! violation on an aggregate's sequence), nothing of the group was stored, and each command
//! is then appended on its own, so that only the one that lost sees the conflict. Any other
//! failure is every member's: a statement whose connection broke may or may not have
//! committed, and appending again could store a command twice.
//!
//! Nothing waits to fill a group: a command's events are written at once while fewer than
//! [`IN_FLIGHT`] groups are being written; otherwise they queue, and the next group takes
//! everything queued (up to [`MAX_GROUP_ROWS`] events).

use crate::stream::Position;
use sqlx::postgres::PgPool;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::oneshot;
use tracing::Instrument;

/// How many groups may be written at once (each holds a connection while it is). Two
/// measured best: with four, most groups held one command; with one, the (b) mix of
/// `bench/run.sh` ran no faster than with two.
pub const IN_FLIGHT: usize = 2;

/// The most events one group takes; what is left waits for the next.
pub const MAX_GROUP_ROWS: usize = 1_024;

/// One event of a command, serialized.
#[derive(Debug, Clone)]
pub struct NewEvent {
    /// The stable event type string.
    pub event_type: String,
    /// The event's schema version.
    pub event_version: String,
    /// The event, as JSON text.
    pub payload: String,
}

/// A command's events: appended after `first_sequence - 1` of one aggregate.
#[derive(Debug, Clone)]
pub struct NewEvents {
    /// The aggregate's type.
    pub aggregate_type: &'static str,
    /// The aggregate's id.
    pub aggregate_id: String,
    /// The sequence number of the first event.
    pub first_sequence: i64,
    /// The events, in order (at least one).
    pub events: Vec<NewEvent>,
    /// The command's metadata, as JSON text; every event carries it.
    pub metadata: String,
}

impl NewEvents {
    fn last_sequence(&self) -> i64 {
        self.first_sequence + self.events.len() as i64 - 1
    }
}

/// Why a command's events were not (or may not have been) stored.
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    /// Its own statement failed (a unique violation is a concurrent command).
    #[error(transparent)]
    Own(sqlx::Error),
    /// The group it was written with failed, for a reason that is not a lost race.
    #[error("the group of appends failed: {0}")]
    Group(Arc<sqlx::Error>),
    /// The group's writer ended before it answered (the process is shutting down): the
    /// events may or may not be stored.
    #[error("the group of appends ended before it answered; the outcome is unknown")]
    Lost,
}

type Reply = oneshot::Sender<Result<Position, AppendError>>;

#[derive(Default)]
struct Queue {
    waiting: Vec<(NewEvents, Reply)>,
    writing: usize,
}

/// Writes the appends of one Postgres pool in groups; see the module documentation.
pub struct GroupAppender {
    pool: PgPool,
    queue: Mutex<Queue>,
}

impl std::fmt::Debug for GroupAppender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupAppender").finish_non_exhaustive()
    }
}

/// One statement for any number of events, so that Postgres prepares it once per
/// connection. Rows take their global positions in the order they are listed.
const INSERT: &str = "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata) \
     SELECT t, i, s, et, ev, p::jsonb, m::jsonb \
     FROM UNNEST($1::text[], $2::text[], $3::int8[], $4::text[], $5::text[], $6::text[], $7::text[]) WITH ORDINALITY AS u(t, i, s, et, ev, p, m, n) \
     ORDER BY n \
     RETURNING aggregate_type, aggregate_id, sequence, transaction_id::text::bigint, global_position";

impl GroupAppender {
    /// An appender writing to `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            queue: Mutex::default(),
        }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        // The queue is left consistent between statements, so a panic elsewhere while it
        // was held does not make it unusable.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many groups are being written and how many commands wait for the next.
    #[cfg(test)]
    fn counts(&self) -> (usize, usize) {
        let queue = self.queue();
        (queue.writing, queue.waiting.len())
    }

    /// Stores `events` (with those of other commands waiting at the same time) and returns
    /// where the last of them stands in the stream.
    pub async fn append(self: &Arc<Self>, events: NewEvents) -> Result<Position, AppendError> {
        debug_assert!(!events.events.is_empty());
        let (reply, answer) = oneshot::channel();
        let group = {
            let mut queue = self.queue();
            queue.waiting.push((events, reply));
            (queue.writing < IN_FLIGHT).then(|| {
                queue.writing += 1;
                take_group(&mut queue.waiting)
            })
        };
        if let Some(group) = group {
            // A task of its own: a caller that goes away (a client that hung up) must not
            // stop the write of the others' events.
            let appender = Arc::clone(self);
            let span = tracing::debug_span!("group_commit");
            tokio::spawn(async move { appender.write_groups(group).await }.instrument(span));
        }
        answer.await.unwrap_or(Err(AppendError::Lost))
    }

    /// Writes `group`, then each group that queued meanwhile, until none is left.
    async fn write_groups(self: Arc<Self>, mut group: Vec<(NewEvents, Reply)>) {
        let mut writer = Writer {
            appender: &self,
            done: false,
        };
        loop {
            self.write(group).await;
            let mut queue = self.queue();
            if queue.waiting.is_empty() {
                // Under the lock that queued them: an append that saw this writer busy has
                // its events taken by it.
                queue.writing -= 1;
                writer.done = true;
                return;
            }
            group = take_group(&mut queue.waiting);
        }
    }

    async fn write(&self, group: Vec<(NewEvents, Reply)>) {
        let members: Vec<&NewEvents> = group.iter().map(|(events, _)| events).collect();
        match insert(&self.pool, &members).await {
            Ok(stored) => {
                for (events, reply) in group {
                    let _ = reply.send(position_of(&stored, &events));
                }
            }
            Err(error) if is_unique_violation(&error) && group.len() > 1 => {
                tracing::debug!(
                    commands = group.len(),
                    "a group of appends lost a race; appending its commands one by one"
                );
                for (events, reply) in group {
                    let answer = insert(&self.pool, &[&events])
                        .await
                        .map_err(AppendError::Own)
                        .and_then(|stored| position_of(&stored, &events));
                    let _ = reply.send(answer);
                }
            }
            Err(error) if group.len() == 1 => {
                if let Some((_, reply)) = group.into_iter().next() {
                    let _ = reply.send(Err(AppendError::Own(error)));
                }
            }
            Err(error) => {
                let error = Arc::new(error);
                for (_, reply) in group {
                    let _ = reply.send(Err(AppendError::Group(Arc::clone(&error))));
                }
            }
        }
    }
}

/// Where the last of `events` was stored, from the rows an insert returned.
fn position_of(
    stored: &HashMap<(String, String, i64), Position>,
    events: &NewEvents,
) -> Result<Position, AppendError> {
    let key = (
        events.aggregate_type.to_string(),
        events.aggregate_id.clone(),
        events.last_sequence(),
    );
    stored.get(&key).copied().ok_or_else(|| {
        AppendError::Own(sqlx::Error::Protocol(format!(
            "the insert returned no row for {} {} sequence {}",
            key.0, key.1, key.2
        )))
    })
}

/// Marks a writer gone; if it ends without finishing (its task was cancelled or panicked),
/// its place is freed so that the next append starts another.
struct Writer<'a> {
    appender: &'a GroupAppender,
    done: bool,
}

impl Drop for Writer<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.appender.queue().writing -= 1;
        }
    }
}

/// The oldest waiting commands, up to [`MAX_GROUP_ROWS`] events (always at least one).
fn take_group(waiting: &mut Vec<(NewEvents, Reply)>) -> Vec<(NewEvents, Reply)> {
    let mut rows = 0;
    let count = waiting
        .iter()
        .take_while(|(events, _)| {
            let fits = rows == 0 || rows + events.events.len() <= MAX_GROUP_ROWS;
            rows += events.events.len();
            fits
        })
        .count();
    waiting.drain(..count.max(1).min(waiting.len())).collect()
}

fn is_unique_violation(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .is_some_and(|e| e.kind() == sqlx::error::ErrorKind::UniqueViolation)
}

/// Inserts every member's events in one statement; returns each stored row's place in the
/// stream by `(aggregate type, aggregate id, sequence)`.
async fn insert(
    pool: &PgPool,
    members: &[&NewEvents],
) -> Result<HashMap<(String, String, i64), Position>, sqlx::Error> {
    let rows: usize = members.iter().map(|m| m.events.len()).sum();
    let mut types = Vec::with_capacity(rows);
    let mut ids = Vec::with_capacity(rows);
    let mut sequences = Vec::with_capacity(rows);
    let mut event_types = Vec::with_capacity(rows);
    let mut versions = Vec::with_capacity(rows);
    let mut payloads = Vec::with_capacity(rows);
    let mut metadata = Vec::with_capacity(rows);
    for member in members {
        for (offset, event) in member.events.iter().enumerate() {
            types.push(member.aggregate_type);
            ids.push(member.aggregate_id.as_str());
            sequences.push(member.first_sequence + offset as i64);
            event_types.push(event.event_type.as_str());
            versions.push(event.event_version.as_str());
            payloads.push(event.payload.as_str());
            metadata.push(member.metadata.as_str());
        }
    }
    let stored: Vec<(String, String, i64, i64, i64)> = sqlx::query_as(INSERT)
        .bind(types)
        .bind(ids)
        .bind(sequences)
        .bind(event_types)
        .bind(versions)
        .bind(payloads)
        .bind(metadata)
        .fetch_all(pool)
        .await?;
    Ok(stored
        .into_iter()
        .map(|(kind, id, sequence, transaction_id, global_position)| {
            (
                (kind, id, sequence),
                Position {
                    transaction_id,
                    global_position,
                },
            )
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::database::{Backend, Pool};
    use crate::stream::{self, StoredEvent};
    use crate::testing::{eventually, TestDatabase};

    fn command(id: &str, first_sequence: i64, count: usize) -> NewEvents {
        NewEvents {
            aggregate_type: "T",
            aggregate_id: id.to_string(),
            first_sequence,
            events: (0..count)
                .map(|n| NewEvent {
                    event_type: "E".to_string(),
                    event_version: "1".to_string(),
                    payload: format!(r#"{{"n":{n}}}"#),
                })
                .collect(),
            metadata: format!(r#"{{"command":"{id}"}}"#),
        }
    }

    type Answer = tokio::task::JoinHandle<Result<Position, AppendError>>;

    fn spawn(appender: &Arc<GroupAppender>, events: NewEvents) -> Answer {
        let appender = Arc::clone(appender);
        tokio::spawn(async move { appender.append(events).await })
    }

    /// Holds the events table so that no append can finish, starts [`IN_FLIGHT`] appends
    /// (every writer busy), then `queued` more, and lets the table go once they all wait:
    /// the queued ones are then one group.
    async fn queued_behind_busy_writers(
        t: &TestDatabase,
        appender: &Arc<GroupAppender>,
        queued: Vec<NewEvents>,
    ) -> (Vec<Answer>, Vec<Answer>) {
        let Pool::Postgres(pool) = t.db.pool().clone() else {
            unreachable!()
        };
        let mut hold = pool.begin().await.unwrap();
        sqlx::query("LOCK TABLE events IN SHARE MODE")
            .execute(&mut *hold)
            .await
            .unwrap();
        let busy: Vec<Answer> = (0..IN_FLIGHT)
            .map(|n| spawn(appender, command(&format!("busy-{n}"), 1, 1)))
            .collect();
        eventually("every writer busy", || async {
            (appender.counts() == (IN_FLIGHT, 0)).then_some(())
        })
        .await;
        let count = queued.len();
        let waiting: Vec<Answer> = queued.into_iter().map(|c| spawn(appender, c)).collect();
        eventually("the commands queued", || async {
            (appender.counts() == (IN_FLIGHT, count)).then_some(())
        })
        .await;
        hold.rollback().await.unwrap();
        (busy, waiting)
    }

    async fn stored(t: &TestDatabase) -> Vec<StoredEvent> {
        stream::read_after(&t.db, Position::default(), 1_000)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn commands_that_wait_for_a_writer_are_stored_in_one_transaction() {
        let t = TestDatabase::new(Backend::Postgres).await;
        let appender = Arc::clone(t.db.group_appender().unwrap());
        let queued = (0..6)
            .map(|n| command(&format!("q-{n}"), 1, n % 3 + 1))
            .collect();
        let (busy, waiting) = queued_behind_busy_writers(&t, &appender, queued).await;
        let mut busy_positions = vec![];
        for answer in busy {
            busy_positions.push(answer.await.unwrap().unwrap());
        }
        let mut positions = vec![];
        for answer in waiting {
            positions.push(answer.await.unwrap().unwrap());
        }
        let stored = eventually("every event readable", || async {
            let stored = stored(&t).await;
            (stored.len() == IN_FLIGHT + 1 + 2 + 3 + 1 + 2 + 3).then_some(stored)
        })
        .await;
        // Each command's answer is where its own last event stands.
        for (n, position) in positions.iter().enumerate() {
            let last = stored
                .iter()
                .filter(|e| e.aggregate_id == format!("q-{n}"))
                .inspect(|e| assert_eq!(e.metadata["command"], format!("q-{n}")))
                .max_by_key(|e| e.sequence)
                .unwrap();
            assert_eq!(last.sequence, (n % 3 + 1) as i64);
            assert_eq!(*position, last.position);
        }
        // The six waited and went as one transaction; each busy writer's was its own.
        assert!(positions
            .iter()
            .all(|p| p.transaction_id == positions[0].transaction_id));
        let mut transactions: Vec<i64> = busy_positions.iter().map(|p| p.transaction_id).collect();
        transactions.push(positions[0].transaction_id);
        transactions.sort_unstable();
        transactions.dedup();
        assert_eq!(transactions.len(), IN_FLIGHT + 1);
        // Every aggregate's events in order in the stream.
        for n in 0..6 {
            let sequences: Vec<i64> = stored
                .iter()
                .filter(|e| e.aggregate_id == format!("q-{n}"))
                .map(|e| e.sequence)
                .collect();
            assert_eq!(sequences, (1..=(n % 3 + 1) as i64).collect::<Vec<_>>());
        }
        assert_eq!(appender.counts(), (0, 0));
        t.cleanup().await;
    }

    #[tokio::test]
    async fn a_command_that_lost_a_race_does_not_fail_the_others_of_its_group() {
        let t = TestDatabase::new(Backend::Postgres).await;
        let appender = Arc::clone(t.db.group_appender().unwrap());
        appender.append(command("taken", 1, 1)).await.unwrap();
        // Another writer stored sequence 1 of this aggregate first.
        let mut refused = command("taken", 1, 2);
        refused.metadata = r#"{"command":"refused"}"#.to_string();
        let queued = vec![command("first", 1, 2), refused, command("last", 1, 1)];
        let (busy, waiting) = queued_behind_busy_writers(&t, &appender, queued).await;
        for answer in busy {
            answer.await.unwrap().unwrap();
        }
        let answers: Vec<_> = futures_join(waiting).await;
        assert!(answers[0].is_ok(), "{:?}", answers[0]);
        assert!(
            matches!(&answers[1], Err(AppendError::Own(e)) if is_unique_violation(e)),
            "{:?}",
            answers[1]
        );
        assert!(answers[2].is_ok(), "{:?}", answers[2]);
        let stored = eventually("every event readable", || async {
            let stored = stored(&t).await;
            (stored.len() == 1 + IN_FLIGHT + 2 + 1).then_some(stored)
        })
        .await;
        let taken: Vec<&StoredEvent> = stored
            .iter()
            .filter(|e| e.aggregate_id == "taken")
            .collect();
        assert_eq!(taken.len(), 1, "nothing of the refused command is stored");
        assert_eq!(taken[0].metadata["command"], "taken");
        assert_eq!(
            stored.iter().filter(|e| e.aggregate_id == "first").count(),
            2
        );
        assert_eq!(appender.counts(), (0, 0));
        t.cleanup().await;
    }

    #[tokio::test]
    async fn a_group_that_fails_for_another_reason_fails_every_member_and_stores_nothing() {
        let t = TestDatabase::new(Backend::Postgres).await;
        let appender = Arc::clone(t.db.group_appender().unwrap());
        // Not JSON: Postgres refuses the whole statement.
        let mut broken = command("broken", 1, 1);
        broken.events[0].payload = "{not json".to_string();
        let queued = vec![command("fine", 1, 1), broken, command("also-fine", 1, 2)];
        let (busy, waiting) = queued_behind_busy_writers(&t, &appender, queued).await;
        for answer in busy {
            answer.await.unwrap().unwrap();
        }
        for answer in futures_join(waiting).await {
            assert!(matches!(answer, Err(AppendError::Group(_))), "{answer:?}");
        }
        // Only the busy writers' events: none of the group's, and none appended again.
        let stored = eventually("the busy writers' events readable", || async {
            let stored = stored(&t).await;
            (stored.len() >= IN_FLIGHT).then_some(stored)
        })
        .await;
        assert_eq!(stored.len(), IN_FLIGHT, "{stored:?}");
        assert!(stored.iter().all(|e| e.aggregate_id.starts_with("busy-")));
        assert_eq!(appender.counts(), (0, 0));
        t.cleanup().await;
    }

    async fn futures_join(answers: Vec<Answer>) -> Vec<Result<Position, AppendError>> {
        let mut out = vec![];
        for answer in answers {
            out.push(answer.await.unwrap());
        }
        out
    }
}
