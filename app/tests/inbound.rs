//! Inbound events over NATS (real nats-server) and HTTP, with dedupe and dead letters.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use async_nats::jetstream;
use common::*;
use ferry_app::contexts::promotions::inbound::ReleaseReady;
use ferry_app::contexts::provisioning::inbound::EnvironmentCreated;
use ferry_app::contexts::provisioning::payloads::ProvisioningAppliedPayload;
use ferry_messaging::inbound::store::dead_letters;
use ferry_messaging::{
    accept_cloud_event, Handled, Inbound, InboundConfig, InboundContext, InboundEnvelope,
    InboundError, InboundHandler, InboundKinds, IntakeError, Poster, Relay, RelayConfig,
};
use ferry_store::testing::TestDatabase;
use ferry_store::Backend;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// Records what it handled; fails transiently `transient` times first; refuses releases
/// of project `blocked`.
#[derive(Default)]
struct Recorder {
    seen: Mutex<Vec<InboundEnvelope>>,
    calls: AtomicU32,
    transient: AtomicU32,
}

#[async_trait::async_trait]
impl InboundHandler for Recorder {
    fn kinds(&self) -> InboundKinds {
        ferry_app::Contexts::builtin().inbound_kinds().unwrap()
    }

    async fn handle(&self, event: InboundEnvelope) -> Result<Handled, InboundError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self
            .transient
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(InboundError::Transient("store briefly down".into()));
        }
        if let Some(r) = event.event.get::<ReleaseReady>() {
            if r.project_id.as_str() == "blocked" {
                return Err(InboundError::Permanent("project blocked".into()));
            }
        }
        self.seen.lock().unwrap().push(event);
        // It keeps what it saw in memory: the message is marked handled on its own.
        Ok(Handled::NothingToDo)
    }
}

impl Recorder {
    fn ids(&self) -> Vec<String> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|e| e.id.clone())
            .collect()
    }
}

fn poster(tenant: &str) -> Poster {
    Poster {
        tenant: ferry_domain::TenantId::parse(tenant).unwrap(),
        actor: ferry_domain::Actor::parse("svc-test").unwrap(),
    }
}

fn cloud_event(id: &str, ty: &str, tenant: &str, data: Value) -> Value {
    json!({"specversion": "1.0", "id": id, "source": "urn:test", "type": ty,
           "tenantid": tenant, "datacontenttype": "application/json", "data": data})
}

fn env_created(tenant: &str) -> Value {
    json!({"environmentId": "payments-prod", "tenantId": tenant,
           "environmentClass": "production", "healthUrl": "https://p/healthz",
           "programRef": "https://git.example/infra.git#envs/prod"})
}

fn release_ready(tenant: &str, project: &str) -> Value {
    json!({"releaseId": "0b7e7f7c-1111-4222-8333-944455556666", "tenantId": tenant,
           "projectId": project, "version": "2.3.0"})
}

async fn publish(js: &jetstream::Context, subject: &str, msg_id: &str, body: Vec<u8>) {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", msg_id);
    js.publish_with_headers(subject.to_string(), headers, body.into())
        .await
        .unwrap()
        .await
        .unwrap();
}

async fn wait_for_stream_of(js: &jetstream::Context, subject: &str) {
    wait_for(&format!("a stream for {subject}"), 30, || {
        let js = js.clone();
        let subject = subject.to_string();
        async move { js.stream_by_subject(subject).await.is_ok() }
    })
    .await;
}

#[tokio::test]
async fn a_redelivered_inbound_event_has_one_effect() {
    let nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Postgres).await;
    let recorder = Arc::new(Recorder::default());
    recorder.transient.store(1, Ordering::SeqCst);
    let ctx = InboundContext::new(t.db.clone(), recorder.clone());
    let (stop, shutdown) = watch::channel(false);
    let inbound = Inbound::start_with(ctx, InboundConfig::new(&nats.url()), shutdown.clone())
        .await
        .unwrap();
    let relay = Relay::start(
        t.db.clone(),
        RelayConfig {
            nats_url: nats.url(),
            poll: Duration::from_millis(100),
            publishers: ferry_app::contexts::provisioning::events::publishers(),
            ..RelayConfig::default()
        },
        shutdown,
    )
    .await
    .unwrap();
    let js = nats.js().await;
    wait_for_stream_of(&js, "environments.v1.environment-created").await;

    // The first delivery fails transiently (nak with delay), the redelivery is handled, and
    // a second copy of the same CloudEvent (another Nats-Msg-Id) has no effect.
    let body = serde_json::to_vec(&cloud_event(
        "evt-1",
        "environments.v1.environment-created",
        "acme",
        env_created("acme"),
    ))
    .unwrap();
    publish(
        &js,
        "environments.v1.environment-created",
        "n-1",
        body.clone(),
    )
    .await;
    publish(&js, "environments.v1.environment-created", "n-2", body).await;
    let metrics = inbound.metrics();
    wait_for("one handled, one duplicate", 30, || {
        let m = metrics.clone();
        async move {
            m.handled.load(Ordering::Relaxed) == 1 && m.duplicates.load(Ordering::Relaxed) == 1
        }
    })
    .await;
    assert_eq!(recorder.ids(), vec!["evt-1".to_string()]);
    assert_eq!(
        recorder.calls.load(Ordering::SeqCst),
        2,
        "one transient failure, one success"
    );
    assert_eq!(metrics.transient_failures.load(Ordering::Relaxed), 1);
    {
        let seen = recorder.seen.lock().unwrap();
        let e = &seen[0];
        assert_eq!(e.tenant_id.as_str(), "acme");
        assert_eq!(e.source, "urn:test");
        assert_eq!(e.via, "nats");
        let Some(c) = e.event.get::<EnvironmentCreated>() else {
            panic!("wrong event {:?}", e.event)
        };
        assert_eq!(c.environment_id.as_str(), "payments-prod");
    }

    // Ferry's own ProvisioningApplied comes back in through the relay's stream.
    let run = applied_run(&t.db, "acme", None).await;
    wait_for("ProvisioningApplied consumed", 30, || {
        let r = recorder.clone();
        async move {
            r.seen.lock().unwrap().iter().any(|e| {
                e.event
                    .get::<ProvisioningAppliedPayload>()
                    .is_some_and(|p| p.provisioning_run_id == run)
            })
        }
    })
    .await;

    stop.send(true).unwrap();
    inbound.join().await;
    relay.join().await;
    t.cleanup().await;
}

#[tokio::test]
async fn a_malformed_inbound_message_is_dead_lettered_and_never_redelivered() {
    let nats = Nats::start().await;
    let t = TestDatabase::new(Backend::Sqlite).await;
    let recorder = Arc::new(Recorder::default());
    let (stop, shutdown) = watch::channel(false);
    let inbound = Inbound::start(t.db.clone(), &nats.url(), recorder.clone(), shutdown)
        .await
        .unwrap();
    let js = nats.js().await;
    let subject = "releases.releases.v1.release-ready";
    wait_for_stream_of(&js, subject).await;

    publish(&js, subject, "m-1", b"{not json".to_vec()).await;
    let bad_payload = cloud_event("evt-bad", subject, "acme", json!({"tenantId": "acme"}));
    publish(
        &js,
        subject,
        "m-2",
        serde_json::to_vec(&bad_payload).unwrap(),
    )
    .await;
    let other_tenant = cloud_event(
        "evt-x",
        subject,
        "acme",
        release_ready("globex", "payments"),
    );
    publish(
        &js,
        subject,
        "m-3",
        serde_json::to_vec(&other_tenant).unwrap(),
    )
    .await;
    let refused = cloud_event(
        "evt-refused",
        subject,
        "acme",
        release_ready("acme", "blocked"),
    );
    publish(&js, subject, "m-4", serde_json::to_vec(&refused).unwrap()).await;
    let good = cloud_event(
        "evt-good",
        subject,
        "acme",
        release_ready("acme", "payments"),
    );
    publish(&js, subject, "m-5", serde_json::to_vec(&good).unwrap()).await;

    let metrics = inbound.metrics();
    wait_for("the good message handled", 30, || {
        let m = metrics.clone();
        async move { m.handled.load(Ordering::Relaxed) == 1 }
    })
    .await;
    assert_eq!(recorder.ids(), vec!["evt-good".to_string()]);
    assert_eq!(metrics.dead_lettered.load(Ordering::Relaxed), 4);

    let letters = dead_letters(&t.db, 10).await.unwrap();
    assert_eq!(letters.len(), 4);
    let reason_of = |id: Option<&str>| {
        letters
            .iter()
            .find(|l| l.message_id.as_deref() == id)
            .map(|l| l.reason.clone())
            .unwrap()
    };
    assert!(
        reason_of(None).contains("not a CloudEvent"),
        "{}",
        reason_of(None)
    );
    assert!(reason_of(Some("evt-bad")).contains("releaseId"));
    assert!(reason_of(Some("evt-x")).contains("differs"));
    assert_eq!(reason_of(Some("evt-refused")), "project blocked");
    assert!(letters
        .iter()
        .all(|l| l.subject == subject && l.via == "nats"));
    assert!(letters.iter().any(|l| l.payload == "{not json"));

    // Terminated, not redelivered: nothing pending, nothing redelivered.
    let stream = js
        .get_stream(js.stream_by_subject(subject).await.unwrap())
        .await
        .unwrap();
    let mut consumer: jetstream::consumer::PullConsumer = stream
        .get_consumer("ferry-inbound-release-ready")
        .await
        .unwrap();
    let info = consumer.info().await.unwrap().clone();
    assert_eq!(info.num_ack_pending, 0);
    assert_eq!(info.num_redelivered, 0);
    assert_eq!(info.num_pending, 0);
    assert_eq!(metrics.dead_lettered.load(Ordering::Relaxed), 4);
    assert!(metrics
        .render()
        .contains("ferry_inbound_dead_lettered_total 4\n"));

    stop.send(true).unwrap();
    inbound.join().await;
    t.cleanup().await;
}

async fn http_events(backend: Backend) {
    let t = TestDatabase::new(backend).await;
    let recorder = Arc::new(Recorder::default());
    let ctx = InboundContext::new(t.db.clone(), recorder.clone());
    let body = |v: Value| serde_json::to_vec(&v).unwrap();

    // The type may be the subject or the event name.
    let ok = body(cloud_event(
        "h-1",
        "ReleaseReady",
        "acme",
        release_ready("acme", "payments"),
    ));
    let first = accept_cloud_event(&ctx, &poster("acme"), &ok)
        .await
        .unwrap();
    assert_eq!(
        (first.event.as_str(), first.duplicate),
        ("ReleaseReady", false)
    );
    let again = accept_cloud_event(&ctx, &poster("acme"), &ok)
        .await
        .unwrap();
    assert!(again.duplicate);
    assert_eq!(recorder.ids(), vec!["h-1".to_string()]);

    // Another tenant's event is refused and not dead-lettered.
    let err = accept_cloud_event(&ctx, &poster("globex"), &ok)
        .await
        .unwrap_err();
    assert!(matches!(err, IntakeError::Forbidden(_)), "{err:?}");

    // Malformed and unknown: dead-lettered with the reason.
    let err = accept_cloud_event(&ctx, &poster("acme"), b"[]")
        .await
        .unwrap_err();
    assert!(matches!(err, IntakeError::Malformed(_)), "{err:?}");
    let unknown = body(cloud_event(
        "h-2",
        "releases.releases.v1.release-burned",
        "acme",
        json!({}),
    ));
    let err = accept_cloud_event(&ctx, &poster("acme"), &unknown)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("unknown event type"), "{err}");

    // Refused by the handler: dead-lettered once; a retry gets the same answer.
    let refused = body(cloud_event(
        "h-3",
        "releases.releases.v1.release-ready",
        "acme",
        release_ready("acme", "blocked"),
    ));
    let err = accept_cloud_event(&ctx, &poster("acme"), &refused)
        .await
        .unwrap_err();
    assert_eq!(err, IntakeError::Rejected("project blocked".into()));
    let calls = recorder.calls.load(Ordering::SeqCst);
    let err = accept_cloud_event(&ctx, &poster("acme"), &refused)
        .await
        .unwrap_err();
    assert_eq!(err, IntakeError::Rejected("project blocked".into()));
    assert_eq!(
        recorder.calls.load(Ordering::SeqCst),
        calls,
        "not handled twice"
    );

    // A transient failure is retryable and then succeeds once.
    recorder.transient.store(1, Ordering::SeqCst);
    let approval = body(cloud_event(
        "h-4",
        "ApprovalDecided",
        "acme",
        json!({"approvalId": "6f1b5c2e-7d7a-4f0e-9c3b-2a1d0e5f4a11", "tenantId": "acme",
               "provisioningRunId": "7f1b5c2e-7d7a-4f0e-9c3b-2a1d0e5f4a11",
               "decision": "approve", "decidedBy": "bob"}),
    ));
    let err = accept_cloud_event(&ctx, &poster("acme"), &approval)
        .await
        .unwrap_err();
    assert!(matches!(err, IntakeError::Unavailable(_)), "{err:?}");
    let done = accept_cloud_event(&ctx, &poster("acme"), &approval)
        .await
        .unwrap();
    assert!(!done.duplicate);

    let letters = dead_letters(&t.db, 10).await.unwrap();
    assert_eq!(letters.len(), 3, "{letters:?}");
    assert!(letters
        .iter()
        .all(|l| l.via == "http" && l.tenant_id.as_deref() == Some("acme")));
    assert_eq!(ctx.metrics.dead_lettered.load(Ordering::Relaxed), 3);
    assert_eq!(ctx.metrics.handled.load(Ordering::Relaxed), 2);
    assert_eq!(recorder.ids(), vec!["h-1".to_string(), "h-4".to_string()]);
    t.cleanup().await;
}

#[tokio::test]
async fn cloud_events_over_http_on_postgres() {
    http_events(Backend::Postgres).await;
}

#[tokio::test]
async fn cloud_events_over_http_on_sqlite() {
    http_events(Backend::Sqlite).await;
}

/// Records a run for each ReleaseReady it handles, committing the effect with the message's
/// mark; before its first commit it lets another delivery take the claim over.
struct RunRecorder {
    db: ferry_store::Database,
    runs: ferry_store::Repository<ferry_domain::run::ProvisioningRun>,
    take_over_first: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl InboundHandler for RunRecorder {
    fn kinds(&self) -> InboundKinds {
        ferry_app::Contexts::builtin().inbound_kinds().unwrap()
    }

    async fn handle(&self, event: InboundEnvelope) -> Result<Handled, InboundError> {
        if self.take_over_first.swap(false, Ordering::SeqCst) {
            // Another delivery takes over the claim while this one still works.
            ferry_store::on_pool!(self.db, pool => sqlx::query(
                "UPDATE inbound_messages SET claim_token = 'another-delivery'"
            ).execute(pool).await.unwrap().rows_affected());
        }
        let key = format!("{} {}", event.source, event.id);
        let id = ferry_domain::ProvisioningRunId::for_idempotency_key(&event.tenant_id, &key);
        self.runs
            .execute_linked(
                &event.tenant_id,
                &id.to_string(),
                run_request(event.tenant_id.as_str(), id, None),
                &meta(event.tenant_id.as_str()),
                true,
                Some(&event.mark),
            )
            .await
            .map_err(|e| InboundError::Transient(e.to_string()))?;
        Ok(Handled::Recorded)
    }
}

async fn run_events(db: &ferry_store::Database) -> i64 {
    ferry_store::on_pool!(db, pool => sqlx::query_scalar(
        "SELECT count(*) FROM events WHERE aggregate_type = 'ProvisioningRun'"
    ).fetch_one(pool).await.unwrap())
}

async fn effects_commit_with_their_mark(backend: Backend) {
    let t = TestDatabase::new(backend).await;
    let handler = Arc::new(RunRecorder {
        db: t.db.clone(),
        runs: ferry_store::Repository::new(t.db.clone(), ()),
        take_over_first: std::sync::atomic::AtomicBool::new(true),
    });
    let ctx = InboundContext::new(t.db.clone(), handler.clone());
    let body = serde_json::to_vec(&cloud_event(
        "r-1",
        "ReleaseReady",
        "acme",
        release_ready("acme", "payments"),
    ))
    .unwrap();

    // The delivery that lost its claim cannot commit its effect: nothing is stored.
    let err = accept_cloud_event(&ctx, &poster("acme"), &body)
        .await
        .unwrap_err();
    assert!(matches!(err, IntakeError::Unavailable(_)), "{err:?}");
    assert_eq!(run_events(&t.db).await, 0, "no effect without its mark");

    // The claim taken over, then abandoned: once its lease is given back, a redelivery
    // handles it, and the effect and the mark are stored together.
    ferry_store::on_pool!(t.db, pool => sqlx::query(
        "UPDATE inbound_messages SET claimed_until_ms = 0"
    ).execute(pool).await.unwrap().rows_affected());
    let done = accept_cloud_event(&ctx, &poster("acme"), &body)
        .await
        .unwrap();
    assert!(!done.duplicate);
    assert_eq!(run_events(&t.db).await, 1);
    let status: String = ferry_store::on_pool!(t.db, pool => sqlx::query_scalar(
        "SELECT status FROM inbound_messages"
    ).fetch_one(pool).await.unwrap());
    assert_eq!(status, "done");
    let again = accept_cloud_event(&ctx, &poster("acme"), &body)
        .await
        .unwrap();
    assert!(again.duplicate);
    assert_eq!(run_events(&t.db).await, 1);

    // CloudEvents are unique by source and id: the same id from another source is another
    // message, not a duplicate.
    let mut other = cloud_event(
        "r-1",
        "ReleaseReady",
        "acme",
        release_ready("acme", "payments"),
    );
    other["source"] = json!("urn:another-release-service");
    let handled = accept_cloud_event(&ctx, &poster("acme"), &serde_json::to_vec(&other).unwrap())
        .await
        .unwrap();
    assert!(!handled.duplicate);
    assert_eq!(run_events(&t.db).await, 2);
    let rows: i64 = ferry_store::on_pool!(t.db, pool => sqlx::query_scalar(
        "SELECT count(*) FROM inbound_messages WHERE message_id = 'r-1'"
    ).fetch_one(pool).await.unwrap());
    assert_eq!(rows, 2, "one row per (source, id)");
    t.cleanup().await;
}

#[tokio::test]
async fn an_effect_commits_with_its_mark_on_postgres() {
    effects_commit_with_their_mark(Backend::Postgres).await;
}

#[tokio::test]
async fn an_effect_commits_with_its_mark_on_sqlite() {
    effects_commit_with_their_mark(Backend::Sqlite).await;
}
