//! Connecting to NATS so that Ferry starts and keeps accepting commands while NATS is down.
//!
//! The client retries the first connection in the background and reconnects forever; each
//! (re)connection bumps a counter so that workers can re-check what a restarted server may
//! have lost (JetStream can lose acknowledged writes without fsync: Jepsen, NATS 2.12.1).

use std::sync::Arc;
use tokio::sync::watch;

/// A NATS client plus a counter of (re)connections.
#[derive(Clone, Debug)]
pub struct Connection {
    /// The client.
    pub client: async_nats::Client,
    /// Incremented on every successful (re)connection.
    pub connected: watch::Receiver<u64>,
}

/// Failure to set up the NATS client (a bad URL or option, not an unreachable server).
#[derive(Debug, thiserror::Error)]
#[error("cannot set up the NATS client for {url}: {reason}")]
pub struct ConnectError {
    /// The URL.
    pub url: String,
    /// Why.
    pub reason: String,
}

/// Connects to `url` (comma-separated server list allowed). Returns at once even when no
/// server answers yet.
pub async fn connect(url: &str, name: &str) -> Result<Connection, ConnectError> {
    let (tx, rx) = watch::channel(0u64);
    let tx = Arc::new(tx);
    let name_owned = name.to_string();
    let client = async_nats::ConnectOptions::new()
        .name(name)
        .retry_on_initial_connect()
        .event_callback(move |event| {
            let tx = tx.clone();
            let name = name_owned.clone();
            async move {
                match event {
                    async_nats::Event::Connected => {
                        tracing::info!(client = %name, "connected to NATS");
                        tx.send_modify(|n| *n = n.wrapping_add(1));
                    }
                    async_nats::Event::Disconnected => {
                        tracing::warn!(client = %name, "disconnected from NATS; reconnecting");
                    }
                    other => tracing::debug!(client = %name, event = %other, "NATS event"),
                }
            }
        })
        .connect(url)
        .await
        .map_err(|e| ConnectError {
            url: url.to_string(),
            reason: e.to_string(),
        })?;
    Ok(Connection {
        client,
        connected: rx,
    })
}
