//! Metric families read at scrape time, for the process's Prometheus registry.
//!
//! The relay and the inbound path count in atomics that their own code, `/readyz` and the
//! tests read, and the relay's and consumers' states live in their status records. Rather
//! than mirror every change into a second set of counters, each part declares its families
//! once ([`Family`]) and builds them from its current values whenever the registry gathers
//! ([`ScrapeCollector`]), as the library's own `PullingGauge` does.

use prometheus::core::{Collector, Desc};
use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};
use prometheus::TextEncoder;
use std::collections::HashMap;

/// One metric family: its name, help, type and label names.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Family {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    labels: &'static [&'static str],
}

impl Family {
    /// A counter.
    pub(crate) const fn counter(
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> Self {
        Self {
            name,
            help,
            kind: MetricType::COUNTER,
            labels,
        }
    }

    /// A gauge.
    pub(crate) const fn gauge(
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> Self {
        Self {
            name,
            help,
            kind: MetricType::GAUGE,
            labels,
        }
    }

    /// The family with one sample per `(label values, value)`; the values are given in the
    /// order of the family's label names.
    pub(crate) fn with<'a>(
        &self,
        samples: impl IntoIterator<Item = (Vec<&'a str>, f64)>,
    ) -> MetricFamily {
        let metrics = samples
            .into_iter()
            .map(|(values, value)| {
                let mut metric = Metric::from_label(
                    self.labels
                        .iter()
                        .zip(values)
                        .map(|(name, value)| {
                            let mut pair = LabelPair::default();
                            pair.set_name((*name).to_string());
                            pair.set_value(value.to_string());
                            pair
                        })
                        .collect(),
                );
                if self.kind == MetricType::COUNTER {
                    let mut counter = Counter::default();
                    counter.set_value(value);
                    metric.set_counter(counter);
                } else {
                    let mut gauge = Gauge::default();
                    gauge.set_value(value);
                    metric.set_gauge(gauge);
                }
                metric
            })
            .collect();
        let mut family = MetricFamily::default();
        family.set_name(self.name.to_string());
        family.set_help(self.help.to_string());
        family.set_field_type(self.kind);
        family.set_metric(metrics);
        family
    }

    /// The family with a single sample.
    pub(crate) fn one(&self, values: Vec<&str>, value: f64) -> MetricFamily {
        self.with([(values, value)])
    }

    fn desc(&self) -> prometheus::Result<Desc> {
        Desc::new(
            self.name.to_string(),
            self.help.to_string(),
            self.labels.iter().map(|l| (*l).to_string()).collect(),
            HashMap::new(),
        )
    }
}

type Gather = dyn Fn() -> Vec<MetricFamily> + Send + Sync;

/// A collector whose families are built by a function each time the registry gathers.
pub(crate) struct ScrapeCollector {
    descs: Vec<Desc>,
    gather: Box<Gather>,
}

impl ScrapeCollector {
    /// A collector of `families`, built by `gather` at scrape time; refused when a family's
    /// name or labels are invalid.
    pub(crate) fn new<'a>(
        families: impl IntoIterator<Item = &'a Family>,
        gather: impl Fn() -> Vec<MetricFamily> + Send + Sync + 'static,
    ) -> prometheus::Result<Self> {
        Ok(Self {
            descs: families
                .into_iter()
                .map(Family::desc)
                .collect::<prometheus::Result<_>>()?,
            gather: Box::new(gather),
        })
    }
}

impl Collector for ScrapeCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        (self.gather)()
    }
}

/// `families` in the Prometheus text format, leaving out those without samples (the encoder
/// refuses them; a registry leaves them out too).
pub(crate) fn encode(families: Vec<MetricFamily>) -> String {
    let families: Vec<MetricFamily> = families
        .into_iter()
        .filter(|f| !f.get_metric().is_empty())
        .collect();
    TextEncoder::new()
        .encode_to_string(&families)
        .unwrap_or_else(|error| {
            tracing::error!(%error, "cannot encode metrics");
            String::new()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_keep_their_label_order_and_integral_values() {
        const F: Family = Family::gauge("g", "A gauge.", &["b", "a"]);
        const C: Family = Family::counter("c_total", "A counter.", &[]);
        let text = encode(vec![
            F.with([(vec!["1", "2"], 3.0)]),
            C.one(vec![], 4.0),
            Family::gauge("empty", "Nothing.", &["x"]).with([]),
        ]);
        assert_eq!(
            text,
            "# HELP g A gauge.\n# TYPE g gauge\ng{b=\"1\",a=\"2\"} 3\n\
             # HELP c_total A counter.\n# TYPE c_total counter\nc_total 4\n"
        );
    }
}
