//! The provisioning metrics, kept in-process and rendered as Prometheus text at `/metrics`:
//! `connectsoft_factory_provisioning_runs_total` (tenant, kind, state) and
//! `connectsoft_factory_provisioning_apply_duration_seconds` (kind). Each instance counts
//! the transitions it made; Prometheus sums instances.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

const BUCKETS: [f64; 12] = [
    1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 2700.0, 3600.0,
];

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

/// Counters and histograms.
#[derive(Debug, Default)]
pub struct Metrics {
    runs: Mutex<BTreeMap<(String, String, String), u64>>,
    apply: Mutex<BTreeMap<String, Histogram>>,
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    /// A run of `kind` reached `state`.
    pub fn run_reached(&self, tenant: &str, kind: &str, state: &str) {
        if let Ok(mut runs) = self.runs.lock() {
            *runs
                .entry((tenant.to_string(), kind.to_string(), state.to_string()))
                .or_default() += 1;
        }
    }

    /// An apply of `kind` took `seconds`.
    pub fn apply_took(&self, kind: &str, seconds: f64) {
        if let Ok(mut apply) = self.apply.lock() {
            let h = apply.entry(kind.to_string()).or_default();
            for (i, bound) in BUCKETS.iter().enumerate() {
                if seconds <= *bound {
                    h.counts[i] += 1;
                }
            }
            h.count += 1;
            h.sum += seconds;
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str("# HELP connectsoft_factory_provisioning_runs_total Provisioning runs by kind and outcome.\n");
        out.push_str("# TYPE connectsoft_factory_provisioning_runs_total counter\n");
        if let Ok(runs) = self.runs.lock() {
            for ((tenant, kind, state), n) in runs.iter() {
                let _ = writeln!(
                    out,
                    "connectsoft_factory_provisioning_runs_total{{tenant=\"{}\",kind=\"{}\",state=\"{}\"}} {n}",
                    escape(tenant),
                    escape(kind),
                    escape(state)
                );
            }
        }
        out.push_str(
            "# HELP connectsoft_factory_provisioning_apply_duration_seconds Apply duration.\n",
        );
        out.push_str("# TYPE connectsoft_factory_provisioning_apply_duration_seconds histogram\n");
        if let Ok(apply) = self.apply.lock() {
            for (kind, h) in apply.iter() {
                let kind = escape(kind);
                for (i, bound) in BUCKETS.iter().enumerate() {
                    let _ = writeln!(
                        out,
                        "connectsoft_factory_provisioning_apply_duration_seconds_bucket{{kind=\"{kind}\",le=\"{bound}\"}} {}",
                        h.counts[i]
                    );
                }
                let _ = writeln!(
                    out,
                    "connectsoft_factory_provisioning_apply_duration_seconds_bucket{{kind=\"{kind}\",le=\"+Inf\"}} {}",
                    h.count
                );
                let _ = writeln!(out, "connectsoft_factory_provisioning_apply_duration_seconds_sum{{kind=\"{kind}\"}} {}", h.sum);
                let _ = writeln!(out, "connectsoft_factory_provisioning_apply_duration_seconds_count{{kind=\"{kind}\"}} {}", h.count);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_histograms() {
        let m = Metrics::default();
        m.run_reached("acme", "Release", "Applied");
        m.run_reached("acme", "Release", "Applied");
        m.apply_took("Release", 12.0);
        let text = m.render();
        assert!(text.contains("connectsoft_factory_provisioning_runs_total{tenant=\"acme\",kind=\"Release\",state=\"Applied\"} 2"));
        assert!(text.contains("connectsoft_factory_provisioning_apply_duration_seconds_bucket{kind=\"Release\",le=\"10\"} 0"));
        assert!(text.contains("connectsoft_factory_provisioning_apply_duration_seconds_bucket{kind=\"Release\",le=\"30\"} 1"));
        assert!(text.contains(
            "connectsoft_factory_provisioning_apply_duration_seconds_count{kind=\"Release\"} 1"
        ));
    }
}
