//! The machinery with a toy context's steps, on both engines: what a context registers is
//! run, retried with back-off and fenced, whatever the steps do. (Provisioning's steps,
//! with their faults injected, are tested in its context.)

use crate::queue::{enqueue, now_ms, Step, WorkItem};
use crate::{Outcome, Settings, SettleError, Steps, Workers};
use ferry_store::stream::Tx;
use ferry_store::testing::{eventually, TestDatabase};
use ferry_store::{on_pool, Subscription};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A toy context's steps: item `retry-*` asks for a retry on its first attempt, `fail-*`
/// fails, `hang-*` never ends (and counts being dropped); the rest are done at once.
#[derive(Default)]
struct Toy {
    runs: Mutex<HashMap<String, usize>>,
    dropped: Arc<AtomicUsize>,
}

/// Counts a step's future dropped before it ended.
struct DropGuard(Arc<AtomicUsize>);

impl Drop for DropGuard {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl Steps for Arc<Toy> {
    fn subscription(&self) -> Subscription {
        // The toy's items are enqueued by the test.
        Subscription::new("toy-workers")
    }

    async fn run(&self, item: &WorkItem) -> Outcome {
        let runs = {
            let mut runs = self.runs.lock().unwrap();
            let n = runs.entry(item.item_id.clone()).or_default();
            *n += 1;
            *n
        };
        match item.item_id.split('-').next() {
            Some("retry") if runs == 1 => Outcome::Retry("not yet".to_string()),
            Some("fail") => Outcome::Failed("the toy refuses".to_string()),
            Some("hang") => {
                let _guard = DropGuard(self.dropped.clone());
                std::future::pending::<()>().await;
                Outcome::Done
            }
            _ => Outcome::Done,
        }
    }

    async fn settle_interrupted(&self, item: &WorkItem) -> Result<(), SettleError> {
        unreachable!("no owner is gone in these tests: {item:?}")
    }
}

async fn started(db: &ferry_store::Database, toy: &Arc<Toy>) -> tokio::sync::watch::Sender<bool> {
    let settings = Settings {
        backoff: Duration::from_millis(10),
        heartbeat: Duration::from_millis(10),
        lease: Duration::from_millis(600),
        poll: Duration::from_millis(20),
        ..Settings::default()
    };
    let workers = Workers::new(db.clone(), settings, |_| toy.clone());
    let (stop, rx) = tokio::sync::watch::channel(false);
    workers.start(rx);
    stop
}

async fn add(db: &ferry_store::Database, item: &str, step: Step) {
    let mut tx = Tx::begin(db).await.unwrap();
    enqueue(&mut tx, item, step, "toy", "toy/one", now_ms(), None, None)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

async fn status(
    db: &ferry_store::Database,
    item: &str,
    step: Step,
) -> Option<(String, Option<String>, i64)> {
    crate::queue::Queue::new(db.clone(), "probe".to_string())
        .status(item, step)
        .await
        .unwrap()
}

ferry_store::test_on_both_engines! {
    async fn a_contexts_steps_run_once_each_and_a_retry_runs_again(backend) {
        let tdb = TestDatabase::new(backend).await;
        let toy = Arc::new(Toy::default());
        let _stop = started(&tdb.db, &toy).await;
        add(&tdb.db, "done-1", Step::Plan).await;
        add(&tdb.db, "retry-1", Step::Plan).await;
        add(&tdb.db, "fail-1", Step::Baseline).await;
        let retried = eventually("the retried item is done", || async {
            status(&tdb.db, "retry-1", Step::Plan).await.filter(|s| s.0 == "done")
        })
        .await;
        assert_eq!(retried.2, 2, "two attempts");
        let failed = eventually("the failing item failed", || async {
            status(&tdb.db, "fail-1", Step::Baseline).await.filter(|s| s.0 == "failed")
        })
        .await;
        assert_eq!(failed.1.as_deref(), Some("the toy refuses"));
        eventually("the plain item is done", || async {
            status(&tdb.db, "done-1", Step::Plan).await.filter(|s| s.0 == "done")
        })
        .await;
        let runs = toy.runs.lock().unwrap().clone();
        assert_eq!(runs.get("done-1"), Some(&1));
        assert_eq!(runs.get("retry-1"), Some(&2));
        assert_eq!(runs.get("fail-1"), Some(&1), "a failure is not retried");
    }
}

ferry_store::test_on_both_engines! {
    async fn a_step_whose_claim_is_taken_over_is_dropped_and_writes_nothing(backend) {
        let tdb = TestDatabase::new(backend).await;
        let toy = Arc::new(Toy::default());
        let _stop = started(&tdb.db, &toy).await;
        add(&tdb.db, "hang-1", Step::Plan).await;
        eventually("the item runs", || async {
            toy.runs.lock().unwrap().contains_key("hang-1").then_some(())
        })
        .await;
        // Someone else (recovery) takes the claim over.
        let sql = "UPDATE work_items SET claim_token = 'taken-over' WHERE item_id = 'hang-1'";
        on_pool!(tdb.db, pool => sqlx::query(sql).execute(pool).await.unwrap().rows_affected());
        eventually("the step's future is dropped", || async {
            (toy.dropped.load(Ordering::SeqCst) == 1).then_some(())
        })
        .await;
        let (state, error, _) = status(&tdb.db, "hang-1", Step::Plan).await.unwrap();
        assert_eq!((state.as_str(), error), ("running", None), "the old owner wrote nothing");
    }
}
