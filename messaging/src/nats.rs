//! Connecting to NATS so that Ferry starts and keeps accepting commands while NATS is down.
//!
//! The client retries the first connection in the background and reconnects forever; each
//! (re)connection bumps a counter so that workers can re-check what a restarted server may
//! have lost (JetStream can lose acknowledged writes without fsync: Jepsen, NATS 2.12.1).
//!
//! Every connection Ferry makes goes through [`connect`] with the operator's [`NatsAuth`]:
//! on NATS the only proof of who published an event is the server's subject permissions, so
//! Ferry connects as its own user (a `.creds` file, an nkey, user and password, or a token),
//! over TLS when asked, and its replies arrive under its own inbox prefix ([`INBOX_PREFIX`])
//! that the server can keep other users from reading or writing. The files are checked when
//! the settings are read ([`check_creds_file`], [`read_nkey_seed_file`], [`check_pem_file`]),
//! so a bad one stops start-up instead of a client retrying forever in the background.

use ferry_domain::ports::SecretValue;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::watch;

/// The prefix of the subjects NATS replies to Ferry on (JetStream API answers, publish
/// acknowledgements, pulled messages). Only Ferry's user may subscribe to it and nobody may
/// publish to it: a message published there would reach Ferry as if JetStream had
/// delivered it.
pub const INBOX_PREFIX: &str = "_INBOX_ferry";

/// How Ferry proves who it is to NATS, and how the connection is protected.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NatsAuth {
    /// Who Ferry is.
    pub credentials: NatsCredentials,
    /// TLS.
    pub tls: NatsTls,
}

/// Ferry's NATS identity: one of these. Its `Debug` never shows a secret.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NatsCredentials {
    /// No credentials: only for a server without authentication.
    #[default]
    Anonymous,
    /// A `.creds` file (user JWT and nkey seed), read again at each connection.
    CredsFile(PathBuf),
    /// A user nkey seed (`SU…`), read from its file at start.
    NkeySeed {
        /// The file it was read from.
        file: PathBuf,
        /// The seed.
        seed: SecretValue,
    },
    /// A user and its password.
    UserPassword {
        /// The user.
        user: String,
        /// The password.
        password: SecretValue,
    },
    /// A token.
    Token(SecretValue),
}

/// TLS towards NATS.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NatsTls {
    /// PEM file of the certificate authorities the server's certificate must chain to.
    pub ca_file: Option<PathBuf>,
    /// PEM files of Ferry's client certificate and its key (for servers that verify clients).
    pub client_certificate: Option<(PathBuf, PathBuf)>,
    /// Refuse a connection without TLS.
    pub required: bool,
}

impl NatsTls {
    /// Whether the connection must use TLS: when asked, and whenever a CA or a client
    /// certificate is given (a server that merely stopped offering TLS would otherwise get
    /// the credentials in clear).
    pub fn is_required(&self) -> bool {
        self.required || self.ca_file.is_some() || self.client_certificate.is_some()
    }
}

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
    /// The URL, without any user or password it held.
    pub url: String,
    /// Why.
    pub reason: String,
}

/// A credentials, key or certificate file that cannot be used. Never shows the file's
/// content.
#[derive(Debug, thiserror::Error)]
pub enum CredentialFileError {
    /// The file cannot be read.
    #[error("cannot read {path}: {source}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Not a `.creds` file.
    #[error("{path} is not a NATS credentials file (a user JWT and its nkey seed): {reason}")]
    NotCreds {
        /// The file.
        path: PathBuf,
        /// What is wrong (never the content).
        reason: String,
    },
    /// Not a user nkey seed.
    #[error("{path} does not hold a NATS user nkey seed (one line starting with SU)")]
    NotSeed {
        /// The file.
        path: PathBuf,
    },
    /// No PEM block.
    #[error("{path} holds no PEM block (-----BEGIN ...)")]
    NotPem {
        /// The file.
        path: PathBuf,
    },
}

fn read(path: &Path) -> Result<String, CredentialFileError> {
    std::fs::read_to_string(path).map_err(|source| CredentialFileError::Unreadable {
        path: path.to_path_buf(),
        source,
    })
}

/// Checks that `path` is a `.creds` file async-nats can use.
pub fn check_creds_file(path: &Path) -> Result<(), CredentialFileError> {
    let text = read(path)?;
    async_nats::ConnectOptions::with_credentials(&text)
        .map(|_| ())
        .map_err(|e| CredentialFileError::NotCreds {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
}

/// The user nkey seed `path` holds (surrounding white space ignored).
pub fn read_nkey_seed_file(path: &Path) -> Result<SecretValue, CredentialFileError> {
    let text = read(path)?;
    let seed = text.trim();
    let not_seed = || CredentialFileError::NotSeed {
        path: path.to_path_buf(),
    };
    // A user seed: an account's or operator's key is refused by the server anyway.
    if !seed.starts_with("SU") {
        return Err(not_seed());
    }
    nkeys::KeyPair::from_seed(seed).map_err(|_| not_seed())?;
    Ok(SecretValue::new(seed))
}

/// Checks that `path` can be read and holds a PEM block (a certificate or a key).
pub fn check_pem_file(path: &Path) -> Result<(), CredentialFileError> {
    if read(path)?.contains("-----BEGIN ") {
        Ok(())
    } else {
        Err(CredentialFileError::NotPem {
            path: path.to_path_buf(),
        })
    }
}

/// `url` (a comma-separated list) with the user and password of each server replaced by
/// `***`, for messages and logs.
pub fn redacted_url(url: &str) -> String {
    url.split(',')
        .map(|server| match (server.find("://"), server.rfind('@')) {
            (Some(scheme), Some(at)) if at > scheme => {
                format!("{}***{}", &server[..scheme + 3], &server[at..])
            }
            (None, Some(at)) => format!("***{}", &server[at..]),
            _ => server.to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Connects to `url` (comma-separated server list allowed) as `auth` says. Returns at once
/// even when no server answers yet.
pub async fn connect(url: &str, auth: &NatsAuth, name: &str) -> Result<Connection, ConnectError> {
    let (tx, rx) = watch::channel(0u64);
    let tx = Arc::new(tx);
    let name_owned = name.to_string();
    let refused = |reason: String| ConnectError {
        url: redacted_url(url),
        reason,
    };
    let options = async_nats::ConnectOptions::new();
    let options = match &auth.credentials {
        NatsCredentials::Anonymous => options,
        NatsCredentials::CredsFile(path) => options
            .credentials_file(path)
            .await
            .map_err(|e| refused(format!("credentials file {}: {e}", path.display())))?,
        NatsCredentials::NkeySeed { seed, .. } => options.nkey(seed.expose().to_string()),
        NatsCredentials::UserPassword { user, password } => {
            options.user_and_password(user.clone(), password.expose().to_string())
        }
        NatsCredentials::Token(token) => options.token(token.expose().to_string()),
    };
    let options = match &auth.tls.ca_file {
        Some(ca) => options.add_root_certificates(ca.clone()),
        None => options,
    };
    let options = match &auth.tls.client_certificate {
        Some((cert, key)) => options.add_client_certificate(cert.clone(), key.clone()),
        None => options,
    };
    let client = options
        .require_tls(auth.tls.is_required())
        .name(name)
        .custom_inbox_prefix(INBOX_PREFIX)
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
                    // A refused login or a subject Ferry's user may not use: the operator's
                    // NATS configuration must change, so say it loudly.
                    async_nats::Event::ServerError(error) => {
                        tracing::warn!(client = %name, %error, "NATS refused Ferry's request");
                    }
                    other => tracing::debug!(client = %name, event = %other, "NATS event"),
                }
            }
        })
        .connect(url)
        .await
        .map_err(|e| refused(e.to_string()))?;
    Ok(Connection {
        client,
        connected: rx,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_loses_its_user_and_password_in_messages() {
        assert_eq!(
            redacted_url("nats://ferry:s3cret@a:4222,tls://tok@b:4222,nats://c:4222"),
            "nats://***@a:4222,tls://***@b:4222,nats://c:4222"
        );
        assert_eq!(redacted_url("u:p@a:4222"), "***@a:4222");
    }

    #[test]
    fn secrets_never_show_in_debug() {
        let auth = NatsAuth {
            credentials: NatsCredentials::UserPassword {
                user: "ferry".into(),
                password: SecretValue::new("s3cret-pw"),
            },
            tls: NatsTls::default(),
        };
        let shown = format!("{auth:?}");
        assert!(
            shown.contains("ferry") && !shown.contains("s3cret-pw"),
            "{shown}"
        );
        let token = format!("{:?}", NatsCredentials::Token(SecretValue::new("tok-123")));
        assert!(!token.contains("tok-123"), "{token}");
    }

    #[test]
    fn credential_files_are_checked_without_showing_them() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.creds");
        assert!(matches!(
            check_creds_file(&missing),
            Err(CredentialFileError::Unreadable { .. })
        ));
        let junk = dir.path().join("junk");
        std::fs::write(&junk, "SUNOTAREALSEEDATALL\n").unwrap();
        let e = check_creds_file(&junk).unwrap_err().to_string();
        assert!(
            e.contains("not a NATS credentials file") && !e.contains("SUNOT"),
            "{e}"
        );
        let e = read_nkey_seed_file(&junk).unwrap_err().to_string();
        assert!(e.contains("nkey seed") && !e.contains("SUNOT"), "{e}");
        let seed = nkeys::KeyPair::new_user().seed().unwrap();
        std::fs::write(&junk, format!("{seed}\n")).unwrap();
        assert_eq!(read_nkey_seed_file(&junk).unwrap().expose(), seed);
        let account = nkeys::KeyPair::new_account().seed().unwrap();
        std::fs::write(&junk, account).unwrap();
        assert!(read_nkey_seed_file(&junk).is_err());
        assert!(matches!(
            check_pem_file(&junk),
            Err(CredentialFileError::NotPem { .. })
        ));
        std::fs::write(
            &junk,
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        check_pem_file(&junk).unwrap();
    }
}
