//! The SSE stream: tenant filter, order, resume with Last-Event-ID, live wake-up.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use axum::response::sse::Sse;
use axum::response::IntoResponse;
use common::*;
use ferry_app::contexts::provisioning::events::publishers;
use ferry_messaging::{parse_position, sse_stream, start_position};
use ferry_store::testing::TestDatabase;
use ferry_store::{Backend, Database, Position};
use futures::StreamExt;
use serde_json::Value;
use std::time::Duration;

/// One parsed SSE event.
#[derive(Debug, Clone, Default)]
struct Frame {
    id: String,
    event: String,
    data: Value,
}

/// Serves the stream as an axum response and reads `n` events from its body.
async fn read_events(db: &Database, tenant: &str, after: Position, n: usize) -> Vec<Frame> {
    let stream = sse_stream(
        db.clone(),
        publishers(),
        tenant.to_string(),
        after,
        db.subscribe_commits(),
    );
    let mut body = Sse::new(stream)
        .into_response()
        .into_body()
        .into_data_stream();
    let mut text = String::new();
    let mut frames = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while frames.len() < n {
        let chunk = tokio::time::timeout_at(deadline, body.next())
            .await
            .expect("timed out waiting for SSE events")
            .unwrap()
            .unwrap();
        text.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = text.find("\n\n") {
            let block: String = text.drain(..end + 2).collect();
            let mut f = Frame::default();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("id: ") {
                    f.id = v.to_string();
                } else if let Some(v) = line.strip_prefix("event: ") {
                    f.event = v.to_string();
                } else if let Some(v) = line.strip_prefix("data: ") {
                    f.data = serde_json::from_str(v).unwrap();
                }
            }
            frames.push(f);
        }
    }
    frames
}

async fn tenant_stream_resumes(backend: Backend) {
    let t = TestDatabase::new(backend).await;
    let db = t.db.clone();
    applied_run(&db, "acme", None).await;
    cancelled_run(&db, "globex").await;
    declare(&db, "acme").await;
    wait_events(&db, 4 + 2 + 1).await;

    let frames = read_events(&db, "acme", Position::default(), 5).await;
    let subjects: Vec<&str> = frames.iter().map(|f| f.event.as_str()).collect();
    assert_eq!(
        subjects,
        [
            "ferry.events.provisioning-run.provisioning-requested",
            "provisioning.runs.v1.provisioning-planned",
            "ferry.events.provisioning-run.apply-started",
            "provisioning.runs.v1.provisioning-applied",
            "provisioning.specifications.v1.specification-declared",
        ]
    );
    let positions: Vec<Position> = frames
        .iter()
        .map(|f| parse_position(&f.id).unwrap())
        .collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "in stream order");
    for f in &frames {
        assert_eq!(f.data["tenantid"], "acme", "only the caller's tenant");
        assert_eq!(f.data["type"], f.event.as_str());
        assert_eq!(f.data["ferryposition"], f.id.as_str());
        assert_valid(&Stored {
            subject: f.event.clone(),
            msg_id: None,
            position: None,
            body: f.data.clone(),
        });
    }

    // Resuming with Last-Event-ID continues right after that event.
    let resume = start_position(Some(&frames[1].id), None);
    let rest = read_events(&db, "acme", resume, 3).await;
    let ids: Vec<&str> = rest.iter().map(|f| f.id.as_str()).collect();
    let expected: Vec<&str> = frames[2..].iter().map(|f| f.id.as_str()).collect();
    assert_eq!(ids, expected);

    // Live: a new event after the stream caught up arrives.
    let last = positions[4];
    let reader = {
        let db = db.clone();
        tokio::spawn(async move { read_events(&db, "acme", last, 2).await })
    };
    failed_run(&db, "acme").await;
    let live = reader.await.unwrap();
    assert_eq!(live[1].event, "provisioning.runs.v1.provisioning-failed");
    t.cleanup().await;
}

#[tokio::test]
async fn the_sse_stream_is_per_tenant_ordered_and_resumable_on_postgres() {
    tenant_stream_resumes(Backend::Postgres).await;
}

#[tokio::test]
async fn the_sse_stream_is_per_tenant_ordered_and_resumable_on_sqlite() {
    tenant_stream_resumes(Backend::Sqlite).await;
}
