//! Reads of the read models, whichever context owns them: cursor paging, and the bounded
//! wait that gives a client read-your-writes after a command. Each context's queries live
//! in its folder (e.g. `app/src/contexts/provisioning/views.rs`).

use crate::projection::Progress;
use base64::Engine;
use ferry_store::stream::{Param, Position};
use ferry_store::{bind_params, on_pool, Database};
use serde_json::Value;
use sqlx::types::Json;
use std::time::Duration;
use tokio::sync::watch;

/// A page of results and the cursor of the next one.
#[derive(Debug, Clone, PartialEq, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Page<T> {
    /// The items, newest first.
    pub items: Vec<T>,
    /// Pass as `cursor` to get the next page; absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// A cursor that does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cursor is not one this server issued")]
pub struct BadCursor;

/// Opaque cursor: the stream position of the last item on the page.
pub fn encode_cursor(position: i64) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("p:{position}"))
}

/// Reads a cursor made by [`encode_cursor`].
pub fn decode_cursor(cursor: &str) -> Result<i64, BadCursor> {
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(cursor)
        .map_err(|_| BadCursor)?;
    let text = String::from_utf8(bytes).map_err(|_| BadCursor)?;
    text.strip_prefix("p:")
        .and_then(|p| p.parse().ok())
        .filter(|p: &i64| *p > 0)
        .ok_or(BadCursor)
}

/// A failure to read.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// The database failed.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    /// A stored document no longer matches its type (rebuild the projection).
    #[error("stored document does not decode: {0}")]
    Document(#[from] serde_json::Error),
    /// A stored row's column does not parse as its type (rebuild the projection).
    #[error("stored row does not parse: {0}")]
    Row(String),
}

/// The read side.
#[derive(Clone)]
pub struct ReadModels {
    db: Database,
    progress: Option<Progress>,
}

/// One page of `table`'s documents (a `position` and a `document` column) matching
/// `clauses` (with `params` for their `$n`), newest first, after `cursor`; and the cursor of
/// the next page, if there is one.
pub async fn page(
    db: &Database,
    table: &str,
    mut clauses: Vec<String>,
    mut params: Vec<Param>,
    limit: u32,
    cursor: Option<i64>,
) -> Result<(Vec<Value>, Option<String>), QueryError> {
    if let Some(c) = cursor {
        params.push(Param::Int(Some(c)));
        clauses.push(format!("position < ${}", params.len()));
    }
    params.push(Param::Int(Some(i64::from(limit) + 1)));
    let sql = format!(
        "SELECT position, document FROM {table} WHERE {} ORDER BY position DESC LIMIT ${}",
        clauses.join(" AND "),
        params.len()
    );
    let sql = db.sql(&sql);
    let mut rows: Vec<(i64, Json<Value>)> = on_pool!(db, pool =>
        bind_params!(sqlx::query_as(&sql), &params).fetch_all(pool).await?);
    let next = if rows.len() > limit as usize {
        rows.truncate(limit as usize);
        rows.last().map(|(p, _)| encode_cursor(*p))
    } else {
        None
    };
    Ok((rows.into_iter().map(|(_, d)| d.0).collect(), next))
}

impl ReadModels {
    /// Reads from `db`; `progress` (from the projector) wakes read-your-writes waits.
    pub fn new(db: Database, progress: Option<Progress>) -> Self {
        Self { db, progress }
    }

    /// The store it reads.
    pub fn db(&self) -> &Database {
        &self.db
    }

    /// Waits (at most `timeout`) until `check` holds: read-your-writes for any read model.
    /// `projections` are those whose tables `check` reads; `after` is where the command's
    /// last event stands in the stream (`None` when it recorded none). The read model is
    /// read once those projections have passed `after` here (at once when there is nothing
    /// to pass), again whenever one of them commits while `check` fails, and on a short poll,
    /// since another instance may be the one projecting.
    pub async fn wait_until<F, Fut>(
        &self,
        timeout: Duration,
        projections: &[&str],
        after: Option<Position>,
        check: F,
    ) -> Result<bool, QueryError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool, QueryError>>,
    {
        self.wait(timeout, projections, after, Confirm::ByCheck, check)
            .await
    }

    /// As [`ReadModels::wait_until`], for a `check` that only asks whether the command's
    /// own events were applied (e.g. a view's version): once this process's `projections`
    /// have passed `after` the wait ends without reading ([`Confirm::ByProgress`]).
    pub async fn wait_for_own_events<F, Fut>(
        &self,
        timeout: Duration,
        projections: &[&str],
        after: Option<Position>,
        check: F,
    ) -> Result<bool, QueryError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool, QueryError>>,
    {
        self.wait(timeout, projections, after, Confirm::ByProgress, check)
            .await
    }

    /// [`ReadModels::wait_until`], confirmed as `confirm` says.
    async fn wait<F, Fut>(
        &self,
        timeout: Duration,
        projections: &[&str],
        after: Option<Position>,
        confirm: Confirm,
        mut check: F,
    ) -> Result<bool, QueryError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool, QueryError>>,
    {
        let deadline = tokio::time::Instant::now() + timeout;
        // Marked as seen before the first look: a commit after it wakes the wait.
        let mut watched = self
            .progress
            .as_ref()
            .map(|p| p.watch(projections))
            .unwrap_or_default();
        let passed = |watched: &[watch::Receiver<Position>]| {
            after.is_none_or(|event| watched.iter().all(|at| *at.borrow() >= event))
        };
        let mut read = watched.is_empty() || passed(&watched);
        loop {
            // This process's projections committed the command's events: what the check
            // would read is there (they skip nothing; a failing batch holds them back).
            if confirm == Confirm::ByProgress
                && after.is_some()
                && !watched.is_empty()
                && passed(&watched)
            {
                return Ok(true);
            }
            if read && check().await? {
                return Ok(true);
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            let pause = (deadline - now).min(Duration::from_millis(50));
            if watched.is_empty() {
                tokio::time::sleep(pause).await;
                read = true;
                continue;
            }
            let moved =
                futures::future::select_all(watched.iter_mut().map(|r| Box::pin(r.changed())));
            let woken = tokio::time::timeout(pause, moved)
                .await
                .map(|(changed, _, _)| changed.is_ok());
            read = match woken {
                Ok(true) => passed(&watched),
                Ok(false) => {
                    // The projector stopped: poll from now on.
                    watched.clear();
                    true
                }
                // The poll.
                Err(_) => true,
            };
        }
    }
}

/// How a read-your-writes wait knows the command's effect is visible.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Confirm {
    /// Only by reading the read model (the check looks at more than the command's events,
    /// or keeps what it read).
    ByCheck,
    /// Once this process's projections have passed the command's last event, without a
    /// read: the check only asks whether they applied the command's own events. It still
    /// reads when there is no event to pass or another instance is the one projecting.
    ByProgress,
}

#[cfg(test)]
mod cursor_tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_reject_garbage() {
        assert_eq!(decode_cursor(&encode_cursor(42)), Ok(42));
        assert_eq!(decode_cursor("not-a-cursor"), Err(BadCursor));
        assert_eq!(decode_cursor(&encode_cursor(-1)), Err(BadCursor));
    }
}
