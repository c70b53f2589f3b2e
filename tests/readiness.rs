//! What `/readyz`, `/metrics` and the store report when the event stream cannot move: a
//! projection stuck on an event it cannot decode, a transaction holding the stream back.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use ferry_store::database::Backend;
use serde_json::Value;
use std::time::Duration;

async fn readyz(s: &TestServer) -> Value {
    let r = s.client.get(s.url("/readyz")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    r.json().await.unwrap()
}

async fn eventually_ready<F: Fn(&Value) -> bool>(s: &TestServer, what: &str, check: F) -> Value {
    let check = &check;
    ferry_store::testing::eventually_within(what, 20, || async move {
        let body = readyz(s).await;
        check(&body).then_some(body)
    })
    .await
}

async fn stuck_projection(backend: Backend) {
    let s = TestServer::start(backend).await;
    let db = s.db.as_ref().unwrap().db.clone();
    // An event its projection cannot decode (written by a buggy or newer version).
    let sql = db.sql(
        "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata)
         VALUES ('ProvisioningRun', 'broken-run', 1, 'ProvisioningRequested', '1.0', $1, $2)",
    );
    let payload = serde_json::json!({"ProvisioningRequested": {"not": "a request"}});
    let metadata = serde_json::json!({"tenantId": "acme"});
    ferry_store::on_pool!(db, pool => sqlx::query(&sql)
        .bind(sqlx::types::Json(&payload)).bind(sqlx::types::Json(&metadata))
        .execute(pool).await.unwrap().rows_affected());
    db.signal_commit();
    let (event_id, position): (String, i64) = ferry_store::on_pool!(db, pool => sqlx::query_as(
        "SELECT CAST(event_id AS text), global_position FROM events WHERE aggregate_id = 'broken-run'"
    ).fetch_one(pool).await.unwrap());

    let runs_of = |b: &Value| {
        b["subscriptions"]
            .as_array()
            .and_then(|subs| subs.iter().find(|s| s["name"] == "runs"))
            .cloned()
    };
    let body = eventually_ready(&s, "the stuck runs projection", |b| {
        runs_of(b).is_some_and(|r| r.get("stuck").is_some())
    })
    .await;
    assert_eq!(body["status"], "degraded");
    let runs = runs_of(&body).unwrap();
    assert_eq!(runs["stuck"]["eventId"], event_id.as_str(), "{body:#}");
    assert_eq!(runs["stuck"]["position"]["globalPosition"], position);
    assert!(
        runs["position"]["globalPosition"].as_i64().unwrap() < position,
        "the checkpoint did not skip the event: {runs}"
    );
    let problems = body["problems"].as_array().unwrap();
    assert!(
        problems
            .iter()
            .any(|p| p.as_str().unwrap().contains(&event_id)),
        "{problems:?}"
    );
    let metrics = s
        .client
        .get(s.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("ferry_subscription_stuck{subscription=\"runs\"} 1"),
        "{metrics}"
    );
    s.stop().await;
}

#[tokio::test]
async fn a_projection_stuck_on_an_event_says_so_on_postgres() {
    stuck_projection(Backend::Postgres).await;
}

#[tokio::test]
async fn a_projection_stuck_on_an_event_says_so_on_sqlite() {
    stuck_projection(Backend::Sqlite).await;
}

#[tokio::test]
async fn the_transaction_holding_the_stream_back_is_named() {
    let data = tempfile::tempdir().unwrap();
    let mut config = config(data.path());
    config.stream_hold_warn = Duration::from_millis(100);
    config.read_your_writes = Duration::ZERO;
    let s = TestServer::start_with(Backend::Postgres, config, data).await;
    let url = s.db.as_ref().unwrap().location.clone();
    // Someone else's session (not Ferry's pool) opens a writing transaction and sits on it.
    use sqlx::Connection;
    let mut other = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("SET application_name = 'forgotten-migration'")
        .execute(&mut other)
        .await
        .unwrap();
    let mut tx = other.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *tx)
        .await
        .unwrap();
    let (status, _) = s
        .post(
            &operator("acme", "alice"),
            "/factory/provisioning/specifications",
            &declaration("payments-dev", "3f2a9c1"),
        )
        .await;
    assert_eq!(status, 201);
    let body = eventually_ready(&s, "the holder", |b| {
        b["streamHeldBackBy"]["pid"].as_i64() == Some(i64::from(pid))
    })
    .await;
    let holder = &body["streamHeldBackBy"];
    assert_eq!(holder["application"], "forgotten-migration");
    assert!(holder["waitingEvents"].as_i64().unwrap() >= 1, "{holder}");
    assert_eq!(body["status"], "degraded");
    tx.rollback().await.unwrap();
    // (Other sessions on the server may hold the stream briefly too; ours is gone.)
    eventually_ready(&s, "the release", |b| {
        b["streamHeldBackBy"]["pid"].as_i64() != Some(i64::from(pid))
    })
    .await;
    s.stop().await;
}

#[tokio::test]
async fn ferrys_own_sessions_cannot_sit_in_a_transaction() {
    let t = ferry_store::testing::TestDatabase::new(Backend::Postgres).await;
    let options = ferry_store::StoreOptions {
        idle_in_transaction_timeout: Duration::from_millis(200),
        ..ferry_store::StoreOptions::default()
    };
    let db = ferry_store::Database::connect_postgres_with(&t.location, &options)
        .await
        .unwrap();
    let mut tx = ferry_store::Tx::begin(&db).await.unwrap();
    tx.execute(
        "INSERT INTO subscription_checkpoints (name) VALUES ('idle')",
        &[],
    )
    .await
    .unwrap();
    // The server ends the session once it has idled in the transaction past the timeout.
    let db_ref = &t.db;
    ferry_store::testing::eventually_within("the idle transaction ended", 10, || async move {
        let alive: bool = ferry_store::on_pool!(db_ref, pool => sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE state = 'idle in transaction' AND datname = current_database())"
        ).fetch_one(pool).await.unwrap());
        (!alive).then_some(())
    })
    .await;
    assert!(tx.commit().await.is_err(), "the session was terminated");
    db.close().await;
    t.cleanup().await;
}
