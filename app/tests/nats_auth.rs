//! Ferry on a NATS server with users and permissions: the Compose example's
//! `deploy/nats.conf`, run by a real nats-server. Ferry's relay and inbound consumers work
//! as its user `ferry`, and an approval reaches Ferry only from run control's user: on NATS
//! the server's subject permissions are the only proof of who published an event.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use common::*;
use ferry_app::contexts::provisioning::payloads::ProvisioningAppliedPayload;
use ferry_app::inbound::ApprovalDecided;
use ferry_domain::ports::SecretValue;
use ferry_messaging::nats::{NatsAuth, NatsCredentials};
use ferry_messaging::{
    Handled, Inbound, InboundConfig, InboundContext, InboundEnvelope, InboundError, InboundHandler,
    InboundKinds, Relay, RelayConfig,
};
use ferry_store::testing::TestDatabase;
use ferry_store::Backend;
use futures::StreamExt;
use serde_json::json;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

const CONFIG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/nats.conf");
const APPROVALS: &str = "runcontrol.approvals.v1.approval-decided";

/// The passwords `deploy/nats.conf` reads from the environment.
const PASSWORDS: [(&str, &str); 4] = [
    ("NATS_PASSWORD_FERRY", "ferry-pw"),
    ("NATS_PASSWORD_RUNCONTROL", "runcontrol-pw"),
    ("NATS_PASSWORD_ENVIRONMENTS", "environments-pw"),
    ("NATS_PASSWORD_RELEASES", "releases-pw"),
];

async fn server() -> Nats {
    Nats::start_with_config(Path::new(CONFIG), &PASSWORDS, ("ferry", "ferry-pw")).await
}

fn ferry_user() -> NatsAuth {
    NatsAuth {
        credentials: NatsCredentials::UserPassword {
            user: "ferry".to_string(),
            password: SecretValue::new("ferry-pw"),
        },
        ..NatsAuth::default()
    }
}

/// Keeps every event it is handed.
#[derive(Default)]
struct Recorder(Mutex<Vec<InboundEnvelope>>);

#[async_trait::async_trait]
impl InboundHandler for Recorder {
    fn kinds(&self) -> InboundKinds {
        ferry_app::Contexts::builtin().inbound_kinds().unwrap()
    }

    async fn handle(&self, event: InboundEnvelope) -> Result<Handled, InboundError> {
        self.0.lock().unwrap().push(event);
        Ok(Handled::NothingToDo)
    }
}

impl Recorder {
    fn approvals(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e.event.get::<ApprovalDecided>().is_some())
            .map(|e| e.id.clone())
            .collect()
    }
}

/// Run control's approval of a production run, as anyone may write it.
fn approval(id: &str) -> bytes::Bytes {
    json!({
        "specversion": "1.0", "id": id, "source": "urn:runcontrol", "type": APPROVALS,
        "tenantid": "acme", "datacontenttype": "application/json",
        "data": {"approvalId": uuid::Uuid::new_v4(), "tenantId": "acme",
                 "provisioningRunId": uuid::Uuid::new_v4(), "decision": "approve",
                 "decidedBy": "carol", "reason": "CAB approved"}
    })
    .to_string()
    .into()
}

#[tokio::test]
async fn only_run_controls_nats_user_gets_an_approval_to_ferry() {
    let nats = server().await;
    let t = TestDatabase::new(Backend::Sqlite).await;
    let recorder = Arc::new(Recorder::default());
    let (stop, shutdown) = watch::channel(false);
    let inbound = Inbound::start_with(
        InboundContext::new(t.db.clone(), recorder.clone()),
        InboundConfig {
            nats_auth: ferry_user(),
            ..InboundConfig::new(&nats.url())
        },
        shutdown.clone(),
    )
    .await
    .unwrap();
    let relay = Relay::start(
        t.db.clone(),
        RelayConfig {
            nats_url: nats.url(),
            nats_auth: ferry_user(),
            poll: Duration::from_millis(100),
            publishers: ferry_app::contexts::provisioning::events::publishers(),
            ..RelayConfig::default()
        },
        shutdown,
    )
    .await
    .unwrap();
    let js = nats.js().await;
    wait_for("Ferry's stream for the approvals", 30, || {
        let js = js.clone();
        async move { js.stream_by_subject(APPROVALS).await.is_ok() }
    })
    .await;

    // Every user but run control's publishes an approval, each as a NATS client does:
    // the delivery pipeline's, the environment service's (through JetStream, waiting for
    // an acknowledgement), and Ferry's own user.
    let releases = nats.connect_as("releases", "releases-pw").await;
    releases
        .publish(APPROVALS, approval("forged-by-releases"))
        .await
        .unwrap();
    releases.flush().await.unwrap();
    let environments =
        async_nats::jetstream::new(nats.connect_as("environments", "environments-pw").await);
    let acked = tokio::time::timeout(Duration::from_secs(3), async {
        environments
            .publish(APPROVALS, approval("forged-by-environments"))
            .await?
            .await
            .map(|_| ())
            .map_err(async_nats::Error::from)
    })
    .await;
    assert!(
        !matches!(acked, Ok(Ok(()))),
        "JetStream stored the environment service's approval"
    );
    let ferry = nats.connect_as("ferry", "ferry-pw").await;
    ferry
        .publish(APPROVALS, approval("forged-by-ferry"))
        .await
        .unwrap();
    ferry.flush().await.unwrap();

    // Run control's own, after them: JetStream acknowledges it and Ferry handles it.
    let runcontrol =
        async_nats::jetstream::new(nats.connect_as("runcontrol", "runcontrol-pw").await);
    runcontrol
        .publish(APPROVALS, approval("from-runcontrol"))
        .await
        .unwrap()
        .await
        .unwrap();
    wait_for("run control's approval handled", 30, || {
        let recorder = recorder.clone();
        async move { !recorder.approvals().is_empty() }
    })
    .await;
    assert_eq!(recorder.approvals(), ["from-runcontrol"]);
    // Not merely not handled yet: the server never stored the others.
    let stream = js
        .get_stream(js.stream_by_subject(APPROVALS).await.unwrap())
        .await
        .unwrap();
    let mut subjects = stream.info_with_subjects(APPROVALS).await.unwrap();
    let stored = subjects.next().await;
    assert_eq!(
        stored.map(|s| s.unwrap()),
        Some((APPROVALS.to_string(), 1)),
        "only run control's approval is in the stream"
    );

    // The relay publishes as Ferry's user, and Ferry's own ProvisioningApplied comes back
    // in through its stream.
    let run = applied_run(&t.db, "acme", None).await;
    wait_for("Ferry's ProvisioningApplied consumed", 30, || {
        let recorder = recorder.clone();
        async move {
            recorder.0.lock().unwrap().iter().any(|e| {
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
