//! The crash soak's load generator and checker (Issue 12, items 3 and 4), driven by
//! `bench/soak.sh` (one Ferry killed with SIGKILL again and again, NATS restarted and made to
//! lose its unsynced tail) and `bench/instances.sh` (three Ferry processes on one Postgres
//! and one NATS).
//!
//! * `write`: N writers against one or more Ferry base URLs, for a duration or until the
//!   store holds a target number of events. They mix specification declarations, plan
//!   requests (applied in development environments, waiting for an approval in production
//!   ones), cancellations, and releases with their promotions. Every 2xx answer's ids are
//!   appended to a records file (one JSON line each, written straight through, so a crash of
//!   the writer itself loses nothing it printed). Connection errors (Ferry is being killed),
//!   503 and 409 with `Retry-After` are retried, with the same `Idempotency-Key` where the
//!   route takes one; a request that may have reached Ferry is retried only under a key.
//! * `check`: waits until Ferry has settled (every subscription at the end of the stream, no
//!   run or promotion in flight, no work running, no new event for a while), then verifies:
//!   every stored event exactly once on the JetStream stream (by `Nats-Msg-Id`), nothing
//!   else on it, per-aggregate order on the stream following `sequence`; every 2xx-recorded
//!   id in the store; no run applied twice (its events, the work queue, and the simulated
//!   runner's own log lines per run); every read model equal to a replay of the events into
//!   fresh tables by Ferry's own projection code, plus per-row version checks; optionally
//!   one reconciliation run per environment per window. Prints the counts; exits 1 on any
//!   loss, duplicate or disorder.
//! * `lose-tail`: cuts the newest message block of a stream in a stopped nats-server's store
//!   after all but its last records, as a machine that crashed before NATS synced leaves it.
//! * `instances`: compares what several instances answer (lists of every read model, page by
//!   page) and counts the relay leaders among them (`ferry_nats_relay_leader`).
//!
//! ```sh
//! cargo run --release --example soak -- write --url http://127.0.0.1:28080 --token "$T" \
//!   --writers 32 --target-events 200000 --records /tmp/records.jsonl \
//!   --program-ref "$REPO#web" --program-version "$COMMIT" --database-url "$DB"
//! cargo run --release --example soak -- check --database-url "$DB" \
//!   --nats-url nats://127.0.0.1:14222 --stream FERRY_EVENTS --records /tmp/records.jsonl
//! ```
#![forbid(unsafe_code)]
#![allow(clippy::print_stdout)] // a command-line report

use clap::{Parser, Subcommand};
use ferry_domain::{ProvisioningRunId, SpecificationId, TenantId};
use ferry_store::stream::{catch_up, ensure_checkpoint, Handler, Param, Tx};
use futures::StreamExt;
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(Parser)]
#[command(about = "Ferry's crash soak: load generator and checker")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Writers against Ferry; every 2xx answer's ids go to the records file.
    Write(WriteArgs),
    /// Waits for Ferry to settle, then checks store, stream, read models and runs.
    Check(CheckArgs),
    /// Cuts the newest message block of a stream in a stopped nats-server's store.
    LoseTail(LoseTailArgs),
    /// Compares what several instances answer and counts their relay leaders.
    Instances(InstancesArgs),
}

#[derive(clap::Args, Clone)]
struct WriteArgs {
    /// Ferry base URL; repeat to spread the writers' requests over several instances.
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// Bearer token (Operator PlatformAdmin, provisioning and delivery scopes).
    #[arg(long)]
    token: String,
    /// Concurrent writers.
    #[arg(long, default_value_t = 32)]
    writers: usize,
    /// Stop after this many seconds (0: no limit).
    #[arg(long, default_value_t = 0)]
    duration_secs: u64,
    /// Stop once the store holds this many events (0: no target; needs --database-url).
    #[arg(long, default_value_t = 0)]
    target_events: u64,
    /// Postgres URL, to count the events while writing.
    #[arg(long)]
    database_url: Option<String>,
    /// Where every 2xx answer's ids are appended.
    #[arg(long)]
    records: PathBuf,
    /// Where 500 answers (a Ferry bug) are appended.
    #[arg(long)]
    errors: Option<PathBuf>,
    /// The program the specifications and releases name (`<repository>#<folder>`).
    #[arg(long)]
    program_ref: String,
    /// Its commit.
    #[arg(long)]
    program_version: String,
    /// Health URL of the promotion environments (verification probes it).
    #[arg(long)]
    health_url: Option<String>,
    /// Environment name prefix.
    #[arg(long, default_value = "soak")]
    prefix: String,
    /// Development environments (plans there apply).
    #[arg(long, default_value_t = 24)]
    dev_envs: usize,
    /// Production environments (plans there wait for an approval, then are cancelled).
    #[arg(long, default_value_t = 8)]
    prod_envs: usize,
    /// Development environments that releases are promoted into.
    #[arg(long, default_value_t = 16)]
    promotion_envs: usize,
    /// Runs requested but not yet planned or applied above which the writers declare
    /// instead of requesting more (the workers plan far fewer runs per second than the API
    /// takes; needs --database-url).
    #[arg(long, default_value_t = 300)]
    max_runs_in_flight: i64,
    /// Give up on one request after this many seconds of retrying.
    #[arg(long, default_value_t = 240)]
    give_up_secs: u64,
}

#[derive(clap::Args)]
struct CheckArgs {
    /// Postgres URL of Ferry's store.
    #[arg(long)]
    database_url: String,
    /// NATS server the relay publishes to.
    #[arg(long)]
    nats_url: String,
    /// The JetStream stream (FERRY_NATS_STREAM).
    #[arg(long, default_value = "FERRY_EVENTS")]
    stream: String,
    /// Records files written by `write` (repeat).
    #[arg(long = "records")]
    records: Vec<PathBuf>,
    /// Ferry's JSON log files with `ferry_runners=info` (repeat): the simulated runner's
    /// "apply done" lines, counted per run.
    #[arg(long = "runner-log")]
    runner_logs: Vec<PathBuf>,
    /// How long to wait for Ferry to settle before checking.
    #[arg(long, default_value_t = 900)]
    settle_timeout_secs: u64,
    /// The tenant (for reconciliation run ids).
    #[arg(long, default_value = "soak")]
    tenant: String,
    /// A reconciliation window reconciled by `ferry reconcile --window W` (repeat): one
    /// run per environment in it.
    #[arg(long = "reconcile-window")]
    reconcile_windows: Vec<String>,
    /// A scheduled window (`YYYY-MM-DDTHH:MMZ`) the instances' schedule reconciled
    /// (repeat): every scheduled run belongs to one of them, one per environment each.
    #[arg(long = "scheduled-window")]
    scheduled_windows: Vec<String>,
    /// Outputs of `ferry reconcile --window` (repeat): the runs they started are the runs
    /// of the window, each started once.
    #[arg(long = "reconcile-output")]
    reconcile_outputs: Vec<PathBuf>,
    /// Skip replaying the events into fresh tables.
    #[arg(long)]
    no_replay: bool,
}

#[derive(clap::Args)]
struct LoseTailArgs {
    /// The nats-server's store directory (`-sd`).
    #[arg(long)]
    store_dir: PathBuf,
    /// The stream.
    #[arg(long, default_value = "FERRY_EVENTS")]
    stream: String,
    /// How many records to cut off the newest block (at most all of that block's).
    #[arg(long, default_value_t = 500)]
    drop: usize,
}

#[derive(clap::Args)]
struct InstancesArgs {
    /// The instances' base URLs.
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// Bearer token with the read scopes.
    #[arg(long)]
    token: String,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Write(args) => write(args).await,
        Command::Check(args) => check(args).await,
        Command::LoseTail(args) => lose_tail(&args),
        Command::Instances(args) => instances(args).await,
    };
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            println!("soak: error: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

// ---------------------------------------------------------------------------------------
// write

/// A small PRNG (xorshift64*): the writers need variety, not quality.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

#[derive(Default)]
struct Stats {
    requests: AtomicU64,
    ok: AtomicU64,
    client_errors: AtomicU64,
    conflicts: AtomicU64,
    unavailable: AtomicU64,
    server_errors: AtomicU64,
    connection_errors: AtomicU64,
    retries: AtomicU64,
    gave_up: AtomicU64,
    specs: AtomicU64,
    runs: AtomicU64,
    cancels: AtomicU64,
    releases: AtomicU64,
    promotions: AtomicU64,
    statuses: Mutex<BTreeMap<u16, u64>>,
}

fn add(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

fn get(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

/// Appends JSON lines, each written straight through (no user-space buffer).
struct Appender(Mutex<std::fs::File>);

impl Appender {
    fn open(path: &Path) -> Result<Self, Error> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Self(Mutex::new(file)))
    }
    fn line(&self, value: &Value) {
        let mut text = value.to_string();
        text.push('\n');
        if let Ok(mut file) = self.0.lock() {
            let _ = file.write_all(text.as_bytes());
            let _ = file.flush();
        }
    }
}

struct Ctx {
    args: WriteArgs,
    http: reqwest::Client,
    stats: Stats,
    records: Appender,
    errors: Option<Appender>,
    stop: AtomicBool,
    next_url: AtomicU64,
    /// Runs in flight, as last counted.
    in_flight: std::sync::atomic::AtomicI64,
}

/// What one request came to.
enum Answer {
    /// A final HTTP answer (2xx or a refusal that a retry would not change).
    Http(u16, Value),
    /// No final answer within the give-up time.
    GaveUp,
}

impl Ctx {
    /// The writers' shared state, with the records file (and the errors file) open.
    fn new(args: WriteArgs) -> Result<Self, Error> {
        Ok(Self {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .connect_timeout(Duration::from_secs(5))
                .pool_max_idle_per_host(args.writers)
                .build()?,
            stats: Stats::default(),
            records: Appender::open(&args.records)?,
            errors: match &args.errors {
                Some(p) => Some(Appender::open(p)?),
                None => None,
            },
            stop: AtomicBool::new(false),
            next_url: AtomicU64::new(0),
            in_flight: std::sync::atomic::AtomicI64::new(0),
            args,
        })
    }

    fn url(&self, path: &str) -> String {
        let n = self.next_url.fetch_add(1, Ordering::Relaxed) as usize;
        format!("{}{path}", self.args.urls[n % self.args.urls.len()])
    }

    /// Sends until a final answer. `key`: the route's `Idempotency-Key`, which makes a
    /// retry after a request that may have reached Ferry safe. `retry_unsure`: retry such a
    /// request even without a key (the command is harmless to repeat).
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
        key: Option<&str>,
        retry_unsure: bool,
    ) -> Answer {
        let give_up = Instant::now() + Duration::from_secs(self.args.give_up_secs);
        let mut pause = Duration::from_millis(200);
        loop {
            add(&self.stats.requests);
            let mut request = self
                .http
                .request(method.clone(), self.url(path))
                .bearer_auth(&self.args.token);
            if let Some(body) = body {
                request = request.json(body);
            }
            if let Some(key) = key {
                request = request.header("Idempotency-Key", key);
            }
            let retry = match request.send().await {
                Ok(response) => {
                    let status = response.status().as_u16();
                    if let Ok(mut s) = self.stats.statuses.lock() {
                        *s.entry(status).or_default() += 1;
                    }
                    let retry_after = response.headers().contains_key("retry-after");
                    let value = response.json::<Value>().await.unwrap_or(Value::Null);
                    match status {
                        200..=299 => {
                            add(&self.stats.ok);
                            return Answer::Http(status, value);
                        }
                        409 if retry_after => {
                            add(&self.stats.conflicts);
                            true
                        }
                        503 => {
                            add(&self.stats.unavailable);
                            true
                        }
                        500..=599 => {
                            add(&self.stats.server_errors);
                            if let Some(errors) = &self.errors {
                                errors.line(&json!({"method": method.as_str(), "path": path,
                                    "status": status, "body": value, "request": body,
                                    "at": chrono::Utc::now().to_rfc3339()}));
                            }
                            // A 502/504 from nothing in between cannot happen; a 500 is
                            // final (and a finding).
                            return Answer::Http(status, value);
                        }
                        _ => {
                            add(&self.stats.client_errors);
                            return Answer::Http(status, value);
                        }
                    }
                }
                Err(e) => {
                    add(&self.stats.connection_errors);
                    // Refused before anything was sent: always safe to send again.
                    e.is_connect() || key.is_some() || retry_unsure
                }
            };
            if !retry || Instant::now() >= give_up {
                add(&self.stats.gave_up);
                return Answer::GaveUp;
            }
            add(&self.stats.retries);
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }
}

fn id_of(value: &Value, field: &str) -> Option<String> {
    value.get(field).and_then(Value::as_str).map(str::to_string)
}

async fn setup_environments(ctx: &Ctx) -> Result<(), Error> {
    let a = &ctx.args;
    let mut envs: Vec<(String, &str, Option<&String>)> = Vec::new();
    for k in 0..a.dev_envs {
        envs.push((format!("{}-dev-{k}", a.prefix), "development", None));
    }
    for k in 0..a.prod_envs {
        envs.push((format!("{}-prod-{k}", a.prefix), "production", None));
    }
    for k in 0..a.promotion_envs {
        envs.push((
            format!("{}-pdev-{k}", a.prefix),
            "development",
            a.health_url.as_ref(),
        ));
    }
    for (env, class, health) in envs {
        let mut body = json!({"environmentClass": class});
        if let Some(h) = health {
            body["healthUrl"] = json!(h);
        }
        let path = format!("/factory/environments/{env}");
        match ctx
            .send(reqwest::Method::PUT, &path, Some(&body), None, true)
            .await
        {
            Answer::Http(200..=299, _) => {}
            Answer::Http(status, v) => {
                return Err(format!("PUT {path}: {status} {v}").into());
            }
            Answer::GaveUp => return Err(format!("PUT {path}: no answer").into()),
        }
    }
    Ok(())
}

/// What one writer knows: the latest version it saw of each environment's specification,
/// and its recent runs (to cancel).
struct Writer {
    id: usize,
    rng: Rng,
    specs: HashMap<String, (String, u64)>,
    runs: Vec<String>,
    n: u64,
    /// The writer's promotion still under way: one at a time, so that promotions (queued
    /// one per environment) never pile up beyond what the workers get through.
    promotion: Option<String>,
}

impl Writer {
    async fn declare(&mut self, ctx: &Ctx, env: &str) -> Option<(String, u64)> {
        let a = &ctx.args;
        self.n += 1;
        // A specification belongs to its environment and one project: the project is the
        // environment's, whichever writer declares.
        let body = json!({"environmentId": env, "projectId": format!("{env}-project"),
            "kind": "Workload", "programRef": a.program_ref, "programVersion": a.program_version});
        // No key on this route: retried only when nothing reached Ferry (a retry of an
        // unsure request would be a second version, harmless but not ours to claim).
        match ctx
            .send(
                reqwest::Method::POST,
                "/factory/provisioning/specifications",
                Some(&body),
                None,
                false,
            )
            .await
        {
            Answer::Http(200..=299, v) => {
                let id = id_of(&v, "specificationId")?;
                let version = v.get("version").and_then(Value::as_u64)?;
                ctx.records
                    .line(&json!({"op": "spec", "id": id, "version": version}));
                add(&ctx.stats.specs);
                let entry = self.specs.entry(env.to_string()).or_default();
                if version > entry.1 {
                    *entry = (id.clone(), version);
                }
                Some((id, version))
            }
            _ => None,
        }
    }

    async fn plan(&mut self, ctx: &Ctx, env: &str) -> Option<String> {
        if ctx.in_flight.load(Ordering::Relaxed) > ctx.args.max_runs_in_flight {
            // The workers are behind: a declaration instead.
            self.declare(ctx, env).await;
            return None;
        }
        let (spec, version) = match self.specs.get(env).cloned() {
            Some(s) => s,
            None => self.declare(ctx, env).await?,
        };
        let key = uuid::Uuid::new_v4().to_string();
        let body = json!({"specificationId": spec, "specificationVersion": version,
            "environmentId": env, "kind": "Release"});
        match ctx
            .send(
                reqwest::Method::POST,
                "/factory/provisioning/runs",
                Some(&body),
                Some(&key),
                false,
            )
            .await
        {
            Answer::Http(200..=299, v) => {
                let id = id_of(&v, "provisioningRunId")?;
                ctx.records
                    .line(&json!({"op": "run", "id": id, "key": key}));
                add(&ctx.stats.runs);
                self.runs.push(id.clone());
                if self.runs.len() > 64 {
                    self.runs.remove(0);
                }
                Some(id)
            }
            Answer::Http(422, _) => {
                // The version it named may be someone else's newer one's predecessor in
                // another environment; forget it and declare again next time.
                self.specs.remove(env);
                None
            }
            _ => None,
        }
    }

    async fn cancel(&mut self, ctx: &Ctx, run: &str) {
        let body = json!({"reason": "soak"});
        let path = format!("/factory/provisioning/runs/{run}/cancel");
        if let Answer::Http(200..=299, _) = ctx
            .send(reqwest::Method::POST, &path, Some(&body), None, true)
            .await
        {
            ctx.records.line(&json!({"op": "cancel", "id": run}));
            add(&ctx.stats.cancels);
        }
    }

    /// Is the writer's last promotion still under way?
    async fn promoting(&mut self, ctx: &Ctx) -> bool {
        let Some(id) = self.promotion.clone() else {
            return false;
        };
        let path = format!("/factory/delivery/promotions/{id}");
        let state = match ctx
            .send(reqwest::Method::GET, &path, None, None, true)
            .await
        {
            Answer::Http(200, v) => v.get("state").and_then(Value::as_str).map(str::to_string),
            _ => None,
        };
        let done = matches!(
            state.as_deref(),
            Some("Completed" | "Rejected" | "Failed" | "RolledBack" | "AwaitingApproval")
        );
        if done {
            self.promotion = None;
        }
        !done
    }

    async fn promote(&mut self, ctx: &Ctx) -> bool {
        let a = &ctx.args;
        if a.promotion_envs == 0 || self.promoting(ctx).await {
            return false;
        }
        self.n += 1;
        let release = uuid::Uuid::new_v4().to_string();
        let mut body = json!({"projectId": format!("{}-shop{}", a.prefix, self.id % 4),
            "version": format!("1.{}.{}", self.id, self.n),
            "programRef": a.program_ref, "programVersion": a.program_version,
            "pipeline": [{"name": "unit", "result": "passed"}]});
        if let Some(h) = &a.health_url {
            body["smokeChecks"] = json!([{"name": "health", "url": h}]);
        }
        let path = format!("/factory/delivery/releases/{release}");
        // PUT of the same release is idempotent (200 unchanged).
        match ctx
            .send(reqwest::Method::PUT, &path, Some(&body), None, true)
            .await
        {
            Answer::Http(200..=299, _) => {
                ctx.records.line(&json!({"op": "release", "id": release}));
                add(&ctx.stats.releases);
            }
            _ => return true,
        }
        let env = format!("{}-pdev-{}", a.prefix, self.id % a.promotion_envs);
        let key = uuid::Uuid::new_v4().to_string();
        let body = json!({"releaseId": release, "environmentId": env});
        if let Answer::Http(200..=299, v) = ctx
            .send(
                reqwest::Method::POST,
                "/factory/delivery/promotions",
                Some(&body),
                Some(&key),
                false,
            )
            .await
        {
            if let Some(id) = id_of(&v, "promotionId") {
                ctx.records
                    .line(&json!({"op": "promotion", "id": id, "key": key}));
                add(&ctx.stats.promotions);
                self.promotion = Some(id);
            }
        }
        true
    }

    async fn step(&mut self, ctx: &Ctx) {
        let a = &ctx.args;
        let dev = |rng: &mut Rng| format!("{}-dev-{}", a.prefix, rng.below(a.dev_envs));
        let prod = |rng: &mut Rng| format!("{}-prod-{}", a.prefix, rng.below(a.prod_envs));
        match self.rng.below(100) {
            // Declarations: one event each.
            0..=19 => {
                let env = if a.prod_envs > 0 && self.rng.below(4) == 0 {
                    prod(&mut self.rng)
                } else {
                    dev(&mut self.rng)
                };
                self.declare(ctx, &env).await;
            }
            // Plans in development: planned and applied by the workers.
            20..=59 => {
                let env = dev(&mut self.rng);
                self.plan(ctx, &env).await;
            }
            // Plans in production: planned, waiting for an approval; cancelled.
            60..=79 if a.prod_envs > 0 => {
                let env = prod(&mut self.rng);
                if let Some(run) = self.plan(ctx, &env).await {
                    if self.rng.below(3) > 0 {
                        self.cancel(ctx, &run).await;
                    }
                }
            }
            // Cancel a recent run, whatever its state (409 once it applied).
            80..=89 => {
                if !self.runs.is_empty() {
                    let run = self.runs[self.rng.below(self.runs.len())].clone();
                    self.cancel(ctx, &run).await;
                }
            }
            // A release and its promotion into a development environment (the writer's
            // own), or a plan while its last promotion is under way.
            _ => {
                if !self.promote(ctx).await {
                    let env = dev(&mut self.rng);
                    self.plan(ctx, &env).await;
                }
            }
        }
    }
}

async fn count_events(db: &PgPool) -> Option<i64> {
    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM events")
        .fetch_one(db)
        .await
        .ok()
}

/// Starts the writers, each with its own seed, to write until `ctx.stop`.
fn spawn_writers(ctx: &Arc<Ctx>) -> Vec<tokio::task::JoinHandle<()>> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(7);
    let mut tasks = Vec::new();
    for w in 0..ctx.args.writers {
        let ctx = ctx.clone();
        tasks.push(tokio::spawn(async move {
            let mut writer = Writer {
                id: w,
                rng: Rng::new(seed ^ (w as u64 + 1).wrapping_mul(0x1000_0001)),
                specs: HashMap::new(),
                runs: Vec::new(),
                n: 0,
                promotion: None,
            };
            while !ctx.stop.load(Ordering::Relaxed) {
                writer.step(&ctx).await;
            }
        }));
    }
    tasks
}

/// The monitor: progress every 10 s, until the duration or the target is reached. The
/// events last counted.
async fn monitor(ctx: &Ctx, db: Option<&PgPool>, started: Instant, first: i64) -> i64 {
    let mut events = first;
    let mut last_print = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        if let Some(db) = db {
            if let Some(n) = count_events(db).await {
                events = n;
            }
            if let Ok(n) = sqlx::query_scalar::<_, i64>(RUNS_IN_FLIGHT)
                .fetch_one(db)
                .await
            {
                ctx.in_flight.store(n, Ordering::Relaxed);
            }
        }
        let elapsed = started.elapsed();
        let done_time = ctx.args.duration_secs > 0 && elapsed.as_secs() >= ctx.args.duration_secs;
        let done_events = ctx.args.target_events > 0 && events as u64 >= ctx.args.target_events;
        if last_print.elapsed() >= Duration::from_secs(10) || done_time || done_events {
            last_print = Instant::now();
            let s = &ctx.stats;
            println!(
                "write: {:>5.0} s  events {:>8} ({:>6.1}/s)  requests {:>8}  2xx {:>8}  conn-errors {:>6}  503 {:>5}  409-retry {:>5}  5xx {:>3}  runs in flight {:>5}",
                elapsed.as_secs_f64(),
                events,
                (events - first) as f64 / elapsed.as_secs_f64().max(0.001),
                get(&s.requests),
                get(&s.ok),
                get(&s.connection_errors),
                get(&s.unavailable),
                get(&s.conflicts),
                get(&s.server_errors),
                ctx.in_flight.load(Ordering::Relaxed),
            );
        }
        if done_time || done_events {
            break;
        }
    }
    events
}

/// Prints what the writers did: the events stored, and the answers by kind and status.
fn print_totals(s: &Stats, events: i64, first: i64, elapsed: f64) {
    println!(
        "write: done in {elapsed:.0} s: {} events stored ({} by this run, {:.1}/s); {} requests, {} answered 2xx \
         ({} specification versions, {} runs, {} cancellations, {} releases, {} promotions), \
         {} refused 4xx, {} 503, {} conflicts retried, {} 5xx, {} connection errors, {} retries, {} given up",
        events,
        events - first,
        (events - first) as f64 / elapsed.max(0.001),
        get(&s.requests),
        get(&s.ok),
        get(&s.specs),
        get(&s.runs),
        get(&s.cancels),
        get(&s.releases),
        get(&s.promotions),
        get(&s.client_errors),
        get(&s.unavailable),
        get(&s.conflicts),
        get(&s.server_errors),
        get(&s.connection_errors),
        get(&s.retries),
        get(&s.gave_up),
    );
    if let Ok(statuses) = s.statuses.lock() {
        println!(
            "write: answers by status: {}",
            statuses
                .iter()
                .map(|(k, v)| format!("{k}: {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if get(&s.server_errors) > 0 {
        println!(
            "write: FINDING: {} answers were 5xx (other than 503); see the errors file",
            get(&s.server_errors)
        );
    }
}

async fn write(args: WriteArgs) -> Result<bool, Error> {
    let db = match &args.database_url {
        Some(url) => Some(PgPoolOptions::new().max_connections(2).connect(url).await?),
        None => None,
    };
    if args.target_events > 0 && db.is_none() {
        return Err("--target-events needs --database-url".into());
    }
    let ctx = Arc::new(Ctx::new(args)?);
    setup_environments(&ctx).await?;
    let started = Instant::now();
    let first = match &db {
        Some(db) => count_events(db).await.unwrap_or(0),
        None => 0,
    };
    let tasks = spawn_writers(&ctx);
    let mut events = monitor(&ctx, db.as_ref(), started, first).await;
    // At the duration or the target: the writers stop.
    ctx.stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    if let Some(db) = &db {
        if let Some(n) = count_events(db).await {
            events = n;
        }
    }
    print_totals(&ctx.stats, events, first, elapsed);
    Ok(get(&ctx.stats.server_errors) == 0)
}

// ---------------------------------------------------------------------------------------
// check

/// Failures and figures of a check.
#[derive(Default)]
struct Report {
    failures: Vec<String>,
}

impl Report {
    fn fail(&mut self, what: String) {
        println!("check: FAIL: {what}");
        self.failures.push(what);
    }
    fn expect(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            self.fail(what());
        }
    }
}

/// The subscriptions of the stream: what each has handled, against the stream's end.
async fn lagging(db: &PgPool) -> Result<Vec<(String, i64)>, Error> {
    let end: Option<(i64, i64)> = sqlx::query_as(
        "SELECT transaction_id::text::bigint, global_position FROM events
          ORDER BY events.transaction_id DESC, events.global_position DESC LIMIT 1",
    )
    .fetch_optional(db)
    .await?;
    let Some((_, end)) = end else {
        return Ok(Vec::new());
    };
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT name, global_position FROM subscription_checkpoints
          WHERE name NOT LIKE '%\\_soakcheck' AND name NOT LIKE '%\\_rebuild'",
    )
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .filter(|(_, p)| *p != end)
        .map(|(n, p)| (n, end - p))
        .collect())
}

const RUNS_IN_FLIGHT: &str =
    "SELECT count(*) FROM rm_runs WHERE state IN ('Requested', 'Planned', 'Applying')";
const PROMOTIONS_IN_FLIGHT: &str = "SELECT count(*) FROM rm_promotions
  WHERE state IN ('Requested', 'GatesEvaluating', 'Approved', 'Deploying', 'Verifying')";
const WORK_RUNNING: &str = "SELECT count(*) FROM work_items WHERE status = 'running'";

/// Waits until every subscription is at the stream's end, nothing is in flight and no event
/// was added for a while. False when it did not within `timeout`.
async fn settle(db: &PgPool, timeout: Duration) -> Result<bool, Error> {
    let started = Instant::now();
    let mut last_count = -1;
    let mut quiet_since = Instant::now();
    let mut last_print = Instant::now() - Duration::from_secs(60);
    loop {
        let count = count_events(db).await.unwrap_or(-1);
        let lag = lagging(db).await?;
        let runs: i64 = sqlx::query_scalar(RUNS_IN_FLIGHT).fetch_one(db).await?;
        let promotions: i64 = sqlx::query_scalar(PROMOTIONS_IN_FLIGHT)
            .fetch_one(db)
            .await
            .unwrap_or(0);
        let work: i64 = sqlx::query_scalar(WORK_RUNNING).fetch_one(db).await?;
        if count != last_count {
            last_count = count;
            quiet_since = Instant::now();
        }
        let quiet = quiet_since.elapsed() >= Duration::from_secs(5);
        if lag.is_empty() && runs == 0 && promotions == 0 && work == 0 && quiet {
            println!(
                "check: settled after {:.0} s: {count} events, every subscription at the end",
                started.elapsed().as_secs_f64()
            );
            return Ok(true);
        }
        if last_print.elapsed() >= Duration::from_secs(15) {
            last_print = Instant::now();
            println!(
                "check: settling ({:.0} s): {count} events, runs in flight {runs}, promotions in flight {promotions}, work running {work}, behind: {lag:?}",
                started.elapsed().as_secs_f64()
            );
        }
        if started.elapsed() >= timeout {
            println!(
                "check: did not settle in {} s: runs in flight {runs}, promotions in flight {promotions}, work running {work}, behind: {lag:?}",
                timeout.as_secs()
            );
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// One stored event, without its payload.
struct Stored {
    aggregate: u32,
    sequence: i64,
    event_type: String,
}

/// One message of the stream.
struct OnStream {
    msg_id: Option<String>,
    body_id: Option<String>,
    sequence: Option<i64>,
    aggregate_type: Option<String>,
    subject: Option<String>,
}

async fn read_stream(nats_url: &str, stream: &str) -> Result<Vec<OnStream>, Error> {
    let client = async_nats::connect(nats_url).await?;
    let js = async_nats::jetstream::new(client);
    let mut stream = js.get_stream(stream).await?;
    let info = stream.info().await?;
    let (first, last, count) = (
        info.state.first_sequence,
        info.state.last_sequence,
        info.state.messages,
    );
    println!(
        "check: stream {}: {count} messages, sequences {first}..{last}",
        info.config.name
    );
    let mut out = Vec::with_capacity(count as usize);
    if count == 0 {
        return Ok(out);
    }
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    loop {
        let next = tokio::time::timeout(Duration::from_secs(30), messages.next()).await;
        let message = match next {
            Ok(Some(m)) => m?,
            Ok(None) => break,
            Err(_) => return Err("no message from the stream for 30 s".into()),
        };
        let seq = message.info()?.stream_sequence;
        let msg_id = message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .map(|v| v.to_string());
        let body: Value = serde_json::from_slice(&message.payload).unwrap_or(Value::Null);
        out.push(OnStream {
            msg_id,
            body_id: body.get("id").and_then(Value::as_str).map(str::to_string),
            sequence: body.get("ferrysequence").and_then(Value::as_i64),
            aggregate_type: body
                .get("ferryaggregatetype")
                .and_then(Value::as_str)
                .map(str::to_string),
            subject: body
                .get("subject")
                .and_then(Value::as_str)
                .map(str::to_string),
        });
        if seq >= last {
            break;
        }
    }
    Ok(out)
}

/// Lines of Ferry's JSON log that say the simulated runner finished an apply, per run.
fn runner_applies(logs: &[PathBuf]) -> Result<(HashMap<String, u64>, u64), Error> {
    let mut per_run: HashMap<String, u64> = HashMap::new();
    let mut unattributed = 0;
    for path in logs {
        let text = std::fs::read_to_string(path)?;
        for line in text.lines() {
            if !line.contains("simulated apply") {
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            let message = v
                .pointer("/fields/message")
                .and_then(Value::as_str)
                .unwrap_or_default();
            if message != "simulated apply done" && message != "simulated apply failure" {
                continue;
            }
            let item = v
                .get("spans")
                .and_then(Value::as_array)
                .and_then(|spans| {
                    spans
                        .iter()
                        .find(|s| s.get("name").and_then(Value::as_str) == Some("work"))
                })
                .and_then(|s| s.get("item").and_then(Value::as_str))
                .map(str::to_string);
            match item {
                Some(run) => *per_run.entry(run).or_default() += 1,
                None => unattributed += 1,
            }
        }
    }
    Ok((per_run, unattributed))
}

/// The stored events, without their payloads, by aggregate.
struct Store {
    /// Every aggregate, as (type, id); an aggregate's number is its place here.
    aggregates: Vec<(String, String)>,
    /// Each aggregate's number.
    aggregate_index: HashMap<(String, String), u32>,
    /// The events, by event id.
    events: HashMap<String, Stored>,
    /// Each aggregate's highest sequence.
    max_sequence: HashMap<u32, i64>,
    /// Each aggregate's event types, in stream order.
    event_types: HashMap<u32, Vec<String>>,
}

impl Store {
    /// The number of the aggregate of type `t` and id `id`, if it has events.
    fn has(&self, t: &str, id: &str) -> Option<u32> {
        self.aggregate_index
            .get(&(t.to_string(), id.to_string()))
            .copied()
    }
}

/// Loads every stored event, in stream order, and prints the counts per aggregate type.
async fn load_store(pool: &PgPool) -> Result<Store, Error> {
    let rows: Vec<(String, String, String, i64, String)> = sqlx::query_as(
        "SELECT event_id::text, aggregate_type, aggregate_id, sequence, event_type FROM events
          ORDER BY transaction_id, global_position",
    )
    .fetch_all(pool)
    .await?;
    let mut aggregates: Vec<(String, String)> = Vec::new();
    let mut aggregate_index: HashMap<(String, String), u32> = HashMap::new();
    let mut events: HashMap<String, Stored> = HashMap::with_capacity(rows.len());
    let mut max_sequence: HashMap<u32, i64> = HashMap::new();
    let mut per_type: BTreeMap<String, u64> = BTreeMap::new();
    let mut event_types: HashMap<u32, Vec<String>> = HashMap::new();
    for (id, aggregate_type, aggregate_id, sequence, event_type) in rows {
        *per_type.entry(aggregate_type.clone()).or_default() += 1;
        let key = (aggregate_type, aggregate_id);
        let aggregate = match aggregate_index.get(&key) {
            Some(a) => *a,
            None => {
                let a = aggregates.len() as u32;
                aggregates.push(key.clone());
                aggregate_index.insert(key, a);
                a
            }
        };
        let m = max_sequence.entry(aggregate).or_default();
        *m = (*m).max(sequence);
        event_types
            .entry(aggregate)
            .or_default()
            .push(event_type.clone());
        events.insert(
            id,
            Stored {
                aggregate,
                sequence,
                event_type,
            },
        );
    }
    println!(
        "check: store: {} events in {} aggregates ({})",
        events.len(),
        aggregates.len(),
        per_type
            .iter()
            .map(|(t, n)| format!("{t} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(Store {
        aggregates,
        aggregate_index,
        events,
        max_sequence,
        event_types,
    })
}

/// The stream's messages against the stored events.
struct StreamTally<'a> {
    /// The distinct event ids on the stream.
    on_stream: HashSet<&'a str>,
    /// Messages of an event already on the stream.
    duplicates: u64,
    /// Messages of no stored event.
    extra: u64,
    /// Messages without a `Nats-Msg-Id`.
    no_id: u64,
    /// Messages that do not match their stored event.
    mismatched: u64,
    /// Messages before an earlier event of their aggregate.
    disorder: u64,
    /// A few of the above, to print.
    examples: Vec<String>,
}

/// Compares the stream's messages, in stream order, with the stored events.
fn tally_stream<'a>(messages: &'a [OnStream], store: &Store) -> StreamTally<'a> {
    let mut on_stream: HashSet<&str> = HashSet::with_capacity(messages.len());
    let (mut duplicates, mut extra, mut no_id, mut mismatched, mut disorder) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut last_on_stream: HashMap<u32, i64> = HashMap::new();
    let mut examples: Vec<String> = Vec::new();
    for m in messages {
        let Some(id) = m.msg_id.as_deref() else {
            no_id += 1;
            continue;
        };
        if m.body_id.as_deref() != Some(id) {
            mismatched += 1;
        }
        if !on_stream.insert(id) {
            duplicates += 1;
            if examples.len() < 5 {
                examples.push(format!("duplicate {id}"));
            }
            continue;
        }
        let Some(stored) = store.events.get(id) else {
            extra += 1;
            if examples.len() < 5 {
                examples.push(format!("not in the store: {id}"));
            }
            continue;
        };
        let (aggregate_type, aggregate_id) = &store.aggregates[stored.aggregate as usize];
        if m.sequence != Some(stored.sequence)
            || m.aggregate_type.as_deref() != Some(aggregate_type.as_str())
            || m.subject.as_deref() != Some(aggregate_id.as_str())
        {
            mismatched += 1;
        }
        let last = last_on_stream.entry(stored.aggregate).or_insert(0);
        if stored.sequence <= *last {
            disorder += 1;
            if examples.len() < 5 {
                examples.push(format!(
                    "{aggregate_type} {aggregate_id}: sequence {} after {}",
                    stored.sequence, *last
                ));
            }
        }
        *last = stored.sequence;
    }
    StreamTally {
        on_stream,
        duplicates,
        extra,
        no_id,
        mismatched,
        disorder,
        examples,
    }
}

/// Every stored event exactly once on the stream (by `Nats-Msg-Id`), nothing else on it,
/// each aggregate's events in the order of their sequences: the number of messages read.
async fn check_stream(
    args: &CheckArgs,
    store: &Store,
    report: &mut Report,
) -> Result<usize, Error> {
    let messages = read_stream(&args.nats_url, &args.stream).await?;
    let StreamTally {
        on_stream,
        duplicates,
        extra,
        no_id,
        mismatched,
        disorder,
        examples,
    } = tally_stream(&messages, store);
    let missing: Vec<&String> = store
        .events
        .keys()
        .filter(|id| !on_stream.contains(id.as_str()))
        .collect();
    println!(
        "check: stream: {} messages, {} distinct event ids; {} stored events missing, {} duplicates, {} not in the store, {} without Nats-Msg-Id, {} not matching their event, {} out of per-aggregate order",
        messages.len(),
        on_stream.len(),
        missing.len(),
        duplicates,
        extra,
        no_id,
        mismatched,
        disorder
    );
    for e in &examples {
        println!("check:   e.g. {e}");
    }
    for id in missing.iter().take(5) {
        if let Some(s) = store.events.get(id.as_str()) {
            let (t, a) = &store.aggregates[s.aggregate as usize];
            println!(
                "check:   e.g. missing {id} ({t} {a} #{} {})",
                s.sequence, s.event_type
            );
        }
    }
    report.expect(missing.is_empty(), || {
        format!("{} stored events are not on the stream", missing.len())
    });
    report.expect(duplicates == 0, || {
        format!("{duplicates} events are on the stream more than once")
    });
    report.expect(extra == 0, || {
        format!("{extra} messages on the stream are no stored event")
    });
    report.expect(no_id == 0 && mismatched == 0, || {
        format!(
            "{no_id} messages without Nats-Msg-Id, {mismatched} not matching their stored event"
        )
    });
    report.expect(disorder == 0, || {
        format!("{disorder} messages break their aggregate's order")
    });
    Ok(messages.len())
}

/// What got a 2xx is stored: every answer in the records files has its aggregate (and,
/// for a specification version or a cancellation, its event) in the store. The number of
/// answers checked.
fn check_answers(args: &CheckArgs, store: &Store, report: &mut Report) -> Result<u64, Error> {
    let mut records: BTreeMap<String, u64> = BTreeMap::new();
    let mut lost: Vec<String> = Vec::new();
    let tenant_prefixed = |id: &str| format!("{}/{id}", args.tenant);
    for path in &args.records {
        let text = std::fs::read_to_string(path)?;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let Ok(r) = serde_json::from_str::<Value>(line) else {
                // A torn last line of a killed writer: not an answer anyone saw.
                continue;
            };
            let op = r.get("op").and_then(Value::as_str).unwrap_or_default();
            let id = r.get("id").and_then(Value::as_str).unwrap_or_default();
            *records.entry(op.to_string()).or_default() += 1;
            let found = match op {
                "spec" => {
                    let v = r.get("version").and_then(Value::as_i64).unwrap_or(0);
                    store
                        .has("DeploymentSpecification", id)
                        .is_some_and(|a| store.max_sequence.get(&a).copied().unwrap_or(0) >= v)
                }
                "run" => store.has("ProvisioningRun", id).is_some(),
                "cancel" => store.has("ProvisioningRun", id).is_some_and(|a| {
                    store
                        .event_types
                        .get(&a)
                        .is_some_and(|t| t.iter().any(|t| t == "ProvisioningCancelled"))
                }),
                "release" => {
                    store.has("Release", id).is_some()
                        || store.has("Release", &tenant_prefixed(id)).is_some()
                }
                "promotion" => {
                    store.has("Promotion", id).is_some()
                        || store.has("Promotion", &tenant_prefixed(id)).is_some()
                }
                _ => true,
            };
            if !found {
                lost.push(format!("{op} {id}"));
            }
        }
    }
    println!(
        "check: 2xx answers recorded: {} ({}); lost: {}",
        records.values().sum::<u64>(),
        records
            .iter()
            .map(|(op, n)| format!("{op} {n}"))
            .collect::<Vec<_>>()
            .join(", "),
        lost.len()
    );
    for l in lost.iter().take(10) {
        println!("check:   lost: {l}");
    }
    report.expect(lost.is_empty(), || {
        format!("{} answers that got a 2xx are not in the store", lost.len())
    });
    Ok(records.values().sum::<u64>())
}

/// Counts the runs and the applied runs, and lists the runs with more than one
/// `ApplyStarted` or `ProvisioningApplied`.
fn count_runs(store: &Store) -> (u64, u64, Vec<String>) {
    let mut runs_total = 0u64;
    let mut applied = 0u64;
    let mut twice: Vec<String> = Vec::new();
    for (a, (t, id)) in store.aggregates.iter().enumerate() {
        if t != "ProvisioningRun" {
            continue;
        }
        runs_total += 1;
        let types = store
            .event_types
            .get(&(a as u32))
            .cloned()
            .unwrap_or_default();
        let count = |name: &str| types.iter().filter(|t| *t == name).count();
        let started = count("ApplyStarted");
        let done = count("ProvisioningApplied");
        if done > 0 {
            applied += 1;
        }
        if started > 1 || done > 1 {
            twice.push(format!(
                "{id}: ApplyStarted x{started}, ProvisioningApplied x{done}"
            ));
        }
    }
    (runs_total, applied, twice)
}

/// No run applied twice: by its events, by the work queue's apply items, by
/// `environment_applies`, and by the simulated runner's own log lines.
async fn check_applies(
    args: &CheckArgs,
    pool: &PgPool,
    store: &Store,
    report: &mut Report,
) -> Result<(), Error> {
    let (runs_total, applied, mut twice) = count_runs(store);
    let mut apply_failed = 0u64;
    let failed_applies: Vec<(String, i64)> = sqlx::query_as(
        "SELECT aggregate_id, count(*) FROM events
          WHERE aggregate_type = 'ProvisioningRun' AND event_type = 'ProvisioningFailed'
            AND payload->'ProvisioningFailed'->>'stage' = 'apply'
          GROUP BY aggregate_id",
    )
    .fetch_all(pool)
    .await?;
    for (id, n) in &failed_applies {
        apply_failed += 1;
        if *n > 1 {
            twice.push(format!("{id}: apply failed x{n}"));
        }
    }
    let work: Vec<(String, String, i64, Option<String>)> = sqlx::query_as(
        "SELECT item_id, status, attempts::bigint, result FROM work_items WHERE step = 'apply'",
    )
    .fetch_all(pool)
    .await?;
    let with_result = work.iter().filter(|w| w.3.is_some()).count();
    let reclaimed = work.iter().filter(|w| w.2 > 1).count();
    let env_applies: Vec<(String, String)> =
        sqlx::query_as("SELECT environment_key, run_id FROM environment_applies")
            .fetch_all(pool)
            .await?;
    let mut bad_env_applies = 0;
    for (env, run) in &env_applies {
        let ok = store.has("ProvisioningRun", run).is_some_and(|a| {
            store
                .event_types
                .get(&a)
                .is_some_and(|t| t.iter().any(|t| t == "ProvisioningApplied"))
        });
        if !ok {
            bad_env_applies += 1;
            println!("check:   environment_applies {env} names run {run}, which has no ProvisioningApplied");
        }
    }
    let (runner, unattributed) = runner_applies(&args.runner_logs)?;
    let runner_total: u64 = runner.values().sum();
    let runner_twice: Vec<(&String, &u64)> = runner.iter().filter(|(_, n)| **n > 1).collect();
    println!(
        "check: runs: {runs_total} runs, {applied} applied, {apply_failed} failed at apply; apply work items {} ({} with a stored result, {} claimed more than once); environment_applies {}; simulated runner applies in the logs: {runner_total} for {} runs ({} runs more than once, {unattributed} unattributed)",
        work.len(),
        with_result,
        reclaimed,
        env_applies.len(),
        runner.len(),
        runner_twice.len()
    );
    for t in twice.iter().take(10) {
        println!("check:   applied twice: {t}");
    }
    for (run, n) in runner_twice.iter().take(10) {
        println!("check:   the runner applied run {run} {n} times");
    }
    report.expect(twice.is_empty(), || {
        format!("{} runs applied more than once", twice.len())
    });
    report.expect(runner_twice.is_empty(), || {
        format!(
            "the simulated runner applied {} runs more than once",
            runner_twice.len()
        )
    });
    report.expect(bad_env_applies == 0, || {
        format!("{bad_env_applies} environment_applies rows name a run that did not apply")
    });
    Ok(())
}

async fn check(args: CheckArgs) -> Result<bool, Error> {
    let started = Instant::now();
    let mut report = Report::default();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&args.database_url)
        .await?;
    let settled = settle(&pool, Duration::from_secs(args.settle_timeout_secs)).await?;
    report.expect(settled, || {
        "Ferry did not settle: a subscription is behind or work is stuck".to_string()
    });

    // The store.
    let store = load_store(&pool).await?;
    // Each aggregate's sequences are 1..n (the store's own invariant, as a baseline).
    let mut seen_sequences: HashMap<u32, u64> = HashMap::new();
    for e in store.events.values() {
        *seen_sequences.entry(e.aggregate).or_default() += 1;
    }
    let gapped = seen_sequences
        .iter()
        .filter(|(a, n)| store.max_sequence.get(a).copied().unwrap_or(0) != **n as i64)
        .count();
    report.expect(gapped == 0, || {
        format!("{gapped} aggregates have gaps in their stored sequences")
    });

    let messages = check_stream(&args, &store, &mut report).await?;
    let answers = check_answers(&args, &store, &mut report)?;
    check_applies(&args, &pool, &store, &mut report).await?;
    // The read models: per-row versions, then a replay by Ferry's own projection code.
    check_versions(
        &pool,
        &store.aggregates,
        &store.max_sequence,
        &store.event_types,
        &mut report,
    )
    .await?;
    if !args.no_replay {
        replay_and_compare(&args.database_url, &mut report).await?;
    }

    if !args.reconcile_windows.is_empty() || !args.scheduled_windows.is_empty() {
        check_reconciliation(&pool, &args, &mut report).await?;
    }

    println!(
        "check: {} in {:.0} s: {} events, {} on the stream, {} 2xx answers checked",
        if report.failures.is_empty() {
            "PASSED"
        } else {
            "FAILED"
        },
        started.elapsed().as_secs_f64(),
        store.events.len(),
        messages,
        answers
    );
    Ok(report.failures.is_empty())
}

/// Each read-model row against its aggregate's events: one row per run, promotion and
/// specification version, each at its aggregate's last sequence.
async fn check_versions(
    pool: &PgPool,
    aggregates: &[(String, String)],
    max_sequence: &HashMap<u32, i64>,
    event_types: &HashMap<u32, Vec<String>>,
    report: &mut Report,
) -> Result<(), Error> {
    let mut expected: HashMap<&str, HashMap<&str, i64>> = HashMap::new();
    let mut spec_versions = 0i64;
    let mut releases = 0i64;
    for (a, (t, id)) in aggregates.iter().enumerate() {
        let seq = max_sequence.get(&(a as u32)).copied().unwrap_or(0);
        match t.as_str() {
            "ProvisioningRun" | "Promotion" => {
                expected
                    .entry(t.as_str())
                    .or_default()
                    .insert(id.as_str(), seq);
            }
            "DeploymentSpecification" => spec_versions += seq,
            "Release"
                if event_types
                    .get(&(a as u32))
                    .is_some_and(|t| t.iter().any(|t| t == "ReleaseRecorded")) =>
            {
                releases += 1;
            }
            _ => {}
        }
    }
    for (t, table, id_col) in [
        ("ProvisioningRun", "rm_runs", "provisioning_run_id"),
        ("Promotion", "rm_promotions", "promotion_id"),
    ] {
        let rows: Vec<(String, i64)> =
            sqlx::query_as(&format!("SELECT {id_col}, version FROM {table}"))
                .fetch_all(pool)
                .await?;
        let want = expected.remove(t).unwrap_or_default();
        let mut wrong = 0;
        let mut extra = 0;
        let mut seen = HashSet::new();
        for (id, version) in &rows {
            seen.insert(id.as_str());
            match want.get(id.as_str()) {
                Some(v) if v == version => {}
                Some(v) => {
                    wrong += 1;
                    if wrong <= 5 {
                        println!(
                            "check:   {table} {id} is at version {version}, its events at {v}"
                        );
                    }
                }
                None => extra += 1,
            }
        }
        let missing = want.keys().filter(|id| !seen.contains(*id)).count();
        println!(
            "check: {table}: {} rows for {} aggregates; {missing} missing, {extra} extra, {wrong} at another version than their events",
            rows.len(),
            want.len()
        );
        report.expect(missing == 0 && extra == 0 && wrong == 0, || {
            format!("{table}: {missing} missing, {extra} extra, {wrong} at the wrong version")
        });
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM rm_specification_versions")
        .fetch_one(pool)
        .await?;
    println!("check: rm_specification_versions: {rows} rows for {spec_versions} declarations");
    report.expect(rows == spec_versions, || {
        format!("rm_specification_versions has {rows} rows for {spec_versions} declarations")
    });
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM rm_releases")
        .fetch_one(pool)
        .await?;
    println!("check: rm_releases: {rows} rows for {releases} releases");
    report.expect(rows == releases, || {
        format!("rm_releases has {rows} rows for {releases} releases")
    });
    Ok(())
}

const SUFFIX: &str = "_soakcheck";

/// Replays the whole stream into fresh `<table>_soakcheck` tables with Ferry's own
/// projections, then compares every live table with its replay, row by row.
async fn replay_and_compare(url: &str, report: &mut Report) -> Result<(), Error> {
    let contexts = ferry_app::Contexts::builtin();
    contexts.register_aggregates();
    let db = ferry_store::Database::connect_postgres(url).await?;
    let pool = PgPoolOptions::new().max_connections(2).connect(url).await?;
    for projection in contexts.projections() {
        let runner = ferry_projections::projection::ProjectionRunner::with_suffix(
            projection.clone(),
            SUFFIX,
        );
        let mut tx = Tx::begin(&db).await?;
        for spec in projection.tables() {
            tx.execute(
                &format!("DROP TABLE IF EXISTS {}", runner.tables().get(spec.base)),
                &[],
            )
            .await?;
        }
        tx.execute(
            "DELETE FROM subscription_checkpoints WHERE name = $1",
            &[Param::Text(Some(runner.name().to_string()))],
        )
        .await?;
        for sql in runner.create_statements(db.backend(), "soakcheck") {
            tx.execute(&sql, &[]).await?;
        }
        tx.commit().await?;
        ensure_checkpoint(&db, runner.name()).await?;
        let t = Instant::now();
        let replayed = catch_up(&db, &runner).await?;
        let mut differences = Vec::new();
        for spec in projection.tables() {
            let live = spec.base;
            let copy = runner.tables().get(spec.base).to_string();
            let count = |a: &str, b: &str| {
                format!(
                    "SELECT count(*) FROM (SELECT to_jsonb(x) FROM {a} x EXCEPT ALL SELECT to_jsonb(y) FROM {b} y) d"
                )
            };
            let only_live: i64 = sqlx::query_scalar(&count(live, &copy))
                .fetch_one(&pool)
                .await?;
            let only_replay: i64 = sqlx::query_scalar(&count(&copy, live))
                .fetch_one(&pool)
                .await?;
            let rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {live}"))
                .fetch_one(&pool)
                .await?;
            println!(
                "check: projection {}: {live}: {rows} rows; {only_live} rows only live, {only_replay} only in the replay",
                projection.name()
            );
            if only_live > 0 || only_replay > 0 {
                differences.push(format!(
                    "{live}: {only_live} only live, {only_replay} only replayed"
                ));
                let sample: Vec<String> = sqlx::query_scalar(&format!(
                    "SELECT to_jsonb(x)::text FROM {live} x EXCEPT ALL SELECT to_jsonb(y)::text FROM {copy} y LIMIT 2"
                ))
                .fetch_all(&pool)
                .await
                .unwrap_or_default();
                for s in sample {
                    println!("check:   live only: {}", &s[..s.len().min(400)]);
                }
            }
        }
        println!(
            "check: projection {}: {replayed} events replayed in {:.1} s",
            projection.name(),
            t.elapsed().as_secs_f64()
        );
        report.expect(differences.is_empty(), || {
            format!(
                "projection {} differs from a replay of the events: {}",
                projection.name(),
                differences.join("; ")
            )
        });
        // Leave nothing behind.
        let mut tx = Tx::begin(&db).await?;
        for spec in projection.tables() {
            tx.execute(
                &format!("DROP TABLE IF EXISTS {}", runner.tables().get(spec.base)),
                &[],
            )
            .await?;
        }
        tx.execute(
            "DELETE FROM subscription_checkpoints WHERE name = $1",
            &[Param::Text(Some(runner.name().to_string()))],
        )
        .await?;
        tx.commit().await?;
    }
    db.close().await;
    Ok(())
}

/// Reconciliation runs: one per environment and window, each named after its window.
async fn check_reconciliation(
    pool: &PgPool,
    args: &CheckArgs,
    report: &mut Report,
) -> Result<(), Error> {
    let tenant = TenantId::parse(args.tenant.clone()).map_err(|e| format!("--tenant: {e}"))?;
    let rows: Vec<(String, Value)> = sqlx::query_as(
        "SELECT aggregate_id, payload FROM events
          WHERE aggregate_type = 'ProvisioningRun' AND event_type = 'ProvisioningRequested'
            AND payload::text LIKE '%\"Reconciliation\"%'",
    )
    .fetch_all(pool)
    .await?;
    let windows: Vec<&String> = args
        .reconcile_windows
        .iter()
        .chain(&args.scheduled_windows)
        .collect();
    let mut per_window_env: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    let mut unnamed = Vec::new();
    for (id, payload) in &rows {
        let request = payload.get("ProvisioningRequested").unwrap_or(payload);
        if request.get("kind").and_then(Value::as_str) != Some("Reconciliation") {
            continue;
        }
        let env = request
            .get("environmentId")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let spec = request
            .get("specificationId")
            .and_then(Value::as_str)
            .and_then(|s| SpecificationId::parse(s).ok());
        let window = spec.and_then(|spec| {
            windows.iter().find(|w| {
                ProvisioningRunId::for_reconciliation(&tenant, spec, w).to_string() == *id
            })
        });
        match window {
            Some(w) => per_window_env
                .entry(((*w).clone(), env))
                .or_default()
                .push(id.clone()),
            None => unnamed.push(id.clone()),
        }
    }
    let many: Vec<_> = per_window_env.iter().filter(|(_, r)| r.len() > 1).collect();
    for w in &windows {
        let n = per_window_env.keys().filter(|(win, _)| win == *w).count();
        println!("check: reconciliation window {w}: {n} environments with a run");
    }
    println!(
        "check: reconciliation: {} runs, {} (window, environment) pairs, {} with more than one run, {} runs of no given window",
        rows.len(),
        per_window_env.len(),
        many.len(),
        unnamed.len()
    );
    report.expect(many.is_empty(), || {
        format!(
            "{} environments have more than one reconciliation run in a window",
            many.len()
        )
    });
    // The `ferry reconcile` outputs: each run of the window started exactly once.
    if !args.reconcile_outputs.is_empty() {
        check_reconcile_outputs(args, &per_window_env, report)?;
    }
    Ok(())
}

/// The outputs of `ferry reconcile`: each run they list started by exactly one of them, and
/// the runs listed are the runs of the reconciled windows in the store (`per_window_env`).
fn check_reconcile_outputs(
    args: &CheckArgs,
    per_window_env: &BTreeMap<(String, String), Vec<String>>,
    report: &mut Report,
) -> Result<(), Error> {
    let mut started: HashMap<String, u64> = HashMap::new();
    let mut listed: HashSet<String> = HashSet::new();
    for path in &args.reconcile_outputs {
        let text = std::fs::read_to_string(path)?;
        let Ok(v) = serde_json::from_str::<Value>(&text) else {
            println!("check: {}: {}", path.display(), text.trim());
            continue;
        };
        for r in v
            .get("runs")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let id = r
                .get("provisioningRunId")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            listed.insert(id.clone());
            if r.get("started").and_then(Value::as_bool) == Some(true) {
                *started.entry(id).or_default() += 1;
            }
        }
    }
    let twice = started.values().filter(|n| **n > 1).count();
    let never = listed
        .iter()
        .filter(|id| !started.contains_key(*id))
        .count();
    println!(
        "check: ferry reconcile x{}: {} runs listed, {} started once, {} started more than once, {} started by none",
        args.reconcile_outputs.len(),
        listed.len(),
        started.values().filter(|n| **n == 1).count(),
        twice,
        never
    );
    report.expect(twice == 0 && never == 0, || {
        format!("reconcile outputs: {twice} runs started twice, {never} never started")
    });
    let window_runs: BTreeSet<&String> = per_window_env
        .iter()
        .filter(|((w, _), _)| args.reconcile_windows.contains(w))
        .flat_map(|(_, r)| r)
        .collect();
    let listed_sorted: BTreeSet<&String> = listed.iter().collect();
    report.expect(window_runs == listed_sorted, || {
        format!(
            "the window's runs in the store ({}) are not the runs the reconcilers listed ({})",
            window_runs.len(),
            listed_sorted.len()
        )
    });
    Ok(())
}

// ---------------------------------------------------------------------------------------
// lose-tail

/// Cuts the newest `.blk` of `stream` after all but its last `drop` records, and removes
/// the per-block indexes and the stream's index that would vouch for them (as
/// `ferry_messaging::testing::Nats::crash_losing_tail` does).
fn lose_tail(args: &LoseTailArgs) -> Result<bool, Error> {
    let msgs = args
        .store_dir
        .join("jetstream")
        .join("$G")
        .join("streams")
        .join(&args.stream)
        .join("msgs");
    let mut blocks: Vec<(u64, PathBuf)> = std::fs::read_dir(&msgs)?
        .filter_map(|e| {
            let path = e.ok()?.path();
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
    let Some((_, newest)) = blocks.last().cloned() else {
        return Err(format!("no message block in {}", msgs.display()).into());
    };
    // Record: total_len u32 (high bit: has headers) | seq u64 | ... (little endian).
    let bytes = std::fs::read(&newest)?;
    let mut offsets = Vec::new();
    let mut at = 0usize;
    let mut last_seq = 0u64;
    while at + 12 <= bytes.len() {
        let len = (u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
            & !(1 << 31)) as usize;
        if len == 0 || at + len > bytes.len() {
            break;
        }
        let mut seq = [0u8; 8];
        seq.copy_from_slice(&bytes[at + 4..at + 12]);
        offsets.push((at, u64::from_le_bytes(seq)));
        last_seq = u64::from_le_bytes(seq);
        at += len;
    }
    let keep = offsets.len().saturating_sub(args.drop);
    let cut_at = offsets.get(keep).map_or(at, |(o, _)| *o);
    let first_lost = offsets.get(keep).map(|(_, s)| *s);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&newest)?
        .set_len(cut_at as u64)?;
    for entry in std::fs::read_dir(&msgs)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e != "blk") {
            std::fs::remove_file(path)?;
        }
    }
    if let Some(parent) = msgs.parent() {
        let _ = std::fs::remove_file(parent.join("index.db"));
    }
    println!(
        "lose-tail: {}: {} records, cut {} (sequences {}..={last_seq}), {} bytes -> {cut_at}",
        newest.display(),
        offsets.len(),
        offsets.len() - keep,
        first_lost.map_or("-".to_string(), |s| s.to_string()),
        bytes.len()
    );
    Ok(true)
}

// ---------------------------------------------------------------------------------------
// instances

/// Every item of a paged list, in order.
async fn list_all(
    http: &reqwest::Client,
    base: &str,
    path: &str,
    token: &str,
) -> Result<Vec<Value>, Error> {
    let mut items = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut url = format!("{base}{path}?limit=200");
        if let Some(c) = &cursor {
            url.push_str(&format!("&cursor={c}"));
        }
        let page: Value = http
            .get(&url)
            .bearer_auth(token)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        items.extend(
            page.get("items")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default(),
        );
        cursor = page
            .get("nextCursor")
            .and_then(Value::as_str)
            .map(str::to_string);
        if cursor.is_none() {
            return Ok(items);
        }
    }
}

async fn instances(args: InstancesArgs) -> Result<bool, Error> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()?;
    let mut ok = true;
    let lists = [
        "/factory/provisioning/specifications",
        "/factory/provisioning/runs",
        "/factory/provisioning/proposals",
        "/factory/delivery/releases",
        "/factory/delivery/promotions",
    ];
    for path in lists {
        let mut answers = Vec::new();
        for base in &args.urls {
            answers.push(list_all(&http, base, path, &args.token).await?);
        }
        let same = answers.windows(2).all(|w| w[0] == w[1]);
        println!(
            "instances: GET {path}: {} items on each of {} instances: {}",
            answers.first().map_or(0, Vec::len),
            args.urls.len(),
            if same { "identical" } else { "DIFFERENT" }
        );
        if !same {
            for (base, a) in args.urls.iter().zip(&answers) {
                println!("instances:   {base}: {} items", a.len());
            }
            ok = false;
        }
    }
    let mut leaders = 0;
    for base in &args.urls {
        let metrics = http
            .get(format!("{base}/metrics"))
            .send()
            .await?
            .text()
            .await?;
        let leader = metrics
            .lines()
            .filter(|l| l.starts_with("ferry_nats_relay_leader"))
            .filter_map(|l| l.rsplit(' ').next())
            .filter_map(|v| v.parse::<f64>().ok())
            .any(|v| v >= 1.0);
        let published = metrics
            .lines()
            .filter(|l| l.starts_with("ferry_nats_relay_published_total"))
            .filter_map(|l| l.rsplit(' ').next())
            .filter_map(|v| v.parse::<f64>().ok())
            .sum::<f64>();
        let ready: Value = http
            .get(format!("{base}/readyz"))
            .send()
            .await?
            .json()
            .await
            .unwrap_or(Value::Null);
        println!(
            "instances: {base}: relay leader {leader}, published {published}, readyz {}",
            ready.get("status").and_then(Value::as_str).unwrap_or("?")
        );
        if leader {
            leaders += 1;
        }
    }
    println!(
        "instances: {leaders} relay leader(s) among {} instances",
        args.urls.len()
    );
    if leaders != 1 {
        ok = false;
    }
    Ok(ok)
}
