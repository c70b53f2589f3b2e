//! Mapping stored events to CloudEvents: unknown aggregates and events fall back to
//! `ferry.events.*`, and an integration event whose payload cannot be built never blocks.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use common::wait_events;
use ferry_app::contexts::provisioning::events::publishers;
use ferry_store::stream::read_after;
use ferry_store::testing::TestDatabase;
use ferry_store::{Backend, Database, Position};
use serde_json::json;

async fn insert_raw(
    db: &Database,
    aggregate: &str,
    id: &str,
    event: &str,
    payload: serde_json::Value,
) {
    let sql = db.sql(
        "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata)
         VALUES ($1, $2, 1, $3, '1.0', $4, $5)",
    );
    let metadata = json!({"tenantId": "acme", "correlationId": "c-1", "causationId": "k-1"});
    ferry_store::on_pool!(db, pool => sqlx::query(&sql)
        .bind(aggregate).bind(id).bind(event)
        .bind(sqlx::types::Json(payload)).bind(sqlx::types::Json(metadata))
        .execute(pool).await.unwrap().rows_affected());
}

async fn fallbacks(backend: Backend) {
    let t = TestDatabase::new(backend).await;
    let db = &t.db;
    // An aggregate that does not exist yet: no code change needed.
    insert_raw(
        db,
        "Promotion",
        "p-1",
        "PromotionGateEvaluated",
        json!({"PromotionGateEvaluated": {"gate": "policy", "outcome": "passed"}}),
    )
    .await;
    // A run event without its ProvisioningRequested (impossible in practice): published on
    // the domain subject, flagged as degraded, never blocking the relay.
    insert_raw(db, "ProvisioningRun", "r-1", "ProvisioningFailed",
        json!({"ProvisioningFailed": {"stage": "plan", "reason": "x", "failedAt": "2026-12-02T10:00:00Z"}})).await;
    wait_events(db, 2).await;
    let events = read_after(db, Position::default(), 10).await.unwrap();

    let promo = publishers()
        .to_outbound(db, "urn:test", &events[0])
        .await
        .unwrap();
    assert_eq!(
        promo.subject,
        "ferry.events.promotion.promotion-gate-evaluated"
    );
    assert_eq!(promo.event.event_type, promo.subject);
    assert_eq!(
        promo.event.data,
        json!({"gate": "policy", "outcome": "passed"})
    );
    assert_eq!(promo.event.source, "urn:test");
    assert_eq!(promo.event.tenantid.as_deref(), Some("acme"));
    assert_eq!(promo.event.correlationid.as_deref(), Some("c-1"));
    assert_eq!(promo.event.causationid.as_deref(), Some("k-1"));
    assert_eq!(promo.event.ferrysequence, Some(1));
    assert_eq!(promo.event.ferryaggregatetype.as_deref(), Some("Promotion"));
    assert!(promo.degraded.is_none());

    let failed = publishers()
        .to_outbound(db, "urn:test", &events[1])
        .await
        .unwrap();
    assert_eq!(
        failed.subject,
        "ferry.events.provisioning-run.provisioning-failed"
    );
    assert!(failed
        .degraded
        .unwrap()
        .contains("no ProvisioningRequested"));
    assert_eq!(failed.event.data["reason"], "x");

    // What the relay and the SSE stream send is the same JSON as the CloudEvent
    // `to_outbound` builds, with and without the optional extensions.
    let sql = db.sql(
        "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata)
         VALUES ('Widget', 'w-1', 1, 'WidgetMade', '1.0', $1, $2)",
    );
    ferry_store::on_pool!(db, pool => sqlx::query(&sql)
        .bind(sqlx::types::Json(json!({"WidgetMade": {"size": 3, "tags": ["a", "é\"q"]}})))
        .bind(sqlx::types::Json(json!({"tenantId": "acme"})))
        .execute(pool).await.unwrap().rows_affected());
    wait_events(db, 3).await;
    let events = read_after(db, Position::default(), 10).await.unwrap();
    for event in &events {
        let publishers = publishers();
        let out = publishers.to_outbound(db, "urn:test", event).await.unwrap();
        let position = ferry_messaging::outbound::position_token(event.position);
        let encoded = publishers
            .encode(db, "urn:test", event, &position)
            .await
            .unwrap();
        // The same JSON; the keys of an event's data keep the order its type gives them in
        // the bytes, where the CloudEvent's `Value` sorts them.
        let sent: serde_json::Value = serde_json::from_str(&encoded.body).unwrap();
        let built: serde_json::Value =
            serde_json::from_slice(&out.event.to_bytes().unwrap()).unwrap();
        assert_eq!(sent, built);
        // Compact, as a serialized tree is (the store may hold a payload spaced).
        assert_eq!(
            encoded.body.len(),
            serde_json::to_string(&sent).unwrap().len()
        );
        assert_eq!(encoded.subject, out.subject);
        assert_eq!(encoded.degraded, out.degraded.is_some());
    }
    t.cleanup().await;
}

#[tokio::test]
async fn unknown_and_unmappable_events_fall_back_on_postgres() {
    fallbacks(Backend::Postgres).await;
}

#[tokio::test]
async fn unknown_and_unmappable_events_fall_back_on_sqlite() {
    fallbacks(Backend::Sqlite).await;
}

async fn undecodable(backend: Backend) {
    let t = TestDatabase::new(backend).await;
    let db = &t.db;
    // An event of one of Ferry's aggregates that does not decode is an error (the relay stops
    // at it and reports it), never published half-understood.
    insert_raw(
        db,
        "ProvisioningRun",
        "r-1",
        "ProvisioningRequested",
        json!({"ProvisioningRequested": {"not": "a request"}}),
    )
    .await;
    // A run event whose request does not decode: its integration payload cannot be built.
    let sql = db.sql(
        "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata)
         VALUES ('ProvisioningRun', 'r-1', 2, 'ProvisioningFailed', '1.0', $1, '{}')",
    );
    let failed = json!({"ProvisioningFailed": {"stage": "plan", "reason": "x", "failedAt": "2026-12-02T10:00:00Z"}});
    ferry_store::on_pool!(db, pool => sqlx::query(&sql)
        .bind(sqlx::types::Json(failed)).execute(pool).await.unwrap().rows_affected());
    wait_events(db, 2).await;
    let events = read_after(db, Position::default(), 10).await.unwrap();
    for event in &events {
        let result = publishers().to_outbound(db, "urn:test", event).await;
        assert!(
            matches!(&result, Err(ferry_store::events::ReadError::Decode(e)) if e.to_string().contains("r-1 event 1")),
            "{result:?}"
        );
    }
    t.cleanup().await;
}

#[tokio::test]
async fn an_event_that_does_not_decode_is_an_error_on_postgres() {
    undecodable(Backend::Postgres).await;
}

#[tokio::test]
async fn an_event_that_does_not_decode_is_an_error_on_sqlite() {
    undecodable(Backend::Sqlite).await;
}
