//! The Release aggregate: a release Ferry may promote, as the release service reported it
//! (`releases.releases.v1.release-ready`) or an administrator recorded it
//! (`PUT /factory/delivery/releases/{releaseId}`), and its withdrawal.
//!
//! A release is immutable: the same report again changes nothing, a different one under the
//! same id is refused (a new build is a new release). A withdrawn release stays withdrawn.

use crate::ids::{Actor, EnvironmentId, ProjectId, PromotionId, ReleaseId, TenantId};
use crate::text::{self, InvalidText};
use crate::values::{ProbeUrl, ProgramRef, ProgramVersion, ValueError};
use crate::{EventType, TenantOwned};
use chrono::{DateTime, Utc};
use cqrs_es::event_sink::EventSink;
use cqrs_es::{Aggregate, DomainEvent};
use serde::{Deserialize, Serialize};
use std::fmt;

/// A release's version as its release service names it (e.g. `2.3.0`): 1 to 64 printable
/// characters without spaces.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct ReleaseVersion(String);

impl ReleaseVersion {
    /// Validates and wraps a version.
    pub fn parse(value: impl Into<String>) -> Result<Self, ValueError> {
        let value = value.into();
        if value.is_empty() {
            return Err(ValueError::Empty);
        }
        if value.chars().count() > 64 {
            return Err(ValueError::TooLong { max: 64 });
        }
        if value.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(ValueError::Whitespace);
        }
        Ok(Self(value))
    }
    /// The version as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ReleaseVersion {
    type Error = ValueError;
    fn try_from(value: String) -> Result<Self, ValueError> {
        Self::parse(value)
    }
}

impl From<ReleaseVersion> for String {
    fn from(value: ReleaseVersion) -> String {
        value.0
    }
}

impl fmt::Display for ReleaseVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The result of one pipeline stage of the release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PipelineOutcome {
    /// The stage passed.
    Passed,
    /// The stage failed.
    Failed,
}

/// One pipeline stage and its result (the pipeline-results gate reads these).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PipelineResult {
    /// The stage's name (e.g. `unit-tests`).
    pub name: String,
    /// Its result.
    pub result: PipelineOutcome,
    /// Where its log or report is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

/// Evidence that agent-generated assets of the release were evaluated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EvaluationEvidence {
    /// Whether the evaluation passed.
    pub passed: bool,
    /// Where the evaluation report is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    /// A short summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
}

/// What a release is: the payload of `ReleaseRecorded`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseRecord {
    /// The release.
    pub release_id: ReleaseId,
    /// The owning tenant.
    pub tenant_id: TenantId,
    /// The project it is a release of.
    pub project_id: ProjectId,
    /// Its version.
    pub version: ReleaseVersion,
    /// The release's infrastructure program, `<repository>#<folder>`.
    pub program_ref: ProgramRef,
    /// The program's commit.
    pub program_version: ProgramVersion,
    /// The pipeline's stages and their results.
    pub pipeline: Vec<PipelineResult>,
    /// True when the release carries agent-generated assets (the evaluation gate applies).
    pub has_agent_generated_assets: bool,
    /// The evaluation of those assets, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation_evidence: Option<EvaluationEvidence>,
    /// The release's smoke suite, run by verification after each apply (none when absent:
    /// an optional field added after the first events, which read as none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub smoke_checks: Vec<SmokeCheck>,
    /// Why the release's program cannot be what it says (its commit or folder does not
    /// exist in its repository), found when it was reported: it is recorded, and its
    /// promotions are rejected at the pipeline gate naming this (absent on releases whose
    /// program was found, or that were recorded before the check).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program_problem: Option<String>,
    /// Who recorded it (a token's subject, or `system:inbound`).
    pub recorded_by: Actor,
    /// When.
    pub recorded_at: DateTime<Utc>,
}

/// One smoke check of a release's suite: verification sends a GET to `url` after the apply
/// and expects `expectedStatus`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SmokeCheck {
    /// What it checks (1 to 100 characters, unique in the suite).
    pub name: String,
    /// Where.
    pub url: ProbeUrl,
    /// The status it must answer (default 200).
    #[serde(default = "ok_status")]
    pub expected_status: u16,
}

fn ok_status() -> u16 {
    200
}

/// At most this many smoke checks per release.
pub const MAX_SMOKE_CHECKS: usize = 20;

impl ReleaseRecord {
    /// The first smoke check that is not usable, by index, and why.
    fn invalid_smoke_check(&self) -> Option<(usize, String)> {
        if self.smoke_checks.len() > MAX_SMOKE_CHECKS {
            return Some((
                MAX_SMOKE_CHECKS,
                format!("at most {MAX_SMOKE_CHECKS} smoke checks"),
            ));
        }
        for (i, check) in self.smoke_checks.iter().enumerate() {
            let name = check.name.trim();
            if let Err(e) = text::check_name_within("name", &check.name, 100)
                .and_then(|()| text::check_web_url("url", check.url.as_str()))
            {
                return Some((i, e.to_string()));
            }
            if self.smoke_checks[..i].iter().any(|c| c.name.trim() == name) {
                return Some((i, format!("name {name:?} is used twice")));
            }
            if !(100..=599).contains(&check.expected_status) {
                return Some((
                    i,
                    "expectedStatus must be an HTTP status (100 to 599)".to_string(),
                ));
            }
        }
        None
    }

    /// The first text field a console would render that is not fit to keep.
    fn invalid_text(&self) -> Result<(), InvalidText> {
        text::check_name("version", self.version.as_str())?;
        text::check_name_within("programRef", self.program_ref.as_str(), 1024)?;
        for (i, stage) in self.pipeline.iter().enumerate() {
            text::check_name(&format!("pipeline[{i}].name"), &stage.name)?;
            if let Some(url) = &stage.url {
                text::check_web_url(&format!("pipeline[{i}].url"), url)?;
            }
        }
        if let Some(evidence) = &self.evaluation_evidence {
            if let Some(reference) = &evidence.reference {
                text::check_web_url("evaluationEvidence.reference", reference)?;
            }
            if let Some(summary) = &evidence.summary {
                text::check_free_text("evaluationEvidence.summary", summary)?;
            }
        }
        Ok(())
    }

    /// The same release, apart from who reported it and when.
    fn same_release(&self, other: &Self) -> bool {
        let mut this = self.clone();
        this.recorded_by = other.recorded_by.clone();
        this.recorded_at = other.recorded_at;
        // Found when reported, not reported: a report again is the same release.
        this.program_problem = other.program_problem.clone();
        this == *other
    }
}

/// Commands of the release aggregate.
#[derive(Debug, Clone, PartialEq)]
pub enum ReleaseCommand {
    /// Record the release as ready (idempotent: the same release again changes nothing).
    Record(Box<ReleaseRecord>),
    /// Withdraw it (idempotent).
    Withdraw {
        /// Why, as the release service or the administrator said.
        reason: String,
        /// Who.
        by: Actor,
        /// When.
        at: DateTime<Utc>,
    },
    /// Lift the quarantine a rollback put the release under in one environment, so that it
    /// may be promoted there again. The caller has checked (from the promotions it holds)
    /// that `promotion_id` rolled this release back in `environment_id`.
    LiftQuarantine {
        /// The environment.
        environment_id: EnvironmentId,
        /// The promotion of this release that was rolled back there.
        promotion_id: PromotionId,
        /// Why it may go there again (required).
        reason: String,
        /// Who (an Operator).
        by: Actor,
        /// When.
        at: DateTime<Utc>,
    },
}

/// Events of the release aggregate (all version 1.0).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ReleaseEvent {
    /// The release is ready to be promoted.
    ReleaseRecorded(Box<ReleaseRecord>),
    /// The release was withdrawn: no new promotion of it, pending ones are rejected.
    #[serde(rename_all = "camelCase")]
    ReleaseWithdrawn {
        /// Why.
        reason: String,
        /// Who.
        withdrawn_by: Actor,
        /// When.
        withdrawn_at: DateTime<Utc>,
    },
    /// The quarantine from a rollback in one environment was lifted.
    #[serde(rename_all = "camelCase")]
    QuarantineLifted {
        /// The environment.
        environment_id: EnvironmentId,
        /// The rolled-back promotion whose quarantine this lifts.
        promotion_id: PromotionId,
        /// Why.
        reason: String,
        /// Who.
        lifted_by: Actor,
        /// When.
        lifted_at: DateTime<Utc>,
    },
}

impl ReleaseEvent {
    /// The name and version this event is stored under (see [`crate::event_type`]).
    pub fn stored_type(&self) -> EventType {
        match self {
            Self::ReleaseRecorded(_) => EventType::first("ReleaseRecorded"),
            Self::ReleaseWithdrawn { .. } => EventType::first("ReleaseWithdrawn"),
            Self::QuarantineLifted { .. } => EventType::first("QuarantineLifted"),
        }
    }
}

impl DomainEvent for ReleaseEvent {
    fn event_type(&self) -> String {
        self.stored_type().name.to_string()
    }
    fn event_version(&self) -> String {
        self.stored_type().version.to_string()
    }
}

/// Rules a release command can break.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReleaseError {
    /// A different release under an id already recorded.
    #[error("release {0} is already recorded with other contents; a new build is a new release")]
    Immutable(ReleaseId),
    /// The release was withdrawn; it cannot be recorded as ready again.
    #[error("release {0} was withdrawn")]
    Withdrawn(ReleaseId),
    /// Withdrawing a release Ferry has not recorded.
    #[error("release is not recorded")]
    NotRecorded,
    /// The record names another release or tenant than the aggregate.
    #[error("the record does not match the release")]
    IdentityMismatch,
    /// A quarantine is lifted only with a reason.
    #[error("a reason is required to lift a quarantine")]
    ReasonRequired,
    /// A smoke check that cannot run.
    #[error("smokeChecks[{index}]: {reason}")]
    InvalidSmokeCheck {
        /// Which.
        index: usize,
        /// Why.
        reason: String,
    },
    /// That rollback's quarantine was lifted already.
    #[error("the quarantine from promotion {0} was lifted already")]
    AlreadyLifted(PromotionId),
    /// A name, reason or link that a console could not render faithfully.
    #[error(transparent)]
    InvalidText(#[from] InvalidText),
}

/// The release as recorded.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Release {
    record: Option<ReleaseRecord>,
    withdrawn: bool,
    withdrawal_reason: Option<String>,
    /// The rolled-back promotions whose quarantine was lifted.
    #[serde(default)]
    lifted: Vec<PromotionId>,
}

impl Release {
    /// The aggregate id of a release of a tenant (release ids are the release service's;
    /// scoping them by tenant keeps one tenant from claiming another's id).
    pub fn aggregate_id(tenant: &TenantId, release: ReleaseId) -> String {
        format!("{tenant}/{release}")
    }
    /// The record, if recorded.
    pub fn record(&self) -> Option<&ReleaseRecord> {
        self.record.as_ref()
    }
    /// True once withdrawn.
    pub fn is_withdrawn(&self) -> bool {
        self.withdrawn
    }
    /// Why it was withdrawn, once withdrawn.
    pub fn withdrawal_reason(&self) -> Option<&str> {
        self.withdrawal_reason.as_deref()
    }
}

impl TenantOwned for Release {
    fn tenant(&self) -> Option<&TenantId> {
        self.record.as_ref().map(|r| &r.tenant_id)
    }
}

/// Stored with no upcasters yet: every event type is at its first version.
impl crate::StoredAggregate for Release {}

impl Aggregate for Release {
    const TYPE: &'static str = "Release";
    type Command = ReleaseCommand;
    type Event = ReleaseEvent;
    type Error = ReleaseError;
    type Services = ();

    async fn handle(
        &mut self,
        command: Self::Command,
        _services: &(),
        sink: &EventSink<Self>,
    ) -> Result<(), Self::Error> {
        let event = match command {
            ReleaseCommand::Record(record) => match &self.record {
                None => {
                    record.invalid_text()?;
                    if let Some((index, reason)) = record.invalid_smoke_check() {
                        return Err(ReleaseError::InvalidSmokeCheck { index, reason });
                    }
                    ReleaseEvent::ReleaseRecorded(record)
                }
                Some(existing) => {
                    if existing.release_id != record.release_id
                        || existing.tenant_id != record.tenant_id
                    {
                        return Err(ReleaseError::IdentityMismatch);
                    }
                    if self.withdrawn {
                        return Err(ReleaseError::Withdrawn(existing.release_id));
                    }
                    if existing.same_release(&record) {
                        return Ok(());
                    }
                    return Err(ReleaseError::Immutable(existing.release_id));
                }
            },
            ReleaseCommand::Withdraw { reason, by, at } => {
                if self.record.is_none() {
                    return Err(ReleaseError::NotRecorded);
                }
                if self.withdrawn {
                    return Ok(());
                }
                // The release service may withdraw without saying why.
                text::check_optional_free_text("reason", Some(&reason))?;
                ReleaseEvent::ReleaseWithdrawn {
                    reason,
                    withdrawn_by: by,
                    withdrawn_at: at,
                }
            }
            ReleaseCommand::LiftQuarantine {
                environment_id,
                promotion_id,
                reason,
                by,
                at,
            } => {
                if self.record.is_none() {
                    return Err(ReleaseError::NotRecorded);
                }
                if reason.trim().is_empty() {
                    return Err(ReleaseError::ReasonRequired);
                }
                text::check_free_text("reason", &reason)?;
                if self.lifted.contains(&promotion_id) {
                    return Err(ReleaseError::AlreadyLifted(promotion_id));
                }
                ReleaseEvent::QuarantineLifted {
                    environment_id,
                    promotion_id,
                    reason,
                    lifted_by: by,
                    lifted_at: at,
                }
            }
        };
        sink.write(event, self).await;
        Ok(())
    }

    fn apply(&mut self, event: Self::Event) {
        match event {
            ReleaseEvent::ReleaseRecorded(record) => self.record = Some(*record),
            ReleaseEvent::ReleaseWithdrawn { reason, .. } => {
                self.withdrawn = true;
                self.withdrawal_reason = Some(reason);
            }
            ReleaseEvent::QuarantineLifted { promotion_id, .. } => self.lifted.push(promotion_id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cqrs_es::test::TestFramework;

    type Fixture = TestFramework<Release>;

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000 + seconds, 0).unwrap_or_default()
    }

    fn record(by: &str, seconds: i64) -> ReleaseRecord {
        ReleaseRecord {
            release_id: ReleaseId::from_uuid(uuid::Uuid::from_u128(5)),
            tenant_id: TenantId::parse("acme").unwrap(),
            project_id: ProjectId::parse("payments").unwrap(),
            version: ReleaseVersion::parse("2.3.0").unwrap(),
            program_ref: ProgramRef::parse("https://git.example.com/payments.git#infra").unwrap(),
            program_version: ProgramVersion::parse("3f2a9c1").unwrap(),
            pipeline: vec![PipelineResult {
                name: "unit-tests".to_string(),
                result: PipelineOutcome::Passed,
                url: None,
            }],
            has_agent_generated_assets: false,
            evaluation_evidence: None,
            smoke_checks: Vec::new(),
            program_problem: None,
            recorded_by: Actor::parse(by).unwrap(),
            recorded_at: at(seconds),
        }
    }

    fn recorded() -> ReleaseEvent {
        ReleaseEvent::ReleaseRecorded(Box::new(record("system:inbound", 0)))
    }

    fn withdraw(seconds: i64) -> ReleaseCommand {
        ReleaseCommand::Withdraw {
            reason: "bad build".to_string(),
            by: Actor::parse("system:inbound").unwrap(),
            at: at(seconds),
        }
    }

    #[test]
    fn a_release_is_recorded_once() {
        Fixture::with(())
            .given_no_previous_events()
            .when(ReleaseCommand::Record(Box::new(record(
                "system:inbound",
                0,
            ))))
            .then_expect_events(vec![recorded()]);
    }

    #[test]
    fn the_same_release_again_changes_nothing_even_from_someone_else_later() {
        Fixture::with(())
            .given(vec![recorded()])
            .when(ReleaseCommand::Record(Box::new(record("admin", 60))))
            .then_expect_events(vec![]);
    }

    #[test]
    fn another_release_under_the_same_id_is_refused() {
        let mut other = record("system:inbound", 0);
        other.version = ReleaseVersion::parse("2.3.1").unwrap();
        Fixture::with(())
            .given(vec![recorded()])
            .when(ReleaseCommand::Record(Box::new(other)))
            .then_expect_error(ReleaseError::Immutable(ReleaseId::from_uuid(
                uuid::Uuid::from_u128(5),
            )));
    }

    #[test]
    fn another_tenant_s_record_does_not_match() {
        let mut other = record("system:inbound", 0);
        other.tenant_id = TenantId::parse("globex").unwrap();
        Fixture::with(())
            .given(vec![recorded()])
            .when(ReleaseCommand::Record(Box::new(other)))
            .then_expect_error(ReleaseError::IdentityMismatch);
    }

    #[test]
    fn a_withdrawal_is_recorded_once_and_sticks() {
        let withdrawn = ReleaseEvent::ReleaseWithdrawn {
            reason: "bad build".to_string(),
            withdrawn_by: Actor::parse("system:inbound").unwrap(),
            withdrawn_at: at(10),
        };
        Fixture::with(())
            .given(vec![recorded()])
            .when(withdraw(10))
            .then_expect_events(vec![withdrawn.clone()]);
        Fixture::with(())
            .given(vec![recorded(), withdrawn.clone()])
            .when(withdraw(20))
            .then_expect_events(vec![]);
        Fixture::with(())
            .given(vec![recorded(), withdrawn])
            .when(ReleaseCommand::Record(Box::new(record(
                "system:inbound",
                0,
            ))))
            .then_expect_error(ReleaseError::Withdrawn(ReleaseId::from_uuid(
                uuid::Uuid::from_u128(5),
            )));
    }

    #[test]
    fn an_unknown_release_cannot_be_withdrawn() {
        Fixture::with(())
            .given_no_previous_events()
            .when(withdraw(0))
            .then_expect_error(ReleaseError::NotRecorded);
    }

    fn lift(promotion: u128, reason: &str) -> ReleaseCommand {
        ReleaseCommand::LiftQuarantine {
            environment_id: EnvironmentId::parse("payments-dev").unwrap(),
            promotion_id: PromotionId::from_uuid(uuid::Uuid::from_u128(promotion)),
            reason: reason.to_string(),
            by: Actor::parse("carol").unwrap(),
            at: at(30),
        }
    }

    #[test]
    fn a_quarantine_is_lifted_once_with_a_reason() {
        let lifted = ReleaseEvent::QuarantineLifted {
            environment_id: EnvironmentId::parse("payments-dev").unwrap(),
            promotion_id: PromotionId::from_uuid(uuid::Uuid::from_u128(9)),
            reason: "fixed by config".to_string(),
            lifted_by: Actor::parse("carol").unwrap(),
            lifted_at: at(30),
        };
        Fixture::with(())
            .given(vec![recorded()])
            .when(lift(9, "fixed by config"))
            .then_expect_events(vec![lifted.clone()]);
        Fixture::with(())
            .given(vec![recorded()])
            .when(lift(9, "  "))
            .then_expect_error(ReleaseError::ReasonRequired);
        Fixture::with(())
            .given(vec![recorded(), lifted.clone()])
            .when(lift(9, "again"))
            .then_expect_error(ReleaseError::AlreadyLifted(PromotionId::from_uuid(
                uuid::Uuid::from_u128(9),
            )));
        // Another rollback of the same release there is another quarantine.
        Fixture::with(())
            .given(vec![recorded(), lifted])
            .when(lift(10, "fixed again"))
            .then_expect_events(vec![ReleaseEvent::QuarantineLifted {
                environment_id: EnvironmentId::parse("payments-dev").unwrap(),
                promotion_id: PromotionId::from_uuid(uuid::Uuid::from_u128(10)),
                reason: "fixed again".to_string(),
                lifted_by: Actor::parse("carol").unwrap(),
                lifted_at: at(30),
            }]);
        Fixture::with(())
            .given_no_previous_events()
            .when(lift(9, "x"))
            .then_expect_error(ReleaseError::NotRecorded);
    }

    #[test]
    fn smoke_checks_are_checked_when_recorded() {
        let check = |name: &str, status: u16| SmokeCheck {
            name: name.to_string(),
            url: ProbeUrl::parse("https://payments.example.com/smoke").unwrap(),
            expected_status: status,
        };
        let mut good = record("system:inbound", 0);
        good.smoke_checks = vec![check("checkout", 200), check("login", 302)];
        Fixture::with(())
            .given_no_previous_events()
            .when(ReleaseCommand::Record(Box::new(good.clone())))
            .then_expect_events(vec![ReleaseEvent::ReleaseRecorded(Box::new(good))]);
        for (checks, index, reason) in [
            (vec![check(" ", 200)], 0, "name: must not be empty"),
            (
                vec![check("a", 200), check("a", 204)],
                1,
                "name \"a\" is used twice",
            ),
            (
                vec![check("a", 42)],
                0,
                "expectedStatus must be an HTTP status (100 to 599)",
            ),
        ] {
            let mut bad = record("system:inbound", 0);
            bad.smoke_checks = checks;
            Fixture::with(())
                .given_no_previous_events()
                .when(ReleaseCommand::Record(Box::new(bad)))
                .then_expect_error(ReleaseError::InvalidSmokeCheck {
                    index,
                    reason: reason.to_string(),
                });
        }
        assert!(ProbeUrl::parse("ftp://x").is_err());
        assert!(ProbeUrl::parse("http://a b").is_err());
        // Events recorded before smoke checks existed read as none.
        let old = serde_json::json!({"ReleaseRecorded": {
            "releaseId": "00000000-0000-0000-0000-000000000005", "tenantId": "acme",
            "projectId": "payments", "version": "2.3.0",
            "programRef": "https://git.example.com/payments.git#infra",
            "programVersion": "3f2a9c1", "pipeline": [], "hasAgentGeneratedAssets": false,
            "recordedBy": "system:inbound", "recordedAt": "2023-11-14T22:13:20Z"}});
        let ReleaseEvent::ReleaseRecorded(r) = serde_json::from_value(old).unwrap() else {
            panic!("a release record");
        };
        assert!(r.smoke_checks.is_empty());
    }

    #[test]
    fn text_a_console_renders_is_refused_when_recorded_and_read_back_as_stored() {
        let stage = |name: &str, url: Option<&str>| PipelineResult {
            name: name.to_string(),
            result: PipelineOutcome::Passed,
            url: url.map(str::to_string),
        };
        let refused = |record: ReleaseRecord, field: &str| {
            let error = Fixture::with(())
                .given_no_previous_events()
                .when(ReleaseCommand::Record(Box::new(record)))
                .inspect_result()
                .unwrap_err();
            match error {
                ReleaseError::InvalidText(InvalidText { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        };
        let mut bad = record("system:inbound", 0);
        bad.pipeline = vec![
            stage("build", None),
            stage("\u{1b}[2J\u{1b}[31mtests", None),
        ];
        refused(bad, "pipeline[1].name");
        let mut bad = record("system:inbound", 0);
        bad.pipeline = vec![stage("build", Some("javascript:alert(1)"))];
        refused(bad, "pipeline[0].url");
        let mut bad = record("system:inbound", 0);
        bad.pipeline = vec![stage(&"n".repeat(257), None)];
        refused(bad, "pipeline[0].name");
        let mut bad = record("system:inbound", 0);
        bad.evaluation_evidence = Some(EvaluationEvidence {
            passed: true,
            reference: Some("https://eval.example/1".into()),
            summary: Some("s".repeat(250_000)),
        });
        refused(bad, "evaluationEvidence.summary");
        let mut bad = record("system:inbound", 0);
        bad.smoke_checks = vec![SmokeCheck {
            name: "login\u{202E}".into(),
            url: ProbeUrl::parse("https://payments.example.com/smoke").unwrap(),
            expected_status: 200,
        }];
        assert!(matches!(
            Fixture::with(())
                .given_no_previous_events()
                .when(ReleaseCommand::Record(Box::new(bad)))
                .inspect_result(),
            Err(ReleaseError::InvalidSmokeCheck { index: 0, .. })
        ));
        // Markup is not refused: it is text, and the console renders it as text.
        let mut markup = record("system:inbound", 0);
        markup.pipeline = vec![stage(
            "<script>alert(1)</script>",
            Some("https://ci.example/1"),
        )];
        Fixture::with(())
            .given_no_previous_events()
            .when(ReleaseCommand::Record(Box::new(markup.clone())))
            .then_expect_events(vec![ReleaseEvent::ReleaseRecorded(Box::new(markup))]);
        Fixture::with(())
            .given(vec![recorded()])
            .when(ReleaseCommand::Withdraw {
                reason: "r".repeat(2001),
                by: Actor::parse("system:inbound").unwrap(),
                at: at(5),
            })
            .then_expect_error(ReleaseError::InvalidText(InvalidText {
                field: "reason".into(),
                problem: text::TextProblem::TooLong { max: 2000 },
            }));
        // What was stored before these checks still loads and applies.
        let mut old = record("system:inbound", 0);
        old.pipeline = vec![stage("\u{1b}[31mold", Some("javascript:old()"))];
        let mut release = Release::default();
        release.apply(ReleaseEvent::ReleaseRecorded(Box::new(old)));
        release.apply(ReleaseEvent::ReleaseWithdrawn {
            reason: "w".repeat(10_000),
            withdrawn_by: Actor::parse("system:inbound").unwrap(),
            withdrawn_at: at(1),
        });
        assert!(release.is_withdrawn());
    }

    #[test]
    fn a_version_is_validated() {
        assert!(ReleaseVersion::parse("2.3.0-rc.1").is_ok());
        assert!(ReleaseVersion::parse("").is_err());
        assert!(ReleaseVersion::parse("2 3").is_err());
        assert!(ReleaseVersion::parse("v".repeat(65)).is_err());
    }
}
