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
        publishers: ferry_app::contexts::provisioning::events::publishers(),
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
    for _ in 0..10 {
        applied_run(&db, "acme", None).await;
    }
    wait_events(&db, 40).await;

    // Kill the relay as soon as it has published something, before it finished (the rest
    // is stored after the kill: the relay is faster than any wait for its first message).
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
    for _ in 0..30 {
        applied_run(&db, "acme", None).await;
    }
    let total = wait_events(&db, 160).await;
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
    recreate_with(&js, &cfg, &original, 5).await;
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

/// Publishes `original[..keep]` again into a new stream of the same name: what a server
/// that lost the rest of the stream's tail holds.
async fn recreate_with(
    js: &async_nats::jetstream::Context,
    cfg: &RelayConfig,
    original: &[Stored],
    keep: usize,
) {
    let _ = js.delete_stream(&cfg.stream_name).await;
    ferry_messaging::relay::ensure_stream(js, cfg)
        .await
        .unwrap();
    for m in &original[..keep] {
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
}

fn ids(messages: &[Stored]) -> Vec<Option<String>> {
    messages.iter().map(|m| m.msg_id.clone()).collect()
}

/// Applies `runs` runs, starts a relay and waits until it has published all their events and
/// saved its checkpoint at the last one. Returns the relay, the stream's messages and the
/// relay's shutdown switch.
async fn relay_after_runs(
    nats: &Nats,
    db: &Database,
    cfg: &RelayConfig,
    runs: usize,
) -> (Relay, Vec<Stored>, watch::Sender<bool>) {
    for _ in 0..runs {
        applied_run(db, "acme", None).await;
    }
    let total = wait_events(db, runs * 4).await;
    let (stop, shutdown) = watch::channel(false);
    let relay = Relay::start(db.clone(), cfg.clone(), shutdown)
        .await
        .unwrap();
    let original = wait_for_stream(nats, total).await;
    let last =
        ferry_messaging::parse_position(original[total - 1].position.as_deref().unwrap()).unwrap();
    let metrics = relay.metrics();
    wait_for("the checkpoint saved", 30, || {
        let m = metrics.clone();
        async move { m.checkpoint.load(Ordering::Relaxed) == last.global_position }
    })
    .await;
    (relay, original, stop)
}

#[tokio::test]
async fn a_stream_that_loses_its_tail_while_the_relay_keeps_publishing_gets_no_gap() {
    // No reconnection tells the relay: only the expectation on its next publish can.
    let nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Postgres).await;
    let db = t.db.clone();
    let cfg = config(&nats);
    let (relay, original, _stop) = relay_after_runs(&nats, &db, &cfg, 3).await;
    let (first, metrics) = (original.len(), relay.metrics());

    // The stream now ends after its 5th message, then the relay publishes the next event.
    let js = nats.js().await;
    recreate_with(&js, &cfg, &original, 5).await;
    applied_run(&db, "acme", None).await;
    let total = wait_events(&db, 16).await;
    let messages = wait_for_stream(&nats, total).await;
    assert_eq!(messages.len(), total, "every event once");
    assert_unique(&messages);
    assert_ordered(&messages);
    messages.iter().for_each(assert_valid);
    assert_eq!(
        ids(&messages[..first]),
        ids(&original),
        "the lost range is back in its place"
    );
    assert!(
        metrics.refused.load(Ordering::Relaxed) >= 1,
        "NATS refused the publish after the loss"
    );
    assert_eq!(metrics.rewound.load(Ordering::Relaxed), (first - 5) as u64);
    let repair = metrics
        .status()
        .last_repair
        .expect("the repair is reported");
    assert_eq!(Some(repair.stream_last), original[4].position);
    assert_eq!(repair.events, (first - 5) as u64);
    assert!(metrics.status().last_error.is_none());
    relay.abort();
    t.cleanup().await;
}

#[tokio::test]
async fn nats_killed_before_its_writes_reached_the_disk_loses_its_tail_and_the_relay_repairs_it() {
    let mut nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Postgres).await;
    let db = t.db.clone();
    let cfg = config(&nats);
    let (relay, original, _stop) = relay_after_runs(&nats, &db, &cfg, 4).await;
    let (first, metrics) = (original.len(), relay.metrics());

    // kill -9, and the store keeps only its first 6 messages; commands go on meanwhile.
    let kept = nats.crash_losing_tail(&cfg.stream_name, 6).await;
    assert!(kept <= 6);
    failed_run(&db, "acme").await;
    let total = wait_events(&db, 18).await;
    let messages = wait_for_stream(&nats, total).await;
    assert_eq!(messages.len(), total);
    assert_unique(&messages);
    assert_ordered(&messages);
    assert_eq!(ids(&messages[..first]), ids(&original));
    // The running relay found exactly what the server lost and republished it.
    assert_eq!(metrics.rewound.load(Ordering::Relaxed), first as u64 - kept);
    assert_eq!(metrics.stream_resets.load(Ordering::Relaxed), 0);
    relay.abort();
    t.cleanup().await;
}

#[tokio::test]
async fn a_stream_that_comes_back_empty_is_reported_and_history_is_not_replayed() {
    let mut nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Sqlite).await;
    let db = t.db.clone();
    let (stop, shutdown) = watch::channel(false);
    let relay = Relay::start(db.clone(), config(&nats), shutdown)
        .await
        .unwrap();
    let metrics = relay.metrics();
    applied_run(&db, "acme", None).await;
    let total = wait_events(&db, 4).await;
    wait_for_stream(&nats, total).await;

    // The running relay notices the reconnection and finds no Ferry message at all.
    nats.restart_empty().await;
    wait_for("the empty stream reported", 30, || {
        let m = metrics.clone();
        async move { m.stream_resets.load(Ordering::Relaxed) == 1 }
    })
    .await;
    let reset = metrics.status().stream_reset.unwrap();
    assert!(reset.open && !reset.explained_by_limits);
    assert_eq!(reset.stream_messages, 0);
    let problems = metrics.problems("FERRY_EVENTS");
    assert!(
        problems.iter().any(|p| p.contains("were not republished")),
        "{problems:?}"
    );
    let text = metrics.render("FERRY_EVENTS");
    assert!(
        text.contains("ferry_nats_relay_stream_resets_total{stream=\"FERRY_EVENTS\"} 1\n"),
        "{text}"
    );

    // New events go on from the checkpoint; the history stays unreplayed.
    let run = failed_run(&db, "acme").await;
    wait_events(&db, total + 2).await;
    let messages = wait_for_stream(&nats, 2).await;
    assert_eq!(messages.len(), 2, "only the new events");
    assert!(messages
        .iter()
        .all(|m| m.body["subject"] == run.to_string().as_str()));
    assert_eq!(metrics.rewound.load(Ordering::Relaxed), 0);
    assert!(
        !metrics.status().stream_reset.unwrap().open,
        "the stream holds Ferry's messages again"
    );
    assert!(metrics.problems("FERRY_EVENTS").is_empty());
    stop.send(true).unwrap();
    relay.join().await;
    t.cleanup().await;
}

#[tokio::test]
async fn a_stream_purged_while_the_relay_runs_is_reported_and_a_restart_replays_nothing() {
    let nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Postgres).await;
    let db = t.db.clone();
    let cfg = RelayConfig {
        check_interval: Duration::from_millis(200),
        ..config(&nats)
    };
    let (relay, original, stop) = relay_after_runs(&nats, &db, &cfg, 1).await;
    let (total, metrics) = (original.len(), relay.metrics());

    let js = nats.js().await;
    js.get_stream(&cfg.stream_name)
        .await
        .unwrap()
        .purge()
        .await
        .unwrap();
    wait_for("the purge reported", 30, || {
        let m = metrics.clone();
        async move { m.stream_resets.load(Ordering::Relaxed) == 1 }
    })
    .await;
    assert!(metrics.status().stream_reset.unwrap().open);
    relay.abort();

    // A restarted relay lines up with the purged stream: reported again, nothing replayed.
    let relay = Relay::start(db.clone(), cfg.clone(), stop.subscribe())
        .await
        .unwrap();
    let metrics = relay.metrics();
    wait_for("the restarted relay lined up", 30, || {
        let m = metrics.clone();
        async move { m.status().stream_reset.is_some() }
    })
    .await;
    let run = cancelled_run(&db, "acme").await;
    wait_events(&db, total + 2).await;
    let messages = wait_for_stream(&nats, 2).await;
    assert_eq!(
        messages.len(),
        2,
        "only the new events: {:?}",
        ids(&messages)
    );
    assert!(messages
        .iter()
        .all(|m| m.body["subject"] == run.to_string().as_str()));
    assert_eq!(metrics.rewound.load(Ordering::Relaxed), 0);
    relay.abort();
    t.cleanup().await;
}

/// A stream reader whose read of one sequence fails, and one that has lost a message.
struct FaultyTail {
    stream: async_nats::jetstream::stream::Stream,
    fail_at: Option<u64>,
    deleted: Option<u64>,
}

impl ferry_messaging::relay::StreamTail for FaultyTail {
    async fn headers_at(
        &self,
        sequence: u64,
    ) -> Result<Option<async_nats::HeaderMap>, ferry_messaging::health::NatsFailure> {
        if self.fail_at == Some(sequence) {
            return Err(ferry_messaging::health::NatsFailure::new(
                format!("read message {sequence}"),
                std::io::Error::new(std::io::ErrorKind::TimedOut, "request timed out"),
            ));
        }
        if self.deleted == Some(sequence) {
            return Ok(None);
        }
        self.stream.headers_at(sequence).await
    }
}

#[tokio::test]
async fn a_failed_read_of_the_newest_message_is_an_error_not_an_empty_stream() {
    let nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Sqlite).await;
    let db = t.db.clone();
    let cfg = config(&nats);
    let (_stop, shutdown) = watch::channel(false);
    let relay = Relay::start(db.clone(), cfg.clone(), shutdown)
        .await
        .unwrap();
    applied_run(&db, "acme", None).await;
    let messages = wait_for_stream(&nats, 4).await;
    relay.abort();
    let js = nats.js().await;
    let mut stream = js.get_stream(&cfg.stream_name).await.unwrap();
    let state = stream.info().await.unwrap().state.clone();
    let last = state.last_sequence;

    let failing = FaultyTail {
        stream: stream.clone(),
        fail_at: Some(last),
        deleted: None,
    };
    let read = ferry_messaging::relay::last_ferry_position_in(&failing, &state).await;
    assert!(
        read.is_err(),
        "a failed read says nothing about the stream: {read:?}"
    );

    // A message that is gone (deleted) is skipped: the one before it is the newest.
    let gone = FaultyTail {
        stream,
        fail_at: None,
        deleted: Some(last),
    };
    let LastPosition::Found(p) = ferry_messaging::relay::last_ferry_position_in(&gone, &state)
        .await
        .unwrap()
    else {
        panic!("the message before the deleted one is Ferry's")
    };
    assert_eq!(
        Some(ferry_messaging::position_token(p)),
        messages[2].position
    );
    t.cleanup().await;
}

#[tokio::test]
async fn a_stream_whose_subjects_another_stream_holds_is_a_permanent_error_with_its_remedy() {
    let nats = Nats::start().await;
    let js = nats.js().await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "AUDIT".to_string(),
        subjects: vec!["provisioning.>".to_string()],
        ..Default::default()
    })
    .await
    .unwrap();
    let t = TestDatabase::new(Backend::Sqlite).await;
    let db = t.db.clone();
    applied_run(&db, "acme", None).await;
    let (stop, shutdown) = watch::channel(false);
    let relay = Relay::start(db.clone(), config(&nats), shutdown)
        .await
        .unwrap();
    let metrics = relay.metrics();
    wait_for("the error reported twice", 30, || {
        let m = metrics.clone();
        async move { m.status().last_error.is_some_and(|e| e.attempts >= 2) }
    })
    .await;
    let error = metrics.status().last_error.unwrap();
    assert!(error.permanent, "{error:?}");
    assert_eq!(error.code, Some(10065));
    assert!(
        error
            .error
            .contains("provisioning.> is stored by stream AUDIT"),
        "{}",
        error.error
    );
    assert!(error
        .remedy
        .as_deref()
        .unwrap()
        .contains("FERRY_NATS_STREAM"));
    let problems = metrics.problems("FERRY_EVENTS");
    assert_eq!(problems.len(), 1);
    assert!(problems[0].contains("to fix:"), "{problems:?}");
    assert!(metrics
        .render("FERRY_EVENTS")
        .contains("ferry_nats_relay_failing{stream=\"FERRY_EVENTS\"} 2\n"));

    // The operator removes the overlap: the relay recovers without a restart.
    js.delete_stream("AUDIT").await.unwrap();
    wait_for_stream(&nats, 4).await;
    wait_for("the error cleared", 30, || {
        let m = metrics.clone();
        async move { m.status().last_error.is_none() }
    })
    .await;
    stop.send(true).unwrap();
    relay.join().await;
    t.cleanup().await;
}

#[tokio::test]
async fn a_checkpoint_that_cannot_be_saved_after_the_pubacks_is_never_published_twice() {
    let nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Postgres).await;
    let db = t.db.clone();
    let exec = |sql: &'static str| {
        let db = db.clone();
        async move {
            ferry_store::on_pool!(db, pool => sqlx::query(sql).execute(pool).await.unwrap().rows_affected());
        }
    };
    // The store refuses to move the relay's checkpoint: PubAcks arrive, the save fails.
    exec("CREATE FUNCTION test_refuse() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'store failure injected by the test'; END $$ LANGUAGE plpgsql").await;
    exec("CREATE TRIGGER test_refuse_moves BEFORE UPDATE ON subscription_checkpoints FOR EACH ROW WHEN (NEW.name LIKE 'nats-relay:%' AND NEW.global_position <> OLD.global_position) EXECUTE FUNCTION test_refuse()").await;
    for _ in 0..2 {
        applied_run(&db, "acme", None).await;
    }
    let total = wait_events(&db, 8).await;
    // A short duplicate window: NATS' own de-duplication cannot hide a second publish.
    let cfg = RelayConfig {
        duplicate_window: Duration::from_secs(1),
        ..config(&nats)
    };
    let (_stop, shutdown) = watch::channel(false);
    let relay = Relay::start(db.clone(), cfg.clone(), shutdown)
        .await
        .unwrap();
    let metrics = relay.metrics();
    wait_for_stream(&nats, total).await;
    // The store recovers only once the saves have failed for longer than the window.
    wait_for("saves failing past the duplicate window", 30, || {
        let m = metrics.clone();
        async move {
            m.status().last_error.is_some_and(|e| {
                e.error.contains("store failure injected")
                    && e.last - e.since > chrono::Duration::milliseconds(1500)
            })
        }
    })
    .await;
    exec("DROP TRIGGER test_refuse_moves ON subscription_checkpoints").await;
    let last = stream_messages(&nats.js().await, &cfg.stream_name).await;
    let last =
        ferry_messaging::parse_position(last[total - 1].position.as_deref().unwrap()).unwrap();
    wait_for("the checkpoint moved past what NATS holds", 30, || {
        let m = metrics.clone();
        async move { m.checkpoint.load(Ordering::Relaxed) == last.global_position }
    })
    .await;
    failed_run(&db, "acme").await;
    let messages = wait_for_stream(&nats, total + 2).await;
    assert_eq!(messages.len(), total + 2, "nothing published twice");
    assert_unique(&messages);
    assert_ordered(&messages);
    assert_eq!(metrics.skipped.load(Ordering::Relaxed), total as u64);
    relay.abort();
    t.cleanup().await;
}

#[tokio::test]
async fn an_operator_replays_the_history_a_reset_stream_lost_and_can_never_skip_ahead() {
    let mut nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Sqlite).await;
    let db = t.db.clone();
    let cfg = config(&nats);
    let (relay, original, _stop) = relay_after_runs(&nats, &db, &cfg, 2).await;
    let metrics = relay.metrics();
    nats.restart_empty().await;
    wait_for("the empty stream reported", 30, || {
        let m = metrics.clone();
        async move { m.stream_resets.load(Ordering::Relaxed) == 1 }
    })
    .await;

    // Forward would skip events: refused, nothing moves.
    let ahead = ferry_store::Position {
        transaction_id: 0,
        global_position: 1_000,
    };
    let refused = ferry_messaging::relay::replay_after(&db, &cfg.stream_name, ahead).await;
    assert!(
        matches!(
            refused,
            Err(ferry_messaging::relay::ReplayError::Forward { .. })
        ),
        "{refused:?}"
    );

    // From the beginning: the running relay publishes the history again, once, in order.
    let n = ferry_messaging::relay::replay_after(&db, &cfg.stream_name, Position::default())
        .await
        .unwrap();
    assert_eq!(n, original.len() as u64);
    let messages = wait_for_stream(&nats, original.len()).await;
    assert_eq!(ids(&messages), ids(&original));
    assert_unique(&messages);
    relay.abort();
    t.cleanup().await;
}

#[tokio::test]
async fn a_stream_ahead_with_other_events_than_the_stores_is_not_skipped_over() {
    // A store restored behind the stream: the stream's newest Ferry message claims a position
    // the store holds, but it is another event there. Skipping to it would leave the store's
    // own events unpublished.
    let nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Sqlite).await;
    let db = t.db.clone();
    applied_run(&db, "acme", None).await;
    let total = wait_events(&db, 4).await;
    let cfg = config(&nats);
    let js = nats.js().await;
    ferry_messaging::relay::ensure_stream(&js, &cfg)
        .await
        .unwrap();
    for position in 1..=4 {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", uuid::Uuid::new_v4().to_string().as_str());
        headers.insert("Ferry-Position", format!("0.{position}").as_str());
        js.publish_with_headers(
            "ferry.events.provisioning-run.from-before-the-restore",
            headers,
            "{}".into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    let (_stop, shutdown) = watch::channel(false);
    let relay = Relay::start(db.clone(), cfg.clone(), shutdown)
        .await
        .unwrap();
    let messages = wait_for_stream(&nats, 4 + total).await;
    let ours: Vec<&Stored> = messages[4..].iter().collect();
    assert_eq!(ours.len(), total, "the store's own events are published");
    ours.iter().for_each(|m| assert_valid(m));
    assert_eq!(relay.metrics().skipped.load(Ordering::Relaxed), 0);
    relay.abort();
    t.cleanup().await;
}

/// Stores a run's request that is not one (as a buggy or newer version could have).
async fn insert_broken_request(db: &Database, run: &str) -> String {
    let sql = db.sql(
        "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata)
         VALUES ('ProvisioningRun', $1, 1, 'ProvisioningRequested', '1.0', $2, $3)",
    );
    let payload = json!({"ProvisioningRequested": {"not": "a request"}});
    let metadata = json!({"tenantId": "acme"});
    ferry_store::on_pool!(db, pool => sqlx::query(&sql)
        .bind(run).bind(sqlx::types::Json(&payload)).bind(sqlx::types::Json(&metadata))
        .execute(pool).await.unwrap().rows_affected());
    let sql = db.sql("SELECT CAST(event_id AS text) FROM events WHERE aggregate_id = $1");
    ferry_store::on_pool!(db, pool => sqlx::query_scalar(&sql).bind(run).fetch_one(pool).await.unwrap())
}

/// `before` events, then one that does not decode, then one more; the relay reads `batch`
/// events at a time.
async fn stops_at_an_event_that_does_not_decode(backend: Backend, before: usize, batch: i64) {
    let nats = Nats::start().await;
    let t = TestDatabase::new(backend).await;
    let db = t.db.clone();
    for i in 0..before {
        declare(&db, &format!("acme{i}")).await;
    }
    let broken = insert_broken_request(&db, "broken-run").await;
    declare(&db, "globex").await;
    wait_events(&db, before + 2).await;

    let (stop, shutdown) = watch::channel(false);
    let cfg = RelayConfig {
        batch,
        ..config(&nats)
    };
    let relay = Relay::start(db.clone(), cfg, shutdown).await.unwrap();
    let metrics = relay.metrics();
    wait_for("the relay to report the event", 30, || {
        let metrics = metrics.clone();
        let broken = broken.clone();
        async move {
            metrics
                .status()
                .last_error
                .is_some_and(|e| e.error.contains(&broken))
        }
    })
    .await;
    let problems = metrics.problems("FERRY_EVENTS");
    assert!(problems.iter().any(|p| p.contains(&broken)), "{problems:?}");
    // The events before it are published, once each and in order; nothing after it, and
    // it is retried, not skipped.
    let messages = stream_messages(&nats.js().await, "FERRY_EVENTS").await;
    assert_eq!(messages.len(), before, "{messages:?}");
    assert_unique(&messages);
    for (i, m) in messages.iter().enumerate() {
        assert_eq!(
            m.subject,
            "provisioning.specifications.v1.specification-declared"
        );
        assert_eq!(m.body["tenantid"], format!("acme{i}"));
    }
    assert_eq!(
        metrics.checkpoint.load(Ordering::Relaxed),
        i64::try_from(before).unwrap()
    );
    wait_for("a retry", 30, || {
        let metrics = metrics.clone();
        async move { metrics.status().last_error.is_some_and(|e| e.attempts > 1) }
    })
    .await;
    assert_eq!(
        stream_messages(&nats.js().await, "FERRY_EVENTS")
            .await
            .len(),
        before
    );
    stop.send(true).unwrap();
    relay.join().await;
    t.cleanup().await;
}

#[tokio::test]
async fn an_event_that_does_not_decode_stops_the_relay_on_postgres() {
    stops_at_an_event_that_does_not_decode(Backend::Postgres, 1, 1024).await;
}

#[tokio::test]
async fn an_event_that_does_not_decode_stops_the_relay_on_sqlite() {
    stops_at_an_event_that_does_not_decode(Backend::Sqlite, 1, 1024).await;
}

/// The batches before the broken one are read and encoded ahead while earlier ones are
/// published: all of them go out, the checkpoint is saved at the last, and the batch read
/// ahead past the broken event is never published.
#[tokio::test]
async fn an_event_that_does_not_decode_several_batches_in_stops_the_relay_there_on_postgres() {
    stops_at_an_event_that_does_not_decode(Backend::Postgres, 11, 3).await;
}

#[tokio::test]
async fn an_event_that_does_not_decode_several_batches_in_stops_the_relay_there_on_sqlite() {
    stops_at_an_event_that_does_not_decode(Backend::Sqlite, 11, 3).await;
}
