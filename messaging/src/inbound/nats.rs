//! Durable pull consumers (explicit ack) for the inbound subjects.
//!
//! One consumer per subject (`ferry-inbound-<event>`), so that each works on servers before
//! 2.10 (no multi-subject filters) and one slow kind does not hold up the others. A subject
//! must be stored by some stream: the one already covering it (found with
//! `stream_by_subject`), else `FERRY_INBOUND`, which Ferry creates. Subjects under Ferry's
//! own stream (`provisioning.>`, `releases.promotions.>`) wait for the relay's stream
//! rather than create an overlapping one.

use super::{process, InboundContext, InboundHandler, InboundMetrics, Outcome, INBOUND};
use crate::subjects::{kebab, STREAM_SUBJECTS};
use async_nats::jetstream::{self, consumer, stream, AckKind};
use ferry_store::Database;
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument;

/// Settings of the inbound consumers. Suggested environment: `NATS_URL`,
/// `FERRY_NATS_INBOUND_STREAM`.
#[derive(Debug, Clone)]
pub struct InboundConfig {
    /// NATS server URL(s).
    pub nats_url: String,
    /// The stream Ferry creates for inbound subjects no other stream covers.
    pub inbound_stream: String,
    /// Prefix of the durable consumer names.
    pub durable_prefix: String,
    /// Subjects to consume (default: every subject of [`INBOUND`]).
    pub subjects: Vec<String>,
    /// How long NATS waits for an ack before redelivering.
    pub ack_wait: Duration,
    /// Duplicate window of the inbound stream Ferry creates.
    pub duplicate_window: Duration,
}

impl InboundConfig {
    /// Defaults for `nats_url`.
    pub fn new(nats_url: &str) -> Self {
        Self {
            nats_url: nats_url.to_string(),
            inbound_stream: "FERRY_INBOUND".to_string(),
            durable_prefix: "ferry-inbound".to_string(),
            subjects: INBOUND.iter().map(|(_, s)| s.to_string()).collect(),
            ack_wait: Duration::from_secs(60),
            duplicate_window: Duration::from_secs(2 * 60 * 60),
        }
    }
}

/// Why the consumers could not start.
#[derive(Debug, thiserror::Error)]
pub enum InboundStartError {
    /// The NATS client could not be set up.
    #[error(transparent)]
    Connect(#[from] crate::nats::ConnectError),
}

/// The running inbound consumers.
pub struct Inbound {
    handles: Vec<JoinHandle<()>>,
    metrics: Arc<InboundMetrics>,
    context: InboundContext,
}

impl Inbound {
    /// Starts one consumer per inbound subject with default settings.
    pub async fn start(
        db: Database,
        nats_url: &str,
        handler: Arc<dyn InboundHandler>,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Self, InboundStartError> {
        Self::start_with(
            InboundContext::new(db, handler),
            InboundConfig::new(nats_url),
            shutdown,
        )
        .await
    }

    /// Starts the consumers with `config`, sharing `context` (and its counters) with the
    /// HTTP endpoint. Returns at once, also when NATS is unreachable.
    pub async fn start_with(
        context: InboundContext,
        config: InboundConfig,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Self, InboundStartError> {
        let connection = crate::nats::connect(&config.nats_url, "ferry-inbound").await?;
        let js = jetstream::new(connection.client);
        let setup = Arc::new(tokio::sync::Mutex::new(()));
        let handles = config
            .subjects
            .iter()
            .map(|subject| {
                let worker = Consumer {
                    js: js.clone(),
                    ctx: context.clone(),
                    config: config.clone(),
                    subject: subject.clone(),
                    setup: setup.clone(),
                };
                let span = tracing::info_span!("nats_inbound", subject = %subject);
                tokio::spawn(worker.run(shutdown.clone()).instrument(span))
            })
            .collect();
        Ok(Self {
            handles,
            metrics: context.metrics.clone(),
            context,
        })
    }

    /// The counters (shared with [`Inbound::context`]).
    pub fn metrics(&self) -> Arc<InboundMetrics> {
        self.metrics.clone()
    }

    /// The processing context, to hand to the HTTP endpoint.
    pub fn context(&self) -> InboundContext {
        self.context.clone()
    }

    /// Waits until every consumer stopped (after `shutdown` turned true).
    pub async fn join(self) {
        for handle in self.handles {
            if let Err(error) = handle.await {
                tracing::error!(%error, "inbound consumer ended abnormally");
            }
        }
    }
}

/// Whether NATS subject `subject` matches `pattern` (`*` one token, `>` the rest).
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

struct Consumer {
    js: jetstream::Context,
    ctx: InboundContext,
    config: InboundConfig,
    subject: String,
    /// Serializes stream creation and updates: two concurrent updates of the subject list
    /// would each drop the other's subject.
    setup: Arc<tokio::sync::Mutex<()>>,
}

impl Consumer {
    async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let mut backoff = Duration::from_millis(200);
        loop {
            if *shutdown.borrow() {
                return;
            }
            match self.consume(&mut shutdown).await {
                Ok(()) => return,
                Err(error) => {
                    tracing::warn!(%error, retry_in_ms = backoff.as_millis() as u64, "inbound consumer interrupted");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = shutdown.changed() => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
            }
        }
    }

    /// The stream storing the subject, creating `FERRY_INBOUND` for it when none does.
    async fn stream_for_subject(&self) -> Result<stream::Stream, String> {
        if let Ok(name) = self.js.stream_by_subject(self.subject.clone()).await {
            return self.js.get_stream(name).await.map_err(|e| e.to_string());
        }
        if STREAM_SUBJECTS
            .iter()
            .any(|p| subject_matches(p, &self.subject))
        {
            return Err(format!(
                "no stream stores {} yet (the relay creates it)",
                self.subject
            ));
        }
        let _guard = self.setup.lock().await;
        // Another consumer may have added it while this one waited for the lock.
        if let Ok(name) = self.js.stream_by_subject(self.subject.clone()).await {
            return self.js.get_stream(name).await.map_err(|e| e.to_string());
        }
        // Every configured subject no stream stores yet (not only this one), in one update.
        let mut missing = Vec::new();
        for subject in &self.config.subjects {
            let ours = STREAM_SUBJECTS.iter().any(|p| subject_matches(p, subject));
            if !ours && self.js.stream_by_subject(subject.clone()).await.is_err() {
                missing.push(subject.clone());
            }
        }
        let name = &self.config.inbound_stream;
        match self.js.get_stream(name).await {
            Ok(mut existing) => {
                let mut config = existing
                    .info()
                    .await
                    .map_err(|e| e.to_string())?
                    .config
                    .clone();
                let before = config.subjects.len();
                for subject in missing {
                    if !config.subjects.iter().any(|s| subject_matches(s, &subject)) {
                        config.subjects.push(subject);
                    }
                }
                if config.subjects.len() != before {
                    self.js
                        .update_stream(config)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                self.js.get_stream(name).await.map_err(|e| e.to_string())
            }
            Err(_) => self
                .js
                .create_stream(stream::Config {
                    name: name.clone(),
                    subjects: missing,
                    duplicate_window: self.config.duplicate_window,
                    storage: stream::StorageType::File,
                    ..Default::default()
                })
                .await
                .map_err(|e| e.to_string()),
        }
    }

    async fn consume(&self, shutdown: &mut watch::Receiver<bool>) -> Result<(), String> {
        let stream = self.stream_for_subject().await?;
        let name = format!(
            "{}-{}",
            self.config.durable_prefix,
            super::inbound_name(&self.subject).map_or_else(|| kebab(&self.subject), kebab)
        );
        let consumer: consumer::PullConsumer = stream
            .get_or_create_consumer(
                &name,
                consumer::pull::Config {
                    durable_name: Some(name.clone()),
                    filter_subject: self.subject.clone(),
                    ack_policy: consumer::AckPolicy::Explicit,
                    deliver_policy: consumer::DeliverPolicy::All,
                    ack_wait: self.config.ack_wait,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| e.to_string())?;
        let mut messages = consumer.messages().await.map_err(|e| e.to_string())?;
        tracing::info!(consumer = %name, "consuming");
        loop {
            let next = tokio::select! {
                m = messages.next() => m,
                _ = shutdown.changed() => return Ok(()),
            };
            let message = match next {
                Some(Ok(m)) => m,
                Some(Err(e)) => return Err(e.to_string()),
                None => return Err("message stream ended".to_string()),
            };
            let delivered = message.info().map(|i| i.delivered).unwrap_or(1);
            let outcome = process(
                &self.ctx,
                "nats",
                Some(message.subject.as_str()),
                None,
                &message.payload,
            )
            .await;
            let ack = match &outcome {
                Outcome::Handled { .. } | Outcome::Duplicate { .. } => AckKind::Ack,
                Outcome::Malformed(_) | Outcome::Rejected(_) | Outcome::Forbidden(_) => {
                    AckKind::Term
                }
                Outcome::Busy(_) => AckKind::Nak(Some(Duration::from_secs(5))),
                Outcome::Transient(reason) => {
                    tracing::warn!(%reason, delivered, "inbound message will be retried");
                    AckKind::Nak(Some(nak_delay(delivered)))
                }
            };
            if let Err(error) = message.ack_with(ack).await {
                // The message comes back after ack_wait; the table keeps it from a second effect.
                tracing::warn!(%error, "cannot acknowledge an inbound message");
            }
        }
    }
}

/// Retry delay after a transient failure: 1 s, 2 s, 4 s, … at most one minute.
fn nak_delay(delivered: i64) -> Duration {
    let exp = u32::try_from(delivered.clamp(1, 7) - 1).unwrap_or(0);
    Duration::from_secs(2u64.pow(exp)).min(Duration::from_secs(60))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_match_wildcards() {
        assert!(subject_matches(
            "provisioning.>",
            "provisioning.runs.v1.provisioning-applied"
        ));
        assert!(subject_matches(
            "environments.v1.*",
            "environments.v1.environment-created"
        ));
        assert!(!subject_matches("environments.v1.*", "environments.v1.a.b"));
        assert!(!subject_matches(
            "releases.promotions.>",
            "releases.releases.v1.release-ready"
        ));
        assert!(subject_matches("a.b", "a.b"));
        assert!(!subject_matches("a.b", "a"));
    }

    #[test]
    fn retry_delays_grow_and_stop_growing() {
        assert_eq!(nak_delay(1), Duration::from_secs(1));
        assert_eq!(nak_delay(3), Duration::from_secs(4));
        assert_eq!(nak_delay(100), Duration::from_secs(60));
    }
}
