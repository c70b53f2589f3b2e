//! Test helpers for other crates' tests: a real `nats-server` per test, on a free port with
//! its own store, that a test can kill, restart empty, or crash so that it loses the tail
//! of a stream. Built with the `testing` feature.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use async_nats::jetstream;
use std::path::PathBuf;
use std::time::Duration;

pub const NATS_BIN: &str = "/usr/sbin/nats-server";

/// A nats-server with JetStream on a free port and its own store directory.
pub struct Nats {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<tokio::process::Child>,
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
        };
        n.spawn().await;
        n
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn store_dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    async fn spawn(&mut self) {
        let child = tokio::process::Command::new(NATS_BIN)
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
        let url = self.url();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(Ok(client)) =
                tokio::time::timeout(Duration::from_secs(1), async_nats::connect(&url)).await
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
        jetstream::new(async_nats::connect(self.url()).await.unwrap())
    }
}
