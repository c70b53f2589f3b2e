//! Ferry's work machinery, which knows no bounded context: a durable queue ([`queue`]) of
//! work items fed from the global stream by a context's subscription, claimed under leases
//! with fencing tokens, and run by the context's [`Steps`]. A context registers its steps
//! (what each item does, which events make work, how an interrupted apply is settled); this
//! crate runs them, retries them with exponential back-off, and recovers what a stopped
//! instance left.
//!
//! **An apply runs at most once, and at most one runner per environment at any moment.**
//!
//! * Every claim carries a fresh fencing token; every write of the item is conditioned on it
//!   (see [`queue`]), so an owner that lost its claim can never overwrite what recovery or
//!   the next owner wrote.
//! * The owner renews its lease every sixth of [`Settings::lease`] and **fences itself**:
//!   when neither a renewal nor (Postgres) its liveness lock was confirmed for two thirds of
//!   the lease, or a renewal finds the claim taken over, the step's future is dropped before
//!   the lease can end. Dropping it drops the runner's future, which kills the runner (the
//!   Pulumi runner kills its whole process group). The heartbeat measures on the queue's
//!   [`clock::Clock`] and is not held up by a renewal that hangs.
//! * Recovery settles an interrupted apply only when its owner is **known gone**, not when
//!   its lease lapsed (see [`liveness`]: on Postgres an advisory lock the owner holds while
//!   it runs the apply, plus a grace period past the lease; on SQLite, claims of this
//!   process), through [`Steps::settle_interrupted`], which records the stored result if the
//!   runner had returned and otherwise reports the work failed; the item is marked only after
//!   that was recorded. The next apply in the environment can be claimed only then.
//! * The steps store the runner's result on the item before the outcome is recorded
//!   ([`Queue::store_result`]); a retry after a store error records the stored result and
//!   never runs the runner again.
#![forbid(unsafe_code)]

pub mod clock;
pub mod liveness;
pub mod queue;

use clock::{ms, Clock, SystemClock};
use ferry_store::stream::run_subscription;
use ferry_store::{Database, Subscription};
use liveness::{Life, Liveness, LivenessError};
use queue::{Queue, QueueError, Step, WorkItem};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Semaphore};
use tracing::Instrument;

/// How a step ended.
#[derive(Debug)]
pub enum Outcome {
    /// The work is done.
    Done,
    /// The work failed for good, for this reason.
    Failed(String),
    /// The work is tried again after the back-off, for this reason.
    Retry(String),
    /// The runner ran but its result could not be stored: the item is left running for
    /// recovery (retrying it would run the runner again).
    Abandoned(String),
    /// A fenced write found the claim taken over: nothing more may be written.
    ClaimLost,
}

/// Why an interrupted apply could not be settled.
#[derive(Debug, thiserror::Error)]
pub enum SettleError {
    /// The queue failed (a lost claim: someone else settled it).
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// The work's outcome could not be recorded.
    #[error("cannot record the interrupted apply's outcome: {0}")]
    Record(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// What a bounded context's work does: the events that make work items, and each item's
/// step. Dropping the future of [`Steps::run`] must stop whatever the step started (its
/// runner): that is how a worker that lost its lease fences itself.
#[async_trait::async_trait]
pub trait Steps: Send + Sync + 'static {
    /// The subscription that turns stored events into work items ([`queue::enqueue`]), in
    /// the same transaction as its checkpoint.
    fn subscription(&self) -> Subscription;

    /// Runs one claimed item.
    async fn run(&self, item: &WorkItem) -> Outcome;

    /// Settles a running apply whose owner is known gone: records what the item's stored
    /// result says, or reports the work failed as interrupted, then marks the item with the
    /// queue's fenced writes. An error leaves the item for the next recovery round.
    async fn settle_interrupted(&self, item: &WorkItem) -> Result<(), SettleError>;
}

/// Worker settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// First retry delay; doubles each time.
    pub backoff: Duration,
    /// Longest retry delay.
    pub backoff_cap: Duration,
    /// How long a claimed item is held without a renewal. The owner renews every sixth of
    /// it and stops its step when nothing was confirmed for two thirds of it.
    pub lease: Duration,
    /// How often the heartbeat looks at the clock (renewals and the self-fencing check).
    pub heartbeat: Duration,
    /// On Postgres, how long past the end of its lease an apply whose owner's liveness lock
    /// is free waits before it is reported interrupted (covers clock skew between
    /// instances and the owner's time to stop its runner).
    pub recovery_grace: Duration,
    /// The clock leases and the heartbeat go by.
    pub clock: Arc<dyn Clock>,
    /// Steps run at once.
    pub concurrency: usize,
    /// Queue polling when nothing wakes the workers.
    pub poll: Duration,
    /// This process's name in `claimed_by`.
    pub instance: String,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            backoff: Duration::from_secs(2),
            backoff_cap: Duration::from_secs(300),
            lease: Duration::from_secs(60),
            heartbeat: Duration::from_secs(1),
            recovery_grace: Duration::from_secs(30),
            clock: Arc::new(SystemClock),
            concurrency: 4,
            poll: Duration::from_millis(500),
            instance: format!("ferry-{}", uuid::Uuid::new_v4().simple()),
        }
    }
}

/// The workers: a context's steps run over the queue.
pub struct Workers<S> {
    db: Database,
    settings: Settings,
    queue: Queue,
    liveness: Liveness,
    steps: S,
}

impl<S: Steps> Workers<S> {
    /// Workers over `db`, running the steps `steps` makes from the workers' queue.
    pub fn new(db: Database, settings: Settings, steps: impl FnOnce(Queue) -> S) -> Arc<Self> {
        let queue = Queue::with_clock(
            db.clone(),
            settings.instance.clone(),
            settings.clock.clone(),
        );
        Arc::new(Self {
            steps: steps(queue.clone()),
            queue,
            liveness: Liveness::of(&db),
            db,
            settings,
        })
    }

    /// The queue (for diagnostics and tests).
    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    /// The steps.
    pub fn steps(&self) -> &S {
        &self.steps
    }

    /// Starts the steps' subscription and the worker loop.
    pub fn start(self: &Arc<Self>, shutdown: watch::Receiver<bool>) {
        tokio::spawn(run_subscription(
            self.db.clone(),
            Arc::new(self.steps.subscription()),
            self.settings.poll,
            shutdown.clone(),
            None,
        ));
        let me = self.clone();
        tokio::spawn(async move { me.run(shutdown).await });
    }

    async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let permits = Arc::new(Semaphore::new(self.settings.concurrency.max(1)));
        let mut commits = self.db.subscribe_commits();
        loop {
            if *shutdown.borrow() {
                return;
            }
            if let Err(error) = self.recover().await {
                tracing::warn!(%error, "cannot look for interrupted work");
            }
            let mut claimed_any = false;
            while let Ok(permit) = permits.clone().try_acquire_owned() {
                let token = uuid::Uuid::new_v4().to_string();
                let life = self.liveness.reserve(&token);
                match self.queue.claim(&token, self.settings.lease).await {
                    Ok(Some(item)) => {
                        claimed_any = true;
                        let me = self.clone();
                        tokio::spawn(async move {
                            me.execute(item, life).await;
                            drop(permit);
                        });
                    }
                    Ok(None) => break,
                    Err(error) => {
                        tracing::warn!(%error, "cannot claim work");
                        break;
                    }
                }
            }
            if claimed_any {
                continue;
            }
            tokio::select! {
                _ = commits.changed() => {}
                _ = tokio::time::sleep(self.settings.poll) => {}
                _ = shutdown.changed() => {}
            }
        }
    }

    /// Runs one claimed item under its lease heartbeat, then records how it ended.
    async fn execute(self: Arc<Self>, item: WorkItem, life: Life) {
        let span = tracing::info_span!("work", item = %item.item_id, step = item.step.as_str(), attempt = item.attempts);
        self.execute_claimed(item, life).instrument(span).await;
    }

    async fn execute_claimed(&self, item: WorkItem, mut life: Life) {
        if item.step == Step::Apply {
            if let Err(error) = life.hold().await {
                // Nothing ran yet: giving the item back is safe.
                tracing::warn!(%error, "cannot take the apply's liveness lock; the item goes back to the queue");
                let reason = format!("not started: {error}");
                self.write_outcome(&item, Outcome::Retry(reason)).await;
                life.release().await;
                return;
            }
        }
        let ended = {
            let step = self.steps.run(&item);
            let heartbeat = self.heartbeat(&item, &mut life);
            tokio::select! {
                biased;
                outcome = step => Ok(outcome),
                fence = heartbeat => Err(fence),
            }
        };
        // The step's future is gone from here on, and with it any runner it started.
        match ended {
            Ok(outcome) => self.write_outcome(&item, outcome).await,
            Err(fence) if item.step == Step::Apply => tracing::error!(
                %fence,
                "apply interrupted by a lost lease: its runner was stopped; the run is reported Failed once this claim is known gone"
            ),
            Err(fence) => {
                tracing::warn!(%fence, "step stopped: it lost its lease; recovery resumes it")
            }
        }
        // Only now, with the runner stopped, may a recoverer see this owner gone.
        life.release().await;
    }

    /// Renews the lease and confirms the liveness lock until the step must stop (see the
    /// crate doc); returns why. Never returns while the claim is confirmed.
    async fn heartbeat(&self, item: &WorkItem, life: &mut Life) -> Fence {
        let clock = self.queue.clock().clone();
        let lease = self.settings.lease;
        let lease_ms = ms(lease);
        let margin = lease_ms / 3 * 2;
        let renew_every = lease_ms / 6;
        let tick = self.settings.heartbeat;
        let claimed_at = item.lease_until.saturating_sub(lease_ms);
        let renewed = AtomicI64::new(claimed_at);
        let confirmed = AtomicI64::new(claimed_at);
        let renewer = async {
            let mut last_attempt = claimed_at;
            loop {
                tokio::time::sleep(tick).await;
                let now = clock.now_ms();
                if now.saturating_sub(last_attempt) < renew_every {
                    continue;
                }
                last_attempt = now;
                match self.queue.renew(item, lease).await {
                    Ok(until) => renewed.store(until.saturating_sub(lease_ms), Ordering::SeqCst),
                    Err(QueueError::ClaimLost { .. }) => return Fence::ClaimLost,
                    Err(error) => tracing::warn!(%error, "cannot renew the lease"),
                }
                match life.confirm().await {
                    Ok(()) => confirmed.store(now, Ordering::SeqCst),
                    Err(error) => tracing::warn!(%error, "cannot confirm the liveness lock"),
                }
            }
        };
        // Separate from the renewer, so that a renewal that hangs cannot delay the fence.
        let watchdog = async {
            loop {
                tokio::time::sleep(tick).await;
                let last = renewed
                    .load(Ordering::SeqCst)
                    .min(confirmed.load(Ordering::SeqCst));
                let unconfirmed = clock.now_ms().saturating_sub(last);
                if unconfirmed >= margin {
                    return Fence::Unconfirmed(unconfirmed);
                }
            }
        };
        tokio::select! {
            fence = renewer => fence,
            fence = watchdog => fence,
        }
    }

    /// Writes how a step ended onto its item (fenced: a lost claim writes nothing).
    async fn write_outcome(&self, item: &WorkItem, outcome: Outcome) {
        let written = match outcome {
            Outcome::Done => self.queue.done(item).await,
            Outcome::Failed(reason) => {
                tracing::warn!(%reason, "step failed");
                self.queue.failed(item, &reason).await
            }
            Outcome::Retry(reason) => {
                let delay = self.backoff(item.attempts);
                tracing::info!(%reason, retry_in_s = delay.as_secs_f64(), "step will be retried");
                self.queue.retry(item, &reason, delay).await
            }
            Outcome::Abandoned(reason) => {
                tracing::error!(%reason, "the item is left to recovery");
                return;
            }
            Outcome::ClaimLost => {
                tracing::error!("the claim was lost during the step; nothing more is written");
                return;
            }
        };
        match written {
            Ok(()) => {}
            Err(error @ QueueError::ClaimLost { .. }) => {
                tracing::error!(%error, "the step's outcome is not written: whoever took the item over settles it");
            }
            Err(error) => {
                tracing::error!(%error, "cannot record the step's outcome; recovery settles the item");
            }
        }
    }

    /// Exponential back-off with a cap.
    fn backoff(&self, attempts: i64) -> Duration {
        let factor = 2u32.saturating_pow(u32::try_from(attempts.max(1) - 1).unwrap_or(u32::MAX));
        self.settings
            .backoff
            .saturating_mul(factor)
            .min(self.settings.backoff_cap)
    }

    /// One recovery round over the running items: an apply whose owner is known gone is
    /// settled (its stored result recorded, else its run reported Failed as interrupted;
    /// never re-run blindly); another step whose lease lapsed is resumed. Returns how many
    /// items it settled; an item it could not settle stays for the next round.
    pub async fn recover(&self) -> Result<usize, QueueError> {
        let now = self.queue.clock().now_ms();
        let grace = ms(self.settings.recovery_grace);
        let mut settled = 0;
        for item in self.queue.running().await? {
            let span = tracing::info_span!("recover", item = %item.item_id, step = item.step.as_str(), attempt = item.attempts);
            match self.recover_item(&item, now, grace).instrument(span.clone()).await {
                Ok(true) => settled += 1,
                Ok(false) => {}
                // Settled by someone else meanwhile.
                Err(RecoverError::Queue(QueueError::ClaimLost { .. })) => {}
                Err(error) => span.in_scope(|| {
                    tracing::error!(%error, "cannot settle the interrupted item; next round tries again")
                }),
            }
        }
        Ok(settled)
    }

    async fn recover_item(
        &self,
        item: &WorkItem,
        now: i64,
        grace: i64,
    ) -> Result<bool, RecoverError> {
        if item.step == Step::Apply {
            if !self.liveness.owner_gone(item, now, grace).await? {
                return Ok(false);
            }
            self.steps.settle_interrupted(item).await?;
            return Ok(true);
        }
        if item.lease_until >= now {
            return Ok(false);
        }
        tracing::info!("resuming interrupted step");
        self.queue
            .retry(item, "interrupted; resumed", Duration::ZERO)
            .await?;
        Ok(true)
    }
}

/// Why a step was stopped before it ended.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Fence {
    /// Neither the lease nor the liveness lock was confirmed for this long.
    #[error("the claim was not confirmed for {0} ms (two thirds of the lease)")]
    Unconfirmed(i64),
    /// A renewal found the claim taken over.
    #[error("a renewal found the claim taken over")]
    ClaimLost,
}

/// Why recovery could not settle an item.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RecoverError {
    /// The queue failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// The owner's liveness could not be probed.
    #[error(transparent)]
    Liveness(#[from] LivenessError),
    /// The outcome could not be recorded.
    #[error(transparent)]
    Record(Box<dyn std::error::Error + Send + Sync>),
}

impl From<SettleError> for RecoverError {
    fn from(error: SettleError) -> Self {
        match error {
            SettleError::Queue(e) => Self::Queue(e),
            SettleError::Record(e) => Self::Record(e),
        }
    }
}

#[cfg(test)]
mod tests;
