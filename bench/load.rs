//! The load generator of `bench/run.sh`: `clients` concurrent clients for `seconds` against
//! a running Ferry, each repeating the command mix declare a specification version, request
//! a plan, cancel the run, request a promotion. It reports throughput and latency per
//! command and the projection lag: for a sample of the commands, the time from the command's
//! answer until a GET on another connection sees the change.
//!
//! `e2e` mode instead requests `count` runs (each in its own environment) and `count`
//! promotions into development, and waits until every run is `Applied` and every promotion
//! `Completed` (a Ferry with workers and the simulated runner): completed per second.
//!
//! ```sh
//! FERRY_WORKERS=false FERRY_TENANT_PROGRAM_ROOTS=/srv/infra cargo run --release -- serve &
//! TOKEN=$(cargo run -q --release -- token --tenant bench --sub load --roles "Operator PlatformAdmin" \
//!   --scopes "factory.provisioning.read factory.provisioning.apply factory.delivery.read factory.delivery.promote")
//! cargo run --release --example load -- --token "$TOKEN" --clients 32 --seconds 20
//! ```
//!
//! The report is one JSON object on stdout (a table goes to stderr).
#![forbid(unsafe_code)]
#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)] // a command-line report

use clap::Parser;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

#[derive(Parser, Debug)]
struct Args {
    /// Ferry's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    base: String,
    /// A bearer token with the provisioning and delivery scopes, roles Operator and
    /// PlatformAdmin.
    #[arg(long)]
    token: String,
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// How long the mix runs.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// One command in this many has its projection lag measured.
    #[arg(long, default_value_t = 4)]
    lag_every: u64,
    /// The program every specification and release names.
    #[arg(long, default_value = "/srv/infra#web")]
    program: String,
    /// The program's commit.
    #[arg(long, default_value = "3f2a9c1")]
    commit: String,
    /// End to end: this many runs and this many promotions, waited for until done.
    #[arg(long)]
    e2e: Option<usize>,
    /// The health URL of the development environments promotions go to (verification
    /// probes it; without one, the readiness gate refuses them).
    #[arg(long)]
    health_url: Option<String>,
    /// A prefix for the environments this invocation creates (runs may share a store).
    #[arg(long, default_value = "load")]
    prefix: String,
}

const OPS: [&str; 4] = [
    "declare specification",
    "request plan",
    "cancel run",
    "request promotion",
];

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

fn summary(mut lat: Vec<Duration>, elapsed: f64) -> Value {
    lat.sort();
    json!({
        "count": lat.len(),
        "perSecond": (lat.len() as f64 / elapsed * 10.0).round() / 10.0,
        "p50Ms": (percentile(&lat, 0.50) * 10.0).round() / 10.0,
        "p99Ms": (percentile(&lat, 0.99) * 10.0).round() / 10.0,
    })
}

/// A command that answered, to be looked for on another connection.
struct LagProbe {
    answered: Instant,
    url: String,
    /// The answer's JSON must have this pointer equal to this value.
    pointer: &'static str,
    expect: Value,
}

struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Client {
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value), String> {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let value = response.json().await.unwrap_or(Value::Null);
        Ok((status, value))
    }
}

async fn setup(client: &Client, args: &Args, n: usize) -> Vec<String> {
    let mut releases = Vec::new();
    for c in 0..n {
        let env = format!("{}-dev-{c}", args.prefix);
        let (s, v) = client
            .send(
                reqwest::Method::PUT,
                &format!("/factory/environments/{env}"),
                Some(match &args.health_url {
                    Some(url) => json!({"environmentClass": "development", "healthUrl": url}),
                    None => json!({"environmentClass": "development"}),
                }),
            )
            .await
            .unwrap();
        assert!(s < 300, "environment {env}: {s} {v}");
        let id = uuid::Uuid::new_v4().to_string();
        let (s, v) = client
            .send(
                reqwest::Method::PUT,
                &format!("/factory/delivery/releases/{id}"),
                Some(
                    json!({"projectId": args.prefix, "version": format!("1.0.{c}"),
                    "programRef": args.program, "programVersion": args.commit,
                    "pipeline": [{"name": "unit", "result": "passed"}]}),
                ),
            )
            .await
            .unwrap();
        assert!(s < 300, "release: {s} {v}");
        releases.push(id);
    }
    releases
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let client = Arc::new(Client {
        http: reqwest::Client::new(),
        base: args.base.trim_end_matches('/').to_string(),
        token: args.token.clone(),
    });
    match args.e2e {
        Some(count) => end_to_end(client, &args, count).await,
        None => mix(client, &args).await,
    }
}

/// Polls for every probe sent until the sender is dropped: the lags seen, and how many
/// probes were not seen within 10 s.
async fn measure_lags(
    reader: Arc<Client>,
    mut probe_rx: mpsc::UnboundedReceiver<LagProbe>,
) -> (Vec<Duration>, u64) {
    // Each probe polls on its own (a queue of probes would add its waiting to the lag).
    let mut probes = tokio::task::JoinSet::new();
    while let Some(probe) = probe_rx.recv().await {
        probes.spawn(wait_for(reader.clone(), probe));
    }
    let (mut lags, mut unseen) = (Vec::new(), 0u64);
    while let Some(done) = probes.join_next().await {
        match done.unwrap() {
            Some(lag) => lags.push(lag),
            None => unseen += 1,
        }
    }
    (lags, unseen)
}

/// Polls until the probe's change is seen: the time since its answer, or `None` after 10 s.
async fn wait_for(reader: Arc<Client>, probe: LagProbe) -> Option<Duration> {
    let give_up = probe.answered + Duration::from_secs(10);
    loop {
        let seen = reader
            .send(reqwest::Method::GET, &probe.url, None)
            .await
            .is_ok_and(|(s, v)| s == 200 && v.pointer(probe.pointer) == Some(&probe.expect));
        if seen {
            return Some(probe.answered.elapsed());
        }
        if Instant::now() > give_up {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// One client of the mix: its connection, its environments and release, and where its
/// failures and lag probes go.
struct MixClient {
    client: Arc<Client>,
    /// The client's number, in its environments' names.
    c: usize,
    release: String,
    prefix: String,
    program: String,
    commit: String,
    lag_every: u64,
    deadline: Instant,
    errors: Arc<AtomicU64>,
    probes: mpsc::UnboundedSender<LagProbe>,
}

impl MixClient {
    /// Repeats the command mix until the deadline: the latencies, per command of `OPS`.
    async fn run(self) -> [Vec<Duration>; 4] {
        let mut lat: [Vec<Duration>; 4] = Default::default();
        let mut n = 0u64;
        while Instant::now() < self.deadline {
            n += 1;
            let sample = n.is_multiple_of(self.lag_every);
            let env = format!("{}-{}-{}", self.prefix, self.c, n % 20);
            self.round(&mut lat, &env, sample).await;
        }
        lat
    }

    /// One round of the mix in `env`, given up at the first command that fails. `sample`:
    /// measure the lag of each command.
    async fn round(&self, lat: &mut [Vec<Duration>; 4], env: &str, sample: bool) {
        let Some(spec) = self.declare(&mut lat[0], env, sample).await else {
            return;
        };
        let Some(run) = self.request_plan(&mut lat[1], env, &spec, sample).await else {
            return;
        };
        if !self.cancel(&mut lat[2], &run, sample).await {
            return;
        }
        self.request_promotion(&mut lat[3], sample).await;
    }

    /// Declares a specification version in `env`: the new version, `None` if refused.
    async fn declare(&self, lat: &mut Vec<Duration>, env: &str, sample: bool) -> Option<Value> {
        let t = Instant::now();
        let r = self
            .client
            .send(
                reqwest::Method::POST,
                "/factory/provisioning/specifications",
                Some(
                    json!({"environmentId": env, "projectId": self.prefix, "kind": "Workload",
                    "programRef": self.program, "programVersion": self.commit}),
                ),
            )
            .await;
        lat.push(t.elapsed());
        let spec = match r {
            Ok((201, v)) => v,
            other => {
                self.failed(OPS[0], format!("{other:?}"));
                return None;
            }
        };
        if sample {
            self.probe(
                format!(
                    "/factory/provisioning/specifications?specificationId={}",
                    spec["specificationId"].as_str().unwrap_or_default()
                ),
                "/items/0/version",
                spec["version"].clone(),
            );
        }
        Some(spec)
    }

    /// Requests a plan of `spec` in `env`: the run's id, `None` if refused.
    async fn request_plan(
        &self,
        lat: &mut Vec<Duration>,
        env: &str,
        spec: &Value,
        sample: bool,
    ) -> Option<String> {
        let t = Instant::now();
        let r = self
            .client
            .send(reqwest::Method::POST, "/factory/provisioning/runs",
                Some(json!({"specificationId": spec["specificationId"], "specificationVersion": spec["version"],
                    "environmentId": env, "kind": "Release"})))
            .await;
        lat.push(t.elapsed());
        let run = match r {
            Ok((201, v)) => v["provisioningRunId"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            other => {
                self.failed(OPS[1], format!("{other:?}"));
                return None;
            }
        };
        if sample {
            self.probe(
                format!("/factory/provisioning/runs/{run}"),
                "/provisioningRunId",
                json!(run),
            );
        }
        Some(run)
    }

    /// Cancels the run: false if refused.
    async fn cancel(&self, lat: &mut Vec<Duration>, run: &str, sample: bool) -> bool {
        let t = Instant::now();
        let r = self
            .client
            .send(
                reqwest::Method::POST,
                &format!("/factory/provisioning/runs/{run}/cancel"),
                Some(json!({"reason": "load"})),
            )
            .await;
        lat.push(t.elapsed());
        match r {
            Ok((200, _)) => {}
            other => {
                self.failed(OPS[2], format!("{other:?}"));
                return false;
            }
        }
        if sample {
            self.probe(
                format!("/factory/provisioning/runs/{run}"),
                "/state",
                json!("Cancelled"),
            );
        }
        true
    }

    /// Requests a promotion of the client's release into its development environment.
    async fn request_promotion(&self, lat: &mut Vec<Duration>, sample: bool) {
        let t = Instant::now();
        let r = self
            .client
            .send(reqwest::Method::POST, "/factory/delivery/promotions",
                Some(json!({"releaseId": self.release, "environmentId": format!("{}-dev-{}", self.prefix, self.c)})))
            .await;
        lat.push(t.elapsed());
        let promotion = match r {
            Ok((s, v)) if s == 201 || s == 202 => {
                v["promotionId"].as_str().unwrap_or_default().to_string()
            }
            other => {
                self.failed(OPS[3], format!("{other:?}"));
                return;
            }
        };
        if sample {
            self.probe(
                format!("/factory/delivery/promotions/{promotion}"),
                "/promotionId",
                json!(promotion),
            );
        }
    }

    /// Counts a failed command; the first few are printed.
    fn failed(&self, what: &str, detail: String) {
        if self.errors.fetch_add(1, Ordering::Relaxed) < 5 {
            eprintln!("{what}: {detail}");
        }
    }

    /// Sends a lag probe for the command just answered: the lag lasts until `url` answers
    /// with `expect` at `pointer`.
    fn probe(&self, url: String, pointer: &'static str, expect: Value) {
        let _ = self.probes.send(LagProbe {
            answered: Instant::now(),
            url,
            pointer,
            expect,
        });
    }
}

async fn mix(client: Arc<Client>, args: &Args) {
    let releases = setup(&client, args, args.clients).await;
    // Lag is read on connections of their own, as another user of the API would.
    let reader = Arc::new(Client {
        http: reqwest::Client::new(),
        base: client.base.clone(),
        token: client.token.clone(),
    });
    let (probe_tx, probe_rx) = mpsc::unbounded_channel::<LagProbe>();
    let lag_task = tokio::spawn(measure_lags(reader, probe_rx));
    let errors = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (c, release) in releases.into_iter().enumerate() {
        let mix_client = MixClient {
            client: client.clone(),
            c,
            release,
            prefix: args.prefix.clone(),
            program: args.program.clone(),
            commit: args.commit.clone(),
            lag_every: args.lag_every.max(1),
            deadline,
            errors: errors.clone(),
            probes: probe_tx.clone(),
        };
        tasks.push(tokio::spawn(mix_client.run()));
    }
    drop(probe_tx);
    let mut all: [Vec<Duration>; 4] = Default::default();
    for t in tasks {
        for (i, l) in t.await.unwrap().into_iter().enumerate() {
            all[i].extend(l);
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let (lags, unseen) = lag_task.await.unwrap();
    let commands: Vec<Duration> = all.iter().flatten().copied().collect();
    let mut per_op = serde_json::Map::new();
    for (name, lat) in OPS.iter().zip(all) {
        per_op.insert(name.to_string(), summary(lat, elapsed));
    }
    let report = json!({
        "clients": args.clients,
        "seconds": (elapsed * 10.0).round() / 10.0,
        "errors": errors.load(Ordering::Relaxed),
        "commands": summary(commands, elapsed),
        "perCommand": per_op,
        "lag": {"samples": lags.len(), "unseenAfter10s": unseen,
                "p50Ms": summary(lags.clone(), elapsed)["p50Ms"], "p99Ms": summary(lags, elapsed)["p99Ms"]},
    });
    eprintln!("{}", serde_json::to_string_pretty(&report).unwrap());
    println!("{report}");
}

/// Requests `count` runs and `count` promotions and waits until all are done.
async fn end_to_end(client: Arc<Client>, args: &Args, count: usize) {
    let releases = setup(&client, args, count).await;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (c, release) in releases.into_iter().enumerate() {
        let client = client.clone();
        let (prefix, program, commit) = (
            args.prefix.clone(),
            args.program.clone(),
            args.commit.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let env = format!("{prefix}-e2e-{c}");
            let (s, v) = client
                .send(reqwest::Method::PUT, &format!("/factory/environments/{env}"),
                    Some(json!({"environmentClass": "development"})))
                .await
                .unwrap();
            assert!(s < 300, "environment {env}: {s} {v}");
            let (s, spec) = client
                .send(reqwest::Method::POST, "/factory/provisioning/specifications",
                    Some(json!({"environmentId": env, "projectId": prefix, "kind": "Workload",
                        "programRef": program, "programVersion": commit})))
                .await
                .unwrap();
            assert_eq!(s, 201, "{spec}");
            let (s, run) = client
                .send(reqwest::Method::POST, "/factory/provisioning/runs",
                    Some(json!({"specificationId": spec["specificationId"], "specificationVersion": spec["version"],
                        "environmentId": env, "kind": "Release"})))
                .await
                .unwrap();
            assert_eq!(s, 201, "{run}");
            let (s, promotion) = client
                .send(reqwest::Method::POST, "/factory/delivery/promotions",
                    Some(json!({"releaseId": release, "environmentId": format!("{prefix}-dev-{c}")})))
                .await
                .unwrap();
            assert!(s == 201 || s == 202, "{s} {promotion}");
            let run = format!("/factory/provisioning/runs/{}", run["provisioningRunId"].as_str().unwrap());
            let promotion = format!("/factory/delivery/promotions/{}", promotion["promotionId"].as_str().unwrap());
            let (mut run_done, mut promotion_done) = (None, None);
            let give_up = Instant::now() + Duration::from_secs(600);
            while (run_done.is_none() || promotion_done.is_none()) && Instant::now() < give_up {
                if run_done.is_none() {
                    let (_, v) = client.send(reqwest::Method::GET, &run, None).await.unwrap();
                    match v["state"].as_str() {
                        Some("Applied") => run_done = Some(started.elapsed()),
                        Some(s @ ("Failed" | "Rejected" | "Cancelled" | "Superseded")) => panic!("run {run}: {s}: {v}"),
                        _ => {}
                    }
                }
                if promotion_done.is_none() {
                    let (_, v) = client.send(reqwest::Method::GET, &promotion, None).await.unwrap();
                    match v["state"].as_str() {
                        Some("Completed") => promotion_done = Some(started.elapsed()),
                        Some(s @ ("Failed" | "Rejected" | "RolledBack" | "Cancelled")) => panic!("promotion {promotion}: {s}: {v}"),
                        _ => {}
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (run_done.expect("run not applied in 10 min"), promotion_done.expect("promotion not completed in 10 min"))
        }));
    }
    let mut runs = Vec::new();
    let mut promotions = Vec::new();
    for t in tasks {
        let (r, p) = t.await.unwrap();
        runs.push(r);
        promotions.push(p);
    }
    let last = |v: &Vec<Duration>| v.iter().max().copied().unwrap_or_default().as_secs_f64();
    let report = json!({
        "runs": count, "promotions": count,
        "runsSeconds": (last(&runs) * 100.0).round() / 100.0,
        "promotionsSeconds": (last(&promotions) * 100.0).round() / 100.0,
        "runsPerSecond": (count as f64 / last(&runs) * 100.0).round() / 100.0,
        "promotionsPerSecond": (count as f64 / last(&promotions) * 100.0).round() / 100.0,
    });
    eprintln!("{}", serde_json::to_string_pretty(&report).unwrap());
    println!("{report}");
}
