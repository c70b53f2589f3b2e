//! Which NATS subject each event travels on.
//!
//! The integration events have fixed subjects (`<context>.<aggregate>.v1.<event>`).
//! Every other domain event goes on `ferry.events.<aggregate>.<event>` in kebab case, so an
//! aggregate or event added later is published without a change here.

/// The stream subjects Ferry publishes on (and that its stream must cover). Only Ferry may
/// publish into that stream: the relay's `Nats-Expected-Last-Sequence` counts every message
/// in it, so another publisher there would stall it (subjects other services publish, e.g.
/// `releases.promotions.>`, are stored by `FERRY_INBOUND` or their own stream).
pub const STREAM_SUBJECTS: [&str; 2] = ["provisioning.>", "ferry.events.>"];

/// `SpecificationDeclared` (integration).
pub const SPECIFICATION_DECLARED: &str = "provisioning.specifications.v1.specification-declared";
/// `ProvisioningPlanned` (integration).
pub const PROVISIONING_PLANNED: &str = "provisioning.runs.v1.provisioning-planned";
/// `ProvisioningApplied` (integration).
pub const PROVISIONING_APPLIED: &str = "provisioning.runs.v1.provisioning-applied";
/// `ProvisioningFailed` (integration).
pub const PROVISIONING_FAILED: &str = "provisioning.runs.v1.provisioning-failed";

/// Inbound: a promotion hands its desired state to provisioning.
pub const PROMOTION_APPROVED: &str = "releases.promotions.v1.promotion-approved";
/// Inbound: the environment service created an environment.
pub const ENVIRONMENT_CREATED: &str = "environments.v1.environment-created";
/// Inbound: an environment's state (readiness) changed.
pub const ENVIRONMENT_STATE_CHANGED: &str = "environments.v1.environment-state-changed";
/// Inbound: run control decided an approval.
pub const APPROVAL_DECIDED: &str = "runcontrol.approvals.v1.approval-decided";
/// Inbound: a release is ready to be promoted.
pub const RELEASE_READY: &str = "releases.releases.v1.release-ready";
/// Inbound: a release was withdrawn.
pub const RELEASE_WITHDRAWN: &str = "releases.releases.v1.release-withdrawn";

/// Prefix of the subjects of domain events that are not integration events.
pub const DOMAIN_PREFIX: &str = "ferry.events";

/// The aggregate and event type of each integration event with a fixed subject.
pub const INTEGRATION: [(&str, &str, &str); 4] = [
    (
        "DeploymentSpecification",
        "SpecificationDeclared",
        SPECIFICATION_DECLARED,
    ),
    (
        "ProvisioningRun",
        "ProvisioningPlanned",
        PROVISIONING_PLANNED,
    ),
    (
        "ProvisioningRun",
        "ProvisioningApplied",
        PROVISIONING_APPLIED,
    ),
    ("ProvisioningRun", "ProvisioningFailed", PROVISIONING_FAILED),
];

/// The fixed subject of an integration event, if it is one.
pub fn integration_subject(aggregate_type: &str, event_type: &str) -> Option<&'static str> {
    INTEGRATION
        .iter()
        .find(|(a, e, _)| *a == aggregate_type && *e == event_type)
        .map(|(_, _, s)| *s)
}

/// `ferry.events.<aggregate>.<event>` for any domain event.
pub fn domain_subject(aggregate_type: &str, event_type: &str) -> String {
    format!(
        "{DOMAIN_PREFIX}.{}.{}",
        kebab(aggregate_type),
        kebab(event_type)
    )
}

/// The subject an event is published on: its fixed subject, else the domain subject.
pub fn subject_for(aggregate_type: &str, event_type: &str) -> String {
    integration_subject(aggregate_type, event_type)
        .map(str::to_string)
        .unwrap_or_else(|| domain_subject(aggregate_type, event_type))
}

/// `ProvisioningRun` → `provisioning-run`. Characters that may not appear in a subject
/// token (space, `.`, `*`, `>`) become `-`, so a strange type name never breaks routing.
pub fn kebab(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    let chars: Vec<char> = name.chars().collect();
    for (i, &c) in chars.iter().enumerate() {
        if c.is_ascii_uppercase() {
            let prev_lower =
                i > 0 && (chars[i - 1].is_ascii_lowercase() || chars[i - 1].is_ascii_digit());
            let next_lower = chars.get(i + 1).is_some_and(char::is_ascii_lowercase);
            let prev_upper = i > 0 && chars[i - 1].is_ascii_uppercase();
            if i > 0 && (prev_lower || (prev_upper && next_lower)) && !out.ends_with('-') {
                out.push('-');
            }
            out.push(c.to_ascii_lowercase());
        } else if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
            out.push(c);
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    let trimmed = out.trim_matches('-');
    if trimmed.is_empty() {
        "unknown".to_string()
    } else {
        trimmed.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integration_events_use_the_seed_subjects() {
        assert_eq!(
            subject_for("ProvisioningRun", "ProvisioningPlanned"),
            "provisioning.runs.v1.provisioning-planned"
        );
        assert_eq!(
            subject_for("DeploymentSpecification", "SpecificationDeclared"),
            "provisioning.specifications.v1.specification-declared"
        );
    }

    #[test]
    fn other_and_unknown_events_fall_back_to_ferry_events() {
        assert_eq!(
            subject_for("ProvisioningRun", "ProvisioningCancelled"),
            "ferry.events.provisioning-run.provisioning-cancelled"
        );
        assert_eq!(
            subject_for("Promotion", "PromotionGateEvaluated"),
            "ferry.events.promotion.promotion-gate-evaluated"
        );
        assert_eq!(
            subject_for("Environment", "EnvironmentRegistered"),
            "ferry.events.environment.environment-registered"
        );
    }

    #[test]
    fn kebab_handles_acronyms_and_bad_characters() {
        assert_eq!(kebab("HTTPRunner"), "http-runner");
        assert_eq!(kebab("ApplyStarted"), "apply-started");
        assert_eq!(kebab("a.b*c>d e"), "a-b-c-d-e");
        assert_eq!(kebab("..."), "unknown");
        assert_eq!(kebab("V2Event"), "v2-event");
    }
}
