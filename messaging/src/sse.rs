//! The live event stream without NATS: Server-Sent Events for `GET /factory/events/stream`.
//!
//! It reads the global stream with the same technique as every subscription
//! ([`ferry_store::stream::read_after`]), so it never skips a late commit, keeps only the
//! caller's tenant, and sends each event as the CloudEvent the relay would publish:
//! `id` = the position (`txid.position`, resumable with `Last-Event-ID`), `event` = the
//! subject, `data` = the CloudEvent JSON.
//!
//! History (a caller starting from `after=0`) is read a page at a time, and a page ends at
//! [`BATCH`] events or once its payloads pass [`PAGE_BYTES`]
//! ([`ferry_store::stream::read_after_bounded`]); the next page is read only when the
//! client has taken the last one. So a stream holds one page whatever the history holds,
//! and twenty callers reading a large tenant's history hold twenty pages, not twenty
//! histories.

use crate::outbound::{parse_position, position_token, DEFAULT_SOURCE};
use crate::publish::{EncodeError, Publishers};
use axum::response::sse::Event;
use ferry_store::events::ReadError;
use ferry_store::stream::read_after_bounded;
use ferry_store::{Database, Position};
use futures::Stream;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;
use tokio::sync::watch;

/// Events read per query, at most.
pub const BATCH: i64 = 256;
/// Bytes of payloads read per query: a page ends at the event that passes them (the first
/// event of a page is always read, so a page is at most this and one event).
pub const PAGE_BYTES: i64 = 1024 * 1024;
/// How often to look for new events when no wake-up arrives.
const POLL: Duration = Duration::from_secs(1);

/// Where to start: after the `Last-Event-ID` header if it parses, else after `after`
/// (a `?after=` query parameter), else from the beginning.
pub fn start_position(last_event_id: Option<&str>, after: Option<&str>) -> Position {
    last_event_id
        .and_then(parse_position)
        .or_else(|| after.and_then(parse_position))
        .unwrap_or_default()
}

struct State {
    db: Database,
    publishers: Publishers,
    tenant: String,
    source: String,
    after: Position,
    wake: watch::Receiver<u64>,
    ready: VecDeque<Event>,
    wake_open: bool,
    named: bool,
}

/// The SSE stream of `tenant`'s events after `after`, each made by `publishers` as the relay
/// would publish it. `wake` is usually
/// `db.subscribe_commits()`; the stream also polls every second. Store errors are logged
/// and retried; the stream ends only when the client goes away. Serve it with
/// `Sse::new(stream).keep_alive(KeepAlive::default())` so idle proxies keep the connection.
pub fn sse_stream(
    db: Database,
    publishers: Publishers,
    tenant: String,
    after: Position,
    wake: watch::Receiver<u64>,
) -> impl Stream<Item = Result<Event, Infallible>> {
    sse_stream_with_source(
        db,
        publishers,
        tenant,
        after,
        wake,
        DEFAULT_SOURCE.to_string(),
    )
}

/// [`sse_stream`] with a configured CloudEvent `source`.
pub fn sse_stream_with_source(
    db: Database,
    publishers: Publishers,
    tenant: String,
    after: Position,
    wake: watch::Receiver<u64>,
    source: String,
) -> impl Stream<Item = Result<Event, Infallible>> {
    events(db, publishers, tenant, after, wake, source, true)
}

/// [`sse_stream`] without event names (the subject is in the CloudEvent): a browser's
/// `EventSource` hears every event in `onmessage`, without listing subjects in advance.
pub fn sse_stream_unnamed(
    db: Database,
    publishers: Publishers,
    tenant: String,
    after: Position,
    wake: watch::Receiver<u64>,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let source = DEFAULT_SOURCE.to_string();
    events(db, publishers, tenant, after, wake, source, false)
}

fn events(
    db: Database,
    publishers: Publishers,
    tenant: String,
    after: Position,
    wake: watch::Receiver<u64>,
    source: String,
    named: bool,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let state = State {
        db,
        publishers,
        tenant,
        source,
        after,
        wake,
        ready: VecDeque::new(),
        wake_open: true,
        named,
    };
    futures::stream::unfold(state, |mut s| async move {
        let mut backoff = Duration::from_millis(200);
        loop {
            if let Some(event) = s.ready.pop_front() {
                return Some((Ok(event), s));
            }
            match fill(&mut s).await {
                Ok(true) => {
                    backoff = Duration::from_millis(200);
                    continue;
                }
                Ok(false) => {
                    if s.wake_open {
                        tokio::select! {
                            changed = s.wake.changed() => s.wake_open = changed.is_ok(),
                            _ = tokio::time::sleep(POLL) => {}
                        }
                    } else {
                        tokio::time::sleep(POLL).await;
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "event stream read failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
            }
        }
    })
}

/// Reads the next batch; true when anything was read (even if none was the tenant's). An
/// event that does not decode is an error like a store error: retried, never skipped.
async fn fill(s: &mut State) -> Result<bool, EncodeError> {
    let events = read_after_bounded(&s.db, s.after, BATCH, PAGE_BYTES)
        .await
        .map_err(ReadError::from)?;
    let Some(last) = events.last().map(|e| e.position) else {
        return Ok(false);
    };
    // Build the whole batch first: a store error part-way must not queue events twice.
    let mut batch = Vec::new();
    for stored in events
        .iter()
        .filter(|e| e.tenant_id() == Some(s.tenant.as_str()))
    {
        let position = position_token(stored.position);
        let out = s
            .publishers
            .encode(&s.db, &s.source, stored, &position)
            .await?;
        let event = Event::default().id(position).data(out.body);
        // An unnamed event reaches an `EventSource`'s `onmessage` whatever its subject.
        batch.push(if s.named {
            event.event(out.subject)
        } else {
            event
        });
    }
    s.ready.extend(batch);
    s.after = last;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_event_id_wins_over_after() {
        let p = start_position(Some("5.9"), Some("1.1"));
        assert_eq!(p.global_position, 9);
        assert_eq!(
            start_position(Some("garbage"), Some("0.3")).global_position,
            3
        );
        assert_eq!(start_position(None, None), Position::default());
    }
}
