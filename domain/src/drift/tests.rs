//! Given/when/then on an environment's ignore rules, and the triage of a plan by them.

use super::*;
use cqrs_es::test::TestFramework;

const BUCKET: &str = "urn:pulumi:acme.dev::site::aws:s3/bucket:Bucket::assets";
const LOGS: &str = "urn:pulumi:acme.dev::site::aws:s3/bucket:Bucket::logs";

fn at() -> DateTime<Utc> {
    DateTime::from_timestamp(1_700_000_000, 0).unwrap()
}

fn rule(n: u128, urn: &str, property: Option<&str>) -> IgnoreRule {
    IgnoreRule {
        rule_id: IgnoreRuleId::from_uuid(uuid::Uuid::from_u128(n)),
        urn: ResourceUrn::parse(urn).unwrap(),
        property: property.map(|p| PropertyPath::parse(p).unwrap()),
        reason: "the cost team tags buckets by hand".to_string(),
        added_by: Actor::parse("alice").unwrap(),
        added_at: at(),
    }
}

fn add(rule: IgnoreRule) -> DriftRulesCommand {
    DriftRulesCommand::Add {
        tenant_id: TenantId::parse("acme").unwrap(),
        environment_id: EnvironmentId::parse("dev").unwrap(),
        rule,
    }
}

fn added(rule: IgnoreRule) -> DriftRulesEvent {
    DriftRulesEvent::DriftIgnoreRuleAdded {
        tenant_id: TenantId::parse("acme").unwrap(),
        environment_id: EnvironmentId::parse("dev").unwrap(),
        rule,
    }
}

fn remove(n: u128, reason: &str) -> DriftRulesCommand {
    DriftRulesCommand::Remove {
        rule_id: IgnoreRuleId::from_uuid(uuid::Uuid::from_u128(n)),
        reason: reason.to_string(),
        by: Actor::parse("bob").unwrap(),
        at: at(),
    }
}

#[test]
fn a_rule_is_added_with_its_reason_and_actor() {
    let r = rule(1, BUCKET, Some("tags"));
    TestFramework::<DriftIgnoreRules>::with(())
        .given_no_previous_events()
        .when(add(r.clone()))
        .then_expect_events(vec![added(r)]);
}

#[test]
fn a_rule_needs_a_reason() {
    let mut r = rule(1, BUCKET, None);
    r.reason = "  ".to_string();
    TestFramework::<DriftIgnoreRules>::with(())
        .given_no_previous_events()
        .when(add(r))
        .then_expect_error(DriftRulesError::Reason);
}

#[test]
fn the_same_difference_is_ignored_once() {
    TestFramework::<DriftIgnoreRules>::with(())
        .given(vec![added(rule(1, BUCKET, Some("tags")))])
        .when(add(rule(2, BUCKET, Some("tags"))))
        .then_expect_error(DriftRulesError::Duplicate(IgnoreRuleId::from_uuid(
            uuid::Uuid::from_u128(1),
        )));
    // Another property of the same resource is another rule.
    let other = rule(2, BUCKET, Some("acl"));
    TestFramework::<DriftIgnoreRules>::with(())
        .given(vec![added(rule(1, BUCKET, Some("tags")))])
        .when(add(other.clone()))
        .then_expect_events(vec![added(other)]);
}

#[test]
fn rules_of_another_tenant_are_not_mixed_in() {
    TestFramework::<DriftIgnoreRules>::with(())
        .given(vec![added(rule(1, BUCKET, None))])
        .when(DriftRulesCommand::Add {
            tenant_id: TenantId::parse("globex").unwrap(),
            environment_id: EnvironmentId::parse("dev").unwrap(),
            rule: rule(2, LOGS, None),
        })
        .then_expect_error(DriftRulesError::IdentityMismatch);
}

#[test]
fn a_rule_is_removed_once_with_a_reason() {
    let removed = DriftRulesEvent::DriftIgnoreRuleRemoved {
        rule_id: IgnoreRuleId::from_uuid(uuid::Uuid::from_u128(1)),
        reason: "tags are in the program now".to_string(),
        removed_by: Actor::parse("bob").unwrap(),
        removed_at: at(),
    };
    TestFramework::<DriftIgnoreRules>::with(())
        .given(vec![added(rule(1, BUCKET, None))])
        .when(remove(1, "tags are in the program now"))
        .then_expect_events(vec![removed.clone()]);
    TestFramework::<DriftIgnoreRules>::with(())
        .given(vec![added(rule(1, BUCKET, None)), removed.clone()])
        .when(remove(1, "again"))
        .then_expect_error(DriftRulesError::AlreadyRemoved(IgnoreRuleId::from_uuid(
            uuid::Uuid::from_u128(1),
        )));
    TestFramework::<DriftIgnoreRules>::with(())
        .given(vec![added(rule(1, BUCKET, None))])
        .when(remove(9, "no such rule"))
        .then_expect_error(DriftRulesError::UnknownRule(IgnoreRuleId::from_uuid(
            uuid::Uuid::from_u128(9),
        )));
    TestFramework::<DriftIgnoreRules>::with(())
        .given(vec![added(rule(1, BUCKET, None))])
        .when(remove(1, ""))
        .then_expect_error(DriftRulesError::Reason);
    // A removed rule's id is not reused.
    TestFramework::<DriftIgnoreRules>::with(())
        .given(vec![added(rule(1, BUCKET, None)), removed])
        .when(add(rule(1, LOGS, None)))
        .then_expect_error(DriftRulesError::RuleExists(IgnoreRuleId::from_uuid(
            uuid::Uuid::from_u128(1),
        )));
}

fn planned(urn: &str, op: ResourceOp, properties: &[&str]) -> PlannedResource {
    PlannedResource {
        urn: urn.to_string(),
        resource_type: "aws:s3/bucket:Bucket".to_string(),
        op,
        properties: properties.iter().map(|p| p.to_string()).collect(),
    }
}

#[test]
fn a_property_rule_hides_exactly_its_difference() {
    let rules = [rule(1, BUCKET, Some("tags"))];
    let t = triage(
        &rules,
        vec![
            planned(BUCKET, ResourceOp::Update, &["tags"]),
            planned(LOGS, ResourceOp::Update, &["tags"]),
        ],
    );
    assert_eq!(t.kept, vec![planned(LOGS, ResourceOp::Update, &["tags"])]);
    assert_eq!(t.ignored.len(), 1);
    assert_eq!(t.ignored[0].resource.urn, BUCKET);
    assert_eq!(t.ignored[0].rule_ids, vec![rules[0].rule_id]);
    assert_eq!(t.counts(), (0, 1, 0, 0));
    assert!(t.notes.is_empty());
    // A nested difference under the property is covered too; a sibling with a shared
    // prefix is not.
    let t = triage(
        &rules,
        vec![planned(BUCKET, ResourceOp::Update, &["tags.owner"])],
    );
    assert_eq!(t.ignored.len(), 1);
    let t = triage(
        &rules,
        vec![planned(BUCKET, ResourceOp::Update, &["tagsAll"])],
    );
    assert!(t.ignored.is_empty());
    assert!(t.notes.is_empty());
}

#[test]
fn a_property_rule_never_hides_a_change_that_would_overwrite_it() {
    let rules = [rule(1, BUCKET, Some("tags"))];
    let t = triage(
        &rules,
        vec![planned(BUCKET, ResourceOp::Update, &["tags", "versioning"])],
    );
    assert!(t.ignored.is_empty());
    assert_eq!(t.counts(), (0, 1, 0, 0));
    assert!(t.notes[0].contains("versioning"), "{:?}", t.notes);
    // A delete of the resource is not a property's difference.
    let t = triage(&rules, vec![planned(BUCKET, ResourceOp::Delete, &[])]);
    assert!(t.ignored.is_empty());
    assert_eq!(t.counts(), (0, 0, 1, 0));
    assert!(t.notes[0].contains("the whole resource"), "{:?}", t.notes);
}

#[test]
fn a_resource_rule_hides_every_difference_of_that_resource_only() {
    let rules = [rule(1, LOGS, None)];
    let t = triage(
        &rules,
        vec![
            planned(BUCKET, ResourceOp::Same, &[]),
            planned(LOGS, ResourceOp::Delete, &[]),
            planned(
                "urn:pulumi:acme.dev::site::aws:s3/bucket:Bucket::other",
                ResourceOp::Replace,
                &["region"],
            ),
        ],
    );
    assert_eq!(t.ignored.len(), 1);
    assert_eq!(t.ignored[0].resource.op, ResourceOp::Delete);
    assert_eq!(t.counts(), (0, 0, 0, 1));
    assert_eq!(t.kept.len(), 2, "unchanged resources stay listed");
}

#[test]
fn urns_and_property_paths_are_validated() {
    assert!(ResourceUrn::parse("assets").is_err());
    assert!(ResourceUrn::parse("urn:pulumi:a::b").is_err());
    assert!(ResourceUrn::parse(format!("{BUCKET} x")).is_err());
    assert!(ResourceUrn::parse(BUCKET).is_ok());
    assert!(PropertyPath::parse("tags..owner").is_err());
    assert!(PropertyPath::parse(".tags").is_err());
    assert!(PropertyPath::parse("").is_err());
    assert!(PropertyPath::parse("tags.owner").is_ok());
}
