//! The relay against real Postgres / SQLite and a real nats-server started by each test.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use common::*;
use ferry_domain::PromotionId;
use ferry_messaging::relay::{last_ferry_position, LastPosition};
use ferry_messaging::{Relay, RelayConfig};
use ferry_store::testing::TestDatabase;
use ferry_store::{Backend, Database, Position, Tx};
use serde_json::json;
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::watch;

fn config(nats: &Nats) -> RelayConfig {
    RelayConfig {
        nats_url: nats.url(),
        poll: Duration::from_millis(100),
        ..RelayConfig::default()
    }
}

async fn wait_for_stream(nats: &Nats, n: usize) -> Vec<Stored> {
    let js = nats.js().await;
    wait_for(&format!("{n} messages in FERRY_EVENTS"), 30, || {
        let js = js.clone();
        async move { stream_messages(&js, "FERRY_EVENTS").await.len() >= n }
    })
    .await;
    stream_messages(&js, "FERRY_EVENTS").await
}

fn assert_unique(messages: &[Stored]) {
    let ids: HashSet<&str> = messages
        .iter()
        .map(|m| m.msg_id.as_deref().unwrap())
        .collect();
    assert_eq!(ids.len(), messages.len(), "a message id appears twice");
    for m in messages {
        assert_eq!(
            m.msg_id.as_deref(),
            m.body["id"].as_str(),
            "Nats-Msg-Id = CloudEvent id"
        );
    }
}

/// Per aggregate, `ferrysequence` increases by one from message to message.
fn assert_ordered(messages: &[Stored]) {
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    for m in messages {
        let agg = m.body["subject"].as_str().unwrap().to_string();
        let seq = m.body["ferrysequence"].as_i64().unwrap();
        let prev = last.insert(agg.clone(), seq).unwrap_or(0);
        assert_eq!(seq, prev + 1, "aggregate {agg} out of order");
    }
}

async fn set_checkpoint(db: &Database, name: &str, to: Position) {
    let mut tx = Tx::begin(db).await.unwrap();
    tx.claim_checkpoint(name).await.unwrap();
    tx.save_checkpoint(name, to).await.unwrap();
    tx.commit().await.unwrap();
}

async fn seed_payloads_on_seed_subjects(backend: Backend) {
    let nats = Nats::start().await;
    let t = TestDatabase::new(backend).await;
    let db = t.db.clone();
    let (stop, shutdown) = watch::channel(false);
    let relay = Relay::start(db.clone(), config(&nats), shutdown)
        .await
        .unwrap();

    let spec = declare(&db, "acme").await;
    let promotion = PromotionId::new_random();
    let applied = applied_run(&db, "acme", Some(promotion)).await;
    let failed = failed_run(&db, "acme").await;
    let cancelled = cancelled_run(&db, "globex").await;
    let total = wait_events(&db, 1 + 4 + 2 + 2).await;

    let messages = wait_for_stream(&nats, total).await;
    assert_eq!(messages.len(), total);
    assert_unique(&messages);
    assert_ordered(&messages);
    for m in &messages {
        assert_valid(m);
        let ce = &m.body;
        assert_eq!(ce["specversion"], "1.0");
        assert_eq!(ce["source"], "urn:ferry");
        assert_eq!(ce["type"], m.subject.as_str());
        assert_eq!(ce["datacontenttype"], "application/json");
        assert!(ce["time"].is_string());
        assert_eq!(m.position.as_deref(), ce["ferryposition"].as_str());
    }
    let by_subject =
        |s: &str| -> Vec<&Stored> { messages.iter().filter(|m| m.subject == s).collect() };

    let declared = by_subject("provisioning.specifications.v1.specification-declared");
    assert_eq!(declared.len(), 1);
    assert_eq!(
        declared[0].body["data"],
        json!({"specificationId": spec.to_string(), "tenantId": "acme",
               "environmentId": "payments-dev", "kind": "Environment", "version": 1,
               "programVersion": "3f2a9c1"})
    );
    assert_eq!(declared[0].body["tenantid"], "acme");
    assert_eq!(declared[0].body["subject"], spec.to_string());

    let planned = by_subject("provisioning.runs.v1.provisioning-planned");
    assert_eq!(planned.len(), 1);
    assert_eq!(
        planned[0].body["data"],
        json!({"provisioningRunId": applied.to_string(), "tenantId": "acme",
               "environmentId": "payments-dev", "kind": "Release",
               "promotionId": promotion.to_string(),
               "planSummary": {"adds": 2, "changes": 1, "deletes": 0, "replaces": 1, "resources": 5}})
    );

    let done = by_subject("provisioning.runs.v1.provisioning-applied");
    assert_eq!(done.len(), 1);
    assert_eq!(
        done[0].body["data"],
        json!({"provisioningRunId": applied.to_string(), "tenantId": "acme",
               "projectId": "payments", "environmentId": "payments-dev", "kind": "Release",
               "promotionId": promotion.to_string(), "specificationVersion": 3,
               "outputs": {"url": "https://payments.dev", "replicas": 3}})
    );

    let failures = by_subject("provisioning.runs.v1.provisioning-failed");
    assert_eq!(failures.len(), 1);
    assert_eq!(
        failures[0].body["data"],
        json!({"provisioningRunId": failed.to_string(), "tenantId": "acme",
               "environmentId": "payments-dev", "kind": "Release",
               "reason": "program version 3f2a9c1 not found"})
    );

    // Every other event goes on ferry.events.* with the domain event's inner object.
    let cancel = by_subject("ferry.events.provisioning-run.provisioning-cancelled");
    assert_eq!(cancel.len(), 1);
    assert_eq!(cancel[0].body["subject"], cancelled.to_string());
    assert_eq!(cancel[0].body["tenantid"], "globex");
    assert_eq!(cancel[0].body["data"]["cancelledBy"], "bob");
    assert_eq!(cancel[0].body["data"]["reason"], "not needed");
    assert_eq!(
        by_subject("ferry.events.provisioning-run.provisioning-requested").len(),
        3
    );
    assert_eq!(
        by_subject("ferry.events.provisioning-run.apply-started").len(),
        1
    );

    let metrics = relay.metrics();
    assert_eq!(metrics.degraded.load(Ordering::Relaxed), 0);
    assert_eq!(metrics.duplicates.load(Ordering::Relaxed), 0);
    let text = metrics.render("FERRY_EVENTS");
    assert!(
        text.contains(&format!(
            "ferry_nats_relay_published_total{{stream=\"FERRY_EVENTS\"}} {total}\n"
        )),
        "{text}"
    );
    stop.send(true).unwrap();
    relay.join().await;
    t.cleanup().await;
}

#[tokio::test]
async fn a_command_produces_its_seed_cloudevent_on_postgres() {
    seed_payloads_on_seed_subjects(Backend::Postgres).await;
}

#[tokio::test]
async fn a_command_produces_its_seed_cloudevent_on_sqlite() {
    seed_payloads_on_seed_subjects(Backend::Sqlite).await;
}

#[tokio::test]
async fn a_relay_killed_mid_stream_loses_and_duplicates_nothing() {
    let nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Postgres).await;
    let db = t.db.clone();
    for _ in 0..40 {
        applied_run(&db, "acme", None).await;
    }
    let total = wait_events(&db, 160).await;

    // Kill the relay as soon as it has published something, before it finished.
    let (_stop, shutdown) = watch::channel(false);
    let cfg = RelayConfig {
        batch: 64,
        ..config(&nats)
    };
    let relay = Relay::start(db.clone(), cfg.clone(), shutdown.clone())
        .await
        .unwrap();
    let js = nats.js().await;
    wait_for("a first message", 30, || {
        let js = js.clone();
        async move { !stream_messages(&js, "FERRY_EVENTS").await.is_empty() }
    })
    .await;
    relay.abort();
    let partial = stream_messages(&js, "FERRY_EVENTS").await.len();
    assert!(
        partial < total,
        "the relay should not have finished ({partial})"
    );

    // The worst crash: everything published, no checkpoint saved. The restarted relay
    // lines its checkpoint up with the stream and publishes nothing twice.
    let relay = Relay::start(db.clone(), cfg.clone(), shutdown.clone())
        .await
        .unwrap();
    let messages = wait_for_stream(&nats, total).await;
    relay.abort();
    set_checkpoint(&db, &cfg.checkpoint_name(), Position::default()).await;
    let relay = Relay::start(db.clone(), cfg.clone(), shutdown.clone())
        .await
        .unwrap();
    let metrics = relay.metrics();
    wait_for("the checkpoint lined up with the stream", 30, || {
        let m = metrics.clone();
        async move { m.skipped.load(Ordering::Relaxed) == total as u64 }
    })
    .await;
    // A new event after that is published once, right after the others.
    applied_run(&db, "acme", None).await;
    let after = wait_for_stream(&nats, total + 4).await;
    assert_eq!(after.len(), total + 4, "no duplicate stored");
    assert_unique(&after);
    after.iter().for_each(assert_valid);
    assert_ordered(&after);
    assert_eq!(messages.len(), total);
    assert_eq!(metrics.published.load(Ordering::Relaxed), 4);
    relay.abort();

    // Second line of defence: the same id again inside the duplicate window is dropped.
    let mut info = js.get_stream("FERRY_EVENTS").await.unwrap();
    assert_eq!(
        info.info().await.unwrap().config.duplicate_window,
        cfg.duplicate_window
    );
    let first = &after[0];
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", first.msg_id.clone().unwrap().as_str());
    let ack = js
        .publish_with_headers(
            first.subject.clone(),
            headers,
            serde_json::to_vec(&first.body).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(ack.duplicate);
    assert_eq!(stream_messages(&js, "FERRY_EVENTS").await.len(), total + 4);
    t.cleanup().await;
}

#[tokio::test]
async fn with_nats_down_commands_are_accepted_and_the_relay_catches_up() {
    let mut nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Sqlite).await;
    let db = t.db.clone();
    let (stop, shutdown) = watch::channel(false);
    let relay = Relay::start(db.clone(), config(&nats), shutdown)
        .await
        .unwrap();
    declare(&db, "acme").await;
    wait_for_stream(&nats, 1).await;

    nats.kill().await;
    // Commands still commit while NATS is away.
    applied_run(&db, "acme", None).await;
    // A relay (re)started while NATS is down starts and waits.
    stop.send(true).unwrap();
    relay.join().await;
    let (stop, shutdown) = watch::channel(false);
    let relay = Relay::start(db.clone(), config(&nats), shutdown)
        .await
        .unwrap();
    failed_run(&db, "acme").await;
    let total = wait_events(&db, 7).await;
    let metrics = relay.metrics();
    wait_for("a failed publish", 30, || {
        let m = metrics.clone();
        async move { m.failures.load(Ordering::Relaxed) > 0 }
    })
    .await;

    nats.restart().await;
    let messages = wait_for_stream(&nats, total).await;
    assert_eq!(messages.len(), total);
    assert_unique(&messages);
    assert_ordered(&messages);
    messages.iter().for_each(assert_valid);
    stop.send(true).unwrap();
    relay.join().await;
    t.cleanup().await;
}

#[tokio::test]
async fn messages_nats_lost_after_acknowledging_them_are_republished() {
    let mut nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Postgres).await;
    let db = t.db.clone();
    for _ in 0..3 {
        applied_run(&db, "acme", None).await;
    }
    let total = wait_events(&db, 12).await;
    let cfg = config(&nats);
    let (_stop, shutdown) = watch::channel(false);
    let relay = Relay::start(db.clone(), cfg.clone(), shutdown.clone())
        .await
        .unwrap();
    let original = wait_for_stream(&nats, total).await;
    let metrics = relay.metrics();
    wait_for("the checkpoint saved", 30, || {
        let m = metrics.clone();
        async move { m.checkpoint.load(Ordering::Relaxed) > 0 }
    })
    .await;
    relay.abort();

    // The server comes back having kept only the first 5 messages (lost acknowledged writes).
    nats.restart_empty().await;
    let js = nats.js().await;
    ferry_messaging::relay::ensure_stream(&js, &cfg)
        .await
        .unwrap();
    for m in &original[..5] {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", m.msg_id.clone().unwrap().as_str());
        headers.insert("Ferry-Position", m.position.clone().unwrap().as_str());
        js.publish_with_headers(
            m.subject.clone(),
            headers,
            serde_json::to_vec(&m.body).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    let LastPosition::Found(kept) = last_ferry_position(&js, &cfg.stream_name).await.unwrap()
    else {
        panic!("no Ferry position in the stream")
    };
    assert_eq!(
        Some(ferry_messaging::position_token(kept)),
        original[4].position
    );

    let relay = Relay::start(db.clone(), cfg.clone(), shutdown.clone())
        .await
        .unwrap();
    let messages = wait_for_stream(&nats, total).await;
    assert_eq!(messages.len(), total);
    assert_unique(&messages);
    assert_ordered(&messages);
    let ids: Vec<_> = messages.iter().map(|m| m.msg_id.clone()).collect();
    let expected: Vec<_> = original.iter().map(|m| m.msg_id.clone()).collect();
    assert_eq!(ids, expected, "same events in the same order");
    messages.iter().for_each(assert_valid);
    assert_eq!(
        relay.metrics().rewound.load(Ordering::Relaxed),
        (total - 5) as u64
    );
    relay.abort();
    t.cleanup().await;
}

#[tokio::test]
async fn two_relays_on_postgres_publish_once_and_the_standby_takes_over() {
    let nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Postgres).await;
    let db = t.db.clone();
    let (_stop, shutdown) = watch::channel(false);
    let a = Relay::start(db.clone(), config(&nats), shutdown.clone())
        .await
        .unwrap();
    let b = Relay::start(db.clone(), config(&nats), shutdown.clone())
        .await
        .unwrap();
    for _ in 0..10 {
        applied_run(&db, "acme", None).await;
    }
    let total = wait_events(&db, 40).await;
    let messages = wait_for_stream(&nats, total).await;
    assert_eq!(messages.len(), total);
    assert_unique(&messages);
    assert_ordered(&messages);
    let published = |r: &Relay| r.metrics().published.load(Ordering::Relaxed);
    assert_eq!(
        published(&a) + published(&b),
        total as u64,
        "only the leader publishes"
    );
    let (leader, standby) = if published(&a) > 0 { (a, b) } else { (b, a) };
    assert_eq!(published(&standby), 0);

    // The leader dies; its lock goes with its connection and the standby takes over.
    leader.abort();
    failed_run(&db, "acme").await;
    let messages = wait_for_stream(&nats, total + 2).await;
    assert_eq!(messages.len(), total + 2);
    assert_unique(&messages);
    messages.iter().for_each(assert_valid);
    assert_eq!(published(&standby), 2);
    standby.abort();
    t.cleanup().await;
}

#[tokio::test]
async fn a_nats_server_that_comes_back_empty_gets_everything_again() {
    let mut nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Sqlite).await;
    let db = t.db.clone();
    let (stop, shutdown) = watch::channel(false);
    let relay = Relay::start(db.clone(), config(&nats), shutdown)
        .await
        .unwrap();
    applied_run(&db, "acme", None).await;
    let total = wait_events(&db, 4).await;
    let original = wait_for_stream(&nats, total).await;

    // The running relay notices the reconnection, finds the stream gone and republishes.
    nats.restart_empty().await;
    let messages = wait_for_stream(&nats, total).await;
    assert_eq!(messages.len(), total);
    assert_unique(&messages);
    let ids: Vec<_> = messages.iter().map(|m| m.msg_id.clone()).collect();
    let expected: Vec<_> = original.iter().map(|m| m.msg_id.clone()).collect();
    assert_eq!(ids, expected);
    assert_eq!(
        relay.metrics().rewound.load(Ordering::Relaxed),
        total as u64
    );
    stop.send(true).unwrap();
    relay.join().await;
    t.cleanup().await;
}
