//! An environment's drift ignore rules over HTTP: list, add (a resource URN, or one property
//! of it, with a reason) and remove (with a reason). The rules are events of the
//! environment's `DriftIgnoreRules` aggregate (`ferry_domain::drift`); the reconciler's
//! planner applies them to each `Reconciliation` plan and lists what they left out on its
//! receipt (`ignored`).
//!
//! The actor is the token's, the tenant is the token's: a rule of one tenant's environment
//! is out of every other tenant's reach (its aggregate is "not found" to them).

use aide::axum::routing::{get_with, post_with};
use aide::axum::ApiRouter;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use chrono::{DateTime, Utc};
use ferry_api::auth::{Caller, SCOPE_APPLY, SCOPE_READ};
use ferry_api::extract::{RequestIds, ValidJson};
use ferry_api::openapi::Doc;
use ferry_api::problem::ApiError;
use ferry_api::state::AppState;
use ferry_domain::drift::{DriftIgnoreRules, DriftRulesCommand, DriftRulesError, IgnoreRule};
use ferry_domain::{Actor, EnvironmentId, IgnoreRuleId, PropertyPath, ResourceUrn};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// Body of `POST /factory/provisioning/environments/{environmentId}/ignore-rules`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AddIgnoreRuleRequest {
    /// The resource whose difference is accepted, as a run's plan lists it.
    pub urn: ResourceUrn,
    /// Only this property of it (as the plan's `properties` name it; `tags` covers
    /// `tags.owner`); the whole resource when absent.
    #[serde(default)]
    pub property: Option<PropertyPath>,
    /// Why the team accepts it (required; kept as evidence).
    pub reason: String,
}

/// Body of `POST …/ignore-rules/{ruleId}/remove`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RemoveIgnoreRuleRequest {
    /// Why the difference is no longer accepted (required).
    pub reason: String,
}

/// An environment's rules in force.
#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IgnoreRulesView {
    /// The environment.
    pub environment_id: EnvironmentId,
    /// The rules in force, oldest first.
    pub rules: Vec<IgnoreRule>,
}

/// A removed rule.
#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IgnoreRuleRemovedView {
    /// The rule.
    pub rule_id: IgnoreRuleId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// Why.
    pub reason: String,
    /// Who.
    pub removed_by: Actor,
    /// When.
    pub removed_at: DateTime<Utc>,
}

fn environment(raw: &str) -> Result<EnvironmentId, ApiError> {
    EnvironmentId::parse(raw).map_err(|e| ApiError::bad_field("environmentId", e))
}

/// Each refusal's status: a missing reason names the field; a rule that is there already,
/// or removed already, is the wrong state; an unknown rule is not found.
fn refusal(e: DriftRulesError) -> ApiError {
    match e {
        DriftRulesError::Reason => ApiError::invalid_field("reason", e.to_string()),
        DriftRulesError::InvalidText(invalid) => ApiError::invalid_text(invalid),
        DriftRulesError::UnknownRule(_) => ApiError::NotFound(e.to_string()),
        DriftRulesError::Duplicate(_)
        | DriftRulesError::RuleExists(_)
        | DriftRulesError::AlreadyRemoved(_) => ApiError::WrongState(e.to_string()),
        DriftRulesError::IdentityMismatch => ApiError::Rule {
            detail: e.to_string(),
            field: None,
        },
    }
}

async fn active_rules(
    state: &AppState,
    caller: &Caller,
    environment: &EnvironmentId,
) -> Result<Vec<IgnoreRule>, ApiError> {
    let loaded = state
        .repository::<DriftIgnoreRules>()
        .load(
            &caller.tenant,
            &DriftIgnoreRules::aggregate_id(&caller.tenant, environment),
        )
        .await
        .map_err(|e| ApiError::from_command(e, refusal))?;
    Ok(loaded
        .map(|(rules, _)| rules.active().to_vec())
        .unwrap_or_default())
}

/// The ignore rules in force in `environment`, oldest first, for any transport.
pub async fn ignore_rules(
    state: &AppState,
    caller: &Caller,
    environment: &EnvironmentId,
) -> Result<Vec<IgnoreRule>, ApiError> {
    caller.require_read()?;
    active_rules(state, caller, environment).await
}

/// `GET /factory/provisioning/environments/{environmentId}/ignore-rules`.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, environment = %raw))]
pub async fn list_ignore_rules(
    State(state): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> Result<Json<IgnoreRulesView>, ApiError> {
    let environment_id = environment(&raw)?;
    let rules = ignore_rules(&state, &caller, &environment_id).await?;
    Ok(Json(IgnoreRulesView {
        environment_id,
        rules,
    }))
}

/// `POST /factory/provisioning/environments/{environmentId}/ignore-rules`: an Operator
/// accepts a difference; the next reconciliation leaves it out.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, environment = %raw))]
pub async fn add_ignore_rule(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    Path(raw): Path<String>,
    ValidJson { value: body, .. }: ValidJson<AddIgnoreRuleRequest>,
) -> Result<(StatusCode, Json<IgnoreRule>), ApiError> {
    caller.require_apply()?;
    let environment_id = environment(&raw)?;
    let rule = IgnoreRule {
        rule_id: IgnoreRuleId::new_random(),
        urn: body.urn,
        property: body.property,
        reason: body.reason,
        added_by: caller.actor.clone(),
        added_at: Utc::now(),
    };
    state
        .repository::<DriftIgnoreRules>()
        .execute(
            &caller.tenant,
            &DriftIgnoreRules::aggregate_id(&caller.tenant, &environment_id),
            DriftRulesCommand::Add {
                tenant_id: caller.tenant.clone(),
                environment_id,
                rule: rule.clone(),
            },
            &caller.metadata(ids),
            true,
        )
        .await
        .map_err(|e| ApiError::from_command(e, refusal))?;
    tracing::info!(rule = %rule.rule_id, urn = %rule.urn, "ignore rule added");
    Ok((StatusCode::CREATED, Json(rule)))
}

/// `POST /factory/provisioning/environments/{environmentId}/ignore-rules/{ruleId}/remove`.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant, environment = %raw.0, rule = %raw.1))]
pub async fn remove_ignore_rule(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    Path(raw): Path<(String, String)>,
    ValidJson { value: body, .. }: ValidJson<RemoveIgnoreRuleRequest>,
) -> Result<Json<IgnoreRuleRemovedView>, ApiError> {
    caller.require_apply()?;
    let environment_id = environment(&raw.0)?;
    let rule_id = IgnoreRuleId::parse(&raw.1).map_err(|e| ApiError::bad_field("ruleId", e))?;
    let removed_at = Utc::now();
    state
        .repository::<DriftIgnoreRules>()
        .execute(
            &caller.tenant,
            &DriftIgnoreRules::aggregate_id(&caller.tenant, &environment_id),
            DriftRulesCommand::Remove {
                rule_id,
                reason: body.reason.clone(),
                by: caller.actor.clone(),
                at: removed_at,
            },
            &caller.metadata(ids),
            false,
        )
        .await
        .map_err(|e| match e {
            ferry_store::CommandError::NotFound => {
                ApiError::NotFound(format!("no rule {rule_id} in {environment_id}"))
            }
            other => ApiError::from_command(other, refusal),
        })?;
    tracing::info!("ignore rule removed");
    Ok(Json(IgnoreRuleRemovedView {
        rule_id,
        environment_id,
        reason: body.reason,
        removed_by: caller.actor.clone(),
        removed_at,
    }))
}

/// The ignore rules' routes, with their documentation.
pub fn routes() -> ApiRouter<AppState> {
    let path = "/factory/provisioning/environments/{environmentId}/ignore-rules";
    ApiRouter::new()
        .api_route(
            path,
            get_with(list_ignore_rules, |op| {
                op.id("ListIgnoreRules")
                    .summary("The environment's drift ignore rules in force: differences the reconciler leaves out of its plans (and the apply leaves alone).")
                    .scope(SCOPE_READ)
                    .path("environmentId", "The environment.", json!({"type": "string"}))
                    .response_with::<200, Json<IgnoreRulesView>, _>(|r| r.description("The rules."))
                    .errors(&[400, 401, 403])
            })
            .post_with(add_ignore_rule, |op| {
                op.id("AddIgnoreRule")
                    .summary("Accept a difference in this environment (Operator or PlatformAdmin): a resource URN, or one property of it, with a required reason. The next reconciliation leaves it out and lists it on the run's plan (`ignored`); a property rule cannot hide a resource whose other properties change too (the apply would overwrite it), and the plan says so.")
                    .scope(SCOPE_APPLY)
                    .path("environmentId", "The environment.", json!({"type": "string"}))
                    .response_with::<201, Json<IgnoreRule>, _>(|r| r.description("The rule, with who added it."))
                    .errors(&[400, 401, 403, 409, 415, 422])
            }),
        )
        .api_route(
            "/factory/provisioning/environments/{environmentId}/ignore-rules/{ruleId}/remove",
            post_with(remove_ignore_rule, |op| {
                op.id("RemoveIgnoreRule")
                    .summary("Stop accepting a difference (Operator or PlatformAdmin, reason required): the next reconciliation shows it again.")
                    .scope(SCOPE_APPLY)
                    .path("environmentId", "The environment.", json!({"type": "string"}))
                    .path("ruleId", "The rule.", json!({"type": "string", "format": "uuid"}))
                    .response_with::<200, Json<IgnoreRuleRemovedView>, _>(|r| r.description("The removal."))
                    .errors(&[400, 401, 403, 404, 409, 415, 422])
            }),
        )
}
