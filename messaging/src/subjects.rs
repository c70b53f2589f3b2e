//! Which NATS subject each event travels on.
//!
//! The integration events have fixed subjects (`<context>.<aggregate>.v1.<event>`).
//! Every other domain event goes on `ferry.events.<aggregate>.<event>` in kebab case, so an
//! aggregate or event added later is published without a change here.

/// The stream subjects Ferry publishes on (and that its stream must cover). Only Ferry may
/// publish into that stream: the relay's `Nats-Expected-Last-Sequence` counts every message
/// in it, so another publisher there would stall it (subjects other services publish, e.g.
/// `releases.releases.>`, are stored by `FERRY_INBOUND` or their own stream). A context's
/// own integration subjects are added by [`stream_subjects`].
pub const STREAM_SUBJECTS: [&str; 2] = ["provisioning.>", "ferry.events.>"];

/// Prefix of the subjects of domain events that are not integration events.
pub const DOMAIN_PREFIX: &str = "ferry.events";

/// The subjects the relay's stream stores: [`STREAM_SUBJECTS`], and every subject
/// `publishers` document that those do not cover (a context's own integration subjects).
pub fn stream_subjects(publishers: &crate::Publishers) -> Vec<String> {
    let mut all: Vec<String> = STREAM_SUBJECTS.iter().map(|s| s.to_string()).collect();
    let covered = |subject: &str| {
        STREAM_SUBJECTS.iter().any(|pattern| {
            pattern
                .strip_suffix('>')
                .is_some_and(|prefix| subject.starts_with(prefix))
        })
    };
    for doc in publishers.documents().subjects {
        if !covered(&doc.subject) && !all.contains(&doc.subject) {
            all.push(doc.subject);
        }
    }
    all
}

/// `ferry.events.<aggregate>.<event>` for any domain event.
pub fn domain_subject(aggregate_type: &str, event_type: &str) -> String {
    format!(
        "{DOMAIN_PREFIX}.{}.{}",
        kebab(aggregate_type),
        kebab(event_type)
    )
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
    fn the_stream_stores_provisioning_subjects_and_a_context_s_own() {
        use crate::publish::{Message, Publisher};
        use crate::schemas::{Direction, Documents, SubjectDoc};
        /// A publisher that only documents `subjects` (for `aggregate`'s `event`).
        struct Documented {
            aggregate: &'static str,
            event: &'static str,
            subjects: [&'static str; 2],
        }
        #[async_trait::async_trait]
        impl Publisher for Documented {
            fn aggregate_type(&self) -> &'static str {
                self.aggregate
            }
            async fn message(
                &self,
                _: &ferry_store::Database,
                _: &ferry_store::StoredEvent,
            ) -> Result<Message, ferry_store::events::ReadError> {
                unreachable!("only documented here")
            }
            fn documents(&self) -> Documents {
                let doc = |subject: &str| SubjectDoc {
                    subject: subject.to_string(),
                    event: self.event.to_string(),
                    schema: format!("events/{}.schema.json", kebab(self.event)),
                    direction: Direction::Out,
                    summary: String::new(),
                };
                Documents {
                    subjects: self.subjects.iter().map(|s| doc(s)).collect(),
                    files: Vec::new(),
                }
            }
        }
        // Provisioning's subjects (its publishers are in its context, `ferry-app`).
        let provisioning = crate::Publishers::new().with(std::sync::Arc::new(Documented {
            aggregate: "ProvisioningRun",
            event: "ProvisioningPlanned",
            subjects: [
                "provisioning.runs.v1.provisioning-planned",
                "ferry.events.provisioning-run.provisioning-cancelled",
            ],
        }));
        assert_eq!(stream_subjects(&provisioning), STREAM_SUBJECTS.to_vec());
        let with_promotions = provisioning.with(std::sync::Arc::new(Documented {
            aggregate: "Promotion",
            event: "PromotionRequested",
            subjects: [
                "releases.promotions.v1.promotion-requested",
                "ferry.events.promotion.promotion-gate-evaluated",
            ],
        }));
        assert_eq!(
            stream_subjects(&with_promotions),
            [
                "provisioning.>",
                "ferry.events.>",
                "releases.promotions.v1.promotion-requested"
            ]
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
