//! The DeploymentSpecification aggregate: the desired state of one environment (or one
//! workload in it). Every declaration appends a new immutable version; none is ever changed
//! or dropped.

use crate::ids::{Actor, EnvironmentId, ProjectId, ReleaseId, SpecificationId, TenantId};
use crate::values::{
    ConfigRef, ProgramRef, ProgramVersion, RefMap, SecretRef, SpecificationKind, Strategy,
};
use crate::{text, EventType, TenantOwned};
use chrono::{DateTime, Utc};
use cqrs_es::event_sink::EventSink;
use cqrs_es::{Aggregate, DomainEvent};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// One declared version of a specification: the payload of `SpecificationDeclared`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SpecificationVersion {
    /// The specification this version belongs to.
    pub specification_id: SpecificationId,
    /// The owning tenant.
    pub tenant_id: TenantId,
    /// The project the environment serves.
    pub project_id: ProjectId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// Environment or workload.
    pub kind: SpecificationKind,
    /// 1 for the first declaration, then one more each time.
    pub version: u32,
    /// Where the program lives.
    pub program_ref: ProgramRef,
    /// The commit of the program.
    pub program_version: ProgramVersion,
    /// The release it deploys, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_id: Option<ReleaseId>,
    /// The roll-out strategy, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<Strategy>,
    /// Configuration references by name.
    pub config_refs: RefMap<ConfigRef>,
    /// Secret references by name; never values.
    pub secret_refs: RefMap<SecretRef>,
    /// Who declared it.
    pub declared_by: Actor,
    /// When.
    pub declared_at: DateTime<Utc>,
}

/// What a declaration says; the aggregate assigns the version.
#[derive(Debug, Clone, PartialEq)]
pub struct Declaration {
    /// The target specification (see [`SpecificationId::for_environment`]).
    pub specification_id: SpecificationId,
    /// The caller's tenant.
    pub tenant_id: TenantId,
    /// The project.
    pub project_id: ProjectId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// Environment or workload.
    pub kind: SpecificationKind,
    /// Where the program lives.
    pub program_ref: ProgramRef,
    /// The commit.
    pub program_version: ProgramVersion,
    /// The release, if any.
    pub release_id: Option<ReleaseId>,
    /// The strategy, if any.
    pub strategy: Option<Strategy>,
    /// Configuration references.
    pub config_refs: RefMap<ConfigRef>,
    /// Secret references.
    pub secret_refs: RefMap<SecretRef>,
    /// Who declares.
    pub declared_by: Actor,
    /// When.
    pub declared_at: DateTime<Utc>,
}

/// Commands of the specification aggregate.
#[derive(Debug, Clone, PartialEq)]
pub enum SpecificationCommand {
    /// Declare a new version of the desired state.
    Declare(Box<Declaration>),
}

/// Events of the specification aggregate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum SpecificationEvent {
    /// A new version exists (type `SpecificationDeclared`, version 1.0).
    SpecificationDeclared(Box<SpecificationVersion>),
}

impl SpecificationEvent {
    /// The name and version this event is stored under (see [`crate::event_type`]).
    pub fn stored_type(&self) -> EventType {
        match self {
            Self::SpecificationDeclared(_) => EventType::first("SpecificationDeclared"),
        }
    }
}

impl DomainEvent for SpecificationEvent {
    fn event_type(&self) -> String {
        self.stored_type().name.to_string()
    }
    fn event_version(&self) -> String {
        self.stored_type().version.to_string()
    }
}

/// Rules a declaration can break.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecificationError {
    /// A specification belongs to one project for its whole life.
    #[error("specification {specification_id} belongs to project {existing}, not {requested}")]
    ProjectMismatch {
        /// The specification.
        specification_id: SpecificationId,
        /// Its project.
        existing: ProjectId,
        /// The project the declaration named.
        requested: ProjectId,
    },
    /// The declaration's tenant, environment or kind does not match the specification id.
    #[error(
        "declaration does not match specification {0}: tenant, environment and kind are fixed"
    )]
    IdentityMismatch(SpecificationId),
    /// A reference a console could not render faithfully (control or invisible characters).
    #[error(transparent)]
    InvalidText(#[from] text::InvalidText),
}

/// The aggregate's state: the identity and every version. The versions are shared by `Arc`
/// so that a copy of a specification with thousands of versions (the store keeps one per
/// cached aggregate and hands out copies) costs one small allocation, not thousands.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DeploymentSpecification {
    #[serde(with = "shared_versions")]
    versions: Vec<Arc<SpecificationVersion>>,
}

impl DeploymentSpecification {
    /// Every version, oldest first.
    pub fn versions(&self) -> &[Arc<SpecificationVersion>] {
        &self.versions
    }
    /// The newest version.
    pub fn latest(&self) -> Option<&SpecificationVersion> {
        self.versions.last().map(AsRef::as_ref)
    }
    /// One version by number.
    pub fn version(&self, number: u32) -> Option<&SpecificationVersion> {
        // Versions are numbered from 1 without gaps, so the number is the index.
        let index = usize::try_from(number).ok()?.checked_sub(1)?;
        self.versions
            .get(index)
            .filter(|v| v.version == number)
            .map(AsRef::as_ref)
    }
}

/// Serde for the shared versions, as a plain list (serde's own `Arc` support is behind a
/// feature that would rebuild every crate that uses serde).
mod shared_versions {
    use super::SpecificationVersion;
    use serde::{Deserialize, Deserializer, Serializer};
    use std::sync::Arc;

    pub fn serialize<S: Serializer>(
        versions: &[Arc<SpecificationVersion>],
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(versions.iter().map(AsRef::as_ref))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Vec<Arc<SpecificationVersion>>, D::Error> {
        let versions = Vec::<SpecificationVersion>::deserialize(deserializer)?;
        Ok(versions.into_iter().map(Arc::new).collect())
    }
}

impl TenantOwned for DeploymentSpecification {
    fn tenant(&self) -> Option<&TenantId> {
        self.latest().map(|v| &v.tenant_id)
    }
}

/// Stored with no upcasters yet: every event type is at its first version.
impl crate::StoredAggregate for DeploymentSpecification {}

impl Aggregate for DeploymentSpecification {
    const TYPE: &'static str = "DeploymentSpecification";
    type Command = SpecificationCommand;
    type Event = SpecificationEvent;
    type Error = SpecificationError;
    type Services = ();

    async fn handle(
        &mut self,
        command: Self::Command,
        _services: &(),
        sink: &EventSink<Self>,
    ) -> Result<(), Self::Error> {
        match command {
            SpecificationCommand::Declare(d) => {
                text::check_name_within("programRef", d.program_ref.as_str(), 1024)?;
                if let Some(strategy) = &d.strategy {
                    text::check_name("strategy", strategy.as_str())?;
                }
                for (key, reference) in &d.config_refs {
                    text::check_name_within(
                        &format!("configRefs.{key}"),
                        reference.as_str(),
                        2048,
                    )?;
                }
                for (key, reference) in &d.secret_refs {
                    text::check_name_within(
                        &format!("secretRefs.{key}"),
                        reference.as_str(),
                        1024,
                    )?;
                }
                let version = match self.latest() {
                    None => 1,
                    Some(latest) => {
                        if latest.specification_id != d.specification_id
                            || latest.tenant_id != d.tenant_id
                            || latest.environment_id != d.environment_id
                            || latest.kind != d.kind
                        {
                            return Err(SpecificationError::IdentityMismatch(d.specification_id));
                        }
                        if latest.project_id != d.project_id {
                            return Err(SpecificationError::ProjectMismatch {
                                specification_id: d.specification_id,
                                existing: latest.project_id.clone(),
                                requested: d.project_id,
                            });
                        }
                        latest.version + 1
                    }
                };
                let d = *d;
                let event =
                    SpecificationEvent::SpecificationDeclared(Box::new(SpecificationVersion {
                        specification_id: d.specification_id,
                        tenant_id: d.tenant_id,
                        project_id: d.project_id,
                        environment_id: d.environment_id,
                        kind: d.kind,
                        version,
                        program_ref: d.program_ref,
                        program_version: d.program_version,
                        release_id: d.release_id,
                        strategy: d.strategy,
                        config_refs: d.config_refs,
                        secret_refs: d.secret_refs,
                        declared_by: d.declared_by,
                        declared_at: d.declared_at,
                    }));
                sink.write(event, self).await;
                Ok(())
            }
        }
    }

    fn apply(&mut self, event: Self::Event) {
        match event {
            SpecificationEvent::SpecificationDeclared(v) => self.versions.push(Arc::from(v)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cqrs_es::test::TestFramework;

    type Fixture = TestFramework<DeploymentSpecification>;

    fn declaration(project: &str, commit: &str) -> Declaration {
        let tenant = TenantId::parse("acme").unwrap();
        let environment = EnvironmentId::parse("payments-dev").unwrap();
        Declaration {
            specification_id: SpecificationId::for_environment(
                &tenant,
                &environment,
                SpecificationKind::Environment,
            ),
            tenant_id: tenant,
            project_id: ProjectId::parse(project).unwrap(),
            environment_id: environment,
            kind: SpecificationKind::Environment,
            program_ref: ProgramRef::parse("/srv/infra#envs/dev").unwrap(),
            program_version: ProgramVersion::parse(commit).unwrap(),
            release_id: None,
            strategy: None,
            config_refs: RefMap::new(),
            secret_refs: RefMap::from([(
                "dbPassword".to_string(),
                SecretRef::parse("env://DB_PASSWORD").unwrap(),
            )]),
            declared_by: Actor::parse("alice").unwrap(),
            declared_at: DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
        }
    }

    fn declared(d: &Declaration, version: u32) -> SpecificationEvent {
        let d = d.clone();
        SpecificationEvent::SpecificationDeclared(Box::new(SpecificationVersion {
            specification_id: d.specification_id,
            tenant_id: d.tenant_id,
            project_id: d.project_id,
            environment_id: d.environment_id,
            kind: d.kind,
            version,
            program_ref: d.program_ref,
            program_version: d.program_version,
            release_id: d.release_id,
            strategy: d.strategy,
            config_refs: d.config_refs,
            secret_refs: d.secret_refs,
            declared_by: d.declared_by,
            declared_at: d.declared_at,
        }))
    }

    #[test]
    fn first_declaration_is_version_one() {
        let d = declaration("payments", "aaaaaaa");
        Fixture::with(())
            .given_no_previous_events()
            .when(SpecificationCommand::Declare(Box::new(d.clone())))
            .then_expect_events(vec![declared(&d, 1)]);
    }

    #[test]
    fn later_declarations_append_versions_and_keep_the_old_ones() {
        let first = declaration("payments", "aaaaaaa");
        let second = declaration("payments", "bbbbbbb");
        let third = declaration("payments", "ccccccc");
        Fixture::with(())
            .given(vec![declared(&first, 1), declared(&second, 2)])
            .when(SpecificationCommand::Declare(Box::new(third.clone())))
            .then_expect_events(vec![declared(&third, 3)]);

        let mut spec = DeploymentSpecification::default();
        spec.apply(declared(&first, 1));
        spec.apply(declared(&second, 2));
        assert_eq!(spec.versions().len(), 2);
        assert_eq!(spec.version(1).unwrap().program_version.as_str(), "aaaaaaa");
        assert_eq!(spec.latest().unwrap().version, 2);
    }

    #[test]
    fn a_specification_keeps_its_project() {
        let first = declaration("payments", "aaaaaaa");
        let other = declaration("billing", "bbbbbbb");
        Fixture::with(())
            .given(vec![declared(&first, 1)])
            .when(SpecificationCommand::Declare(Box::new(other)))
            .then_expect_error(SpecificationError::ProjectMismatch {
                specification_id: first.specification_id,
                existing: ProjectId::parse("payments").unwrap(),
                requested: ProjectId::parse("billing").unwrap(),
            });
    }

    #[test]
    fn the_identity_is_fixed() {
        let first = declaration("payments", "aaaaaaa");
        let mut other = declaration("payments", "bbbbbbb");
        other.kind = SpecificationKind::Workload;
        Fixture::with(())
            .given(vec![declared(&first, 1)])
            .when(SpecificationCommand::Declare(Box::new(other)))
            .then_expect_error(SpecificationError::IdentityMismatch(first.specification_id));
    }
}
