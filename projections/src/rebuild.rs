//! Rebuilding projections while the service keeps answering.
//!
//! 1. Fresh `<table>_rebuild` tables of every projection being rebuilt are filled by
//!    replaying the whole stream under checkpoints of their own, while the live projections
//!    and the API carry on.
//! 2. One transaction takes the live checkpoints (pausing the live projections), replays the
//!    tail that arrived meanwhile, renames the fresh tables into place, drops the old ones
//!    and moves the live checkpoints to where the replay ended. Readers see either the old
//!    tables or the new ones, never a half-built one.

use crate::projection::{Projection, ProjectionRunner};
use ferry_store::database::Backend;
use ferry_store::stream::{self, Handler, HandlerError, Param, Position, Tx, BATCH_SIZE};
use ferry_store::Database;
use std::sync::Arc;
use tracing::Instrument;

/// What a rebuild did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RebuildReport {
    /// The projection.
    pub projection: String,
    /// Events replayed into the fresh tables.
    pub events: usize,
    /// Where the live checkpoint now stands.
    pub position: Position,
}

/// Why a rebuild stopped (nothing was swapped).
#[derive(Debug, thiserror::Error)]
pub enum RebuildError {
    /// The database failed.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    /// A stored event could not be applied.
    #[error(transparent)]
    Handler(#[from] HandlerError),
    /// No projection of that name.
    #[error("no projection named {name:?} (known: {})", known.join(", "))]
    Unknown {
        /// The name asked for.
        name: String,
        /// The projections there are.
        known: Vec<&'static str>,
    },
    /// A projection's replay task ended without an answer (it panicked or was cancelled).
    #[error("a projection's replay stopped: {0}")]
    Stopped(#[from] tokio::task::JoinError),
    /// The replay ended behind the live projection (should not happen; nothing swapped).
    #[error("rebuild ended at {rebuilt:?}, behind the live checkpoint {live:?}; nothing swapped")]
    Behind {
        /// Where the replay ended.
        rebuilt: Position,
        /// Where the live projection was.
        live: Position,
    },
}

const SUFFIX: &str = "_rebuild";

/// Events per transaction while replaying into the fresh tables. Larger batches save
/// commits but hold more at once (every projection's documents of a batch, and the next
/// batch read ahead): measured over 300,000 events, 1,024 replayed as fast as 4,096 with a
/// peak of 80 MB instead of 154 MB.
const REBUILD_BATCH: i64 = 1024;

/// How often (in events) a long replay reports its progress.
const PROGRESS_EVERY: usize = 100_000;

/// Does a table exist?
pub async fn table_exists(tx: &mut Tx, name: &str) -> Result<bool, sqlx::Error> {
    let sql = match tx.backend() {
        Backend::Postgres => "SELECT to_jsonb(to_regclass($1) IS NOT NULL)",
        Backend::Sqlite => {
            "SELECT json(CASE WHEN EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = $1) THEN 'true' ELSE 'false' END)"
        }
    };
    let found = tx
        .fetch_json(sql, &[Param::Text(Some(name.to_string()))])
        .await?;
    Ok(found.and_then(|v| v.as_bool()).unwrap_or(false))
}

/// How many batches a projection may fall behind the reading of the stream in a replay on
/// Postgres (each batch is held until every projection has written it).
const AHEAD: usize = 2;

/// Replays the stream into the fresh tables of `runners`, which all start at the stream's
/// beginning: each batch is read once and handed to every runner. On Postgres each runner
/// writes on a task and connection of its own, up to [`AHEAD`] batches behind the reading,
/// so a projection whose batch is quick goes on instead of waiting for the slowest (in step,
/// a quarter of the machine sat idle during a rebuild). Returns the events replayed.
async fn replay(db: &Database, runners: &[Arc<ProjectionRunner>]) -> Result<usize, RebuildError> {
    if db.backend() == Backend::Sqlite {
        return replay_in_step(db, runners).await;
    }
    let started = std::time::Instant::now();
    let mut senders = Vec::with_capacity(runners.len());
    let mut writers = Vec::with_capacity(runners.len());
    for runner in runners {
        let (to, mut batches) = tokio::sync::mpsc::channel::<Arc<Vec<stream::StoredEvent>>>(AHEAD);
        senders.push(to);
        let (db, runner) = (db.clone(), Arc::clone(runner));
        let write = async move {
            let mut from = Position::default();
            while let Some(batch) = batches.recv().await {
                stream::apply_read_batch(&db, runner.as_ref(), from, &batch).await?;
                from = batch.last().map_or(from, |e| e.position);
            }
            Ok::<(), HandlerError>(())
        };
        writers.push(tokio::spawn(write.in_current_span()));
    }
    let read = async {
        let mut events = 0;
        let mut position = Position::default();
        loop {
            let batch = stream::read_after(db, position, REBUILD_BATCH).await?;
            let Some(last) = batch.last().map(|e| e.position) else {
                break;
            };
            let more = batch.len() == REBUILD_BATCH as usize;
            events += batch.len();
            position = last;
            let batch = Arc::new(batch);
            for to in &senders {
                // A writer that stopped has failed: its error is reported below.
                if to.send(Arc::clone(&batch)).await.is_err() {
                    return Ok(events);
                }
            }
            report_progress(events, started);
            if !more {
                break;
            }
        }
        Ok::<usize, sqlx::Error>(events)
    };
    let read = read.await;
    drop(senders);
    for writer in writers {
        writer.await??;
    }
    Ok(read?)
}

/// [`replay`] in step, for SQLite's one writer: each batch is written by every runner in
/// turn while the next is read.
async fn replay_in_step(
    db: &Database,
    runners: &[Arc<ProjectionRunner>],
) -> Result<usize, RebuildError> {
    let started = std::time::Instant::now();
    let mut events = 0;
    let mut position = Position::default();
    let mut batch = stream::read_after(db, position, REBUILD_BATCH).await?;
    while let Some(last) = batch.last().map(|e| e.position) {
        let more = batch.len() == REBUILD_BATCH as usize;
        let read_next = async {
            if more {
                stream::read_after(db, last, REBUILD_BATCH).await
            } else {
                Ok(Vec::new())
            }
        };
        let (next, applied) = tokio::join!(read_next, apply_to_all(db, runners, position, &batch));
        applied?;
        events += batch.len();
        position = last;
        batch = next?;
        report_progress(events, started);
    }
    Ok(events)
}

/// Logs a long replay's progress about every [`PROGRESS_EVERY`] events.
fn report_progress(events: usize, started: std::time::Instant) {
    if events % PROGRESS_EVERY < REBUILD_BATCH as usize {
        let rate = events as f64 / started.elapsed().as_secs_f64().max(0.001);
        tracing::info!(events, per_second = rate.round(), "replaying");
    }
}

async fn apply_to_all(
    db: &Database,
    runners: &[Arc<ProjectionRunner>],
    from: Position,
    batch: &[stream::StoredEvent],
) -> Result<(), RebuildError> {
    for runner in runners {
        stream::apply_read_batch(db, runner.as_ref(), from, batch).await?;
    }
    Ok(())
}

/// Rebuilds `projections` and swaps them in together. Their replays share each read of
/// the stream; on Postgres they write side by side (each on its own connection and
/// checkpoint); SQLite has one writer, so there they write one after the other.
pub async fn rebuild(
    db: &Database,
    projections: &[Arc<dyn Projection>],
) -> Result<Vec<RebuildReport>, RebuildError> {
    let mut lives = Vec::with_capacity(projections.len());
    for projection in projections {
        let live = ProjectionRunner::live(projection.clone());
        live.ensure_tables(db).await?;
        lives.push(live);
    }
    let fresh: Vec<Arc<ProjectionRunner>> = projections
        .iter()
        .map(|p| Arc::new(ProjectionRunner::with_suffix(p.clone(), SUFFIX)))
        .collect();
    let token = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();

    // Start from nothing: leftovers of an interrupted rebuild are dropped.
    let mut tx = Tx::begin(db).await?;
    for runner in &fresh {
        for spec in runner.projection().tables() {
            let sql = format!("DROP TABLE IF EXISTS {}", runner.tables().get(spec.base));
            tx.execute(&sql, &[]).await?;
        }
        tx.execute(
            "DELETE FROM subscription_checkpoints WHERE name = $1",
            &[Param::Text(Some(runner.name().to_string()))],
        )
        .await?;
        for sql in runner.create_statements(db.backend(), &token) {
            tx.execute(&sql, &[]).await?;
        }
    }
    tx.commit().await?;
    let names: Vec<&str> = projections.iter().map(|p| p.name()).collect();
    tracing::info!(projections = ?names, "replaying the stream into fresh tables");
    let replayed = replay(db, &fresh).await?;
    let mut events = vec![replayed; fresh.len()];

    // Swap: hold the live checkpoints, replay the tails, rename, move the checkpoints.
    let mut tx = Tx::begin(db).await?;
    let mut positions = Vec::with_capacity(fresh.len());
    // All live checkpoints first, in the order every claimer takes them (the live
    // projections claim theirs together), so that the swap and the live batches never
    // hold one each of two and wait for the other.
    let live_names: Vec<&str> = lives.iter().map(|live| live.name()).collect();
    let live_positions = tx.claim_checkpoints(&live_names).await?;
    for ((runner, count), live_position) in fresh.iter().zip(&mut events).zip(live_positions) {
        let mut position = tx.claim_checkpoint(runner.name()).await?;
        loop {
            let batch = tx.read_batch(position, BATCH_SIZE).await?;
            let Some(last) = batch.last().map(|e| e.position) else {
                break;
            };
            runner.handle_batch(&mut tx, &batch).await?;
            *count += batch.len();
            position = last;
        }
        if position < live_position {
            return Err(RebuildError::Behind {
                rebuilt: position,
                live: live_position,
            });
        }
        positions.push(position);
    }
    for runner in &fresh {
        for spec in runner.projection().tables() {
            let old = format!("{}_old_{token}", spec.base);
            let rebuilt = runner.tables().get(spec.base);
            tx.execute(&format!("ALTER TABLE {} RENAME TO {old}", spec.base), &[])
                .await?;
            tx.execute(
                &format!("ALTER TABLE {rebuilt} RENAME TO {}", spec.base),
                &[],
            )
            .await?;
            tx.execute(&format!("DROP TABLE {old}"), &[]).await?;
        }
    }
    for ((live, runner), position) in lives.iter().zip(&fresh).zip(&positions) {
        tx.save_checkpoint(live.name(), *position).await?;
        tx.execute(
            "DELETE FROM subscription_checkpoints WHERE name = $1",
            &[Param::Text(Some(runner.name().to_string()))],
        )
        .await?;
    }
    tx.commit().await?;
    tracing::info!(projections = ?names, ?events, "rebuilt and swapped");
    Ok(names
        .iter()
        .zip(events)
        .zip(positions)
        .map(|((name, events), position)| RebuildReport {
            projection: name.to_string(),
            events,
            position,
        })
        .collect())
}

/// Rebuilds the projection of `projections` named `name`, or all of them.
pub async fn rebuild_named(
    db: &Database,
    projections: &[Arc<dyn Projection>],
    name: Option<&str>,
) -> Result<Vec<RebuildReport>, RebuildError> {
    let chosen: Vec<_> = match name {
        None => projections.to_vec(),
        Some(n) => {
            let found: Vec<_> = projections
                .iter()
                .filter(|p| p.name() == n)
                .cloned()
                .collect();
            if found.is_empty() {
                return Err(RebuildError::Unknown {
                    name: n.to_string(),
                    known: projections.iter().map(|p| p.name()).collect(),
                });
            }
            found
        }
    };
    rebuild(db, &chosen).await
}
