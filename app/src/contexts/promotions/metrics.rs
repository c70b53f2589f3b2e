//! The promotion metrics, served at `/metrics`:
//! `connectsoft_factory_delivery_promotions_total` (tenant, environmentClass, state: each
//! state a promotion reached: Requested, Approved, Completed, Rejected, Failed, RolledBack),
//! `connectsoft_factory_delivery_promotion_lead_time_seconds` (environmentClass: request to
//! completion) and `connectsoft_factory_delivery_rollbacks_total` (tenant, environmentClass,
//! automatic).
//!
//! Promotion commands commit in three places (the driver, the API, the inbound handler), so
//! the families are one set per process, counted through [`observe`] wherever a command
//! commits, and registered in the process's registry at start. As with the provisioning
//! metrics, each instance counts the transitions it made; Prometheus sums instances.

use ferry_domain::promotion::{Promotion, PromotionEvent};
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};
use std::sync::LazyLock;

/// Lead times run from minutes (development) to days (a production approval waiting).
const LEAD_TIME_BUCKETS: [f64; 12] = [
    30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0, 86400.0, 259200.0, 604800.0,
];

/// The three families.
#[derive(Debug, Clone)]
pub struct PromotionMetrics {
    promotions: IntCounterVec,
    lead_time: HistogramVec,
    rollbacks: IntCounterVec,
}

impl PromotionMetrics {
    fn new() -> prometheus::Result<Self> {
        Ok(Self {
            promotions: IntCounterVec::new(
                Opts::new(
                    "connectsoft_factory_delivery_promotions_total",
                    "Promotions by the states they reached.",
                ),
                &["tenant", "environmentClass", "state"],
            )?,
            lead_time: HistogramVec::new(
                HistogramOpts::new(
                    "connectsoft_factory_delivery_promotion_lead_time_seconds",
                    "Promotion request to completion.",
                )
                .buckets(LEAD_TIME_BUCKETS.to_vec()),
                &["environmentClass"],
            )?,
            rollbacks: IntCounterVec::new(
                Opts::new(
                    "connectsoft_factory_delivery_rollbacks_total",
                    "Rollbacks started, automatic or by an Operator.",
                ),
                &["tenant", "environmentClass", "automatic"],
            )?,
        })
    }

    /// Puts the families in `registry` (the process's, served at `/metrics`).
    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.promotions.clone()))?;
        registry.register(Box::new(self.lead_time.clone()))?;
        registry.register(Box::new(self.rollbacks.clone()))
    }

    /// Counts what `events`, just committed, did to `promotion` (the aggregate after them).
    pub fn observe(&self, promotion: &Promotion, events: &[PromotionEvent]) {
        let Some(request) = promotion.request() else {
            return;
        };
        let tenant = request.tenant_id.as_str();
        let class = request.environment_class.as_str();
        for event in events {
            let state = match event {
                PromotionEvent::PromotionRequested(_) => "Requested",
                PromotionEvent::PromotionApproved { .. } => "Approved",
                PromotionEvent::PromotionRejected { .. } => "Rejected",
                PromotionEvent::PromotionFailed { rolled_back, .. } => {
                    if *rolled_back {
                        "RolledBack"
                    } else {
                        "Failed"
                    }
                }
                PromotionEvent::PromotionCompleted { completed_at } => {
                    let seconds = (*completed_at - request.requested_at).num_milliseconds();
                    self.lead_time
                        .with_label_values(&[class])
                        .observe(seconds.max(0) as f64 / 1000.0);
                    "Completed"
                }
                PromotionEvent::RollbackStarted { automatic, .. } => {
                    let automatic = if *automatic { "true" } else { "false" };
                    self.rollbacks
                        .with_label_values(&[tenant, class, automatic])
                        .inc();
                    continue;
                }
                _ => continue,
            };
            self.promotions
                .with_label_values(&[tenant, class, state])
                .inc();
        }
    }
}

static METRICS: LazyLock<Option<PromotionMetrics>> = LazyLock::new(|| {
    PromotionMetrics::new()
        .inspect_err(|error| tracing::error!(%error, "promotion metrics are not available"))
        .ok()
});

/// The process's promotion metrics (`None` only if the families could not be made, which
/// their fixed names and labels rule out; logged once).
pub fn metrics() -> Option<&'static PromotionMetrics> {
    METRICS.as_ref()
}

/// Counts `events` just committed to `promotion` (see [`PromotionMetrics::observe`]).
pub fn observe(promotion: &Promotion, events: &[PromotionEvent]) {
    if let Some(m) = metrics() {
        m.observe(promotion, events);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{Duration, Utc};
    use cqrs_es::Aggregate;
    use ferry_domain::promotion::{PromotionRequest, Strategy};
    use ferry_domain::{Actor, EnvironmentClass, EnvironmentId, ProjectId, PromotionId, TenantId};

    #[test]
    fn counts_states_reached_lead_time_and_rollbacks() {
        let requested_at = Utc::now() - Duration::seconds(90);
        let request = PromotionRequest {
            promotion_id: PromotionId::new_random(),
            tenant_id: TenantId::parse("metrics-test").unwrap(),
            project_id: ProjectId::parse("payments").unwrap(),
            release_id: ferry_domain::ReleaseId::new_random(),
            environment_id: EnvironmentId::parse("payments-prod").unwrap(),
            environment_class: EnvironmentClass::Production,
            strategy: Strategy::AllAtOnce,
            run_id: None,
            hotfix: None,
            receipt_ref: None,
            previous_release_id: None,
            rollback_of: None,
            requested_by: Actor::parse("alice").unwrap(),
            requested_at,
        };
        let mut promotion = Promotion::default();
        let requested = PromotionEvent::PromotionRequested(Box::new(request));
        promotion.apply(requested.clone());
        let m = PromotionMetrics::new().unwrap();
        let registry = Registry::new();
        m.register(&registry).unwrap();
        m.observe(
            &promotion,
            &[
                requested,
                PromotionEvent::PromotionCompleted {
                    completed_at: requested_at + Duration::seconds(90),
                },
                PromotionEvent::RollbackStarted {
                    rollback_promotion_id: PromotionId::new_random(),
                    restored_release_id: ferry_domain::ReleaseId::new_random(),
                    automatic: true,
                    started_by: Actor::parse("system:promotions").unwrap(),
                    reason: "health".to_string(),
                    started_at: Utc::now(),
                },
                PromotionEvent::PromotionFailed {
                    reason: "health".to_string(),
                    rolled_back: true,
                    failed_at: Utc::now(),
                },
            ],
        );
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .unwrap();
        for line in [
            r#"connectsoft_factory_delivery_promotions_total{environmentClass="production",state="Requested",tenant="metrics-test"} 1"#,
            r#"connectsoft_factory_delivery_promotions_total{environmentClass="production",state="Completed",tenant="metrics-test"} 1"#,
            r#"connectsoft_factory_delivery_promotions_total{environmentClass="production",state="RolledBack",tenant="metrics-test"} 1"#,
            r#"connectsoft_factory_delivery_promotion_lead_time_seconds_sum{environmentClass="production"} 90"#,
            r#"connectsoft_factory_delivery_promotion_lead_time_seconds_bucket{environmentClass="production",le="60"} 0"#,
            r#"connectsoft_factory_delivery_promotion_lead_time_seconds_bucket{environmentClass="production",le="300"} 1"#,
            r#"connectsoft_factory_delivery_rollbacks_total{automatic="true",environmentClass="production",tenant="metrics-test"} 1"#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(!text.contains(r#"state="Failed""#));
    }
}
