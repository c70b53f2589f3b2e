//! Group commit on Postgres: the events of concurrent commands that commit nothing else go
//! to the store as one `INSERT`, one transaction, instead of one each.
//!
//! Why: an append's cost in Postgres is mostly its commit (the transaction's start and end,
//! its commit record, its wait for the WAL flush), not its rows; one transaction of eight
//! rows costs little more than one of one (the figures are in `bench/README.md`).
//!
//! A command's events are never split: the group is one statement, stored whole or not at
//! all. A group lists its rows in the order of their keys (aggregate type, id, sequence), so
//! two groups inserting the same keys wait for each other in one order and never deadlock.
//! When Postgres refuses a group because one of its commands lost a race (a unique
//! violation on an aggregate's sequence), or rolls it back for a deadlock with some other
//! writer, nothing of the group was stored, and each command is then appended on its own,
//! so that only the one that lost sees the conflict. Any other
//! failure is every member's: a statement whose connection broke may or may not have
//! committed, and appending again could store a command twice.
//!
//! A command may name its basis: other aggregates it was decided on, at the sequence it saw
//! ([`Basis`]). The statement stores a command's events only if none of them has events
//! after that sequence, read when the statement begins; a command whose basis moved stores
//! nothing and is answered [`AppendError::Moved`] (the others of its group are stored). So a
//! decision on another aggregate costs no read of its own: it is checked in the append.
//!
//! Nothing waits to fill a group: a command's events are written at once while fewer than
//! [`IN_FLIGHT`] groups are being written; otherwise they queue, and the next group takes
//! everything queued (up to [`MAX_GROUP_ROWS`] events).

use crate::database::{is_rolled_back_for_another, is_unique_violation};
use crate::stream::Position;
use sqlx::postgres::PgPool;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// The other aggregates the command was decided on (often none).
    pub basis: Vec<Basis>,
}

impl NewEvents {
    fn last_sequence(&self) -> i64 {
        self.first_sequence + self.events.len() as i64 - 1
    }
}

/// An aggregate a command was decided on, at the last sequence the decision saw (0: none
/// stored). The command is stored only while that aggregate has no events after it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Basis {
    aggregate_type: &'static str,
    aggregate_id: String,
    sequence: i64,
}

impl Basis {
    /// Aggregate `aggregate_id` of type `aggregate_type`, seen at `sequence`.
    pub fn new(
        aggregate_type: &'static str,
        aggregate_id: impl Into<String>,
        sequence: i64,
    ) -> Self {
        Self {
            aggregate_type,
            aggregate_id: aggregate_id.into(),
            sequence,
        }
    }

    /// The aggregate's type.
    pub fn aggregate_type(&self) -> &'static str {
        self.aggregate_type
    }

    /// The aggregate's id.
    pub fn aggregate_id(&self) -> &str {
        &self.aggregate_id
    }

    /// The last sequence the decision saw.
    pub fn sequence(&self) -> i64 {
        self.sequence
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
    /// An aggregate of the command's basis has events after the sequence it was decided on:
    /// nothing of the command was stored; deciding it again may succeed.
    #[error("an aggregate the command was decided on changed meanwhile")]
    Moved,
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
    counters: Counters,
}

/// What the appender has written since the process started, for `/metrics`: how well
/// commands are grouped (commands per group) and how often a group had to be split.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupStats {
    /// Group statements written (a group may hold one command).
    pub groups: u64,
    /// Commands those groups held.
    pub commands: u64,
    /// Events those groups held.
    pub events: u64,
    /// Groups Postgres refused as a whole for a lost race or a deadlock, whose commands
    /// were then appended one at a time.
    pub split: u64,
}

#[derive(Default)]
struct Counters {
    groups: AtomicU64,
    commands: AtomicU64,
    events: AtomicU64,
    split: AtomicU64,
}

impl std::fmt::Debug for GroupAppender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupAppender").finish_non_exhaustive()
    }
}

/// The most bases one group checks (and one command may name); a group takes no more
/// members once it has this many.
pub const BASIS_SLOTS: usize = 16;

/// The insert of a group without bases: one statement for any number of events, so that
/// Postgres prepares it once per connection. Rows take their global positions in the order
/// they are listed.
const INSERT: &str = "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata) \
     SELECT t, i, s, et, ev, p::jsonb, m::jsonb \
     FROM UNNEST($1::text[], $2::text[], $3::int8[], $4::text[], $5::text[], $6::text[], $7::text[]) WITH ORDINALITY AS u(t, i, s, et, ev, p, m, n) \
     ORDER BY n \
     RETURNING aggregate_type, aggregate_id, sequence, transaction_id::text::bigint, global_position";

/// The insert of a group with bases: as [`INSERT`], leaving out the rows of the members
/// (numbered by `$8`, one per row) one of whose bases has events after the sequence it
/// names. The bases are [`BASIS_SLOTS`] rows of four parameters each (type, id, sequence,
/// member; unused ones NULL) rather than arrays: with as many rows whatever the group,
/// Postgres keeps one plan for the statement instead of planning it at every call (it plans
/// an array's rows as ten, and the cheaper plan for the few a group holds won each time).
static INSERT_CHECKED: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let slots: Vec<String> = (0..BASIS_SLOTS)
        .map(|k| {
            let n = 9 + 4 * k;
            format!(
                "(${}::text, ${}::text, ${}::int8, ${}::int4)",
                n,
                n + 1,
                n + 2,
                n + 3
            )
        })
        .collect();
    format!(
        "WITH moved AS ( \
           SELECT b.member FROM (VALUES {}) AS b(t, i, s, member) \
            WHERE b.t IS NOT NULL \
              AND EXISTS (SELECT 1 FROM events e WHERE e.aggregate_type = b.t AND e.aggregate_id = b.i AND e.sequence > b.s)) \
         INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata) \
         SELECT t, i, s, et, ev, p::jsonb, m::jsonb \
         FROM UNNEST($1::text[], $2::text[], $3::int8[], $4::text[], $5::text[], $6::text[], $7::text[], $8::int4[]) WITH ORDINALITY AS u(t, i, s, et, ev, p, m, member, n) \
         WHERE u.member NOT IN (SELECT moved.member FROM moved) \
         ORDER BY n \
         RETURNING aggregate_type, aggregate_id, sequence, transaction_id::text::bigint, global_position",
        slots.join(", ")
    )
});

impl GroupAppender {
    /// An appender writing to `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            queue: Mutex::default(),
            counters: Counters::default(),
        }
    }

    /// What this appender has written so far.
    pub fn stats(&self) -> GroupStats {
        let c = &self.counters;
        GroupStats {
            groups: c.groups.load(Ordering::Relaxed),
            commands: c.commands.load(Ordering::Relaxed),
            events: c.events.load(Ordering::Relaxed),
            split: c.split.load(Ordering::Relaxed),
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
        let c = &self.counters;
        c.groups.fetch_add(1, Ordering::Relaxed);
        c.commands
            .fetch_add(members.len() as u64, Ordering::Relaxed);
        let events: usize = members.iter().map(|m| m.events.len()).sum();
        c.events.fetch_add(events as u64, Ordering::Relaxed);
        match insert(&self.pool, &members).await {
            Ok(stored) => {
                for (events, reply) in group {
                    let _ = reply.send(position_of(&stored, &events));
                }
            }
            // Nothing of the group was stored: a command lost a race (a unique violation),
            // or two groups inserting the same keys in opposite orders deadlocked and
            // Postgres rolled this one back.
            Err(error)
                if (is_unique_violation(&error) || is_rolled_back_for_another(&error))
                    && group.len() > 1 =>
            {
                self.counters.split.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    commands = group.len(),
                    %error,
                    "a group of appends was refused; appending its commands one by one"
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

/// Where the last of `events` was stored, from the rows an insert returned. A command
/// with a basis whose rows were left out had its basis moved.
fn position_of(
    stored: &HashMap<(String, String, i64), Position>,
    events: &NewEvents,
) -> Result<Position, AppendError> {
    let key = (
        events.aggregate_type.to_string(),
        events.aggregate_id.clone(),
        events.last_sequence(),
    );
    match stored.get(&key) {
        Some(position) => Ok(*position),
        None if !events.basis.is_empty() => Err(AppendError::Moved),
        None => Err(AppendError::Own(sqlx::Error::Protocol(format!(
            "the insert returned no row for {} {} sequence {}",
            key.0, key.1, key.2
        )))),
    }
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

/// The oldest waiting commands, up to [`MAX_GROUP_ROWS`] events and [`BASIS_SLOTS`] bases
/// (always at least one command).
fn take_group(waiting: &mut Vec<(NewEvents, Reply)>) -> Vec<(NewEvents, Reply)> {
    let (mut rows, mut bases) = (0, 0);
    let count = waiting
        .iter()
        .take_while(|(events, _)| {
            let fits = rows == 0
                || (rows + events.events.len() <= MAX_GROUP_ROWS
                    && bases + events.basis.len() <= BASIS_SLOTS);
            rows += events.events.len();
            bases += events.basis.len();
            fits
        })
        .count();
    waiting.drain(..count.max(1).min(waiting.len())).collect()
}

/// Whether `member`'s basis names an aggregate that one of the `earlier` members writes
/// after the sequence the basis saw: the statement's own rows are invisible to its check,
/// and the stream would show the command after the change it did not see.
fn moved_by_earlier(member: &NewEvents, earlier: &[&NewEvents]) -> bool {
    member.basis.iter().any(|basis| {
        earlier.iter().any(|other| {
            other.aggregate_type == basis.aggregate_type
                && other.aggregate_id == basis.aggregate_id
                && other.last_sequence() > basis.sequence
        })
    })
}

/// Inserts every member's events in one statement, but those whose basis moved; returns
/// each stored row's place in the stream by `(aggregate type, aggregate id, sequence)`.
async fn insert(
    pool: &PgPool,
    members: &[&NewEvents],
) -> Result<HashMap<(String, String, i64), Position>, sqlx::Error> {
    // Every group lists its rows in one order, the key's: two groups that insert the same
    // keys then wait for each other's first in the same order instead of each holding a
    // key the other waits for (a deadlock Postgres breaks only after `deadlock_timeout`).
    // Rows take their positions in this order, and the basis check below follows it.
    let mut members = members.to_vec();
    members.sort_by(|a, b| {
        (a.aggregate_type, &a.aggregate_id, a.first_sequence).cmp(&(
            b.aggregate_type,
            &b.aggregate_id,
            b.first_sequence,
        ))
    });
    let rows: usize = members.iter().map(|m| m.events.len()).sum();
    let mut basis_types = Vec::new();
    let mut basis_ids = Vec::new();
    let mut basis_sequences = Vec::new();
    let mut basis_members = Vec::new();
    let mut row_members = Vec::with_capacity(rows);
    let mut types = Vec::with_capacity(rows);
    let mut ids = Vec::with_capacity(rows);
    let mut sequences = Vec::with_capacity(rows);
    let mut event_types = Vec::with_capacity(rows);
    let mut versions = Vec::with_capacity(rows);
    let mut payloads = Vec::with_capacity(rows);
    let mut metadata = Vec::with_capacity(rows);
    for (number, member) in members.iter().enumerate() {
        if moved_by_earlier(member, &members[..number]) {
            continue;
        }
        // A group holds at most MAX_GROUP_ROWS commands.
        let number = number as i32;
        for basis in &member.basis {
            basis_types.push(basis.aggregate_type);
            basis_ids.push(basis.aggregate_id.as_str());
            basis_sequences.push(basis.sequence);
            basis_members.push(number);
        }
        for (offset, event) in member.events.iter().enumerate() {
            row_members.push(number);
            types.push(member.aggregate_type);
            ids.push(member.aggregate_id.as_str());
            sequences.push(member.first_sequence + offset as i64);
            event_types.push(event.event_type.as_str());
            versions.push(event.event_version.as_str());
            payloads.push(event.payload.as_str());
            metadata.push(member.metadata.as_str());
        }
    }
    if basis_types.len() > BASIS_SLOTS {
        // `take_group` keeps a group within the slots; only one command naming more than
        // there are (refused by the repository before it gets here) could exceed them.
        return Err(sqlx::Error::Protocol(format!(
            "a group names {} bases; a statement checks at most {BASIS_SLOTS}",
            basis_types.len()
        )));
    }
    let query = if basis_types.is_empty() {
        sqlx::query_as(INSERT)
    } else {
        sqlx::query_as(INSERT_CHECKED.as_str())
    };
    let mut query = query
        .bind(types)
        .bind(ids)
        .bind(sequences)
        .bind(event_types)
        .bind(versions)
        .bind(payloads)
        .bind(metadata);
    if !basis_types.is_empty() {
        query = query.bind(row_members);
        for slot in 0..BASIS_SLOTS {
            query = query
                .bind(basis_types.get(slot).copied())
                .bind(basis_ids.get(slot).copied())
                .bind(basis_sequences.get(slot).copied())
                .bind(basis_members.get(slot).copied());
        }
    }
    let stored: Vec<(String, String, i64, i64, i64)> = query.fetch_all(pool).await?;
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
            basis: vec![],
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
                .inspect(|e| assert_eq!(e.metadata.to_value()["command"], format!("q-{n}")))
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
        // The counters show it: one group per busy writer and one of six commands.
        assert_eq!(
            t.db.group_stats(),
            Some(GroupStats {
                groups: IN_FLIGHT as u64 + 1,
                commands: IN_FLIGHT as u64 + 6,
                events: IN_FLIGHT as u64 + 12,
                split: 0,
            })
        );
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
        assert_eq!(taken[0].metadata.to_value()["command"], "taken");
        // The refused group counts as split; its appends one by one are not groups.
        assert_eq!(
            t.db.group_stats(),
            Some(GroupStats {
                groups: 1 + IN_FLIGHT as u64 + 1,
                commands: 1 + IN_FLIGHT as u64 + 3,
                events: 1 + IN_FLIGHT as u64 + 2 + 2 + 1,
                split: 1,
            })
        );
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

    #[tokio::test]
    async fn a_command_whose_basis_moved_stores_nothing_and_the_others_are_stored() {
        let t = TestDatabase::new(Backend::Postgres).await;
        let appender = Arc::clone(t.db.group_appender().unwrap());
        appender.append(command("dep", 1, 1)).await.unwrap();
        let decided_on = |id: &str, seen: i64| {
            let mut c = command(id, 1, 1);
            c.basis = vec![Basis::new("T", "dep", seen)];
            c
        };
        // Queued in an order other than the key's, which the group stores them in.
        let queued = vec![
            command("plain", 1, 1),
            // Decided on dep as stored, but its key comes after the command changing dep.
            decided_on("z-after", 1),
            command("dep", 2, 1),
            // Decided on dep as stored: kept, its key comes before the change to dep.
            decided_on("a-current", 1),
            // Decided before dep's first event: moved.
            decided_on("stale", 0),
        ];
        let (busy, waiting) = queued_behind_busy_writers(&t, &appender, queued).await;
        for answer in busy {
            answer.await.unwrap().unwrap();
        }
        let answers = futures_join(waiting).await;
        let outcome: Vec<&str> = answers
            .iter()
            .map(|a| match a {
                Ok(_) => "stored",
                Err(AppendError::Moved) => "moved",
                Err(_) => "failed",
            })
            .collect();
        assert_eq!(
            outcome,
            ["stored", "moved", "stored", "stored", "moved"],
            "{answers:?}"
        );
        let stored = eventually("every event readable", || async {
            let stored = stored(&t).await;
            (stored.len() == 1 + IN_FLIGHT + 3).then_some(stored)
        })
        .await;
        let ids: Vec<&str> = stored.iter().map(|e| e.aggregate_id.as_str()).collect();
        assert!(
            !ids.contains(&"stale") && !ids.contains(&"z-after"),
            "{ids:?}"
        );
        // The three stored went together, in the order of their keys.
        let group: Vec<&StoredEvent> = stored
            .iter()
            .filter(|e| ["a-current", "dep", "plain"].contains(&e.aggregate_id.as_str()))
            .filter(|e| !(e.aggregate_id == "dep" && e.sequence == 1))
            .collect();
        let order: Vec<&str> = group.iter().map(|e| e.aggregate_id.as_str()).collect();
        assert_eq!(order, ["a-current", "dep", "plain"]);
        assert!(group
            .iter()
            .all(|e| e.position.transaction_id == group[0].position.transaction_id));
        // Alone, the same check: a basis as stored is kept, a moved one refused.
        assert!(appender.append(decided_on("alone", 2)).await.is_ok());
        assert!(matches!(
            appender.append(decided_on("alone-stale", 1)).await,
            Err(AppendError::Moved)
        ));
        assert_eq!(appender.counts(), (0, 0));
        t.cleanup().await;
    }

    #[tokio::test]
    async fn groups_inserting_the_same_keys_in_opposite_orders_do_not_deadlock() {
        let t = TestDatabase::new(Backend::Postgres).await;
        let Pool::Postgres(pool) = t.db.pool().clone() else {
            unreachable!()
        };
        let lock_waits = || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                  WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            waiting
        };
        let start = |members: Vec<NewEvents>| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let members: Vec<&NewEvents> = members.iter().collect();
                insert(&pool, &members).await
            })
        };
        // Another writer holds k3, so that the first group stops there.
        let mut hold = pool.begin().await.unwrap();
        insert_on(&mut hold, &[&command("k3", 1, 1)]).await;
        // Listed k2, k3, k1: taken in that order, it would hold k2 while it waits at k3.
        let first = start(vec![
            command("k2", 1, 1),
            command("k3", 1, 1),
            command("k1", 1, 1),
        ]);
        eventually("the first group waiting", || async {
            (lock_waits().await == 1).then_some(())
        })
        .await;
        // Listed k1, k2: taken in that order, it would hold k1 while it waits for k2, and
        // once the holder let k3 go the first would wait for k1: each for the other.
        let second = start(vec![command("k1", 1, 1), command("k2", 1, 1)]);
        eventually("both groups waiting", || async {
            (lock_waits().await == 2).then_some(())
        })
        .await;
        hold.rollback().await.unwrap();
        let answers = [first.await.unwrap(), second.await.unwrap()];
        // Both take their keys in the key's order: the first stores all three, the second
        // waits for it at k1 and then lost the race, which tells it to append its commands
        // one by one; not a deadlock, which Postgres breaks only after `deadlock_timeout`.
        assert!(answers[0].is_ok(), "{answers:?}");
        assert!(
            matches!(&answers[1], Err(error) if is_unique_violation(error)),
            "{answers:?}"
        );
        drop(pool);
        t.cleanup().await;
    }

    /// Inserts `members` in `tx` as a group's statement would, without committing.
    async fn insert_on(tx: &mut sqlx::PgConnection, members: &[&NewEvents]) {
        for member in members {
            sqlx::query(
                "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata) \
                 VALUES ($1, $2, $3, 'E', '1', '{}', '{}')",
            )
            .bind(member.aggregate_type)
            .bind(&member.aggregate_id)
            .bind(member.first_sequence)
            .execute(&mut *tx)
            .await
            .unwrap();
        }
    }

    #[test]
    fn a_group_takes_no_more_bases_than_its_statement_checks() {
        let with_bases = |count: usize| {
            let mut c = command("x", 1, 1);
            c.basis = (0..count)
                .map(|k| Basis::new("T", format!("d{k}"), 0))
                .collect();
            (c, oneshot::channel().0)
        };
        let mut waiting = vec![with_bases(10), with_bases(6), with_bases(1), with_bases(0)];
        assert_eq!(take_group(&mut waiting).len(), 2, "10 + 6 fill the slots");
        assert_eq!(take_group(&mut waiting).len(), 2);
        assert!(waiting.is_empty());
    }

    async fn futures_join(answers: Vec<Answer>) -> Vec<Result<Position, AppendError>> {
        let mut out = vec![];
        for answer in answers {
            out.push(answer.await.unwrap());
        }
        out
    }
}
