//! End-to-end messaging through a running Ferry: real Postgres, a real nats-server started
//! by the test, HTTP. (The relay's crash and outage behaviour is tested in
//! `app/tests/`.)
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod common;

use common::*;
use ferry_messaging::testing::Nats;
use ferry_store::database::Backend;
use ferry_store::testing::eventually_showing;
use serde_json::{json, Value};
use std::time::Duration;

async fn server(nats: &Nats) -> TestServer {
    let data = tempfile::tempdir().unwrap();
    let mut config = config(data.path());
    config.nats_url = Some(nats.url());
    TestServer::start_with(Backend::Postgres, config, data).await
}

fn schema_for(subject: &str) -> Value {
    let file = match subject {
        "provisioning.specifications.v1.specification-declared" => "specification-declared",
        "provisioning.runs.v1.provisioning-planned" => "provisioning-planned",
        other => panic!("no schema chosen for {other}"),
    };
    let path = format!(
        "{}/schemas/events/{file}.schema.json",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[tokio::test]
async fn a_command_is_published_as_a_cloudevent_on_the_seed_subject() {
    let nats = Nats::start().await;
    let s = server(&nats).await;
    let (status, spec) = s
        .post(
            &operator("acme", "alice"),
            "/factory/provisioning/specifications",
            &declaration("payments-dev", "3f2a9c1"),
        )
        .await;
    assert_eq!(status, 201);

    let client = async_nats::connect(&nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let js = &js;
    let stream = eventually_showing("the relay's stream FERRY_EVENTS", 15, || async move {
        js.get_stream("FERRY_EVENTS")
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    let stream = &stream;
    let message = eventually_showing("a specification-declared message", 15, || async move {
        stream
            .get_last_raw_message_by_subject(
                "provisioning.specifications.v1.specification-declared",
            )
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    let event: Value = serde_json::from_slice(&message.payload).unwrap();
    assert_eq!(event["specversion"], "1.0");
    assert_eq!(
        event["type"],
        "provisioning.specifications.v1.specification-declared"
    );
    assert_eq!(event["subject"], spec["specificationId"]);
    assert_eq!(event["tenantid"], "acme");
    assert_eq!(event["datacontenttype"], "application/json");
    let data = &event["data"];
    let mut fields: Vec<&str> = data
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    fields.sort();
    assert_eq!(
        fields,
        [
            "environmentId",
            "kind",
            "programVersion",
            "specificationId",
            "tenantId",
            "version"
        ]
    );
    assert_eq!(
        (data["version"].as_u64(), data["programVersion"].as_str()),
        (Some(1), Some("3f2a9c1"))
    );
    let schema = schema_for("provisioning.specifications.v1.specification-declared");
    let validator = jsonschema::validator_for(&schema).unwrap();
    assert!(
        validator.is_valid(data),
        "payload does not match its schema: {data}"
    );
    // Nats-Msg-Id is the CloudEvent id (the stored event id).
    let id = message.headers.get("Nats-Msg-Id").unwrap().to_string();
    assert_eq!(event["id"], id.as_str());
    s.stop().await;
}

fn cloud_event(id: &str, kind: &str, tenant: &str, data: Value) -> Value {
    json!({"specversion": "1.0", "id": id, "source": "urn:test:environments", "type": kind,
           "tenantid": tenant, "datacontenttype": "application/json", "data": data})
}

#[tokio::test]
async fn inbound_events_over_nats_and_http_have_one_effect_and_bad_ones_are_dead_lettered() {
    let nats = Nats::start().await;
    let s = server(&nats).await;
    let alice = operator("acme", "alice");

    // Over NATS, published twice with the same id: one effect.
    let client = async_nats::connect(&nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let created = cloud_event(
        "env-created-1",
        "environments.v1.environment-created",
        "acme",
        json!({"environmentId": "payments-stg", "tenantId": "acme", "environmentClass": "staging"}),
    );
    // The consumer creates its stream in the background: publish once it exists.
    let (js, created) = (&js, &created);
    eventually_showing("the inbound stream", 15, || async move {
        let ack = js
            .publish(
                "environments.v1.environment-created",
                created.to_string().into(),
            )
            .await
            .map_err(|e| e.to_string())?;
        ack.await.map(|_| ()).map_err(|e| e.to_string())
    })
    .await;
    js.publish(
        "environments.v1.environment-created",
        created.to_string().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let (server, token) = (&s, &alice);
    let env = eventually_showing("EnvironmentCreated's effect", 15, || async move {
        let (status, env) = server
            .get(token, "/factory/environments/payments-stg")
            .await;
        if status == 200 {
            Ok(env)
        } else {
            Err(format!("{status}: {env}"))
        }
    })
    .await;
    assert_eq!(env["environmentClass"], "staging");

    // Over HTTP (a service token): accepted, then a duplicate; a state change; a
    // malformed one.
    let environments = service("acme", "svc-environments");
    let post = |body: String| {
        let s = &s;
        let token = environments.clone();
        async move {
            let r = s
                .client
                .post(s.url("/factory/events"))
                .bearer_auth(token)
                .header("content-type", "application/cloudevents+json")
                .body(body)
                .send()
                .await
                .unwrap();
            response(r).await
        }
    };
    let changed = cloud_event(
        "env-state-1",
        "environments.v1.environment-state-changed",
        "acme",
        json!({"environmentId": "payments-stg", "tenantId": "acme", "state": "ready"}),
    );
    let (status, first) = post(changed.to_string()).await;
    assert_eq!(
        (status, &first["duplicate"]),
        (202, &json!(false)),
        "{first}"
    );
    let (status, again) = post(changed.to_string()).await;
    assert_eq!((status, &again["duplicate"]), (202, &json!(true)));
    let (_, env) = s.get(&alice, "/factory/environments/payments-stg").await;
    assert_eq!(env["ready"], true);

    let (status, _) = post("{\"specversion\": \"1.0\", \"id\": 7}".to_string()).await;
    assert_eq!(status, 400);
    let other_tenant = cloud_event(
        "x-1",
        "environments.v1.environment-created",
        "globex",
        json!({"environmentId": "e", "tenantId": "globex", "environmentClass": "test"}),
    );
    assert_eq!(post(other_tenant.to_string()).await.0, 403);

    // Exactly one EnvironmentRegistered and one EnvironmentStateChanged were stored.
    let db = &s.db.as_ref().unwrap().db;
    let counts: Vec<(String, i64)> = ferry_store::on_pool!(db, pool => sqlx::query_as(
        "SELECT event_type, count(*) FROM events WHERE aggregate_type = 'Environment' GROUP BY event_type ORDER BY event_type"
    ).fetch_all(pool).await.unwrap());
    assert_eq!(
        counts,
        [
            ("EnvironmentRegistered".to_string(), 1),
            ("EnvironmentStateChanged".to_string(), 1)
        ]
    );
    let dead = ferry_messaging::inbound::store::dead_letters(db, 10)
        .await
        .unwrap();
    assert!(
        dead.iter().any(|d| d.via == "http" && !d.reason.is_empty()),
        "{dead:?}"
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
    assert!(metrics.contains("inbound"), "{metrics}");
    s.stop().await;
}

#[tokio::test]
async fn the_event_stream_serves_a_tenants_events_and_resumes() {
    let s = TestServer::start(Backend::Postgres).await;
    let alice = operator("acme", "alice");
    declare_twice(&s, &alice).await;
    s.post(
        &operator("globex", "g"),
        "/factory/provisioning/specifications",
        &declaration("other", "3f2a9c1"),
    )
    .await;

    let read = |last: Option<String>, n: usize| {
        let s = &s;
        let alice = alice.clone();
        async move {
            let mut request = s
                .client
                .get(s.url("/factory/events/stream"))
                .bearer_auth(alice);
            if let Some(id) = last {
                request = request.header("Last-Event-ID", id);
            }
            let r = request.send().await.unwrap();
            assert_eq!(r.status(), 200);
            assert!(r.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream"));
            let mut r = r;
            let mut text = String::new();
            let mut events = Vec::new();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while events.len() < n {
                let chunk = tokio::time::timeout_at(deadline, r.chunk())
                    .await
                    .expect("timed out")
                    .unwrap()
                    .unwrap();
                text.push_str(&String::from_utf8_lossy(&chunk));
                while let Some(end) = text.find("\n\n") {
                    let frame: String = text.drain(..end + 2).collect();
                    let id = frame
                        .lines()
                        .find_map(|l| l.strip_prefix("id:"))
                        .map(|v| v.trim().to_string());
                    let data = frame
                        .lines()
                        .find_map(|l| l.strip_prefix("data:"))
                        .map(|v| v.trim().to_string());
                    if let (Some(id), Some(data)) = (id, data) {
                        events.push((id, serde_json::from_str::<Value>(&data).unwrap()));
                    }
                }
            }
            events
        }
    };
    let events = read(None, 2).await;
    assert!(
        events.iter().all(|(_, e)| e["tenantid"] == "acme"),
        "{events:?}"
    );
    assert_eq!(events[0].1["data"]["version"], 1);
    // Resuming after the first event starts with the second.
    let resumed = read(Some(events[0].0.clone()), 1).await;
    assert_eq!(resumed[0].1["id"], events[1].1["id"]);
    s.stop().await;
}

async fn declare_twice(s: &TestServer, token: &str) {
    for commit in ["3f2a9c1", "4b5c6d7"] {
        let (status, _) = s
            .post(
                token,
                "/factory/provisioning/specifications",
                &declaration("payments-dev", commit),
            )
            .await;
        assert_eq!(status, 201);
    }
}

/// `/readyz` once `check` holds for it (at most 20 s).
async fn readyz_until<F: Fn(&Value) -> bool>(s: &TestServer, what: &str, check: F) -> Value {
    let check = &check;
    ferry_store::testing::eventually_within(what, 20, || async move {
        let r = s.client.get(s.url("/readyz")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let body: Value = r.json().await.unwrap();
        check(&body).then_some(body)
    })
    .await
}

#[tokio::test]
async fn readyz_lists_the_relay_and_every_inbound_consumer_with_their_lag() {
    let nats = Nats::start().await;
    let s = server(&nats).await;
    let (status, _) = s
        .post(
            &operator("acme", "alice"),
            "/factory/provisioning/specifications",
            &declaration("payments-dev", "3f2a9c1"),
        )
        .await;
    assert_eq!(status, 201);
    let inbound = ferry_app::Contexts::builtin()
        .inbound_kinds()
        .unwrap()
        .subjects();
    let body = readyz_until(
        &s,
        "the relay caught up and every consumer consuming",
        |b| {
            let relay = &b["nats"]["relay"];
            let consumers = b["nats"]["consumers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            relay["role"] == "leader"
                && relay["lag"] == 0
                && relay["lastPublishedAt"].is_string()
                && consumers.len() == inbound.len()
                && consumers
                    .iter()
                    .all(|c| c["state"] == "consuming" && c["pending"].is_u64())
        },
    )
    .await;
    assert_eq!(body["status"], "ready", "{body:#}");
    let relay = &body["nats"]["relay"];
    assert_eq!(relay["stream"], "FERRY_EVENTS");
    assert!(relay["expectedLastSequence"].as_u64().unwrap() >= 1);
    assert!(relay.get("lastError").is_none());
    for c in body["nats"]["consumers"].as_array().unwrap() {
        assert!(inbound.iter().any(|s| c["subject"] == s.as_str()), "{c}");
        assert!(c["consumer"]
            .as_str()
            .unwrap()
            .starts_with("ferry-inbound-"));
        assert!(c["stream"].is_string());
    }
    let metrics = s
        .client
        .get(s.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "ferry_nats_relay_lag_events{stream=\"FERRY_EVENTS\"} 0\n",
        "ferry_subscription_lag_events{subscription=\"nats-relay:FERRY_EVENTS\"} 0\n",
        "ferry_nats_relay_failing{stream=\"FERRY_EVENTS\"} 0\n",
        "ferry_nats_relay_leader{stream=\"FERRY_EVENTS\"} 1\n",
        "ferry_nats_inbound_failing{subject=\"runcontrol.approvals.v1.approval-decided\"} 0\n",
    ] {
        assert!(metrics.contains(line), "no {line:?} in\n{metrics}");
    }
    assert!(metrics
        .contains("ferry_nats_inbound_pending{subject=\"environments.v1.environment-created\"}"));
    s.stop().await;
}

#[tokio::test]
async fn readyz_names_a_permanent_nats_error_and_what_to_change() {
    let nats = Nats::start().await;
    // An operator's stream already stores Ferry's subjects.
    let js = async_nats::jetstream::new(async_nats::connect(&nats.url()).await.unwrap());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "AUDIT".to_string(),
        subjects: vec!["provisioning.>".to_string()],
        ..Default::default()
    })
    .await
    .unwrap();
    // And the inbound stream allows one consumer, where Ferry needs one per subject.
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "FERRY_INBOUND".to_string(),
        subjects: vec!["environments.v1.environment-created".to_string()],
        max_consumers: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    let s = server(&nats).await;
    let (status, _) = s
        .post(
            &operator("acme", "alice"),
            "/factory/provisioning/specifications",
            &declaration("payments-dev", "3f2a9c1"),
        )
        .await;
    assert_eq!(status, 201);
    let body = readyz_until(&s, "the relay's and the consumers' permanent errors", |b| {
        let consumers = b["nats"]["consumers"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        // The lag comes from the checkpoints read before the relay's status in the same
        // answer, so a first answer may hold the error and not yet the row.
        b["nats"]["relay"]["lastError"]["permanent"] == true
            && b["nats"]["relay"]["lag"].as_i64().is_some()
            && consumers
                .iter()
                .any(|c| c["lastError"]["permanent"] == true)
    })
    .await;
    let failing: Vec<&Value> = body["nats"]["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["state"] == "failing")
        .collect();
    assert!(!failing.is_empty());
    for c in &failing {
        assert_eq!(c["lastError"]["code"], 10026, "{c}");
        assert!(
            c["lastError"]["remedy"].as_str().unwrap().contains("limit"),
            "{c}"
        );
    }
    assert_eq!(body["status"], "degraded");
    let error = &body["nats"]["relay"]["lastError"];
    assert_eq!(error["code"], 10065);
    assert!(
        error["error"]
            .as_str()
            .unwrap()
            .contains("stored by stream AUDIT"),
        "{error}"
    );
    assert!(error["remedy"]
        .as_str()
        .unwrap()
        .contains("FERRY_NATS_STREAM"));
    assert!(
        body["nats"]["relay"]["lag"].as_i64().unwrap() >= 1,
        "the events wait: {body:#}"
    );
    let problems = body["problems"].as_array().unwrap();
    assert!(
        problems
            .iter()
            .any(|p| p.as_str().unwrap().contains("NATS relay")
                && p.as_str().unwrap().contains("to fix:")),
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
        metrics.contains("ferry_nats_relay_failing{stream=\"FERRY_EVENTS\"} 2\n"),
        "{metrics}"
    );
    assert!(!metrics.contains("ferry_nats_relay_lag_events{stream=\"FERRY_EVENTS\"} 0\n"));
    let subject = failing[0]["subject"].as_str().unwrap();
    assert!(
        metrics.contains(&format!(
            "ferry_nats_inbound_failing{{subject=\"{subject}\"}} 2\n"
        )),
        "{metrics}"
    );
    s.stop().await;
}
