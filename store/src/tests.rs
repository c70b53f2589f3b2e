//! Store tests on both engines: commands, tenants, conflicts, the global stream and
//! idempotency keys. Postgres tests use `DATABASE_URL` (or the local default).

use crate::database::{Backend, Pool};
use crate::idempotency::{self, KeyState};
use crate::metadata::EventMetadata;
use crate::repository::{CommandError, Read, Repository};
use crate::stream::{self, Handler, HandlerError, Position, StoredEvent, Tx};
use crate::testing::{eventually, TestDatabase};
use chrono::Utc;
use ferry_domain::run::{ProvisioningRun, RunCommand, RunError, RunRequest};
use ferry_domain::specification::DeploymentSpecification;
use ferry_domain::*;
use std::sync::Mutex;
use uuid::Uuid;

fn tenant(name: &str) -> TenantId {
    TenantId::parse(name).unwrap()
}

fn meta(t: &str) -> EventMetadata {
    EventMetadata::for_request(tenant(t), Actor::parse("alice").unwrap(), Uuid::new_v4())
}

fn request(t: &str, id: ProvisioningRunId) -> RunCommand {
    RunCommand::Request(Box::new(RunRequest {
        provisioning_run_id: id,
        tenant_id: tenant(t),
        project_id: ProjectId::parse("payments").unwrap(),
        environment_id: EnvironmentId::parse("dev").unwrap(),
        environment_class: None,
        specification_id: SpecificationId::new_random(),
        specification_version: 1,
        kind: ProvisioningKind::Release,
        promotion_id: None,
        approval_id: None,
        follows_failed_apply: None,
        requested_by: Actor::parse("alice").unwrap(),
        requested_at: Utc::now(),
    }))
}

fn cancel() -> RunCommand {
    RunCommand::Cancel {
        cancelled_by: Actor::parse("bob").unwrap(),
        reason: None,
        at: Utc::now(),
    }
}

crate::test_on_both_engines! {
    async fn commands_are_stored_and_scoped_to_their_tenant(backend) {
        let t = TestDatabase::new(backend).await;
        let runs: Repository<ProvisioningRun> = Repository::new(t.db.clone(), ());
        let id = ProvisioningRunId::new_random();
        let key = id.to_string();
        let done = runs
            .execute(&tenant("a"), &key, request("a", id), &meta("a"), true)
            .await
            .unwrap();
        assert_eq!(done.sequence, 1);
        assert_eq!(done.aggregate.state(), Some(ProvisioningState::Requested));

        // Tenant b sees nothing and changes nothing.
        assert!(runs.load(&tenant("b"), &key).await.unwrap().is_none());
        let err = runs
            .execute(&tenant("b"), &key, cancel(), &meta("b"), false)
            .await
            .unwrap_err();
        assert!(
            matches!(err, CommandError::NotFound),
            "{backend:?}: {err:?}"
        );

        // A command on a missing run is NotFound, not a new aggregate.
        let err = runs
            .execute(&tenant("a"), "nope", cancel(), &meta("a"), false)
            .await
            .unwrap_err();
        assert!(matches!(err, CommandError::NotFound));

        let done = runs
            .execute(&tenant("a"), &key, cancel(), &meta("a"), false)
            .await
            .unwrap();
        assert_eq!(done.sequence, 2);
        let err = runs
            .execute(&tenant("a"), &key, cancel(), &meta("a"), false)
            .await
            .unwrap_err();
        assert!(matches!(
            err,
            CommandError::Domain(RunError::InvalidTransition { .. })
        ));
        let (run, seq) = runs.load(&tenant("a"), &key).await.unwrap().unwrap();
        assert_eq!((run.state(), seq), (Some(ProvisioningState::Cancelled), 2));

        // Metadata and the stream columns are stored with each event.
        let events = eventually("two events", || async {
            let e = stream::read_after(&t.db, Position::default(), 10)
                .await
                .unwrap();
            (e.len() == 2).then_some(e)
        })
        .await;
        assert_eq!(events[0].tenant_id(), Some("a"));
        assert_eq!(events[0].metadata.actor(), Some("alice"));
        assert_ne!(events[0].event_id, events[1].event_id);
        assert_eq!(events[1].event_type, "ProvisioningCancelled");
        t.cleanup().await;
    }
}

crate::test_on_both_engines! {
    async fn a_concurrent_write_is_a_conflict(backend) {
        let t = TestDatabase::new(backend).await;
        let id = Uuid::new_v4().to_string();
        // Two events claiming the same aggregate sequence: the second is refused.
        let insert = t.db.sql(
            "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata)
             VALUES ('ProvisioningRun', $1, 1, 'X', '1.0', $2, $2)",
        );
        let json = sqlx::types::Json(serde_json::json!({}));
        crate::on_pool!(t.db, pool => sqlx::query(&insert).bind(&id).bind(&json).execute(pool).await.unwrap().rows_affected());
        let err = crate::on_pool!(t.db, pool => sqlx::query(&insert).bind(&id).bind(&json).execute(pool).await.map(|r| r.rows_affected())).unwrap_err();
        let mapped: CommandError<RunError> =
            cqrs_es::AggregateError::<RunError>::UnexpectedError(Box::new(err)).into();
        assert!(matches!(mapped, CommandError::Conflict), "{backend:?}");

        // Through the repository: two requests racing on one run id end with one event.
        let runs: Repository<ProvisioningRun> = Repository::new(t.db.clone(), ());
        let run_id = ProvisioningRunId::new_random();
        let key = run_id.to_string();
        let (ta, ma1, ma2) = (tenant("a"), meta("a"), meta("a"));
        let (a, b) = tokio::join!(
            runs.execute(&ta, &key, request("a", run_id), &ma1, true),
            runs.execute(&ta, &key, request("a", run_id), &ma2, true),
        );
        let ok = [a.is_ok(), b.is_ok()].iter().filter(|x| **x).count();
        assert_eq!(ok, 1, "{backend:?}: exactly one request wins");
        for r in [a, b] {
            if let Err(e) = r {
                assert!(
                    matches!(
                        e,
                        CommandError::Conflict | CommandError::Domain(RunError::AlreadyRequested)
                    ),
                    "{e:?}"
                );
            }
        }
        t.cleanup().await;
    }
}

fn declaration(t: &str, commit: &str) -> Box<specification::Declaration> {
    let environment = EnvironmentId::parse("payments-dev").unwrap();
    Box::new(specification::Declaration {
        specification_id: SpecificationId::for_environment(
            &tenant(t),
            &environment,
            SpecificationKind::Environment,
        ),
        tenant_id: tenant(t),
        project_id: ProjectId::parse("payments").unwrap(),
        environment_id: environment,
        kind: SpecificationKind::Environment,
        program_ref: ProgramRef::parse("/srv/infra#envs/dev").unwrap(),
        program_version: ProgramVersion::parse(commit).unwrap(),
        release_id: None,
        strategy: None,
        config_refs: RefMap::new(),
        secret_refs: RefMap::new(),
        declared_by: Actor::parse("alice").unwrap(),
        declared_at: Utc::now(),
    })
}

crate::test_on_both_engines! {
    async fn a_cached_aggregate_still_sees_what_another_instance_wrote(backend) {
        let t = TestDatabase::new(backend).await;
        // A second handle on the same pool has a cache of its own, as another process has.
        let elsewhere = crate::Database::from_pool(t.db.pool().clone());
        let here: Repository<DeploymentSpecification> = Repository::new(t.db.clone(), ());
        let there: Repository<DeploymentSpecification> = Repository::new(elsewhere.clone(), ());
        let id = declaration("a", "aaaaaaa").specification_id.to_string();
        let declare = |commit: &'static str| specification::SpecificationCommand::Declare(declaration("a", commit));
        let (a, m) = (tenant("a"), meta("a"));
        assert_eq!(here.execute(&a, &id, declare("aaaaaaa"), &m, true).await.unwrap().sequence, 1);
        assert_eq!(there.execute(&a, &id, declare("bbbbbbb"), &m, true).await.unwrap().sequence, 2);
        // `here` cached version 1; it must read version 2 before deciding on version 3.
        let done = here.execute(&a, &id, declare("ccccccc"), &m, true).await.unwrap();
        assert_eq!(done.sequence, 3, "{backend:?}");
        let versions: Vec<u32> = done.aggregate.versions().iter().map(|v| v.version).collect();
        assert_eq!(versions, [1, 2, 3]);
        let (loaded, sequence) = there.load(&a, &id).await.unwrap().unwrap();
        assert_eq!((loaded.latest().unwrap().version, sequence), (3, 3));
        assert!(here.load(&tenant("b"), &id).await.unwrap().is_none(), "still scoped to its tenant");

        // Runs with histories: the history is the cached one plus what was stored after it.
        let runs: Repository<ProvisioningRun> = Repository::with_history(t.db.clone(), ());
        let other_runs: Repository<ProvisioningRun> = Repository::new(elsewhere, ());
        let run_id = ProvisioningRunId::new_random();
        let key = run_id.to_string();
        let requested = runs.execute(&a, &key, request("a", run_id), &m, true).await.unwrap();
        assert_eq!(requested.history.as_ref().map(Vec::len), Some(1));
        assert!(other_runs.execute(&a, &key, cancel(), &m, false).await.unwrap().history.is_none());
        let (run, sequence) = runs.load(&a, &key).await.unwrap().unwrap();
        assert_eq!((run.state(), sequence), (Some(ProvisioningState::Cancelled), 2));
        // Cancelling again is the domain's refusal, decided on the current state, not a
        // conflict over a stale sequence.
        let again = runs.execute(&a, &key, cancel(), &m, false).await.unwrap_err();
        assert!(matches!(again, CommandError::Domain(_)), "{backend:?}: {again:?}");
        t.cleanup().await;
    }
}

crate::test_on_both_engines! {
    async fn a_cached_command_reads_only_the_events_after_the_cache(backend) {
        let t = TestDatabase::new(backend).await;
        let specs: Repository<DeploymentSpecification> = Repository::new(t.db.clone(), ());
        let id = declaration("a", "aaaaaaa").specification_id.to_string();
        let declare = |commit: &'static str| specification::SpecificationCommand::Declare(declaration("a", commit));
        let (a, m) = (tenant("a"), meta("a"));
        for commit in ["aaaaaaa", "bbbbbbb"] {
            specs.execute(&a, &id, declare(commit), &m, true).await.unwrap();
        }
        // Spoil the first stored event. Only a repository that reads the whole history again
        // can notice; the cached one reads the events after version 2, of which there are none.
        let spoil = t.db.sql("UPDATE events SET payload = $1 WHERE aggregate_id = $2 AND sequence = 1");
        let json = sqlx::types::Json(serde_json::json!({"spoiled": true}));
        crate::on_pool!(t.db, pool => sqlx::query(&spoil).bind(&json).bind(&id).execute(pool).await.unwrap().rows_affected());
        let done = specs.execute(&a, &id, declare("ccccccc"), &m, true).await.unwrap();
        assert_eq!(done.sequence, 3, "{backend:?}");
        for uncached in [
            crate::Database::from_pool(t.db.pool().clone()),
            t.db.clone().with_aggregate_cache(0),
        ] {
            let fresh: Repository<DeploymentSpecification> = Repository::new(uncached, ());
            let err = fresh.execute(&a, &id, declare("ddddddd"), &m, true).await.unwrap_err();
            assert!(matches!(err, CommandError::Store(_)), "{backend:?}: {err:?}");
        }
        t.cleanup().await;
    }
}

/// Runs `sql` on the held SQLite connection, or on the Postgres pool.
async fn rename_on(
    db: &crate::Database,
    held: Option<&mut sqlx::pool::PoolConnection<sqlx::Sqlite>>,
    sql: &str,
) {
    match (db.pool(), held) {
        (_, Some(conn)) => {
            sqlx::query(sql).execute(&mut **conn).await.unwrap();
        }
        (Pool::Postgres(pool), None) => {
            sqlx::query(sql).execute(pool).await.unwrap();
        }
        (Pool::Sqlite(_), None) => unreachable!("SQLite renames go through the held connection"),
    }
}

crate::test_on_both_engines! {
    async fn a_command_on_a_cached_aggregate_does_not_read_the_store(backend) {
        let t = TestDatabase::new(backend).await;
        let specs: Repository<DeploymentSpecification> = Repository::new(t.db.clone(), ());
        let elsewhere: Repository<DeploymentSpecification> =
            Repository::new(crate::Database::from_pool(t.db.pool().clone()), ());
        let id = declaration("a", "aaaaaaa").specification_id.to_string();
        let declare = |commit: &'static str| specification::SpecificationCommand::Declare(declaration("a", commit));
        let (a, m) = (tenant("a"), meta("a"));
        specs.execute(&a, &id, declare("aaaaaaa"), &m, true).await.unwrap();
        // Reading events now fails (a column every read selects is gone); appending does not
        // name it, so it still works.
        let hide = "ALTER TABLE events RENAME COLUMN recorded_at TO recorded_at_hidden";
        // Both renames go through one connection held by the test: each SQLite connection
        // keeps its own copy of the schema, and once (in CI) a pooled one that the second
        // rename drew still knew the column by its old name.
        let mut held = match t.db.pool() {
            Pool::Sqlite(pool) => Some(pool.acquire().await.unwrap()),
            Pool::Postgres(_) => None,
        };
        rename_on(&t.db, held.as_mut(), hide).await;
        // The cached aggregate: decided and appended without a read.
        let done = specs.execute(&a, &id, declare("bbbbbbb"), &m, true).await.unwrap();
        assert_eq!(done.sequence, 2, "{backend:?}");
        // A command creating a new aggregate needs no read either.
        let runs: Repository<ProvisioningRun> = Repository::with_history(t.db.clone(), ());
        let run_id = ProvisioningRunId::new_random();
        let created = runs.execute(&a, &run_id.to_string(), request("a", run_id), &m, true).await.unwrap();
        assert_eq!((created.sequence, created.history.as_ref().map(Vec::len)), (1, Some(1)));
        // Without the aggregate cached, the first append (as if new) is refused by the
        // stored sequence 1, and the command is decided on the store: which has to read.
        let err = elsewhere.execute(&a, &id, declare("ddddddd"), &m, true).await.unwrap_err();
        assert!(matches!(err, CommandError::Store(_)), "{backend:?}: {err:?}");
        // A refusal on the cached state is decided on the store as well: it reads.
        let err = specs
            .execute(&tenant("b"), &id, declare("eeeeeee"), &m, true)
            .await
            .unwrap_err();
        assert!(matches!(err, CommandError::Store(_)), "{backend:?}: {err:?}");
        let unhide = "ALTER TABLE events RENAME COLUMN recorded_at_hidden TO recorded_at";
        rename_on(&t.db, held.as_mut(), unhide).await;
        drop(held);
        // Nothing was half-written: two versions of the specification, the run requested.
        let (spec, sequence) = elsewhere.load(&a, &id).await.unwrap().unwrap();
        assert_eq!((spec.latest().unwrap().version, sequence), (2, 2));
        assert_eq!(runs.load(&a, &run_id.to_string()).await.unwrap().unwrap().1, 1);
        t.cleanup().await;
    }
}

crate::test_on_both_engines! {
    async fn a_command_decided_on_a_basis_that_moved_stores_nothing(backend) {
        let t = TestDatabase::new(backend).await;
        // A second handle on the same pool has a cache of its own, as another process has.
        let elsewhere = crate::Database::from_pool(t.db.pool().clone());
        let specs: Repository<DeploymentSpecification> = Repository::new(t.db.clone(), ());
        let there: Repository<DeploymentSpecification> = Repository::new(elsewhere, ());
        let runs: Repository<ProvisioningRun> = Repository::with_history(t.db.clone(), ());
        let id = declaration("a", "aaaaaaa").specification_id.to_string();
        let declare = |commit: &'static str| specification::SpecificationCommand::Declare(declaration("a", commit));
        let (a, m) = (tenant("a"), meta("a"));
        specs.execute(&a, &id, declare("aaaaaaa"), &m, true).await.unwrap();
        there.execute(&a, &id, declare("bbbbbbb"), &m, true).await.unwrap();
        // The cached specification is version 1, without a read; the store holds version 2.
        let (cached, basis) = specs.load_basis(&a, &id, Read::Cached).await.unwrap();
        assert_eq!((cached.unwrap().latest().unwrap().version, basis.sequence()), (1, 1));
        let run_id = ProvisioningRunId::new_random();
        let key = run_id.to_string();
        let err = runs
            .execute_on(&a, &key, request("a", run_id), &m, true, std::slice::from_ref(&basis))
            .await
            .unwrap_err();
        assert!(matches!(err, CommandError::Moved), "{backend:?}: {err:?}");
        assert!(runs.load(&a, &key).await.unwrap().is_none(), "nothing of it stored");
        // Decided again on the stored state, it goes through.
        let (stored, basis) = specs.load_basis(&a, &id, Read::Stored).await.unwrap();
        assert_eq!((stored.unwrap().latest().unwrap().version, basis.sequence()), (2, 2));
        let done = runs
            .execute_on(&a, &key, request("a", run_id), &m, true, std::slice::from_ref(&basis))
            .await
            .unwrap();
        assert_eq!(done.sequence, 1);
        // Another tenant's aggregate is no basis to decide on: none, at its sequence.
        let (theirs, basis) = specs.load_basis(&tenant("b"), &id, Read::Cached).await.unwrap();
        assert!(theirs.is_none());
        assert_eq!(basis.sequence(), 2);
        // A basis on an aggregate with nothing stored is at sequence 0, and moves with its
        // first event.
        let missing = declaration("c", "aaaaaaa").specification_id.to_string();
        let (none, basis) = specs.load_basis(&tenant("c"), &missing, Read::Cached).await.unwrap();
        assert!(none.is_none());
        assert_eq!(basis.sequence(), 0);
        there
            .execute(&tenant("c"), &missing, specification::SpecificationCommand::Declare(declaration("c", "aaaaaaa")), &meta("c"), true)
            .await
            .unwrap();
        let other_run = ProvisioningRunId::new_random();
        let err = runs
            .execute_on(&tenant("c"), &other_run.to_string(), request("c", other_run), &meta("c"), true, &[basis])
            .await
            .unwrap_err();
        assert!(matches!(err, CommandError::Moved), "{backend:?}: {err:?}");
        // More bases than an append checks is refused before anything is stored.
        let many: Vec<_> = (0..=crate::group::BASIS_SLOTS as i64)
            .map(|n| crate::Basis::new("DeploymentSpecification", format!("s-{n}"), 0))
            .collect();
        let err = runs
            .execute_on(&tenant("c"), &other_run.to_string(), request("c", other_run), &meta("c"), true, &many)
            .await
            .unwrap_err();
        assert!(matches!(err, CommandError::Store(_)), "{backend:?}: {err:?}");
        assert!(runs.load(&tenant("c"), &other_run.to_string()).await.unwrap().is_none());
        t.cleanup().await;
    }
}

struct Recorder {
    name: String,
    seen: Mutex<Vec<StoredEvent>>,
}

#[async_trait::async_trait]
impl Handler for Recorder {
    fn name(&self) -> &str {
        &self.name
    }
    async fn handle(&self, _tx: &mut Tx, event: &StoredEvent) -> Result<(), HandlerError> {
        self.seen.lock().unwrap().push(event.clone());
        Ok(())
    }
}

/// The transaction that inserted first commits last: a reader that ran in between must
/// still see its event afterwards. Two connections, real Postgres.
#[tokio::test]
async fn a_slow_earlier_transaction_is_not_skipped() {
    let t = TestDatabase::new(Backend::Postgres).await;
    let Pool::Postgres(pool) = t.db.pool().clone() else {
        unreachable!()
    };
    let insert = "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata)
                  VALUES ('T', $1, 1, 'E', '1.0', '{}', '{}') RETURNING global_position";
    let mut slow = pool.begin().await.unwrap();
    let slow_pos: i64 = sqlx::query_scalar(insert)
        .bind("slow")
        .fetch_one(&mut *slow)
        .await
        .unwrap();
    let mut fast = pool.begin().await.unwrap();
    let fast_pos: i64 = sqlx::query_scalar(insert)
        .bind("fast")
        .fetch_one(&mut *fast)
        .await
        .unwrap();
    assert!(slow_pos < fast_pos);
    fast.commit().await.unwrap();

    let recorder = Recorder {
        name: "test".to_string(),
        seen: Mutex::new(vec![]),
    };
    // While the slow transaction runs, the fast event (a later position) is held back.
    assert_eq!(stream::catch_up(&t.db, &recorder).await.unwrap(), 0);
    slow.commit().await.unwrap();
    // Other tests' transactions on the server may hold the horizon a moment longer.
    eventually("both events", || async {
        stream::catch_up(&t.db, &recorder).await.unwrap();
        (recorder.seen.lock().unwrap().len() == 2).then_some(())
    })
    .await;
    let ids: Vec<String> = recorder
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|e| e.aggregate_id.clone())
        .collect();
    assert_eq!(ids, ["slow", "fast"]);
    assert_eq!(stream::catch_up(&t.db, &recorder).await.unwrap(), 0);
    let status = stream::subscription_status(&t.db).await.unwrap();
    assert_eq!(status[0].lag, 0);
    assert_eq!(status[0].head, fast_pos);
    t.cleanup().await;
}

crate::test_on_both_engines! {
    async fn a_subscription_resumes_from_its_checkpoint(backend) {
        let t = TestDatabase::new(backend).await;
        let runs: Repository<ProvisioningRun> = Repository::new(t.db.clone(), ());
        record_runs(&runs, 3).await;
        let first = Recorder {
            name: "s".to_string(),
            seen: Mutex::new(vec![]),
        };
        eventually("three events", || async {
            stream::catch_up(&t.db, &first).await.unwrap();
            (first.seen.lock().unwrap().len() == 3).then_some(())
        })
        .await;
        assert_eq!(first.seen.lock().unwrap().len(), 3);
        let id = record_runs(&runs, 1).await.remove(0);
        // A new runner of the same subscription only gets what is new.
        let second = Recorder {
            name: "s".to_string(),
            seen: Mutex::new(vec![]),
        };
        eventually("the new event", || async {
            stream::catch_up(&t.db, &second).await.unwrap();
            (!second.seen.lock().unwrap().is_empty()).then_some(())
        })
        .await;
        assert_eq!(second.seen.lock().unwrap().len(), 1, "{backend:?}");
        assert_eq!(second.seen.lock().unwrap()[0].aggregate_id, id);
        let status = stream::subscription_status(&t.db).await.unwrap();
        assert_eq!(
            (status[0].lag, status[0].head),
            (0, status[0].position.global_position)
        );
        t.cleanup().await;
    }
}

crate::test_on_both_engines! {
    async fn a_lag_past_what_is_counted_is_estimated_from_the_positions(backend) {
        let t = TestDatabase::new(backend).await;
        let runs: Repository<ProvisioningRun> = Repository::new(t.db.clone(), ());
        // The subscription's row exists at the beginning; five events come after it.
        let lagging = Recorder {
            name: "lagging".to_string(),
            seen: Mutex::new(vec![]),
        };
        stream::catch_up(&t.db, &lagging).await.unwrap();
        record_runs(&runs, 5).await;
        let status = |counted| {
            let db = t.db.clone();
            async move {
                let all = stream::subscription_status_counting(&db, counted).await.unwrap();
                let s = all.into_iter().find(|s| s.name == "lagging").unwrap();
                (s.lag, s.lag_estimated, s.head)
            }
        };
        let (lag, estimated, head) = status(10).await;
        assert_eq!((lag, estimated), (5, false), "{backend:?}");
        // Counting stops at three: the rest is the distance to the head, never less than
        // what was counted.
        let (lag, estimated, _) = status(3).await;
        assert!(estimated, "{backend:?}");
        assert_eq!(lag, head.max(3), "{backend:?}");
        assert!(lag >= 5, "{backend:?}: {lag}");
        // Caught up, nothing is estimated.
        eventually("the five events", || async {
            stream::catch_up(&t.db, &lagging).await.unwrap();
            (lagging.seen.lock().unwrap().len() == 5).then_some(())
        })
        .await;
        assert_eq!(status(3).await, (0, false, head), "{backend:?}");
        t.cleanup().await;
    }
}

crate::test_on_both_engines! {
    async fn idempotency_keys_replay_or_refuse(backend) {
        let t = TestDatabase::new(backend).await;
        let db = &t.db;
        assert_eq!(
            idempotency::reserve(db, "a", "k1", "op", "h1", "r1", "req-1")
                .await
                .unwrap(),
            KeyState::Fresh
        );
        assert_eq!(
            idempotency::reserve(db, "a", "k1", "op", "h1", "r1", "req-1")
                .await
                .unwrap(),
            KeyState::Replay {
                resource_id: "r1".to_string(),
                response: None
            }
        );
        let body = serde_json::json!({"state": "Requested"});
        idempotency::record_response(db, "a", "k1", 201, &body)
            .await
            .unwrap();
        assert_eq!(
            idempotency::reserve(db, "a", "k1", "op", "h1", "r1", "req-1")
                .await
                .unwrap(),
            KeyState::Replay {
                resource_id: "r1".to_string(),
                response: Some((201, body))
            }
        );
        assert_eq!(
            idempotency::reserve(db, "a", "k1", "op", "h2", "r1", "req-3")
                .await
                .unwrap(),
            KeyState::Mismatch
        );
        // Keys are per tenant.
        assert_eq!(
            idempotency::reserve(db, "b", "k1", "op", "h2", "r2", "req-4")
                .await
                .unwrap(),
            KeyState::Fresh
        );
        t.cleanup().await;
    }
}

crate::test_on_both_engines! {
    async fn an_idempotency_reservation_belongs_to_the_request_that_made_it(backend) {
        let t = TestDatabase::new(backend).await;
        let db = &t.db;
        let reserve = |owner: &'static str, hash: &'static str| async move {
            idempotency::reserve(db, "a", "k", "PlanProvisioning", hash, "run-1", owner)
                .await
                .unwrap()
        };
        assert_eq!(reserve("first", "h1").await, KeyState::Fresh);
        // A concurrent retry of the same body sees the reservation, fails, and cleans up:
        // its clean-up must not free the first request's key.
        assert!(matches!(
            reserve("second", "h1").await,
            KeyState::Replay { response: None, .. }
        ));
        idempotency::release(db, "a", "k", "second").await.unwrap();
        assert_eq!(
            reserve("third", "h2").await,
            KeyState::Mismatch,
            "another body with the key is refused while the first request holds it"
        );
        // The owner may give it back after its own failure.
        idempotency::release(db, "a", "k", "first").await.unwrap();
        assert_eq!(reserve("fourth", "h2").await, KeyState::Fresh);
        t.cleanup().await;
    }
}

/// Two writers inserting the same keys in opposite orders deadlock; Postgres rolls one
/// back, and that one's error is a conflict to retry (nothing of it was stored), as the
/// group commit treats it.
#[tokio::test]
async fn a_deadlock_between_writers_is_a_conflict_to_retry() {
    let t = TestDatabase::new(Backend::Postgres).await;
    let Pool::Postgres(pool) = t.db.pool().clone() else {
        unreachable!()
    };
    let insert = "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata) \
                  VALUES ('T', $1, 1, 'E', '1', '{}', '{}')";
    let (mut first, mut second) = (pool.begin().await.unwrap(), pool.begin().await.unwrap());
    // The second waits long before it looks for a deadlock: the first is the one rolled back.
    sqlx::query("SET LOCAL deadlock_timeout = '20s'")
        .execute(&mut *second)
        .await
        .unwrap();
    sqlx::query(insert)
        .bind("a")
        .execute(&mut *first)
        .await
        .unwrap();
    sqlx::query(insert)
        .bind("b")
        .execute(&mut *second)
        .await
        .unwrap();
    let waiting = tokio::spawn(async move {
        let result = sqlx::query(insert).bind("a").execute(&mut *second).await;
        (result.map(|_| ()), second)
    });
    let error = sqlx::query(insert)
        .bind("b")
        .execute(&mut *first)
        .await
        .unwrap_err();
    assert!(
        crate::database::is_rolled_back_for_another(&error),
        "{error:?}"
    );
    let classified: CommandError<RunError> = CommandError::from_sql(error);
    assert!(
        matches!(classified, CommandError::Conflict),
        "{classified:?}"
    );
    drop(first);
    let (result, second) = waiting.await.unwrap();
    result.unwrap();
    second.commit().await.unwrap();
    t.cleanup().await;
}

/// A connection handed back to the pool inside a transaction (what a future cancelled in
/// sqlx's `begin_with` leaves behind) is closed, not reused: the write lock it held is
/// released at once and the next transaction on the pool begins normally.
#[tokio::test]
async fn a_connection_returned_inside_a_transaction_is_not_reused() {
    use sqlx::Connection;
    let dir = tempfile::tempdir().unwrap();
    let options = crate::database::StoreOptions {
        sqlite_busy_timeout: std::time::Duration::from_millis(500),
        ..Default::default()
    };
    let db = crate::Database::open_sqlite_file_with(&dir.path().join("ferry.db"), &options)
        .await
        .unwrap();
    let Pool::Sqlite(pool) = db.pool() else {
        unreachable!()
    };
    sqlx::query("CREATE TABLE t (x integer)")
        .execute(pool)
        .await
        .unwrap();
    for _ in 0..3 {
        let mut conn = pool.acquire().await.unwrap();
        let tx = conn.begin_with("BEGIN IMMEDIATE").await.unwrap();
        // The state a cancelled begin leaves: a transaction with no guard to end it.
        std::mem::forget(tx);
        drop(conn);
        let mut tx = Tx::begin(&db).await.expect("the write lock was released");
        tx.execute("INSERT INTO t (x) VALUES (1)", &[])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM t")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(n, 3);
}

/// A subscription's batch read walks the stream-order index from its checkpoint: it never
/// sorts the table (which, at a million events, took seconds per batch).
#[tokio::test]
async fn the_batch_read_walks_the_stream_order_index() {
    let t = TestDatabase::new(Backend::Postgres).await;
    let Pool::Postgres(pool) = t.db.pool().clone() else {
        unreachable!()
    };
    let mut tx = pool.begin().await.unwrap();
    // The table is small: the plan is to be the one a large table gets (no sort).
    crate::testing::plan_as_for_large_tables(&mut tx).await;
    let (plan,): (serde_json::Value,) = sqlx::query_as(&format!(
        "EXPLAIN (FORMAT JSON) {}",
        crate::stream::PG_BATCH
    ))
    .bind("0")
    .bind(0i64)
    .bind(256i64)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    let plan = plan.to_string();
    assert!(plan.contains("events_stream_order"), "{plan}");
    assert!(!plan.contains("\"Sort\""), "{plan}");
    drop(tx);
    t.cleanup().await;
}

/// A handler whose batch write always fails without naming an event (as a multi-row
/// statement does), and whose event-by-event path fails on the event `fails_on` (if any).
struct FailingBatch {
    fails_on: Option<String>,
    seen: Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl Handler for FailingBatch {
    fn name(&self) -> &str {
        "failing-batch"
    }
    async fn handle(&self, _tx: &mut Tx, event: &StoredEvent) -> Result<(), HandlerError> {
        if self.fails_on.as_deref() == Some(event.aggregate_id.as_str()) {
            return Err(HandlerError::Record {
                what: "the event's row".to_string(),
                source: "refused".into(),
            });
        }
        self.seen.lock().unwrap().push(event.aggregate_id.clone());
        Ok(())
    }
    async fn handle_batch(&self, _tx: &mut Tx, _: &[StoredEvent]) -> Result<(), HandlerError> {
        Err(HandlerError::Record {
            what: "a multi-row statement".to_string(),
            source: "refused".into(),
        })
    }
}

crate::test_on_both_engines! {
    async fn a_failed_batch_is_handled_again_event_by_event_and_names_the_failing_event(backend) {
        let t = TestDatabase::new(backend).await;
        let runs: Repository<ProvisioningRun> = Repository::new(t.db.clone(), ());
        let ids = record_runs(&runs, 3).await;
        // All three readable first: the stream holds events back while a writing
        // transaction runs (in any database of the server), and a first batch of the first
        // event alone would move the checkpoint past it before the failing one is read.
        eventually("three events readable", || async {
            let stored = stream::read_after(&t.db, Position::default(), 10).await.unwrap();
            (stored.len() == 3).then_some(())
        })
        .await;
        let failing = FailingBatch { fails_on: Some(ids[1].clone()), seen: Mutex::new(vec![]) };
        let error = stream::catch_up(&t.db, &failing).await.unwrap_err();
        let HandlerError::AtEvent { position, source, .. } = &error else {
            panic!("{backend:?}: {error:?}")
        };
        assert!(matches!(**source, HandlerError::Record { .. }), "{error:?}");
        let stored = stream::read_after(&t.db, Position::default(), 10).await.unwrap();
        assert_eq!(*position, stored[1].position, "{backend:?}: the second event is named");
        // Nothing moved: the checkpoint is where it was.
        let status = stream::subscription_status(&t.db).await.unwrap();
        assert!(status.iter().all(|s| s.position.global_position == 0), "{backend:?}: {status:?}");

        // When the events go through one by one, the batch is done that way.
        let passing = FailingBatch { fails_on: None, seen: Mutex::new(vec![]) };
        eventually("three events", || async {
            stream::catch_up(&t.db, &passing).await.unwrap();
            (passing.seen.lock().unwrap().len() == 3).then_some(())
        })
        .await;
        assert_eq!(*passing.seen.lock().unwrap(), ids);
        t.cleanup().await;
    }
}

fn ids_of(recorder: &Recorder) -> Vec<String> {
    recorder
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|e| e.aggregate_id.clone())
        .collect()
}

async fn record_runs(runs: &Repository<ProvisioningRun>, count: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for _ in 0..count {
        let id = ProvisioningRunId::new_random();
        runs.execute(
            &tenant("a"),
            &id.to_string(),
            request("a", id),
            &meta("a"),
            true,
        )
        .await
        .unwrap();
        ids.push(id.to_string());
    }
    ids
}

crate::test_on_both_engines! {
    async fn subscriptions_sharing_a_batch_each_get_what_follows_their_checkpoint(backend) {
        let t = TestDatabase::new(backend).await;
        let runs: Repository<ProvisioningRun> = Repository::new(t.db.clone(), ());
        let mut ids = record_runs(&runs, 2).await;
        let ahead = Recorder { name: "ahead".to_string(), seen: Mutex::new(vec![]) };
        eventually("two events", || async {
            stream::catch_up(&t.db, &ahead).await.unwrap();
            (ahead.seen.lock().unwrap().len() == 2).then_some(())
        })
        .await;
        ids.extend(record_runs(&runs, 1).await);
        let behind = Recorder { name: "behind".to_string(), seen: Mutex::new(vec![]) };
        let both: [&dyn Handler; 2] = [&ahead, &behind];
        eventually("three events each", || async {
            stream::catch_up_together(&t.db, &both).await.unwrap();
            (ahead.seen.lock().unwrap().len() == 3 && behind.seen.lock().unwrap().len() == 3)
                .then_some(())
        })
        .await;
        // Each got every event once, in order: one read served both checkpoints.
        assert_eq!(ids_of(&ahead), ids, "{backend:?}");
        assert_eq!(ids_of(&behind), ids, "{backend:?}");
        let status = stream::subscription_status(&t.db).await.unwrap();
        assert_eq!(status.len(), 2);
        assert!(status.iter().all(|s| s.lag == 0 && s.position.global_position == s.head), "{status:?}");
        let (again, apart) = stream::catch_up_together(&t.db, &both).await.unwrap();
        assert!(!apart);
        let at = Some(status[0].position);
        assert_eq!(again, [stream::Taken { events: 0, reached: at }; 2], "{backend:?}");
        t.cleanup().await;
    }
}

crate::test_on_both_engines! {
    async fn a_failing_subscription_does_not_hold_back_those_it_runs_with(backend) {
        let t = TestDatabase::new(backend).await;
        let runs: Repository<ProvisioningRun> = Repository::new(t.db.clone(), ());
        let first = record_runs(&runs, 1).await;
        // The failing one comes first, so the shared attempt fails before the recorder
        // handles anything (a recorder keeps what it saw even when its batch rolls back).
        let failing = std::sync::Arc::new(FailingBatch {
            fails_on: Some(first[0].clone()),
            seen: Mutex::new(vec![]),
        });
        let recorder = std::sync::Arc::new(Recorder {
            name: "keeps-up".to_string(),
            seen: Mutex::new(vec![]),
        });
        for name in ["failing-batch", "keeps-up"] {
            stream::ensure_checkpoint(&t.db, name).await.unwrap();
        }
        let (stop, shutdown) = tokio::sync::watch::channel(false);
        let moved = tokio::sync::watch::channel(Position::default()).0;
        let progress = moved.subscribe();
        tokio::spawn(stream::run_subscriptions(
            t.db.clone(),
            vec![
                stream::Running { handler: failing.clone(), progress: None },
                stream::Running { handler: recorder.clone(), progress: Some(moved) },
            ],
            // A short poll: other tests' transactions may hold the stream's horizon back
            // past a commit signal. Far shorter than the failing one's pause (3.2 s).
            std::time::Duration::from_millis(100),
            shutdown,
        ));
        let attempts_of_failing = || {
            t.db.subscription_health()
                .problems()
                .into_iter()
                .find(|p| p.name == "failing-batch")
                .map(|p| p.attempts)
        };
        // Six attempts (3.1 s): the next retry is 3.2 s after the sixth.
        let attempts = eventually("six failed attempts", || async {
            attempts_of_failing().filter(|n| *n >= 6)
        })
        .await;
        assert_eq!(ids_of(&recorder), first, "{backend:?}");
        let second = record_runs(&runs, 1).await;
        eventually("the recorder keeps up", || async {
            (ids_of(&recorder).len() == 2).then_some(())
        })
        .await;
        assert_eq!(ids_of(&recorder), [first[0].clone(), second[0].clone()]);
        let head = stream::read_after(&t.db, Position::default(), 10).await.unwrap()[1].position;
        // The recorder sees the event inside its batch's transaction; waiters are told after
        // the commit, a moment later.
        eventually("the recorder's checkpoint, for waiters", || async {
            (*progress.borrow() == head).then_some(())
        })
        .await;
        // It went on at the commit, not at the failing one's next retry, and that one is
        // still stuck where it was: nothing skipped, nothing moved.
        assert_eq!(attempts_of_failing(), Some(attempts), "{backend:?}");
        assert!(failing.seen.lock().unwrap().is_empty());
        let status = stream::subscription_status(&t.db).await.unwrap();
        let at = |name: &str| status.iter().find(|s| s.name == name).unwrap().position.global_position;
        assert_eq!(at("failing-batch"), 0, "{status:?}");
        assert_eq!(at("keeps-up"), status[0].head, "{status:?}");
        stop.send(true).unwrap();
        t.cleanup().await;
    }
}

crate::test_on_both_engines! {
    async fn rows_are_inserted_and_read_in_as_many_statements_as_the_parameter_limit_needs(backend) {
        use stream::Param;
        let t = TestDatabase::new(backend).await;
        let mut tx = Tx::begin(&t.db).await.unwrap();
        let json = match backend { Backend::Postgres => "jsonb", Backend::Sqlite => "text" };
        tx.execute(&format!("CREATE TABLE wide (a text NOT NULL, b text NOT NULL, doc {json} NOT NULL, PRIMARY KEY (a, b))"), &[])
            .await
            .unwrap();
        // 12,000 rows of three columns: more parameters than one statement may bind.
        let rows: Vec<Vec<Param>> = (0..12_000)
            .map(|n| vec![
                Param::Text(Some(format!("a{}", n % 7))),
                Param::Text(Some(format!("b{n}"))),
                Param::Json(Some(serde_json::json!({"n": n}))),
            ])
            .collect();
        let inserted = tx.insert_rows("wide", &["a", "b", "doc"], rows, "ON CONFLICT DO NOTHING").await.unwrap();
        assert_eq!(inserted, 12_000, "{backend:?}");
        // Again: the conflict clause applies to every statement.
        let again = vec![vec![
            Param::Text(Some("a0".to_string())),
            Param::Text(Some("b0".to_string())),
            Param::Json(Some(serde_json::json!({"n": -1}))),
        ]];
        assert_eq!(tx.insert_rows("wide", &["a", "b", "doc"], again, "ON CONFLICT DO NOTHING").await.unwrap(), 0);
        // Read back by key, 31,000 of them (more than one statement binds).
        let keys: Vec<Param> = (0..31_000).map(|n| Param::Text(Some(format!("b{n}")))).collect();
        let mut found = tx.fetch_documents("SELECT b, doc FROM wide WHERE b IN", &keys).await.unwrap();
        assert_eq!(found.len(), 12_000, "{backend:?}: keys that are not there are not found");
        found.sort_by_key(|(_, doc)| doc["n"].as_i64());
        assert_eq!(found[0], ("b0".to_string(), serde_json::json!({"n": 0})));
        assert_eq!(found[11_999], ("b11999".to_string(), serde_json::json!({"n": 11_999})));
        // Nothing to write or read is no statement at all.
        assert_eq!(tx.insert_rows("wide", &["a", "b", "doc"], vec![], "").await.unwrap(), 0);
        assert!(tx.fetch_documents("SELECT b, doc FROM wide WHERE b IN", &[]).await.unwrap().is_empty());
        tx.commit().await.unwrap();
        t.cleanup().await;
    }
}

crate::test_on_both_engines! {
    async fn rows_of_every_kind_of_column_are_inserted_and_upserted(backend) {
        use stream::Param;
        let t = TestDatabase::new(backend).await;
        let mut tx = Tx::begin(&t.db).await.unwrap();
        let (json, ts) = match backend {
            Backend::Postgres => ("jsonb", "timestamptz"),
            Backend::Sqlite => ("text", "text"),
        };
        tx.execute(
            &format!("CREATE TABLE kinds (k text PRIMARY KEY, n bigint, i integer NOT NULL, at {ts}, doc {json}, note text)"),
            &[],
        )
        .await
        .unwrap();
        let at: chrono::DateTime<chrono::Utc> = "2026-12-04T10:00:00.123456Z".parse().unwrap();
        let row = |k: &str, n: Option<i64>, i: i64, at: Option<chrono::DateTime<chrono::Utc>>, doc: Option<serde_json::Value>, note: Param| {
            vec![Param::Text(Some(k.to_string())), Param::Int(n), Param::Int(Some(i)), Param::Time(at), Param::Json(doc), note]
        };
        let columns = ["k", "n", "i", "at", "doc", "note"];
        let upsert = "ON CONFLICT (k) DO UPDATE SET n = EXCLUDED.n, doc = EXCLUDED.doc";
        // Batches of different sizes, NULLs in every nullable column, an upsert.
        let batches = vec![
            vec![row("a", Some(1), 1, Some(at), Some(serde_json::json!({"a": [1, "é\"\n"]})), Param::Text(Some("x".into())))],
            vec![
                row("b", None, 2, None, None, Param::Text(None)),
                row("c", Some(-3), 3, Some(at), Some(serde_json::json!(null)), Param::Text(Some(String::new()))),
            ],
            vec![
                row("a", Some(10), 1, Some(at), Some(serde_json::json!({"a": 2})), Param::Text(Some("x".into()))),
                row("d", Some(i64::MAX), 4, None, Some(serde_json::json!("text")), Param::Text(Some("y".into()))),
                row("e", Some(5), 5, None, None, Param::Text(None)),
            ],
        ];
        for batch in batches {
            tx.insert_rows("kinds", &columns, batch, upsert).await.unwrap();
        }
        if backend == Backend::Postgres {
            // One statement text for the table whatever the batch's size: prepared once.
            let prepared = tx
                .fetch_json(
                    "SELECT to_jsonb(count(*)) FROM pg_prepared_statements WHERE statement LIKE 'INSERT INTO kinds %'",
                    &[],
                )
                .await
                .unwrap();
            assert_eq!(prepared, Some(serde_json::json!(1)));
        }
        // A column whose values are not all of one kind still goes in (as `VALUES`).
        let mixed = vec![
            row("f", Some(6), 6, None, None, Param::Text(Some("z".into()))),
            row("g", Some(7), 7, None, None, Param::Int(Some(7))),
        ];
        assert_eq!(tx.insert_rows("kinds", &columns, mixed, upsert).await.unwrap(), 2);

        let read = match backend {
            Backend::Postgres => "SELECT jsonb_agg(jsonb_build_array(k, n, i, CASE WHEN at IS NULL THEN 0 ELSE 1 END, doc, note) ORDER BY k) FROM kinds",
            Backend::Sqlite => "SELECT json_group_array(json_array(k, n, i, CASE WHEN at IS NULL THEN 0 ELSE 1 END, json(doc), note)) FROM (SELECT * FROM kinds ORDER BY k)",
        };
        let rows = tx.fetch_json(read, &[]).await.unwrap().unwrap();
        assert_eq!(
            rows,
            serde_json::json!([
                ["a", 10, 1, 1, {"a": 2}, "x"],
                ["b", null, 2, 0, null, null],
                ["c", -3, 3, 1, null, ""],
                ["d", i64::MAX, 4, 0, "text", "y"],
                ["e", 5, 5, 0, null, null],
                ["f", 6, 6, 0, null, "z"],
                ["g", 7, 7, 0, null, "7"],
            ]),
            "{backend:?}"
        );
        let same_time = tx
            .fetch_json(
                match backend {
                    Backend::Postgres => "SELECT to_jsonb(count(*)) FROM kinds WHERE at = $1",
                    Backend::Sqlite => "SELECT json(count(*)) FROM kinds WHERE at = $1",
                },
                &[Param::Time(Some(at))],
            )
            .await
            .unwrap();
        assert_eq!(same_time, Some(serde_json::json!(2)), "{backend:?}: timestamps kept to the microsecond");
        tx.commit().await.unwrap();
        t.cleanup().await;
    }
}

/// Instances tell each other of their appends with a NOTIFY of their own after the append,
/// not from the appending transaction (no trigger on the events table): another instance's
/// subscribers wake when this one appends, and the other way round.
#[tokio::test]
async fn an_append_wakes_the_other_instances_subscribers() {
    let t = TestDatabase::new(Backend::Postgres).await;
    let other = crate::Database::connect_postgres(&t.location)
        .await
        .unwrap();
    let (stop, shutdown) = tokio::sync::watch::channel(false);
    stream::spawn_notifications(&t.db, shutdown.clone());
    stream::spawn_notifications(&other, shutdown);
    let triggers: i64 = crate::on_pool!(t.db, pool => sqlx::query_scalar(
        "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'events'::regclass AND NOT tgisinternal",
    )
    .fetch_one(pool)
    .await
    .unwrap());
    assert_eq!(triggers, 0, "nothing notifies from inside an append");
    for (from, to) in [(&t.db, &other), (&other, &t.db)] {
        let runs: Repository<ProvisioningRun> = Repository::new(from.clone(), ());
        let mut woken = to.subscribe_commits();
        // The listener may still be connecting: append until a notification gets through.
        let mut attempts = 0;
        loop {
            record_runs(&runs, 1).await;
            let wait = std::time::Duration::from_millis(200);
            if tokio::time::timeout(wait, woken.changed()).await.is_ok() {
                break;
            }
            attempts += 1;
            assert!(attempts < 50, "the other instance was never woken");
        }
    }
    stop.send(true).unwrap();
    other.close().await;
    t.cleanup().await;
}

crate::test_on_both_engines! {
    async fn a_command_reports_where_its_last_event_stands_in_the_stream(backend) {
        let t = TestDatabase::new(backend).await;
        let runs: Repository<ProvisioningRun> = Repository::new(t.db.clone(), ());
        let id = ProvisioningRunId::new_random();
        let key = id.to_string();
        let requested = runs
            .execute(&tenant("a"), &key, request("a", id), &meta("a"), true)
            .await
            .unwrap();
        let cancelled = runs
            .execute(&tenant("a"), &key, cancel(), &meta("a"), false)
            .await
            .unwrap();
        let stored = eventually("both events", || async {
            let stored = stream::read_after(&t.db, Position::default(), 10).await.unwrap();
            (stored.len() == 2).then_some(stored)
        })
        .await;
        // What a read-your-writes wait compares with the projections' checkpoints.
        assert_eq!(requested.position, Some(stored[0].position), "{backend:?}");
        assert_eq!(cancelled.position, Some(stored[1].position), "{backend:?}");
        t.cleanup().await;
    }
}

/// Records, in one log shared by several handlers, which handler took each event.
struct Logged {
    name: &'static str,
    log: std::sync::Arc<Mutex<Vec<&'static str>>>,
}

#[async_trait::async_trait]
impl Handler for Logged {
    fn name(&self) -> &str {
        self.name
    }
    async fn handle(&self, _tx: &mut Tx, _event: &StoredEvent) -> Result<(), HandlerError> {
        self.log.lock().unwrap().push(self.name);
        Ok(())
    }
}

crate::test_on_both_engines! {
    async fn a_subscription_far_behind_does_not_hold_back_those_it_runs_with(backend) {
        let t = TestDatabase::new(backend).await;
        let runs: Repository<ProvisioningRun> = Repository::new(t.db.clone(), ());
        let before = 600;
        record_runs(&runs, before).await;
        let ahead = Recorder { name: "ahead".to_string(), seen: Mutex::new(vec![]) };
        eventually("the ahead one caught up", || async {
            stream::catch_up(&t.db, &ahead).await.unwrap();
            (ahead.seen.lock().unwrap().len() == before).then_some(())
        })
        .await;
        record_runs(&runs, 1).await;
        // Readable by a subscription (other tests' transactions on the server can hold the
        // stream's horizon back a moment): else the one behind might catch up first.
        eventually("the newest event readable", || async {
            let stored = stream::read_after(&t.db, Position::default(), 1000).await.unwrap();
            (stored.len() == before + 1).then_some(())
        })
        .await;
        // A new subscription (e.g. a projection new in this version) starts from the first
        // event, beside one that only has the newest to take.
        let log = std::sync::Arc::new(Mutex::new(Vec::new()));
        let (stop, shutdown) = tokio::sync::watch::channel(false);
        tokio::spawn(stream::run_subscriptions(
            t.db.clone(),
            vec![
                stream::Running {
                    handler: std::sync::Arc::new(Logged { name: "behind", log: log.clone() }),
                    progress: None,
                },
                stream::Running {
                    handler: std::sync::Arc::new(Logged { name: "ahead", log: log.clone() }),
                    progress: None,
                },
            ],
            std::time::Duration::from_millis(100),
            shutdown,
        ));
        let log = eventually("every event taken", || async {
            let log = log.lock().unwrap().clone();
            (log.len() == before + 2).then_some(log)
        })
        .await;
        let behind_first = log.iter().position(|name| *name == "ahead").unwrap();
        // The ahead one took its event after the first batches of the one behind, not
        // after its whole replay: the two went a batch at a time each.
        assert!(
            behind_first < before,
            "{backend:?}: {behind_first} events of the one behind came first"
        );
        assert_eq!(log.iter().filter(|name| **name == "behind").count(), before + 1);
        stop.send(true).unwrap();
        t.cleanup().await;
    }
}

/// Reads, inside each batch's transaction, whether its commit waits for the WAL flush.
struct FlushSetting {
    name: &'static str,
    replayable: bool,
    seen: Mutex<Vec<String>>,
}

impl FlushSetting {
    fn new(name: &'static str, replayable: bool) -> Self {
        Self {
            name,
            replayable,
            seen: Mutex::new(vec![]),
        }
    }
}

#[async_trait::async_trait]
impl Handler for FlushSetting {
    fn name(&self) -> &str {
        self.name
    }
    fn replayable(&self) -> bool {
        self.replayable
    }
    async fn handle(&self, _tx: &mut Tx, _event: &StoredEvent) -> Result<(), HandlerError> {
        unreachable!("batches only")
    }
    async fn handle_batch(&self, tx: &mut Tx, _events: &[StoredEvent]) -> Result<(), HandlerError> {
        let setting = tx
            .fetch_json(
                "SELECT to_jsonb(current_setting('synchronous_commit'))",
                &[],
            )
            .await?;
        let setting = setting
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        self.seen.lock().unwrap().push(setting);
        Ok(())
    }
}

/// A read model's batch commits without waiting for the WAL flush (a crash can lose only
/// what it would read again); any other handler's batch, or a batch shared with one, waits.
/// Only that transaction: the connection goes back to the pool as it was.
#[tokio::test]
async fn only_replayable_batches_commit_without_waiting_for_the_flush() {
    let t = TestDatabase::new(Backend::Postgres).await;
    let runs: Repository<ProvisioningRun> = Repository::new(t.db.clone(), ());
    let replayable = FlushSetting::new("replayable", true);
    let effectful = FlushSetting::new("effectful", false);
    let shared_replayable = FlushSetting::new("shared-replayable", true);
    let shared_effectful = FlushSetting::new("shared-effectful", false);
    let shared_a = FlushSetting::new("shared-a", true);
    let shared_b = FlushSetting::new("shared-b", true);
    record_runs(&runs, 1).await;
    eventually("a batch for each", || async {
        stream::run_batch(&t.db, &replayable).await.unwrap();
        stream::run_batch(&t.db, &effectful).await.unwrap();
        stream::run_batch_together(&t.db, &[&shared_replayable, &shared_effectful], 10)
            .await
            .unwrap();
        stream::run_batch_together(&t.db, &[&shared_a, &shared_b], 10)
            .await
            .unwrap();
        let all = [
            &replayable,
            &effectful,
            &shared_replayable,
            &shared_effectful,
            &shared_a,
            &shared_b,
        ];
        all.iter()
            .all(|h| !h.seen.lock().unwrap().is_empty())
            .then_some(())
    })
    .await;
    let seen = |h: &FlushSetting| h.seen.lock().unwrap().clone();
    assert_eq!(seen(&replayable), ["off"]);
    assert_eq!(seen(&effectful), ["on"]);
    assert_eq!(
        seen(&shared_replayable),
        ["on"],
        "shared with a handler that is not replayable"
    );
    assert_eq!(seen(&shared_effectful), ["on"]);
    assert_eq!(seen(&shared_a), ["off"]);
    assert_eq!(seen(&shared_b), ["off"]);
    let Pool::Postgres(pool) = t.db.pool().clone() else {
        unreachable!()
    };
    let mut connections = Vec::new();
    for _ in 0..pool.size() {
        let mut connection = pool.acquire().await.unwrap();
        let setting: String = sqlx::query_scalar("SELECT current_setting('synchronous_commit')")
            .fetch_one(&mut *connection)
            .await
            .unwrap();
        assert_eq!(setting, "on", "the setting outlived its transaction");
        connections.push(connection);
    }
    drop(connections);
    t.cleanup().await;
}

crate::test_on_both_engines! {
    async fn a_bounded_read_ends_its_batch_at_the_byte_budget(backend) {
        let t = TestDatabase::new(backend).await;
        let runs: Repository<ProvisioningRun> = Repository::new(t.db.clone(), ());
        for _ in 0..5 {
            let id = ProvisioningRunId::new_random();
            runs.execute(&tenant("a"), &id.to_string(), request("a", id), &meta("a"), true)
                .await
                .unwrap();
        }
        let all = eventually("five events", || async {
            let e = stream::read_after(&t.db, Position::default(), 10).await.unwrap();
            (e.len() == 5).then_some(e)
        })
        .await;
        let sizes: Vec<i64> = all.iter().map(|e| e.payload.get().len() as i64).collect();
        let read = |max_bytes: i64| {
            let db = t.db.clone();
            async move {
                stream::read_after_bounded(&db, Position::default(), 10, max_bytes)
                    .await
                    .unwrap()
                    .iter()
                    .map(|e| e.position)
                    .collect::<Vec<_>>()
            }
        };
        let positions: Vec<Position> = all.iter().map(|e| e.position).collect();
        // The first event always, however small the budget.
        assert_eq!(read(0).await, positions[..1]);
        assert_eq!(read(1).await, positions[..1]);
        // The events that start within the budget.
        assert_eq!(read(sizes[0] + sizes[1] - 1).await, positions[..2]);
        assert_eq!(read(sizes[0] + sizes[1] + 1).await, positions[..3]);
        // A budget larger than the stream: the count limits, as `read_after` does.
        assert_eq!(read(i64::MAX / 2).await, positions);
        let limited = stream::read_after_bounded(&t.db, Position::default(), 4, i64::MAX / 2)
            .await
            .unwrap();
        assert_eq!(limited.len(), 4);
        // Resuming after a bounded batch goes on where it ended.
        let next = stream::read_after_bounded(&t.db, positions[1], 10, 1).await.unwrap();
        assert_eq!(next.iter().map(|e| e.position).collect::<Vec<_>>(), positions[2..3]);
        t.cleanup().await;
    }
}
