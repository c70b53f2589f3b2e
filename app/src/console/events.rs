//! `/events`: the tenant's audit trail, live. The page opens the console's event stream
//! (`/console/stream`, the API's Server-Sent Events of the viewer's tenant, authorised by
//! the session) and the script adds each event as a row, as text, newest first, filtered by
//! type as the viewer types. `?from=head` starts the stream at the present (the board's
//! live swap needs only what happens next).

use super::layout;
use super::session::Viewer;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use ferry_api::problem::ApiError;
use ferry_api::state::AppState;
use maud::html;
use serde::Deserialize;

/// `GET /events[?type=]`.
#[derive(Debug, Deserialize)]
pub struct EventsQuery {
    #[serde(rename = "type")]
    kind: Option<String>,
}

/// `GET /events`.
#[tracing::instrument(skip_all, fields(tenant = %viewer.caller.tenant))]
pub async fn page(viewer: Viewer, Query(query): Query<EventsQuery>) -> Response {
    if let Err(error) = viewer.caller.require_read() {
        return layout::error_page(error).await;
    }
    let filter = query.kind.unwrap_or_default();
    layout::page(
        &viewer,
        "Events",
        html! {
            h1 { "Events" }
            p class="hint" { "Every event of your tenant, newest first; new ones appear as they are recorded." }
            label for="type-filter" { "Show only types containing" }
            input type="search" id="type-filter" value=(filter) autocomplete="off";
            table class="events" {
                thead { tr { th { "Recorded" } th { "Type" } th { "Subject" } th { "Actor" } } }
                tbody id="events" data-stream="/console/stream" {}
            }
        },
    )
    .into_response()
}

/// `GET /console/changes`: one bare `changed` message per event of the viewer's tenant
/// from now on, no content: what the board needs to read itself again, for any viewer who
/// may read the board (the events' contents need the read scope of `/console/stream`).
#[tracing::instrument(skip_all, fields(tenant = %viewer.caller.tenant))]
pub async fn changes(viewer: Viewer, State(state): State<AppState>) -> Response {
    use futures::StreamExt;
    let caller = &viewer.caller;
    if caller.require_read().is_err() {
        if let Err(error) = caller.require_scope(crate::contexts::promotions::READ) {
            return error.into_response();
        }
    }
    let head = match ferry_store::stream::head(state.db()).await {
        Ok(head) => ferry_messaging::position_token(head),
        Err(error) => return ApiError::internal(error).into_response(),
    };
    let ticks = state
        .feed()
        .stream_unnamed(&caller.tenant, None, Some(&head))
        .map(|_| {
            Ok::<_, std::convert::Infallible>(axum::response::sse::Event::default().data("changed"))
        });
    Sse::new(ticks)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// `GET /console/stream[?after=|from=head]`.
#[derive(Debug, Deserialize)]
pub struct StreamQuery {
    after: Option<String>,
    from: Option<String>,
}

/// `GET /console/stream`: the viewer's tenant's events as Server-Sent Events (as
/// `GET /factory/events/stream` serves them), authorised by the session cookie, which an
/// `EventSource` sends and a bearer header it cannot.
#[tracing::instrument(skip_all, fields(tenant = %viewer.caller.tenant))]
pub async fn stream(
    viewer: Viewer,
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(query): Query<StreamQuery>,
) -> Response {
    if let Err(error) = viewer.caller.require_read() {
        return error.into_response();
    }
    let after = match (query.from.as_deref(), query.after) {
        (Some("head"), _) => match ferry_store::stream::head(state.db()).await {
            Ok(head) => Some(ferry_messaging::position_token(head)),
            Err(error) => return ApiError::internal(error).into_response(),
        },
        (Some(_), _) => return (StatusCode::BAD_REQUEST, "from: only head").into_response(),
        (None, after) => after,
    };
    if let Some(a) = &after {
        if !state.feed().is_position(a) {
            return ApiError::bad_field("after", "not a stream position").into_response();
        }
    }
    let last_event_id = headers.get("last-event-id").and_then(|v| v.to_str().ok());
    let events =
        state
            .feed()
            .stream_unnamed(&viewer.caller.tenant, last_event_id, after.as_deref());
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}
