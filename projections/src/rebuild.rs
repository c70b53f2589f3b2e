//! Rebuilding a projection while the service keeps answering.
//!
//! 1. Fresh `<table>_rebuild` tables are filled by replaying the whole stream under their
//!    own checkpoint, while the live projection and the API carry on.
//! 2. One transaction takes the live checkpoint (pausing the live projection), replays the
//!    tail that arrived meanwhile, renames the fresh tables into place, drops the old ones
//!    and moves the live checkpoint to where the replay ended. Readers see either the old
//!    tables or the new ones, never a half-built one.

use crate::projection::{Projection, ProjectionRunner};
use ferry_store::database::Backend;
use ferry_store::stream::{self, Handler, HandlerError, Param, Position, Tx, BATCH_SIZE};
use ferry_store::Database;
use std::sync::Arc;

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

/// Rebuilds one projection and swaps it in.
pub async fn rebuild(
    db: &Database,
    projection: Arc<dyn Projection>,
) -> Result<RebuildReport, RebuildError> {
    let name = projection.name();
    let live = ProjectionRunner::live(projection.clone());
    live.ensure_tables(db).await?;
    let fresh = ProjectionRunner::with_suffix(projection.clone(), SUFFIX);
    let token = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();

    // Start from nothing: leftovers of an interrupted rebuild are dropped.
    let mut tx = Tx::begin(db).await?;
    for spec in projection.tables() {
        let sql = format!("DROP TABLE IF EXISTS {}", fresh.tables().get(spec.base));
        tx.execute(&sql, &[]).await?;
    }
    tx.execute(
        "DELETE FROM subscription_checkpoints WHERE name = $1",
        &[Param::Text(Some(fresh.name().to_string()))],
    )
    .await?;
    for sql in fresh.create_statements(db.backend(), &token) {
        tx.execute(&sql, &[]).await?;
    }
    tx.commit().await?;
    tracing::info!(projection = name, "replaying the stream into fresh tables");
    let mut events = stream::catch_up(db, &fresh).await?;

    // Swap: hold the live checkpoint, replay the tail, rename, move the checkpoint.
    let mut tx = Tx::begin(db).await?;
    let live_position = tx.claim_checkpoint(live.name()).await?;
    let mut position = tx.claim_checkpoint(fresh.name()).await?;
    loop {
        let batch = tx.read_batch(position, BATCH_SIZE).await?;
        let Some(last) = batch.last().map(|e| e.position) else {
            break;
        };
        for event in &batch {
            fresh.handle(&mut tx, event).await?;
        }
        events += batch.len();
        position = last;
    }
    if position < live_position {
        return Err(RebuildError::Behind {
            rebuilt: position,
            live: live_position,
        });
    }
    for spec in projection.tables() {
        let old = format!("{}_old_{token}", spec.base);
        let rebuilt = fresh.tables().get(spec.base);
        tx.execute(&format!("ALTER TABLE {} RENAME TO {old}", spec.base), &[])
            .await?;
        tx.execute(
            &format!("ALTER TABLE {rebuilt} RENAME TO {}", spec.base),
            &[],
        )
        .await?;
        tx.execute(&format!("DROP TABLE {old}"), &[]).await?;
    }
    tx.save_checkpoint(live.name(), position).await?;
    tx.execute(
        "DELETE FROM subscription_checkpoints WHERE name = $1",
        &[Param::Text(Some(fresh.name().to_string()))],
    )
    .await?;
    tx.commit().await?;
    tracing::info!(projection = name, events, "rebuilt and swapped");
    Ok(RebuildReport {
        projection: name.to_string(),
        events,
        position,
    })
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
    let mut reports = Vec::new();
    for projection in chosen {
        reports.push(rebuild(db, projection).await?);
    }
    Ok(reports)
}
