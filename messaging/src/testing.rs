//! Test helpers for other crates' tests: a real `nats-server` per test, on a free port with
//! its own store, that a test can kill, restart empty, or crash so that it loses the tail
//! of a stream; or one started from a configuration file with users and permissions
//! ([`Nats::start_with_config`]). Built with the `testing` feature.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use async_nats::jetstream;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const NATS_BIN: &str = "/usr/sbin/nats-server";

/// A nats-server with JetStream on a free port and its own store directory.
pub struct Nats {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<tokio::process::Child>,
    config: Option<ServerConfig>,
}

/// A configuration file, the variables it reads, and Ferry's user in it (user, password).
struct ServerConfig {
    file: PathBuf,
    env: Vec<(String, String)>,
    ferry: (String, String),
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

impl Nats {
    pub async fn start() -> Self {
        let mut n = Self {
            port: free_port(),
            dir: tempfile::tempdir().unwrap(),
            child: None,
            config: None,
        };
        n.spawn().await;
        n
    }

    /// A server started from the configuration file `file` (users and permissions), with
    /// `env` as the variables it reads; its address, port and store folder are given on
    /// the command line, so the file must not set a store folder. It is up when Ferry's
    /// user `ferry` (user, password; replies under Ferry's inbox prefix) can ask JetStream
    /// for its account; [`Nats::js`] is that user's.
    pub async fn start_with_config(file: &Path, env: &[(&str, &str)], ferry: (&str, &str)) -> Self {
        let mut n = Self {
            port: free_port(),
            dir: tempfile::tempdir().unwrap(),
            child: None,
            config: Some(ServerConfig {
                file: file.to_path_buf(),
                env: env
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                ferry: (ferry.0.to_string(), ferry.1.to_string()),
            }),
        };
        n.spawn().await;
        n
    }

    /// A client of user `user`.
    pub async fn connect_as(&self, user: &str, password: &str) -> async_nats::Client {
        async_nats::ConnectOptions::with_user_and_password(user.to_string(), password.to_string())
            .connect(self.url())
            .await
            .unwrap()
    }

    /// A client as Ferry's user, or anonymous when the server has no configuration file.
    async fn probe(&self) -> Result<async_nats::Client, async_nats::ConnectError> {
        let options = match &self.config {
            Some(ServerConfig {
                ferry: (user, password),
                ..
            }) => {
                async_nats::ConnectOptions::with_user_and_password(user.clone(), password.clone())
                    .custom_inbox_prefix(crate::nats::INBOX_PREFIX)
            }
            None => async_nats::ConnectOptions::new(),
        };
        options.connect(self.url()).await
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn store_dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    async fn spawn(&mut self) {
        let mut command = tokio::process::Command::new(NATS_BIN);
        if let Some(config) = &self.config {
            command
                .arg("-c")
                .arg(&config.file)
                .envs(config.env.iter().cloned());
        }
        let child = command
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.store_dir())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("nats-server starts");
        self.child = Some(child);
        // Ready when a client can ask JetStream for the account.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(Ok(client)) = tokio::time::timeout(Duration::from_secs(1), self.probe()).await
            {
                // JetStream answers once it has loaded its store.
                let info = client.request("$JS.API.INFO", "".into()).await;
                if info.is_ok_and(|m| !m.payload.is_empty()) {
                    return;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "nats-server did not start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills the server (SIGKILL: no clean shutdown).
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().await.unwrap();
            let _ = child.wait().await;
        }
    }

    /// Starts it again on the same port with the same store.
    pub async fn restart(&mut self) {
        self.kill().await;
        self.spawn().await;
    }

    /// Starts it again on the same port with an empty store (a server that lost its data).
    pub async fn restart_empty(&mut self) {
        self.kill().await;
        self.dir = tempfile::tempdir().unwrap();
        self.spawn().await;
    }

    /// Kills the server (SIGKILL) and cuts the stream's newest message block after its
    /// `keep`-th message, as a machine that crashed before the server's writes reached the
    /// disk leaves it; then starts it again on the same store. Returns how many messages of
    /// the stream the store kept.
    pub async fn crash_losing_tail(&mut self, stream: &str, keep: u64) -> u64 {
        self.kill().await;
        let msgs = self
            .store_dir()
            .join("jetstream")
            .join("$G")
            .join("streams")
            .join(stream)
            .join("msgs");
        let mut blocks: Vec<(u64, PathBuf)> = std::fs::read_dir(&msgs)
            .unwrap()
            .filter_map(|e| {
                let path = e.unwrap().path();
                let n = path
                    .file_name()?
                    .to_str()?
                    .strip_suffix(".blk")?
                    .parse()
                    .ok()?;
                Some((n, path))
            })
            .collect();
        blocks.sort();
        let (_, newest) = blocks
            .last()
            .expect("the stream has a message block")
            .clone();
        // Record: total_len u32 (high bit: has headers) | seq u64 | ... (little endian).
        let bytes = std::fs::read(&newest).unwrap();
        let (mut at, mut kept) = (0usize, 0u64);
        while at + 12 <= bytes.len() {
            let len =
                (u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) & !(1 << 31)) as usize;
            let seq = u64::from_le_bytes(bytes[at + 4..at + 12].try_into().unwrap());
            if len == 0 || at + len > bytes.len() || seq > keep {
                break;
            }
            kept = seq;
            at += len;
        }
        std::fs::OpenOptions::new()
            .write(true)
            .open(&newest)
            .unwrap()
            .set_len(at as u64)
            .unwrap();
        // The per-block index and subject state would vouch for the lost messages.
        for entry in std::fs::read_dir(&msgs).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e != "blk") {
                std::fs::remove_file(path).unwrap();
            }
        }
        let _ = std::fs::remove_file(msgs.parent().unwrap().join("index.db"));
        self.spawn().await;
        kept
    }

    pub async fn js(&self) -> jetstream::Context {
        jetstream::new(self.probe().await.unwrap())
    }
}
