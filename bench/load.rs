//! A load benchmark against a running Ferry: `concurrency` clients for `seconds`, each
//! declaring a specification version and requesting a plan, then reading the run back.
//! Prints throughput and latency percentiles per operation.
//!
//! ```sh
//! # API only: measures the API and store; the clients declare /srv/infra#web.
//! FERRY_WORKERS=false FERRY_TENANT_PROGRAM_ROOTS=/srv/infra cargo run --release -- serve &
//! cargo run --release --example load -- http://127.0.0.1:8080 <token> 8 20
//! ```
#![forbid(unsafe_code)]
#![allow(clippy::print_stdout, clippy::unwrap_used)] // a command-line report

use serde_json::json;
use std::time::{Duration, Instant};

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let base = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "http://127.0.0.1:8080".to_string());
    let token = args
        .get(2)
        .cloned()
        .expect("usage: load <base-url> <token> [concurrency] [seconds]");
    let concurrency: usize = args.get(3).and_then(|v| v.parse().ok()).unwrap_or(8);
    let seconds: u64 = args.get(4).and_then(|v| v.parse().ok()).unwrap_or(20);
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..concurrency {
        let (client, base, token) = (client.clone(), base.clone(), token.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat: [Vec<Duration>; 3] = [vec![], vec![], vec![]];
            let mut errors = 0u64;
            let mut n = 0u64;
            while Instant::now() < deadline {
                n += 1;
                let env = format!("load-{worker}-{}", n % 50);
                let t = Instant::now();
                let spec = client
                    .post(format!("{base}/factory/provisioning/specifications"))
                    .bearer_auth(&token)
                    .json(&json!({"environmentId": env, "projectId": "load", "kind": "Workload",
                        "programRef": "/srv/infra#web", "programVersion": "3f2a9c1"}))
                    .send()
                    .await;
                lat[0].push(t.elapsed());
                let Ok(spec) = spec else { errors += 1; continue };
                if spec.status() != 201 { errors += 1; continue; }
                let spec: serde_json::Value = spec.json().await.unwrap();
                let t = Instant::now();
                let run = client
                    .post(format!("{base}/factory/provisioning/runs"))
                    .bearer_auth(&token)
                    .json(&json!({"specificationId": spec["specificationId"], "specificationVersion": spec["version"],
                        "environmentId": env, "kind": "Release"}))
                    .send()
                    .await;
                lat[1].push(t.elapsed());
                let Ok(run) = run else { errors += 1; continue };
                if run.status() != 201 { errors += 1; continue; }
                let run: serde_json::Value = run.json().await.unwrap();
                let t = Instant::now();
                let got = client
                    .get(format!("{base}/factory/provisioning/runs/{}", run["provisioningRunId"].as_str().unwrap_or_default()))
                    .bearer_auth(&token)
                    .send()
                    .await;
                lat[2].push(t.elapsed());
                if !got.is_ok_and(|r| r.status() == 200) {
                    errors += 1;
                }
            }
            (lat, errors)
        }));
    }
    let mut all: [Vec<Duration>; 3] = [vec![], vec![], vec![]];
    let mut errors = 0;
    for t in tasks {
        let (lat, e) = t.await.unwrap();
        errors += e;
        for (i, l) in lat.into_iter().enumerate() {
            all[i].extend(l);
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    println!("concurrency {concurrency}, {elapsed:.1} s, errors {errors}");
    println!(
        "{:<32} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "operation", "count", "per s", "p50 ms", "p95 ms", "p99 ms"
    );
    for (name, mut lat) in [
        "POST specifications",
        "POST runs",
        "GET run (read-your-writes)",
    ]
    .into_iter()
    .zip(all)
    {
        lat.sort();
        println!(
            "{:<32} {:>8} {:>8.1} {:>8.1} {:>8.1} {:>8.1}",
            name,
            lat.len(),
            lat.len() as f64 / elapsed,
            percentile(&lat, 0.50),
            percentile(&lat, 0.95),
            percentile(&lat, 0.99)
        );
    }
}
