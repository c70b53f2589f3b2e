//! The provisioning metrics, kept in the `prometheus` library's counters and histograms and
//! served at `/metrics` through the process's registry:
//! `connectsoft_factory_provisioning_runs_total` (tenant, kind, state) and
//! `connectsoft_factory_provisioning_apply_duration_seconds` (kind) and
//! `connectsoft_factory_provisioning_reconciliation_diffs_total` (tenant, destructive). Each instance counts
//! the transitions it made; Prometheus sums instances.

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder};

const BUCKETS: [f64; 12] = [
    1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 2700.0, 3600.0,
];

/// The labels of the runs counter, in the order they are written.
const RUN_LABELS: [&str; 3] = ["tenant", "kind", "state"];

/// The runs counter and the apply-duration histogram. Clones share the same values, so
/// one clone can be registered in the process's registry while the workers count on another.
#[derive(Debug, Clone)]
pub struct Metrics {
    runs: IntCounterVec,
    apply: HistogramVec,
    diffs: IntCounterVec,
}

impl Metrics {
    /// Empty counters and histograms; refused only if a family's name or labels were invalid.
    pub fn new() -> prometheus::Result<Self> {
        Ok(Self {
            runs: IntCounterVec::new(
                Opts::new(
                    "connectsoft_factory_provisioning_runs_total",
                    "Provisioning runs by kind and outcome.",
                ),
                &RUN_LABELS,
            )?,
            apply: HistogramVec::new(
                HistogramOpts::new(
                    "connectsoft_factory_provisioning_apply_duration_seconds",
                    "Apply duration.",
                )
                .buckets(BUCKETS.to_vec()),
                &["kind"],
            )?,
            diffs: IntCounterVec::new(
                Opts::new(
                    "connectsoft_factory_provisioning_reconciliation_diffs_total",
                    "Differences found by reconciliation.",
                ),
                &["tenant", "destructive"],
            )?,
        })
    }

    /// A reconciliation's plan found `count` differences (`destructive`: deletes and
    /// replaces; the others: creates and in-place updates).
    pub fn diffs_found(&self, tenant: &str, destructive: bool, count: u32) {
        if count > 0 {
            let label = if destructive { "true" } else { "false" };
            self.diffs
                .with_label_values(&[tenant, label])
                .inc_by(u64::from(count));
        }
    }

    /// Registers both families in `registry` (the process's, served at `/metrics`).
    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.clone()))
    }

    /// A run of `kind` reached `state`.
    pub fn run_reached(&self, tenant: &str, kind: &str, state: &str) {
        self.runs.with_label_values(&[tenant, kind, state]).inc();
    }

    /// An apply of `kind` took `seconds`.
    pub fn apply_took(&self, kind: &str, seconds: f64) {
        self.apply.with_label_values(&[kind]).observe(seconds);
    }

    /// These two families alone in the Prometheus text format (the process serves them
    /// with everything else through its registry).
    pub fn render(&self) -> String {
        // The encoder refuses a family without samples; a registry leaves those out too.
        let families: Vec<MetricFamily> = self
            .collect()
            .into_iter()
            .filter(|f| !f.get_metric().is_empty())
            .collect();
        TextEncoder::new()
            .encode_to_string(&families)
            .unwrap_or_else(|error| {
                tracing::error!(%error, "cannot encode the provisioning metrics");
                String::new()
            })
    }
}

impl Collector for Metrics {
    fn desc(&self) -> Vec<&Desc> {
        let mut descs = self.runs.desc();
        descs.extend(self.apply.desc());
        descs.extend(self.diffs.desc());
        descs
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let mut runs = self.runs.collect();
        // The library sorts label pairs by name; the runs have always been written tenant,
        // kind, state, and dashboards and tests read them so.
        for family in &mut runs {
            for metric in family.mut_metric() {
                let mut labels = metric.take_label();
                labels.sort_by_key(|l| RUN_LABELS.iter().position(|n| *n == l.name()));
                metric.set_label(labels);
            }
        }
        runs.extend(self.apply.collect());
        runs.extend(self.diffs.collect());
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_histograms() {
        let m = Metrics::new().unwrap();
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

    #[test]
    fn a_registry_serves_the_same_lines_and_nothing_before_the_first_count() {
        let m = Metrics::new().unwrap();
        assert_eq!(m.render(), "");
        let registry = Registry::new();
        m.register(&registry).unwrap();
        m.run_reached("acme", "Release", "Failed");
        let text = TextEncoder::new()
            .encode_to_string(&registry.gather())
            .unwrap();
        assert!(text.contains("# HELP connectsoft_factory_provisioning_runs_total Provisioning runs by kind and outcome.\n# TYPE connectsoft_factory_provisioning_runs_total counter\n"), "{text}");
        assert!(text.contains("connectsoft_factory_provisioning_runs_total{tenant=\"acme\",kind=\"Release\",state=\"Failed\"} 1\n"), "{text}");
    }
}
