//! Which CloudEvent sources Ferry trusts for which events (`FERRY_TRUSTED_SOURCES`).
//!
//! The events Ferry reacts to carry another service's authority: an approval decided in
//! run control, an environment's class from the environment service. Over HTTP only service
//! tokens may post them; on top of that, and over NATS too, the operator can name the
//! CloudEvent `source`s each event may come from:
//!
//! ```text
//! runcontrol.approvals.v1.approval-decided=urn:runcontrol;environments.v1.*=urn:environments,urn:envsvc-eu
//! ```
//!
//! Entries are `;`-separated `<event>=<source>[,<source>…]`; `<event>` is a subject, a NATS
//! wildcard pattern over subjects (`*` one token, `>` the rest) or an event name
//! (`ApprovalDecided`); a source ending in `*` matches by prefix. Unset, any source is
//! accepted (from a token allowed to post events). Set, an event no entry names is refused:
//! trust is granted, never assumed.

use super::nats::subject_matches;

/// One `<event>=<sources>` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    event: String,
    sources: Vec<String>,
}

/// The trusted sources per event; [`TrustedSources::any`] when not configured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedSources {
    entries: Option<Vec<Entry>>,
}

/// Why a `FERRY_TRUSTED_SOURCES` value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrustedSourcesError {
    /// An entry is not `<event>=<source>[,<source>…]`.
    #[error("entry {0:?} is not <event>=<source>[,<source>...]")]
    Malformed(String),
    /// An entry names no known inbound event.
    #[error("entry {0:?} matches none of the events Ferry accepts")]
    UnknownEvent(String),
}

impl TrustedSources {
    /// Every source is trusted (the setting is unset).
    pub fn any() -> Self {
        Self::default()
    }

    /// Parses the setting's value (see the module documentation).
    pub fn parse(text: &str) -> Result<Self, TrustedSourcesError> {
        let mut entries = Vec::new();
        for raw in text.split(';').map(str::trim).filter(|e| !e.is_empty()) {
            let (event, sources) = raw
                .split_once('=')
                .ok_or_else(|| TrustedSourcesError::Malformed(raw.to_string()))?;
            let event = event.trim().to_string();
            let sources: Vec<String> = sources
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect();
            if event.is_empty() || sources.is_empty() {
                return Err(TrustedSourcesError::Malformed(raw.to_string()));
            }
            let known = super::INBOUND
                .iter()
                .any(|(name, subject)| *name == event || subject_matches(&event, subject));
            if !known {
                return Err(TrustedSourcesError::UnknownEvent(event));
            }
            entries.push(Entry { event, sources });
        }
        Ok(Self {
            entries: Some(entries),
        })
    }

    /// Whether `source` may send event `name` (arriving on `subject`); the error says why
    /// not and what to configure.
    pub fn check(&self, name: &str, subject: &str, source: &str) -> Result<(), String> {
        let Some(entries) = &self.entries else {
            return Ok(());
        };
        let matching: Vec<&Entry> = entries
            .iter()
            .filter(|e| e.event == name || subject_matches(&e.event, subject))
            .collect();
        if matching.is_empty() {
            return Err(format!(
                "no source is trusted for {subject} (FERRY_TRUSTED_SOURCES names none for it)"
            ));
        }
        let trusted = matching.iter().flat_map(|e| &e.sources).any(|s| {
            s.strip_suffix('*')
                .map_or(s == source, |prefix| source.starts_with(prefix))
        });
        if trusted {
            Ok(())
        } else {
            Err(format!(
                "source {source:?} is not trusted for {subject} (FERRY_TRUSTED_SOURCES)"
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::subjects::{APPROVAL_DECIDED, ENVIRONMENT_CREATED, RELEASE_READY};

    #[test]
    fn unset_trusts_every_source() {
        assert!(TrustedSources::any()
            .check("ApprovalDecided", APPROVAL_DECIDED, "urn:anyone")
            .is_ok());
    }

    #[test]
    fn sources_are_trusted_per_event_and_nothing_else() {
        let t = TrustedSources::parse(
            "runcontrol.approvals.v1.approval-decided=urn:runcontrol; environments.v1.*=urn:env-*,urn:envsvc",
        )
        .unwrap();
        assert!(t
            .check("ApprovalDecided", APPROVAL_DECIDED, "urn:runcontrol")
            .is_ok());
        let refused = t
            .check("ApprovalDecided", APPROVAL_DECIDED, "urn:env-eu")
            .unwrap_err();
        assert!(refused.contains("not trusted"), "{refused}");
        assert!(t
            .check("EnvironmentCreated", ENVIRONMENT_CREATED, "urn:env-eu")
            .is_ok());
        assert!(t
            .check("EnvironmentCreated", ENVIRONMENT_CREATED, "urn:envsvc")
            .is_ok());
        // Configured, an event no entry names is refused.
        let none = t
            .check("ReleaseReady", RELEASE_READY, "urn:releases")
            .unwrap_err();
        assert!(none.contains("names none"), "{none}");
        // Event names work as well as subjects.
        let by_name = TrustedSources::parse("ReleaseReady=urn:releases").unwrap();
        assert!(by_name
            .check("ReleaseReady", RELEASE_READY, "urn:releases")
            .is_ok());
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(matches!(
            TrustedSources::parse("ApprovalDecided"),
            Err(TrustedSourcesError::Malformed(_))
        ));
        assert!(matches!(
            TrustedSources::parse("ApprovalDecided="),
            Err(TrustedSourcesError::Malformed(_))
        ));
        assert!(matches!(
            TrustedSources::parse("orders.v1.*=urn:x"),
            Err(TrustedSourcesError::UnknownEvent(_))
        ));
    }
}
