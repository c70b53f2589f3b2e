//! Typed events: upcasters reach the repository and subscribers alike, events that do not
//! decode are errors, other aggregates' events are passed over.

use super::*;
use crate::database::Backend;
use crate::metadata::StoredMetadata;
use crate::repository::Repository;
use crate::stream::{self, Handler};
use crate::testing::{eventually, TestDatabase};
use cqrs_es::event_sink::EventSink;
use cqrs_es::persist::SemanticVersionEventUpcaster;
use ferry_domain::environment::Environment;
use ferry_domain::run::{ProvisioningRun, RunEvent};
use ferry_domain::{TenantId, TenantOwned};
use serde::Serialize;
use serde_json::json;
use serde_json::Value;
use std::sync::Mutex;

/// A test aggregate whose only event is at version 2.0: version 1.0 called the amount `n`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Tally {
    tenant: Option<TenantId>,
    total: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum TallyEvent {
    Counted { tenant: TenantId, by: u32 },
}

impl DomainEvent for TallyEvent {
    fn event_type(&self) -> String {
        "Counted".to_string()
    }
    fn event_version(&self) -> String {
        "2.0".to_string()
    }
}

#[derive(Debug, thiserror::Error)]
#[error("refused")]
struct Refused;

impl Aggregate for Tally {
    const TYPE: &'static str = "Tally";
    type Command = ();
    type Event = TallyEvent;
    type Error = Refused;
    type Services = ();

    async fn handle(&mut self, _: (), _: &(), _: &EventSink<Self>) -> Result<(), Refused> {
        Err(Refused)
    }

    fn apply(&mut self, event: TallyEvent) {
        let TallyEvent::Counted { tenant, by } = event;
        self.tenant = Some(tenant);
        self.total += by;
    }
}

impl TenantOwned for Tally {
    fn tenant(&self) -> Option<&TenantId> {
        self.tenant.as_ref()
    }
}

impl StoredAggregate for Tally {
    fn upcasters() -> Vec<Box<dyn EventUpcaster>> {
        let rename = |payload: Value| {
            let n = payload["Counted"]["n"].clone();
            let tenant = payload["Counted"]["tenant"].clone();
            json!({"Counted": {"tenant": tenant, "by": n}})
        };
        vec![Box::new(SemanticVersionEventUpcaster::new(
            "Counted",
            "2.0",
            Box::new(rename),
        ))]
    }
}

/// Every event a subscriber was given.
struct Seen<A: Aggregate>(Mutex<Vec<Typed<A::Event>>>);

impl<A: Aggregate> Seen<A> {
    fn new() -> Arc<Self> {
        Arc::new(Self(Mutex::new(Vec::new())))
    }
    fn events(&self) -> Vec<Typed<A::Event>> {
        self.0.lock().unwrap().clone()
    }
}

#[async_trait::async_trait]
impl<A: Aggregate> Subscriber<A> for Seen<A> {
    async fn on(&self, _tx: &mut Tx, event: &Typed<A::Event>) -> Result<(), HandlerError> {
        self.0.lock().unwrap().push(event.clone());
        Ok(())
    }
}

/// Stores an event as an older (or broken) version of Ferry could have.
#[allow(clippy::too_many_arguments)]
async fn insert(
    db: &Database,
    aggregate_type: &str,
    id: &str,
    sequence: i64,
    event_type: &str,
    event_version: &str,
    payload: Value,
) {
    let sql = db.sql(
        "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    );
    let metadata = json!({"tenantId": "a", "correlationId": "c-1"});
    crate::on_pool!(db, pool => sqlx::query(&sql)
        .bind(aggregate_type).bind(id).bind(sequence).bind(event_type).bind(event_version)
        .bind(sqlx::types::Json(payload)).bind(sqlx::types::Json(metadata))
        .execute(pool).await.unwrap().rows_affected());
}

/// A stored event held in memory, for decoding without a database.
fn stored(
    aggregate_type: &str,
    event_type: &str,
    event_version: &str,
    payload: Value,
) -> StoredEvent {
    StoredEvent {
        position: Position {
            transaction_id: 0,
            global_position: 7,
        },
        event_id: Uuid::new_v4(),
        aggregate_type: aggregate_type.to_string(),
        aggregate_id: "x-1".to_string(),
        sequence: 1,
        event_type: event_type.to_string(),
        event_version: event_version.to_string(),
        payload: (&payload).into(),
        metadata: StoredMetadata::from_value(&json!({"tenantId": "a"})),
        recorded_at: Utc::now(),
    }
}

fn cancelled() -> Value {
    json!({"ProvisioningCancelled": {"cancelledBy": "bob", "cancelledAt": "2026-12-02T10:00:00Z"}})
}

crate::test_on_both_engines! {
    async fn an_old_version_is_upcast_for_the_repository_and_for_subscribers(backend) {
        let t = TestDatabase::new(backend).await;
        insert(&t.db, "Tally", "t-1", 1, "Counted", "1.0", json!({"Counted": {"tenant": "a", "n": 3}})).await;
        insert(&t.db, "Tally", "t-1", 2, "Counted", "2.0", json!({"Counted": {"tenant": "a", "by": 4}})).await;

        // The repository's event store reads through the upcaster...
        let tallies: Repository<Tally> = Repository::new(t.db.clone(), ());
        let a = TenantId::parse("a").unwrap();
        let (tally, sequence) = tallies.load(&a, "t-1").await.unwrap().unwrap();
        assert_eq!((tally.total, sequence), (7, 2));

        // ...and so does a subscriber of the global stream.
        let seen = Seen::<Tally>::new();
        let subscription = Subscription::new("tallies").on::<Tally>(seen.clone());
        eventually("both tally events", || async {
            stream::catch_up(&t.db, &subscription).await.unwrap();
            (seen.events().len() == 2).then_some(())
        })
        .await;
        let events = seen.events();
        let counted = |by| TallyEvent::Counted { tenant: a.clone(), by };
        assert_eq!(events[0].event, counted(3));
        assert_eq!(events[1].event, counted(4));
        assert_eq!((events[0].sequence, events[1].sequence), (1, 2));
        assert_eq!(events[0].aggregate_id, "t-1");
        assert_eq!(events[0].tenant_id(), Some("a"));
        assert_eq!(events[0].metadata.correlation_id(), Some("c-1"));
        assert!(events[0].position < events[1].position);
        t.cleanup().await;
    }
}

crate::test_on_both_engines! {
    async fn an_event_that_does_not_decode_stops_the_subscription_at_it(backend) {
        let t = TestDatabase::new(backend).await;
        // A process registers every context's aggregates at start; here, environments.
        register::<Environment>();
        // Another aggregate's event (not decoded, however odd), then a run whose request is
        // not one: the subscription passes over the first and stops at the second.
        insert(&t.db, "Environment", "e-1", 1, "EnvironmentRegistered", "1.0", json!({"odd": true})).await;
        insert(&t.db, "ProvisioningRun", "r-1", 1, "ProvisioningRequested", "1.0",
            json!({"ProvisioningRequested": {"not": "a request"}})).await;
        let seen = Seen::<ProvisioningRun>::new();
        let subscription = Subscription::new("runs-only").on::<ProvisioningRun>(seen.clone());
        let error = eventually("the decode error", || async {
            stream::catch_up(&t.db, &subscription).await.err()
        })
        .await;
        let HandlerError::AtEvent { position, source, .. } = &error else {
            panic!("not tied to the event: {error:?}")
        };
        assert!(
            matches!(source.as_ref(), HandlerError::Decode(DecodeError::Payload { event, .. })
                if event.aggregate_id == "r-1" && event.event_type == "ProvisioningRequested"),
            "{error:?}"
        );
        assert_eq!(position.global_position, 2);
        assert!(error.to_string().contains("r-1"), "{error}");
        // Nothing was skipped: the checkpoint is before the run's event (it may have passed
        // the environment's, if a concurrent transaction elsewhere in the cluster held the
        // run's back from the first read), and it fails again.
        let status = stream::subscription_status(&t.db).await.unwrap();
        assert!(status.iter().all(|s| s.position.global_position < 2), "{status:?}");
        assert!(stream::catch_up(&t.db, &subscription).await.is_err());
        assert!(seen.events().is_empty());
        t.cleanup().await;
    }
}

crate::test_on_both_engines! {
    async fn the_first_event_of_an_aggregate_is_read_typed(backend) {
        let t = TestDatabase::new(backend).await;
        insert(&t.db, "ProvisioningRun", "r-1", 1, "ProvisioningCancelled", "1.0", cancelled()).await;
        let first = first_event::<ProvisioningRun>(&t.db, "r-1").await.unwrap().unwrap();
        assert!(matches!(first.event, RunEvent::ProvisioningCancelled { .. }));
        assert_eq!(first.sequence, 1);
        assert!(first_event::<ProvisioningRun>(&t.db, "r-2").await.unwrap().is_none());
        // Another aggregate's events are not the run's.
        assert!(first_event::<Environment>(&t.db, "r-1").await.unwrap().is_none());

        let mut tx = Tx::begin(&t.db).await.unwrap();
        let first = tx.first_event::<ProvisioningRun>("r-1").await.unwrap().unwrap();
        assert_eq!(first.aggregate_id, "r-1");
        tx.commit().await.unwrap();

        insert(&t.db, "ProvisioningRun", "r-3", 1, "ProvisioningRequested", "1.0", json!({"ProvisioningRequested": {}})).await;
        assert!(matches!(
            first_event::<ProvisioningRun>(&t.db, "r-3").await,
            Err(ReadError::Decode(DecodeError::Payload { .. }))
        ));
        t.cleanup().await;
    }
}

#[test]
fn decoding_checks_the_stored_type_and_version() {
    let ok = decode::<ProvisioningRun>(&stored(
        "ProvisioningRun",
        "ProvisioningCancelled",
        "1.0",
        cancelled(),
    ))
    .unwrap();
    assert!(matches!(ok.event, RunEvent::ProvisioningCancelled { .. }));
    assert_eq!(ok.position.global_position, 7);
    // `1.0.0` is `1.0`.
    assert!(decode::<ProvisioningRun>(&stored(
        "ProvisioningRun",
        "ProvisioningCancelled",
        "1.0.0",
        cancelled()
    ))
    .is_ok());
    // An older version that no upcaster brings to the current one.
    let old = decode::<ProvisioningRun>(&stored(
        "ProvisioningRun",
        "ProvisioningCancelled",
        "0.9",
        cancelled(),
    ));
    assert!(
        matches!(&old, Err(DecodeError::Version { decoded_version, .. }) if decoded_version == "1.0"),
        "{old:?}"
    );
    // A payload stored under another type's name.
    let renamed = decode::<ProvisioningRun>(&stored(
        "ProvisioningRun",
        "ProvisioningFailed",
        "1.0",
        cancelled(),
    ));
    assert!(
        matches!(&renamed, Err(DecodeError::Version { decoded_type, .. }) if decoded_type == "ProvisioningCancelled"),
        "{renamed:?}"
    );
    // The upcaster applies to older versions only.
    let tally = |version, payload| decode::<Tally>(&stored("Tally", "Counted", version, payload));
    let tenant = TenantId::parse("a").unwrap();
    assert_eq!(
        tally("1.0", json!({"Counted": {"tenant": "a", "n": 2}}))
            .unwrap()
            .event,
        TallyEvent::Counted { tenant, by: 2 }
    );
    assert!(matches!(
        tally("2.0", json!({"Counted": {"tenant": "a", "n": 2}})),
        Err(DecodeError::Payload { .. })
    ));
}

#[test]
fn a_decoder_reads_the_aggregates_it_declares() {
    #[derive(Debug)]
    enum Decoded {
        Run(Typed<RunEvent>),
        Tally(Typed<TallyEvent>),
    }
    let decoder = Decoder::new()
        .on::<ProvisioningRun>(Decoded::Run)
        .on::<Tally>(Decoded::Tally);
    assert!(decoder.declares("Tally") && !decoder.declares("Environment"));
    let run = decoder.decode(&stored(
        "ProvisioningRun",
        "ProvisioningCancelled",
        "1.0",
        cancelled(),
    ));
    assert!(
        matches!(&run, Ok(Some(Decoded::Run(r))) if r.aggregate_id == "x-1"),
        "{run:?}"
    );
    let tally = decoder.decode(&stored(
        "Tally",
        "Counted",
        "1.0",
        json!({"Counted": {"tenant": "a", "n": 1}}),
    ));
    assert!(
        matches!(&tally, Ok(Some(Decoded::Tally(t))) if t.sequence == 1),
        "{tally:?}"
    );
    let other = decoder.decode(&stored(
        "Environment",
        "EnvironmentRegistered",
        "1.0",
        json!({}),
    ));
    assert!(matches!(other, Ok(None)), "{other:?}");
    let broken = decoder.decode(&stored(
        "ProvisioningRun",
        "ProvisioningCancelled",
        "1.0",
        json!({}),
    ));
    assert!(
        matches!(broken, Err(DecodeError::Payload { .. })),
        "{broken:?}"
    );
}

#[tokio::test]
async fn a_subscription_passes_over_other_aggregates_and_stops_at_unknown_ones() {
    let t = TestDatabase::new(Backend::Sqlite).await;
    // A process registers every context's aggregates at start; here, environments.
    register::<Environment>();
    let seen = Seen::<ProvisioningRun>::new();
    let subscription = Subscription::new("runs").on::<ProvisioningRun>(seen.clone());
    assert!(subscription.declares("ProvisioningRun") && !subscription.declares("Environment"));
    let mut tx = Tx::begin(&t.db).await.unwrap();
    let run = stored(
        "ProvisioningRun",
        "ProvisioningCancelled",
        "1.0",
        cancelled(),
    );
    subscription.handle(&mut tx, &run).await.unwrap();
    assert_eq!(seen.events().len(), 1);
    assert_eq!(seen.events()[0].event_id, run.event_id);
    // Known aggregates it did not declare are not its business, whatever they hold.
    let environment = stored("Environment", "Whatever", "9.9", json!(null));
    subscription.handle(&mut tx, &environment).await.unwrap();
    // An aggregate no part of Ferry knows: nobody can tell whether it mattered.
    let unknown = stored("Promotion", "PromotionGateEvaluated", "1.0", json!({}));
    let error = subscription.handle(&mut tx, &unknown).await.unwrap_err();
    assert!(
        matches!(&error, HandlerError::Decode(DecodeError::UnknownAggregate { event }) if event.aggregate_type == "Promotion"),
        "{error:?}"
    );
    // A declared aggregate's event that does not decode.
    let broken = stored(
        "ProvisioningRun",
        "ProvisioningCancelled",
        "1.0",
        json!({"ProvisioningCancelled": 1}),
    );
    let error = subscription.handle(&mut tx, &broken).await.unwrap_err();
    assert!(
        matches!(error, HandlerError::Decode(DecodeError::Payload { .. })),
        "{error:?}"
    );
    assert_eq!(seen.events().len(), 1);
    tx.commit().await.unwrap();
    t.cleanup().await;
}

#[test]
fn an_aggregate_is_known_once_registered_and_not_before() {
    assert!(!is_known("NeverRegistered"));
    register::<Tally>();
    assert!(is_known("Tally"));
    assert!(known_aggregates().contains(&"Tally"));
}

/// Each call a subscriber got: the aggregate and how many events it held.
#[derive(Default)]
struct Calls(Mutex<Vec<String>>);

#[async_trait::async_trait]
impl<A: StoredAggregate> Subscriber<A> for Calls {
    async fn on(&self, _tx: &mut Tx, _event: &Typed<A::Event>) -> Result<(), HandlerError> {
        self.0.lock().unwrap().push(format!("{} x1", A::TYPE));
        Ok(())
    }
    async fn on_batch(&self, _tx: &mut Tx, events: &[Typed<A::Event>]) -> Result<(), HandlerError> {
        let call = format!("{} x{}", A::TYPE, events.len());
        self.0.lock().unwrap().push(call);
        Ok(())
    }
}

#[tokio::test]
async fn a_batch_goes_to_subscribers_in_runs_of_one_aggregate_and_keeps_the_stream_order() {
    let t = TestDatabase::new(Backend::Sqlite).await;
    register::<Environment>();
    let tally = |by| {
        stored(
            "Tally",
            "Counted",
            "2.0",
            json!({"Counted": {"tenant": "a", "by": by}}),
        )
    };
    let run = || {
        stored(
            "ProvisioningRun",
            "ProvisioningCancelled",
            "1.0",
            cancelled(),
        )
    };
    let other = stored("Environment", "Whatever", "9.9", json!(null));
    let batch = vec![tally(1), tally(2), other, run(), tally(3), run(), run()];

    let calls = Arc::new(Calls::default());
    let ordered = Subscription::new("ordered")
        .on::<Tally>(calls.clone())
        .on::<ProvisioningRun>(calls.clone());
    let mut tx = Tx::begin(&t.db).await.unwrap();
    ordered.handle_batch(&mut tx, &batch).await.unwrap();
    // Another aggregate's event between two of Tally's does not split them.
    assert_eq!(
        *calls.0.lock().unwrap(),
        [
            "Tally x2",
            "ProvisioningRun x1",
            "Tally x1",
            "ProvisioningRun x2"
        ]
    );

    // Grouped: one call per aggregate, in the order `on` declared them.
    let calls = Arc::new(Calls::default());
    let grouped = Subscription::new("grouped")
        .on::<ProvisioningRun>(calls.clone())
        .on::<Tally>(calls.clone())
        .by_aggregate();
    grouped.handle_batch(&mut tx, &batch).await.unwrap();
    assert_eq!(*calls.0.lock().unwrap(), ["ProvisioningRun x3", "Tally x3"]);

    // An event that does not decode is named, in either way through a batch.
    let broken = stored(
        "ProvisioningRun",
        "ProvisioningCancelled",
        "1.0",
        json!({"ProvisioningCancelled": 1}),
    );
    let batch = vec![tally(1), broken.clone()];
    for subscription in [&ordered, &grouped] {
        let error = subscription
            .handle_batch(&mut tx, &batch)
            .await
            .unwrap_err();
        assert!(
            matches!(&error, HandlerError::AtEvent { event_id, source, .. }
                if *event_id == broken.event_id && matches!(**source, HandlerError::Decode(_))),
            "{error:?}"
        );
    }
    tx.commit().await.unwrap();
    t.cleanup().await;
}
