//! Projection and query tests on real Postgres and SQLite.

use super::{provisioning_projections as all_projections, ProvisioningReads};
use super::{RunFilter, SpecificationFilter};
use chrono::Utc;
use ferry_domain::receipts::{ApplyReceipt, ApplyResult, PlanReceipt};
use ferry_domain::run::{ProvisioningRun, RunCommand, RunRequest};
use ferry_domain::specification::{Declaration, DeploymentSpecification, SpecificationCommand};
use ferry_domain::*;
use ferry_projections::rebuild::rebuild_named;
use ferry_projections::{ProjectionRunner, ReadModels};
use ferry_store::stream::catch_up;
use ferry_store::testing::{eventually, eventually_within, TestDatabase};
use ferry_store::{on_pool, Database, EventMetadata, Repository};
use std::collections::BTreeMap;
use uuid::Uuid;

fn t(name: &str) -> TenantId {
    TenantId::parse(name).unwrap()
}

fn meta(tenant: &str) -> EventMetadata {
    EventMetadata::for_request(t(tenant), Actor::parse("alice").unwrap(), Uuid::new_v4())
}

struct World {
    specs: Repository<DeploymentSpecification>,
    runs: Repository<ProvisioningRun>,
}

impl World {
    fn new(db: &Database) -> Self {
        Self {
            specs: Repository::new(db.clone(), ()),
            runs: Repository::new(db.clone(), ()),
        }
    }

    async fn declare(&self, tenant: &str, env: &str, commit: &str) -> (SpecificationId, u32) {
        let environment = EnvironmentId::parse(env).unwrap();
        let id = SpecificationId::for_environment(
            &t(tenant),
            &environment,
            SpecificationKind::Environment,
        );
        let d = Declaration {
            specification_id: id,
            tenant_id: t(tenant),
            project_id: ProjectId::parse("payments").unwrap(),
            environment_id: environment,
            kind: SpecificationKind::Environment,
            program_ref: ProgramRef::parse("/srv/infra#env").unwrap(),
            program_version: ProgramVersion::parse(commit).unwrap(),
            release_id: None,
            strategy: None,
            config_refs: BTreeMap::new(),
            secret_refs: BTreeMap::new(),
            declared_by: Actor::parse("alice").unwrap(),
            declared_at: Utc::now(),
        };
        let done = self
            .specs
            .execute(
                &t(tenant),
                &id.to_string(),
                SpecificationCommand::Declare(Box::new(d)),
                &meta(tenant),
                true,
            )
            .await
            .unwrap();
        (id, done.aggregate.latest().unwrap().version)
    }

    async fn request(
        &self,
        tenant: &str,
        env: &str,
        spec: (SpecificationId, u32),
    ) -> ProvisioningRunId {
        let id = ProvisioningRunId::new_random();
        let r = RunRequest {
            provisioning_run_id: id,
            tenant_id: t(tenant),
            project_id: ProjectId::parse("payments").unwrap(),
            environment_id: EnvironmentId::parse(env).unwrap(),
            environment_class: Some(EnvironmentClass::Development),
            specification_id: spec.0,
            specification_version: spec.1,
            kind: ProvisioningKind::Release,
            promotion_id: None,
            approval_id: None,
            follows_failed_apply: None,
            requested_by: Actor::parse("alice").unwrap(),
            requested_at: Utc::now(),
        };
        self.run(tenant, id, RunCommand::Request(Box::new(r))).await;
        id
    }

    async fn run(&self, tenant: &str, id: ProvisioningRunId, command: RunCommand) {
        self.runs
            .execute(&t(tenant), &id.to_string(), command, &meta(tenant), true)
            .await
            .unwrap();
    }

    async fn apply_fully(&self, tenant: &str, id: ProvisioningRunId) {
        let plan = PlanReceipt {
            ignored: Vec::new(),
            adds: 1,
            changes: 0,
            deletes: 0,
            replaces: 0,
            resources: vec![],
            inputs_hash: "00".repeat(32),
            program_version: "aaaaaaa".to_string(),
            runner: "simulated".to_string(),
            runner_version: "test".to_string(),
            policy: None,
            warnings: vec![],
        };
        self.run(
            tenant,
            id,
            RunCommand::RecordPlan {
                receipt: Box::new(plan),
                logs_ref: None,
                at: Utc::now(),
            },
        )
        .await;
        self.run(tenant, id, RunCommand::StartApply { at: Utc::now() })
            .await;
        let receipt = ApplyReceipt {
            outputs: BTreeMap::from([("url".to_string(), serde_json::json!("https://dev"))]),
            duration_seconds: 0.5,
            result: ApplyResult::Succeeded,
            runner_version: "test".to_string(),
            failing_resource: None,
        };
        self.run(
            tenant,
            id,
            RunCommand::RecordApplySucceeded {
                receipt: Box::new(receipt),
                logs_ref: None,
                at: Utc::now(),
            },
        )
        .await;
    }
}

async fn project_all(db: &Database) {
    for p in all_projections() {
        let runner = ProjectionRunner::live(p);
        runner.ensure_tables(db).await.unwrap();
        catch_up(db, &runner).await.unwrap();
    }
}

/// Catches every projection up until `done` holds (the Postgres stream can hold events
/// back while other tests' transactions run).
async fn project_until<F, Fut>(db: &Database, what: &str, done: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    // Every projection caught up too: each keeps its own checkpoint, and on Postgres another
    // test's transaction can hold one back while the next one reads on.
    eventually(what, || async {
        project_all(db).await;
        let caught_up = ferry_store::stream::subscription_status(db)
            .await
            .unwrap()
            .iter()
            .all(|s| s.lag == 0);
        (caught_up && done().await).then_some(())
    })
    .await;
}

ferry_store::test_on_both_engines! {
    async fn read_models_follow_the_stream(backend) {
        let tdb = TestDatabase::new(backend).await;
        let db = &tdb.db;
        let w = World::new(db);
        let reads = ReadModels::new(db.clone(), None);
        let v1 = w.declare("a", "dev", "aaaaaaa").await;
        let v2 = w.declare("a", "dev", "bbbbbbb").await;
        let other = w.declare("a", "prod", "ccccccc").await;
        w.declare("b", "dev", "ddddddd").await;
        assert_eq!((v1.1, v2.1), (1, 2));
        let r1 = w.request("a", "dev", v1).await;
        let r2 = w.request("a", "dev", v2).await;
        let r3 = w.request("a", "prod", other).await;
        w.run(
            "a",
            r3,
            RunCommand::Cancel {
                cancelled_by: Actor::parse("bob").unwrap(),
                reason: Some("no".into()),
                at: Utc::now(),
            },
        )
        .await;
        w.apply_fully("a", r2).await;

        project_until(db, "all runs projected", || async {
            reads
                .get_run(&t("a"), r2)
                .await
                .unwrap()
                .is_some_and(|r| r.state == ProvisioningState::Applied)
                && reads
                    .get_run(&t("a"), r3)
                    .await
                    .unwrap()
                    .is_some_and(|r| r.state == ProvisioningState::Cancelled)
        })
        .await;

        // Every version is kept, newest first; filters narrow.
        let all = reads
            .list_specifications(&t("a"), &SpecificationFilter::default(), 50, None)
            .await
            .unwrap();
        assert_eq!(all.items.len(), 3, "{backend:?}");
        let dev = SpecificationFilter {
            environment_id: Some(EnvironmentId::parse("dev").unwrap()),
            ..Default::default()
        };
        let dev_specs = reads
            .list_specifications(&t("a"), &dev, 50, None)
            .await
            .unwrap();
        assert_eq!(
            dev_specs
                .items
                .iter()
                .map(|v| v.version)
                .collect::<Vec<_>>(),
            [2, 1]
        );
        let workloads = SpecificationFilter {
            kind: Some(SpecificationKind::Workload),
            ..Default::default()
        };
        assert!(reads
            .list_specifications(&t("a"), &workloads, 50, None)
            .await
            .unwrap()
            .items
            .is_empty());

        // Cursor paging walks every run once.
        let first = reads
            .list_runs(&t("a"), &RunFilter::default(), 2, None)
            .await
            .unwrap();
        assert_eq!(first.items.len(), 2);
        let cursor = ferry_projections::queries::decode_cursor(first.next_cursor.as_deref().unwrap()).unwrap();
        let second = reads
            .list_runs(&t("a"), &RunFilter::default(), 2, Some(cursor))
            .await
            .unwrap();
        assert_eq!(second.items.len(), 1);
        assert!(second.next_cursor.is_none());
        let mut ids: Vec<_> = first
            .items
            .iter()
            .chain(&second.items)
            .map(|r| r.provisioning_run_id)
            .collect();
        ids.sort();
        let mut expected = vec![r1, r2, r3];
        expected.sort();
        assert_eq!(ids, expected);

        let cancelled = RunFilter {
            state: Some(ProvisioningState::Cancelled),
            ..Default::default()
        };
        let page = reads
            .list_runs(&t("a"), &cancelled, 50, None)
            .await
            .unwrap();
        assert_eq!(page.items.len(), 1);
        assert_eq!(
            page.items[0]
                .cancellation
                .as_ref()
                .unwrap()
                .cancelled_by
                .as_str(),
            "bob"
        );
        assert!(page.items[0].completed_at.is_some());

        // The applied run carries both receipts; the environment shows what was applied.
        let applied = reads.get_run(&t("a"), r2).await.unwrap().unwrap();
        assert!(applied.plan_receipt.is_some() && applied.apply_receipt.is_some());
        assert_eq!(applied.version, 4);
        let current = reads
            .current_specification(&t("a"), &EnvironmentId::parse("dev").unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(current.specifications.len(), 1);
        assert_eq!(current.specifications[0].latest.version, 2);
        let applied_spec = current.specifications[0].applied.as_ref().unwrap();
        assert_eq!(
            (applied_spec.version, applied_spec.provisioning_run_id),
            (2, r2)
        );
        let prod = reads
            .current_specification(&t("a"), &EnvironmentId::parse("prod").unwrap())
            .await
            .unwrap()
            .unwrap();
        assert!(prod.specifications[0].applied.is_none());

        // Tenant b sees only its own.
        assert!(reads.get_run(&t("b"), r1).await.unwrap().is_none());
        assert!(reads
            .list_runs(&t("b"), &RunFilter::default(), 50, None)
            .await
            .unwrap()
            .items
            .is_empty());
        assert_eq!(
            reads
                .list_specifications(&t("b"), &SpecificationFilter::default(), 50, None)
                .await
                .unwrap()
                .items
                .len(),
            1
        );
        assert!(reads
            .current_specification(&t("b"), &EnvironmentId::parse("prod").unwrap())
            .await
            .unwrap()
            .is_none());
        tdb.cleanup().await;
    }
}

async fn snapshot(db: &Database) -> Vec<String> {
    snapshot_of(db, "").await
}

/// The rows of every table, or of their `<table><suffix>` copies.
async fn snapshot_of(db: &Database, suffix: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (table, order) in [
        (
            "rm_specification_versions",
            "tenant_id, specification_id, version",
        ),
        ("rm_runs", "provisioning_run_id"),
        (
            "rm_environment_specifications",
            "tenant_id, environment_id, kind",
        ),
        ("rm_environment_run_targets", "provisioning_run_id"),
    ] {
        let sql = format!("SELECT * FROM {table}{suffix} ORDER BY {order}");
        let rows: Vec<String> = on_pool!(db, pool => {
            use sqlx::{Column, Row};
            sqlx::query(&sql).fetch_all(pool).await.unwrap().iter().map(|row| {
                row.columns().iter().map(|c| {
                    let i = c.ordinal();
                    row.try_get::<String, _>(i).ok()
                        .or_else(|| row.try_get::<i64, _>(i).ok().map(|v| v.to_string()))
                        .or_else(|| row.try_get::<serde_json::Value, _>(i).ok().map(|v| v.to_string()))
                        .or_else(|| row.try_get::<chrono::DateTime<Utc>, _>(i).ok().map(|v| v.to_rfc3339()))
                        .unwrap_or_else(|| "NULL".to_string())
                }).collect::<Vec<_>>().join("|")
            }).collect()
        });
        out.push(format!("{table}: {}", rows.len()));
        out.extend(rows);
    }
    out
}

ferry_store::test_on_both_engines! {
    async fn a_rebuild_equals_the_live_model_and_reads_continue(backend) {
        let tdb = TestDatabase::new(backend).await;
        let db = &tdb.db;
        let w = World::new(db);
        let reads = ReadModels::new(db.clone(), None);
        let mut last = None;
        for i in 0..5 {
            let spec = w.declare("a", &format!("env{i}"), "aaaaaaa").await;
            let run = w.request("a", &format!("env{i}"), spec).await;
            if i % 2 == 0 {
                w.apply_fully("a", run).await;
            }
            last = Some(run);
        }
        let last = last.unwrap();
        project_until(db, "live model", || async {
            reads.get_run(&t("a"), last).await.unwrap().is_some()
                && reads
                    .list_runs(
                        &t("a"),
                        &RunFilter {
                            state: Some(ProvisioningState::Applied),
                            ..Default::default()
                        },
                        50,
                        None,
                    )
                    .await
                    .unwrap()
                    .items
                    .len()
                    == 3
        })
        .await;
        let before = snapshot(db).await;
        assert!(before.len() > 15, "{before:?}");

        // Readers keep getting full answers while the rebuild runs and swaps.
        let reader = {
            let reads = reads.clone();
            tokio::spawn(async move {
                let mut answered = 0;
                for _ in 0..200 {
                    let page = reads
                        .list_runs(&t("a"), &RunFilter::default(), 50, None)
                        .await
                        .unwrap();
                    assert_eq!(page.items.len(), 5);
                    answered += 1;
                    tokio::task::yield_now().await;
                }
                answered
            })
        };
        let reports = rebuild_named(db, &all_projections(), None).await.unwrap();
        assert_eq!(reports.len(), 3);
        assert!(reports.iter().all(|r| r.events > 0));
        assert_eq!(reader.await.unwrap(), 200);
        assert_eq!(snapshot(db).await, before, "{backend:?}");

        // The live projection carries on from the swapped checkpoint, and a second rebuild works.
        w.declare("a", "env9", "bbbbbbb").await;
        project_until(db, "new declaration", || async {
            reads
                .list_specifications(&t("a"), &SpecificationFilter::default(), 50, None)
                .await
                .unwrap()
                .items
                .len()
                == 6
        })
        .await;
        rebuild_named(db, &all_projections(), Some("runs")).await.unwrap();
        assert!(matches!(
            rebuild_named(db, &all_projections(), Some("nope")).await,
            Err(ferry_projections::rebuild::RebuildError::Unknown { .. })
        ));
        tdb.cleanup().await;
    }
}

ferry_store::test_on_both_engines! {
    async fn a_run_event_that_does_not_decode_stops_the_projections_that_read_runs(backend) {
        let tdb = TestDatabase::new(backend).await;
        let db = &tdb.db;
        let w = World::new(db);
        // A request that is not one (written by a buggy or newer version), then a declaration.
        let sql = db.sql(
            "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata)
             VALUES ('ProvisioningRun', 'broken-run', 1, 'ProvisioningRequested', '1.0', $1, $2)",
        );
        let payload = serde_json::json!({"ProvisioningRequested": {"not": "a request"}});
        let metadata = serde_json::json!({"tenantId": "a"});
        on_pool!(db, pool => sqlx::query(&sql)
            .bind(sqlx::types::Json(&payload)).bind(sqlx::types::Json(&metadata))
            .execute(pool).await.unwrap().rows_affected());
        w.declare("a", "dev", "aaaaaaa").await;

        let reads = ReadModels::new(db.clone(), None);
        for projection in all_projections() {
            let runner = ProjectionRunner::live(projection.clone());
            runner.ensure_tables(db).await.unwrap();
            if projection.name() == "specifications" {
                // It does not read runs: it passes over the broken event and goes on.
                eventually("the declaration", || async {
                    catch_up(db, &runner).await.unwrap();
                    let page = reads
                        .list_specifications(&t("a"), &SpecificationFilter::default(), 50, None)
                        .await
                        .unwrap();
                    (page.items.len() == 1).then_some(())
                })
                .await;
                continue;
            }
            let error = eventually("the decode error", || async {
                catch_up(db, &runner).await.err()
            })
            .await;
            let ferry_store::HandlerError::AtEvent { position, source, .. } = &error else {
                panic!("{}: {error:?}", projection.name())
            };
            assert!(
                matches!(source.as_ref(), ferry_store::HandlerError::Decode(_)),
                "{}: {error:?}",
                projection.name()
            );
            assert_eq!(position.global_position, 1);
        }
        // Nothing was skipped: the run projections' checkpoints have not moved.
        let status = ferry_store::stream::subscription_status(db).await.unwrap();
        assert!(
            status
                .iter()
                .filter(|s| s.name != "specifications")
                .all(|s| s.position.global_position == 0),
            "{status:?}"
        );
        tdb.cleanup().await;
    }
}

/// Projects the whole stream event by event (the way a failed batch is handled again) into
/// `<table>_one` copies.
async fn project_one_by_one(db: &Database) {
    use ferry_store::stream::{Handler, Position, Tx};
    for projection in all_projections() {
        let runner = ProjectionRunner::with_suffix(projection, "_one");
        runner.ensure_tables(db).await.unwrap();
        let mut tx = Tx::begin(db).await.unwrap();
        for event in tx.read_batch(Position::default(), 10_000).await.unwrap() {
            runner.handle(&mut tx, &event).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
}

ferry_store::test_on_both_engines! {
    async fn a_batch_writes_the_same_rows_as_event_by_event(backend) {
        let tdb = TestDatabase::new(backend).await;
        let db = &tdb.db;
        let w = World::new(db);
        // Part of the history is projected first, so the next batch folds into stored rows.
        w.declare("a", "env0", "aaaaaaa").await;
        let v2 = w.declare("a", "env0", "bbbbbbb").await;
        let first = w.request("a", "env0", v2).await;
        project_all(db).await;
        // One batch: a stored run applied, a newer declaration of the same environment,
        // another environment declared, requested and applied (its target read in the same
        // batch), and one run requested only.
        w.apply_fully("a", first).await;
        let v3 = w.declare("a", "env0", "ccccccc").await;
        let other = w.declare("b", "env1", "aaaaaaa").await;
        let second = w.request("b", "env1", other).await;
        w.apply_fully("b", second).await;
        w.request("a", "env0", v3).await;
        w.declare("b", "env1", "ddddddd").await;
        project_until(db, "every event", || async { true }).await;
        project_one_by_one(db).await;
        let batched = snapshot_of(db, "").await;
        assert_eq!(batched, snapshot_of(db, "_one").await, "{backend:?}");
        // The snapshot holds what the scenario wrote: 5 declarations, 3 runs, 2 environments.
        for count in [
            "rm_specification_versions: 5",
            "rm_runs: 3",
            "rm_environment_specifications: 2",
            "rm_environment_run_targets: 3",
        ] {
            assert!(batched.contains(&count.to_string()), "{backend:?}: {count} in {batched:#?}");
        }
        tdb.cleanup().await;
    }
}

ferry_store::test_on_both_engines! {
    async fn a_rebuild_over_several_batches_reads_each_once_and_equals_the_live_model(backend) {
        let tdb = TestDatabase::new(backend).await;
        let db = &tdb.db;
        let w = World::new(db);
        let spec = w.declare("a", "dev", "aaaaaaa").await;
        // More events than one rebuild batch (1,024): the replay reads ahead and hands
        // every stretch to each projection from where its checkpoint stands.
        for _ in 0..70 {
            futures::future::join_all((0..16).map(|_| w.request("a", "dev", spec))).await;
        }
        let total: i64 = on_pool!(db, pool => sqlx::query_scalar("SELECT count(*) FROM events")
            .fetch_one(pool).await.unwrap());
        assert_eq!(total, 1 + 70 * 16);
        // The stream's last event in stream order, `(transaction_id, global_position)`:
        // under concurrent appends a later transaction may hold a lower global position,
        // so the highest global position is not necessarily where the replay ends.
        let head: i64 = match db.pool() {
            ferry_store::database::Pool::Postgres(pool) => sqlx::query_scalar(
                "SELECT global_position FROM events ORDER BY transaction_id DESC, global_position DESC LIMIT 1",
            )
            .fetch_one(pool)
            .await
            .unwrap(),
            ferry_store::database::Pool::Sqlite(pool) => {
                sqlx::query_scalar("SELECT max(global_position) FROM events").fetch_one(pool).await.unwrap()
            }
        };
        project_until(db, "every run", || async { true }).await;
        let before = snapshot(db).await;
        assert!(before.contains(&"rm_runs: 1120".to_string()), "{backend:?}");
        let reports = rebuild_named(db, &all_projections(), None).await.unwrap();
        for report in &reports {
            assert_eq!(report.events as i64, total, "{backend:?}: {report:?}");
            assert_eq!(report.position.global_position, head, "{backend:?}: {report:?}");
        }
        assert_eq!(snapshot(db).await, before, "{backend:?}");
        tdb.cleanup().await;
    }
}

/// The shapes of the runs table's indexes, sorted (the primary key's is there on Postgres).
async fn runs_index_shapes(db: &Database) -> Vec<String> {
    let mut tx = ferry_store::stream::Tx::begin(db).await.unwrap();
    let mut shapes: Vec<String> = ferry_projections::projection::index_shapes(&mut tx, "rm_runs")
        .await
        .unwrap()
        .into_iter()
        .map(|shape| format!("{shape:?}"))
        .collect();
    tx.commit().await.unwrap();
    shapes.sort();
    shapes
}

ferry_store::test_on_both_engines! {
    async fn a_table_made_by_an_earlier_version_gets_the_index_it_lacks_once(backend) {
        let tdb = TestDatabase::new(backend).await;
        let db = &tdb.db;
        let runs = ProjectionRunner::live(
            all_projections().into_iter().find(|p| p.name() == "runs").unwrap(),
        );
        runs.ensure_tables(db).await.unwrap();
        let current = runs_index_shapes(db).await;
        assert!(
            current.iter().any(|s| s.contains("tenant_id,environment_id,position")),
            "{backend:?}: {current:?}"
        );
        // The table as a version before the environment index made it, with a run in it.
        let w = World::new(db);
        let spec = w.declare("a", "dev", "aaaaaaa").await;
        w.request("a", "dev", spec).await;
        project_until(db, "the run", || async {
            on_pool!(db, pool => sqlx::query_scalar::<_, i64>("SELECT count(*) FROM rm_runs")
                .fetch_one(pool).await.unwrap()) == 1
        })
        .await;
        on_pool!(db, pool => { sqlx::query("DROP INDEX rm_runs_v1_environment").execute(pool).await.unwrap(); });
        assert_eq!(runs_index_shapes(db).await.len(), current.len() - 1, "{backend:?}");

        // The next start adds it (under a name of its own), keeps the rows, and a start
        // after that adds nothing.
        runs.ensure_tables(db).await.unwrap();
        assert_eq!(runs_index_shapes(db).await, current, "{backend:?}");
        runs.ensure_tables(db).await.unwrap();
        assert_eq!(runs_index_shapes(db).await, current, "{backend:?}");
        let rows: i64 = on_pool!(db, pool => sqlx::query_scalar("SELECT count(*) FROM rm_runs")
            .fetch_one(pool).await.unwrap());
        assert_eq!(rows, 1, "{backend:?}");

        // A rebuilt table's indexes carry the rebuild's token in their names: recognised by
        // their shape, none is added again.
        rebuild_named(db, &all_projections(), Some("runs")).await.unwrap();
        runs.ensure_tables(db).await.unwrap();
        assert_eq!(runs_index_shapes(db).await, current, "{backend:?}");
        tdb.cleanup().await;
    }
}

/// Instances starting together on one Postgres make the read-model tables once and none
/// fails (they take turns; without the lock two CREATEs of one table can collide).
#[tokio::test]
async fn instances_starting_together_make_the_tables_once() {
    let tdb = TestDatabase::new(ferry_store::database::Backend::Postgres).await;
    let db = &tdb.db;
    let starts = (0..4).map(|_| async {
        for p in all_projections() {
            ProjectionRunner::live(p).ensure_tables(db).await?;
        }
        Ok::<(), sqlx::Error>(())
    });
    for started in futures::future::join_all(starts).await {
        started.unwrap();
    }
    assert_eq!(runs_index_shapes(db).await.len(), 3);
    tdb.cleanup().await;
}

#[test]
fn an_index_is_known_by_what_it_indexes() {
    use ferry_projections::projection::IndexShape;
    let spec = IndexShape::of(
        "CREATE INDEX IF NOT EXISTS rm_runs_v1_page ON rm_runs (tenant_id, position)",
    );
    let postgres = IndexShape::of(
        "CREATE INDEX rm_runs_rebuild_1a2b3c4d_page ON public.rm_runs USING btree (tenant_id, \"position\")",
    );
    assert!(spec.is_some());
    assert_eq!(spec, postgres);
    let unique = IndexShape::of(
        "CREATE UNIQUE INDEX rm_runs_pkey ON public.rm_runs USING btree (tenant_id, position)",
    );
    assert_ne!(spec, unique);
    let other = IndexShape::of("create index x on rm_runs (tenant_id,environment_id,position)");
    assert_ne!(spec, other);
    let written_over_lines = IndexShape::of(
        "\n  CREATE INDEX IF NOT EXISTS rm_runs_v1_page\n    ON rm_runs\n    (tenant_id,\n     position)",
    );
    assert_eq!(written_over_lines, spec);
    assert_eq!(
        IndexShape::of("CREATE TABLE IF NOT EXISTS rm_runs (id text PRIMARY KEY)"),
        None
    );
    assert_eq!(IndexShape::of("CREATE INDEX broken ON rm_runs"), None);
}

/// A read-your-writes wait reads the model once the projections it names have passed its
/// command's events, not before and not when another projection moves; again at each of
/// their commits while the check fails; on a poll when they do not move; at once when the
/// command recorded nothing.
#[tokio::test]
async fn a_wait_reads_once_its_projections_pass_the_command() {
    use ferry_projections::projection::Progress;
    use ferry_store::stream::Position;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;
    let at = |global_position| Position {
        transaction_id: 0,
        global_position,
    };
    let tdb = TestDatabase::new(ferry_store::database::Backend::Sqlite).await;
    let runs = tokio::sync::watch::channel(at(0)).0;
    let delivery = tokio::sync::watch::channel(at(0)).0;
    let senders = HashMap::from([("runs", runs.clone()), ("delivery", delivery.clone())]);
    let reads = ReadModels::new(tdb.db.clone(), Some(Progress::of(&senders)));
    // Time stands still while this task keeps running: the wait's 50-ms poll cannot fire.
    tokio::time::pause();
    let checks = Arc::new(AtomicUsize::new(0));
    let visible = Arc::new(AtomicBool::new(false));
    let wait = {
        let (reads, checks, visible) = (reads.clone(), checks.clone(), visible.clone());
        tokio::spawn(async move {
            reads
                .wait_until(Duration::from_secs(2), &["runs"], Some(at(5)), || {
                    checks.fetch_add(1, Ordering::SeqCst);
                    let visible = visible.load(Ordering::SeqCst);
                    async move { Ok(visible) }
                })
                .await
                .unwrap()
        })
    };
    let settle = || async {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    };
    let checked = || checks.load(Ordering::SeqCst);
    settle().await;
    assert_eq!(
        checked(),
        0,
        "not read before its projection passed the event"
    );
    for n in 1..=3 {
        delivery.send_replace(at(10 * n));
        settle().await;
    }
    assert_eq!(checked(), 0, "another projection's commits wake nothing");
    runs.send_replace(at(4));
    settle().await;
    assert_eq!(checked(), 0, "its projection moved, but not past the event");
    runs.send_replace(at(5));
    settle().await;
    assert_eq!(checked(), 1, "past the event: read");
    runs.send_replace(at(6));
    settle().await;
    assert_eq!(
        checked(),
        2,
        "the check failed: read again at its next commit"
    );
    visible.store(true, Ordering::SeqCst);
    runs.send_replace(at(7));
    assert!(wait.await.unwrap(), "seen after the next commit");
    assert_eq!(checked(), 3);

    // Its projection does not move (another instance may be projecting): polled every 50 ms
    // (not at once), then false at the deadline.
    let before = checked();
    let start = tokio::time::Instant::now();
    let seen = reads
        .wait_until(Duration::from_millis(200), &["runs"], Some(at(100)), || {
            checks.fetch_add(1, Ordering::SeqCst);
            async { Ok(false) }
        })
        .await
        .unwrap();
    assert!(!seen);
    // Timers fire on whole milliseconds.
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_millis(210),
        "{waited:?}"
    );
    assert_eq!(checked() - before, 4, "at 50, 100, 150 and 200 ms");

    // A command that recorded nothing has nothing to wait for: read at once.
    let before = checked();
    let seen = reads
        .wait_until(Duration::from_millis(200), &["runs"], None, || {
            checks.fetch_add(1, Ordering::SeqCst);
            async { Ok(true) }
        })
        .await
        .unwrap();
    assert!(seen);
    assert_eq!(checked() - before, 1);
    assert_eq!(start.elapsed(), waited, "no time passed");
    tdb.cleanup().await;
}

/// A run's wait is confirmed by this process's projection passing the command's last
/// event, without a read (the table here never holds the run); with no event to pass, or
/// before its projection passes it, it reads the table.
#[tokio::test]
async fn a_runs_wait_is_confirmed_by_its_projection_passing_the_command() {
    use ferry_projections::projection::Progress;
    use ferry_store::stream::Position;
    use std::collections::HashMap;
    use std::time::Duration;
    let at = |global_position| Position {
        transaction_id: 0,
        global_position,
    };
    let tdb = TestDatabase::new(ferry_store::database::Backend::Sqlite).await;
    project_all(&tdb.db).await;
    let runs = tokio::sync::watch::channel(at(0)).0;
    let reads = ReadModels::new(
        tdb.db.clone(),
        Some(Progress::of(&HashMap::from([("runs", runs.clone())]))),
    );
    let id = ProvisioningRunId::new_random();
    let wait = {
        let reads = reads.clone();
        tokio::spawn(async move {
            reads
                .wait_for_run(&t("a"), id, 1, Some(at(5)), Duration::from_secs(2))
                .await
                .unwrap()
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !wait.is_finished(),
        "not before the projection passes the event"
    );
    runs.send_replace(at(5));
    assert!(wait.await.unwrap());

    let start = tokio::time::Instant::now();
    let short = Duration::from_millis(200);
    let not_passed = reads
        .wait_for_run(&t("a"), id, 1, Some(at(9)), short)
        .await
        .unwrap();
    assert!(
        !not_passed,
        "not passed: the table decides, and holds no such run"
    );
    assert!(start.elapsed() >= short, "{:?}", start.elapsed());
    let nothing_to_pass = reads
        .wait_for_run(&t("a"), id, 1, None, short)
        .await
        .unwrap();
    assert!(!nothing_to_pass, "nothing to pass: the table decides");
    tdb.cleanup().await;
}

/// A live projection analyzes a table that grew past its last statistics (so that plans
/// cached while it was small are made again), beside the projector: once the changes are
/// counted, the next check analyzes it.
#[tokio::test]
async fn a_live_projection_analyzes_a_table_that_grew() {
    use ferry_projections::projection::GROWTH_CHECK_EVERY;
    let tdb = TestDatabase::new(ferry_store::database::Backend::Postgres).await;
    let db = &tdb.db;
    let runs = all_projections()
        .into_iter()
        .find(|p| p.name() == "runs")
        .unwrap();
    let runner = ProjectionRunner::live(runs).analyzing(db.clone());
    runner.ensure_tables(db).await.unwrap();
    // The autovacuum daemon must not analyze it behind the test's back.
    on_pool!(db, pool => sqlx::query("ALTER TABLE rm_runs SET (autovacuum_enabled = false)")
        .execute(pool).await.map(|_| ()).unwrap());
    let reltuples = || async {
        on_pool!(db, pool => sqlx::query_scalar::<_, f32>(
            "SELECT reltuples FROM pg_class WHERE oid = to_regclass('rm_runs')")
            .fetch_one(pool).await.unwrap())
    };
    let w = World::new(db);
    let spec = w.declare("a", "dev", "aaaaaaa").await;
    let requests = |n: u64| {
        let w = &w;
        async move {
            for _ in 0..n.div_ceil(16) {
                futures::future::join_all((0..16).map(|_| w.request("a", "dev", spec))).await;
            }
        }
    };
    // One catch-up can stop short while another test's transaction holds the stream back.
    let project = |runs: i64| {
        let runner = &runner;
        eventually("every run projected", move || async move {
            catch_up(db, runner).await.unwrap();
            let rows: i64 = on_pool!(db, pool => sqlx::query_scalar("SELECT count(*) FROM rm_runs")
                .fetch_one(pool).await.unwrap());
            (rows == runs).then_some(())
        })
    };
    // `requests` sends whole rounds of 16.
    let first = (GROWTH_CHECK_EVERY + 100).div_ceil(16) as i64 * 16;
    let second = GROWTH_CHECK_EVERY.div_ceil(16) as i64 * 16;
    requests(GROWTH_CHECK_EVERY + 100).await;
    project(first).await;
    // Postgres counts a connection's changes when it goes idle, at most once a second and
    // otherwise up to ten seconds later: a busy test suite can see them that late.
    eventually_within("the changes counted", 30, || async {
        let changed: i64 = on_pool!(db, pool => sqlx::query_scalar(
            "SELECT n_mod_since_analyze FROM pg_stat_user_tables WHERE relid = to_regclass('rm_runs')")
            .fetch_one(pool).await.unwrap());
        (changed >= GROWTH_CHECK_EVERY as i64).then_some(())
    })
    .await;
    // Past the next check, the table is analyzed.
    requests(GROWTH_CHECK_EVERY).await;
    project(first + second).await;
    eventually_within("rm_runs analyzed", 30, || async {
        (reltuples().await >= GROWTH_CHECK_EVERY as f32).then_some(())
    })
    .await;
    tdb.cleanup().await;
}

/// Every projection, live or being rebuilt, is a read model whose batches may commit
/// without waiting for the WAL flush (`Handler::replayable`); the delivery projection
/// (in the app) says the same through its runner.
#[test]
fn every_projection_runner_is_replayable() {
    use ferry_store::stream::Handler;
    for projection in all_projections() {
        let name = projection.name();
        assert!(
            ProjectionRunner::live(projection.clone()).replayable(),
            "{name}"
        );
        assert!(
            ProjectionRunner::with_suffix(projection, "_rebuild").replayable(),
            "{name}"
        );
    }
}
