//! End-to-end messaging through a running Ferry: real Postgres, a real nats-server started
//! by the test, HTTP. (The relay's crash and outage behaviour is tested in
//! `messaging/tests/`.)
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod common;

use common::*;
use ferry_store::database::Backend;
use serde_json::{json, Value};
use std::time::Duration;

struct Nats {
    child: std::process::Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Nats {
    async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = tempfile::tempdir().unwrap();
        let child = std::process::Command::new("/usr/sbin/nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "nats-server did not start"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Self {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            _dir: dir,
        }
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn server(nats: &Nats) -> TestServer {
    let data = tempfile::tempdir().unwrap();
    let mut config = config(data.path());
    config.nats_url = Some(nats.url.clone());
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

    let client = async_nats::connect(&nats.url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let stream = loop {
        match js.get_stream("FERRY_EVENTS").await {
            Ok(stream) => break stream,
            Err(_) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the relay never created FERRY_EVENTS"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let message = loop {
        match stream
            .get_last_raw_message_by_subject(
                "provisioning.specifications.v1.specification-declared",
            )
            .await
        {
            Ok(m) => break m,
            Err(_) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no specification-declared message"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
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
    let client = async_nats::connect(&nats.url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let created = cloud_event(
        "env-created-1",
        "environments.v1.environment-created",
        "acme",
        json!({"environmentId": "payments-stg", "tenantId": "acme", "environmentClass": "staging"}),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    // The consumer creates its stream in the background: publish once it exists.
    loop {
        let ack = js
            .publish(
                "environments.v1.environment-created",
                created.to_string().into(),
            )
            .await;
        if let Ok(ack) = ack {
            if ack.await.is_ok() {
                break;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the inbound stream never appeared"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    js.publish(
        "environments.v1.environment-created",
        created.to_string().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let env = loop {
        let (status, env) = s.get(&alice, "/factory/environments/payments-stg").await;
        if status == 200 {
            break env;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "EnvironmentCreated had no effect"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
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
