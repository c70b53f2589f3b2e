//! The HTTP client verification probes a tenant's URLs with (health URLs, smoke checks):
//! it connects only to public addresses.
//!
//! A URL is checked when it is recorded and again before each probe
//! ([`Confinement::check_probe`](ferry_domain::confinement::Confinement::check_probe)): its
//! prefix, and its host when it is a literal address. A name is checked here, on the
//! addresses it resolves to: the client's resolver drops every non-public one, and the
//! connection goes to what is left, so no second lookup can answer differently (DNS
//! rebinding). Redirects are not followed (a 3xx is the answer), and no proxy is used (the
//! address checked is the address connected to).

use ferry_domain::confinement::is_public;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// A name that resolved to no address a probe may reach.
#[derive(Debug, thiserror::Error)]
#[error(
    "{name} resolves to no public address ({}); probes reach non-public addresses only when \
     a probe URL prefix (FERRY_TENANT_PROBE_URL_PREFIXES) names the address",
    listing(.refused)
)]
pub struct NonPublicName {
    /// The name.
    pub name: String,
    /// The addresses it resolved to, all refused.
    pub refused: Vec<SocketAddr>,
}

fn listing(addresses: &[SocketAddr]) -> String {
    if addresses.is_empty() {
        return "no addresses".to_string();
    }
    addresses
        .iter()
        .map(|a| a.ip().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Resolves with the system's resolver and keeps only public addresses.
#[derive(Debug, Default)]
struct PublicOnly;

impl Resolve for PublicOnly {
    fn resolve(&self, name: Name) -> Resolving {
        let name = name.as_str().to_string();
        Box::pin(async move {
            let resolved: Vec<SocketAddr> = tokio::net::lookup_host((name.as_str(), 0))
                .await
                .map_err(|e| Box::new(e) as BoxError)?
                .collect();
            let (public, refused): (Vec<SocketAddr>, Vec<SocketAddr>) =
                resolved.into_iter().partition(|a| is_public(a.ip()));
            if public.is_empty() {
                tracing::info!(%name, ?refused, "probe refused: the name resolves to no public address");
                return Err(Box::new(NonPublicName { name, refused }) as BoxError);
            }
            Ok(Box::new(public.into_iter()) as Addrs)
        })
    }
}

/// Why tenants' URLs are not probed at all: the probe client could not be built.
#[derive(Debug, thiserror::Error)]
#[error("the probe client could not be built: {0}")]
pub struct NoProbeClient(#[source] reqwest::Error);

/// The client for a tenant's probes: public addresses only, no redirects, no proxy.
pub fn client(timeout: Duration) -> Result<reqwest::Client, NoProbeClient> {
    reqwest::Client::builder()
        .timeout(timeout)
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .dns_resolver(Arc::new(PublicOnly))
        .build()
        .map_err(NoProbeClient)
}

/// Why a probe's request failed because its address was refused, if it was.
pub fn refused(error: &reqwest::Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if let Some(refusal) = e.downcast_ref::<NonPublicName>() {
            return Some(refusal.to_string());
        }
        source = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A name that resolves to loopback (`localhost`, from the hosts file: no traffic
    /// leaves the machine) is refused before any connection, with the addresses named.
    #[tokio::test]
    async fn a_name_resolving_to_loopback_is_not_connected_to() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
        let client = client(Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e}"));
        let error = client
            .get(format!("http://localhost:{port}/metrics"))
            .send()
            .await
            .expect_err("refused");
        let reason = refused(&error).unwrap_or_else(|| panic!("not a refusal: {error:?}"));
        assert!(
            reason.contains("localhost resolves to no public address"),
            "{reason}"
        );
        assert!(
            reason.contains("127.0.0.1") || reason.contains("::1"),
            "{reason}"
        );
        // Nothing connected: the listener has no connection waiting.
        let waiting = futures::FutureExt::now_or_never(listener.accept());
        assert!(waiting.is_none(), "a connection was made");
    }
}
