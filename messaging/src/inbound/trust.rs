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
//!
//! A `source` is what the sender wrote in the body, so over HTTP it proves nothing by
//! itself: the service identities (token subjects) allowed to speak for each source are
//! bound by `FERRY_SOURCE_IDENTITIES` ([`SourceIdentities`]):
//!
//! ```text
//! urn:runcontrol=svc-runcontrol;urn:environments=svc-environments,svc-envsvc-eu
//! ```
//!
//! Entries are `;`-separated `<source>=<identity>[,<identity>…]` (a source ending in `*`
//! matches by prefix; identities are compared as people are, `ferry_domain::Actor`). When
//! either setting is set, an HTTP post is accepted only from an identity bound to its
//! source: with sources trusted but no identities bound, no service speaks for any source
//! over HTTP. Over NATS the server's subject permissions say who may publish. With both
//! unset, every service token of a tenant may post every event for it: a default for a
//! single team, reported by `/readyz` (`inboundTrust`) and warned about at start-up.

use super::nats::subject_matches;
use ferry_domain::Actor;

/// One `<event>=<sources>` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    event: String,
    sources: Vec<String>,
}

/// The trusted sources per event, and the identities bound to each source;
/// [`TrustedSources::any`] when not configured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedSources {
    entries: Option<Vec<Entry>>,
    identities: SourceIdentities,
}

/// One `<source>=<identities>` binding.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Binding {
    source: String,
    identities: Vec<Actor>,
}

/// The service identities allowed to speak for each CloudEvent source over HTTP
/// (`FERRY_SOURCE_IDENTITIES`, see the module documentation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceIdentities {
    bindings: Option<Vec<Binding>>,
}

/// Why a `FERRY_SOURCE_IDENTITIES` value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceIdentitiesError {
    /// An entry is not `<source>=<identity>[,<identity>…]`.
    #[error("entry {0:?} is not <source>=<identity>[,<identity>...]")]
    Malformed(String),
    /// An identity is not a valid actor name.
    #[error("identity {identity:?} of entry {entry:?} is not valid: {reason}")]
    BadIdentity {
        /// The entry.
        entry: String,
        /// The identity.
        identity: String,
        /// Why.
        reason: String,
    },
}

impl SourceIdentities {
    /// Parses the setting's value (see the module documentation).
    pub fn parse(text: &str) -> Result<Self, SourceIdentitiesError> {
        let mut bindings = Vec::new();
        for raw in text.split(';').map(str::trim).filter(|e| !e.is_empty()) {
            // A source is a URI reference and may hold `=`; identities do not.
            let (source, identities) = raw
                .rsplit_once('=')
                .ok_or_else(|| SourceIdentitiesError::Malformed(raw.to_string()))?;
            let source = source.trim().to_string();
            let identities = identities
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|identity| {
                    Actor::parse(identity).map_err(|e| SourceIdentitiesError::BadIdentity {
                        entry: raw.to_string(),
                        identity: identity.to_string(),
                        reason: e.to_string(),
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            if source.is_empty() || identities.is_empty() {
                return Err(SourceIdentitiesError::Malformed(raw.to_string()));
            }
            bindings.push(Binding { source, identities });
        }
        if bindings.is_empty() {
            return Err(SourceIdentitiesError::Malformed(text.to_string()));
        }
        Ok(Self {
            bindings: Some(bindings),
        })
    }

    /// The identities bound to `source`; `None` when the setting is unset.
    fn bound_to(&self, source: &str) -> Option<Vec<&Actor>> {
        let bindings = self.bindings.as_ref()?;
        Some(
            bindings
                .iter()
                .filter(|b| source_matches(&b.source, source))
                .flat_map(|b| &b.identities)
                .collect(),
        )
    }
}

/// Whether the configured `pattern` (a source, or a prefix ending in `*`) names `source`.
fn source_matches(pattern: &str, source: &str) -> bool {
    pattern
        .strip_suffix('*')
        .map_or(pattern == source, |prefix| source.starts_with(prefix))
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

/// Why an event is not accepted from its source, or a poster may not speak for it. The text
/// is what the poster is told, or what the dead letter says, and names the setting to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Untrusted {
    /// No service identity is bound to the source.
    #[error(
        "no service identity may speak for source {0:?} over HTTP \
         (FERRY_SOURCE_IDENTITIES binds none to it)"
    )]
    Unbound(String),
    /// The poster is not one of the identities bound to the source.
    #[error("{poster:?} may not speak for source {claimed:?} (FERRY_SOURCE_IDENTITIES)")]
    NotBound {
        /// The poster (a token's subject).
        poster: String,
        /// The source the event claims.
        claimed: String,
    },
    /// No entry names the event.
    #[error("no source is trusted for {0} (FERRY_TRUSTED_SOURCES names none for it)")]
    NoneTrusted(String),
    /// The event's entries do not name its source.
    #[error("source {claimed:?} is not trusted for {subject} (FERRY_TRUSTED_SOURCES)")]
    NotTrusted {
        /// The source the event claims.
        claimed: String,
        /// The event's subject.
        subject: String,
    },
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
            entries.push(Entry { event, sources });
        }
        Ok(Self {
            entries: Some(entries),
            identities: SourceIdentities::default(),
        })
    }

    /// Refuses an entry that names none of the events the process hears (`kinds`): a typo
    /// would otherwise trust nothing, silently.
    pub fn check_events(&self, kinds: &super::InboundKinds) -> Result<(), TrustedSourcesError> {
        for entry in self.entries.iter().flatten() {
            let known = kinds.iter().any(|kind| {
                kind.name() == entry.event || subject_matches(&entry.event, kind.subject())
            });
            if !known {
                return Err(TrustedSourcesError::UnknownEvent(entry.event.clone()));
            }
        }
        Ok(())
    }

    /// The same, with the service identities bound to each source.
    pub fn with_identities(mut self, identities: SourceIdentities) -> Self {
        self.identities = identities;
        self
    }

    /// True when neither setting is set: every service token may post every event (the
    /// single-team default).
    pub fn is_open(&self) -> bool {
        self.entries.is_none() && self.identities.bindings.is_none()
    }

    /// Whether the service `poster` may speak for `source` over HTTP; the error says why not
    /// and what to configure. Open ([`TrustedSources::is_open`]), anyone may.
    pub fn check_poster(&self, source: &str, poster: &Actor) -> Result<(), Untrusted> {
        if self.is_open() {
            return Ok(());
        }
        let bound = self.identities.bound_to(source).unwrap_or_default();
        if bound.iter().any(|identity| identity.same_person(poster)) {
            return Ok(());
        }
        if bound.is_empty() {
            Err(Untrusted::Unbound(source.to_string()))
        } else {
            Err(Untrusted::NotBound {
                poster: poster.as_str().to_string(),
                claimed: source.to_string(),
            })
        }
    }

    /// What `/readyz` shows of inbound trust (`inboundTrust`).
    pub fn report(&self) -> serde_json::Value {
        if self.is_open() {
            return serde_json::json!({
                "mode": "open",
                "detail": "FERRY_TRUSTED_SOURCES and FERRY_SOURCE_IDENTITIES are unset: every \
                           service token may post every event for its tenant (a single-team \
                           default)",
            });
        }
        serde_json::json!({
            "mode": "bound",
            "trustedSources": self.entries.as_ref().map(|entries| entries
                .iter()
                .map(|e| serde_json::json!({"event": e.event, "sources": e.sources}))
                .collect::<Vec<_>>()),
            "sourceIdentities": self.identities.bindings.as_ref().map(|bindings| bindings
                .iter()
                .map(|b| serde_json::json!({
                    "source": b.source,
                    "identities": b.identities.iter().map(Actor::as_str).collect::<Vec<_>>(),
                }))
                .collect::<Vec<_>>()),
        })
    }

    /// What an operator should hear at start-up: the open default, or trusted sources no
    /// identity may speak for over HTTP.
    pub fn warnings(&self) -> Vec<String> {
        if self.is_open() {
            return vec![
                "FERRY_TRUSTED_SOURCES and FERRY_SOURCE_IDENTITIES are unset: every service \
                 token may post every event for its tenant (a single-team default; bind \
                 sources to service identities to close it)"
                    .to_string(),
            ];
        }
        let mut unbound: Vec<&str> = self
            .entries
            .iter()
            .flatten()
            .flat_map(|e| &e.sources)
            .map(String::as_str)
            .filter(|s| self.identities.bound_to(s).unwrap_or_default().is_empty())
            .collect();
        unbound.sort_unstable();
        unbound.dedup();
        unbound
            .into_iter()
            .map(|s| {
                format!(
                    "source {s:?} is trusted but FERRY_SOURCE_IDENTITIES binds no service \
                     identity to it: its events are accepted over NATS only"
                )
            })
            .collect()
    }

    /// Whether `source` may send event `name` (arriving on `subject`); the error says why
    /// not and what to configure.
    pub fn check(&self, name: &str, subject: &str, source: &str) -> Result<(), Untrusted> {
        let Some(entries) = &self.entries else {
            return Ok(());
        };
        let matching: Vec<&Entry> = entries
            .iter()
            .filter(|e| e.event == name || subject_matches(&e.event, subject))
            .collect();
        if matching.is_empty() {
            return Err(Untrusted::NoneTrusted(subject.to_string()));
        }
        let trusted = matching
            .iter()
            .flat_map(|e| &e.sources)
            .any(|s| source_matches(s, source));
        if trusted {
            Ok(())
        } else {
            Err(Untrusted::NotTrusted {
                claimed: source.to_string(),
                subject: subject.to_string(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const APPROVAL_DECIDED: &str = "runcontrol.approvals.v1.approval-decided";
    const ENVIRONMENT_CREATED: &str = "environments.v1.environment-created";
    const RELEASE_READY: &str = "releases.releases.v1.release-ready";

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
            .unwrap_err()
            .to_string();
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
            .unwrap_err()
            .to_string();
        assert!(none.contains("names none"), "{none}");
        // Event names work as well as subjects.
        let by_name = TrustedSources::parse("ReleaseReady=urn:releases").unwrap();
        assert!(by_name
            .check("ReleaseReady", RELEASE_READY, "urn:releases")
            .is_ok());
    }

    fn actor(name: &str) -> Actor {
        Actor::parse(name).unwrap()
    }

    /// Issue 37: with sources trusted, `svc-anything` wrote `source: urn:runcontrol` and
    /// was accepted. A source speaks only through the identities bound to it.
    #[test]
    fn a_source_speaks_only_through_the_identities_bound_to_it() {
        let trusted = TrustedSources::parse("ApprovalDecided=urn:runcontrol").unwrap();
        // Sources trusted, no identity bound: no service speaks for any source over HTTP.
        let refused = trusted
            .check_poster("urn:runcontrol", &actor("svc-anything"))
            .unwrap_err()
            .to_string();
        assert!(refused.contains("FERRY_SOURCE_IDENTITIES"), "{refused}");
        let bound = trusted.with_identities(
            SourceIdentities::parse("urn:runcontrol=svc-runcontrol; urn:env-*=svc-env,svc-env-eu")
                .unwrap(),
        );
        assert!(bound
            .check_poster("urn:runcontrol", &actor("svc-runcontrol"))
            .is_ok());
        let refused = bound
            .check_poster("urn:runcontrol", &actor("svc-anything"))
            .unwrap_err()
            .to_string();
        assert!(refused.contains("may not speak"), "{refused}");
        assert!(bound
            .check_poster("urn:env-eu", &actor("svc-env-eu"))
            .is_ok());
        assert!(bound
            .check_poster("urn:env-eu", &actor("svc-runcontrol"))
            .is_err());
        assert!(bound
            .check_poster("urn:elsewhere", &actor("svc-runcontrol"))
            .is_err());
        // Identities alone bind too.
        let only = TrustedSources::any()
            .with_identities(SourceIdentities::parse("urn:runcontrol=svc-runcontrol").unwrap());
        assert!(!only.is_open());
        assert!(only
            .check_poster("urn:runcontrol", &actor("svc-other"))
            .is_err());
    }

    #[test]
    fn unset_is_the_open_single_team_default_and_says_so() {
        let open = TrustedSources::any();
        assert!(open.is_open());
        assert!(open
            .check_poster("urn:runcontrol", &actor("svc-anything"))
            .is_ok());
        assert_eq!(open.report()["mode"], "open");
        assert_eq!(open.warnings().len(), 1);
        let bound = TrustedSources::parse("ApprovalDecided=urn:runcontrol;ReleaseReady=urn:rel")
            .unwrap()
            .with_identities(SourceIdentities::parse("urn:runcontrol=svc-runcontrol").unwrap());
        assert_eq!(bound.report()["mode"], "bound");
        let warnings = bound.warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("urn:rel"), "{warnings:?}");
    }

    #[test]
    fn bad_identities_are_refused() {
        for bad in ["urn:runcontrol", "urn:runcontrol=", "=svc", " ; "] {
            assert!(
                matches!(
                    SourceIdentities::parse(bad),
                    Err(SourceIdentitiesError::Malformed(_))
                ),
                "{bad:?}"
            );
        }
        assert!(matches!(
            SourceIdentities::parse("urn:runcontrol=svc\u{200B}"),
            Err(SourceIdentitiesError::BadIdentity { .. })
        ));
        // A source may hold `=`.
        let q = TrustedSources::any()
            .with_identities(SourceIdentities::parse("https://x/?a=b=svc-x").unwrap());
        assert!(q.check_poster("https://x/?a=b", &actor("svc-x")).is_ok());
    }

    /// An event some context hears.
    #[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
    struct Applied {
        #[serde(rename = "tenantId")]
        tenant_id: ferry_domain::TenantId,
    }

    impl crate::inbound::InboundEvent for Applied {
        const NAME: &'static str = "ProvisioningApplied";
        const SUBJECT: &'static str = "provisioning.runs.v1.provisioning-applied";
        const SUMMARY: &'static str = "A run applied.";
        fn tenant_id(&self) -> &ferry_domain::TenantId {
            &self.tenant_id
        }
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
        // An entry must name an event the process hears, by name or by a subject pattern.
        let kinds =
            crate::inbound::InboundKinds::new([crate::inbound::InboundKind::of::<Applied>()])
                .unwrap();
        for known in ["ProvisioningApplied=urn:x", "provisioning.runs.v1.*=urn:x"] {
            assert!(TrustedSources::parse(known)
                .unwrap()
                .check_events(&kinds)
                .is_ok());
        }
        assert!(matches!(
            TrustedSources::parse("orders.v1.*=urn:x")
                .unwrap()
                .check_events(&kinds),
            Err(TrustedSourcesError::UnknownEvent(_))
        ));
    }
}
