//! Gathering a run's inputs: the program checkout, configuration and secrets, the tenant's
//! runner identity when the runner needs one (never part of the hash), and the inputs hash
//! (sha256 over the program version, the resolved configuration values and the secret
//! references' versions; never secret values).

use ferry_domain::ports::identity::IdentityError;
use ferry_domain::ports::runner::{RunnerInput, StackName};
use ferry_domain::ports::sources::{ConfigError, SecretError, SourceError};
use ferry_domain::ports::SecretValue;
use ferry_domain::specification::SpecificationVersion;
use ferry_domain::TenantId;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::limits::LimitError;
use super::ProvisioningSteps;

/// Why a step's inputs could not be gathered; the text is the run's failure reason (it
/// names the reference, the limit or the setting that gives the tenant no identity).
#[derive(Debug, thiserror::Error)]
pub(crate) enum GatherError {
    /// The tenant has no runner identity, or one of its references did not resolve.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// The work folder could not be made.
    #[error("cannot create work folder {}: {source}", path.display())]
    WorkFolder {
        /// The folder.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The program could not be checked out.
    #[error(transparent)]
    Checkout(#[from] SourceError),
    /// The program is over a limit.
    #[error(transparent)]
    Limit(#[from] LimitError),
    /// Configuration could not be resolved.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A secret could not be resolved.
    #[error(transparent)]
    Secret(#[from] SecretError),
}

/// Everything resolved for one preview or apply.
pub struct Inputs {
    /// What the runner gets.
    pub runner: RunnerInput,
    /// The commit actually checked out.
    pub commit: String,
    /// See the module doc.
    pub hash: String,
    /// Warnings for the receipt (degraded configuration).
    pub warnings: Vec<String>,
}

impl Inputs {
    /// The secret values and the identity's, to redact logs with.
    pub fn secrets(&self) -> impl Iterator<Item = &SecretValue> {
        self.runner
            .secrets
            .values()
            .chain(self.runner.identity.iter().flat_map(|i| i.values()))
    }
}

/// The hash of the inputs (see the module doc).
pub fn inputs_hash(
    commit: &str,
    config: &BTreeMap<String, serde_json::Value>,
    secret_versions: &BTreeMap<String, String>,
) -> String {
    // serde_json maps are ordered by key, so the document is canonical.
    let doc = serde_json::json!({"programVersion": commit, "config": config, "secretVersions": secret_versions});
    hex::encode(Sha256::digest(doc.to_string().as_bytes()))
}

impl ProvisioningSteps {
    /// Checks the program out into `dir` and resolves configuration, secrets and (for a
    /// runner that needs one) the runner identity, each for `tenant` (the adapters refuse
    /// what the tenant may not reach). An error is the reason the step cannot go on (it
    /// names the reference, or the setting that gives the tenant no identity).
    pub(crate) async fn gather(
        &self,
        tenant: &TenantId,
        spec: &SpecificationVersion,
        dir: &Path,
        timeout: Duration,
    ) -> Result<Inputs, GatherError> {
        // First: a tenant without an identity has nothing to check out for.
        let identity = if self.ports.runner.needs_identity() {
            let identities = &self.settings.runner_identities;
            Some(
                identities
                    .resolve(tenant, self.ports.secrets.as_ref())
                    .await?,
            )
        } else {
            None
        };
        let _ = tokio::fs::remove_dir_all(dir).await;
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|source| GatherError::WorkFolder {
                path: dir.to_path_buf(),
                source,
            })?;
        let checkout = self
            .ports
            .programs
            .checkout(tenant, &spec.program_ref, &spec.program_version, dir)
            .await?;
        // Before any runner reads or parses it.
        self.settings
            .limits
            .check_program(&checkout.program_dir)
            .await?;
        let config = self
            .ports
            .config
            .resolve(tenant, spec.environment_id.as_str(), &spec.config_refs)
            .await?;
        let mut secrets = BTreeMap::new();
        let mut versions = BTreeMap::new();
        for (name, reference) in &spec.secret_refs {
            let resolved = self.ports.secrets.resolve(tenant, reference).await?;
            versions.insert(name.clone(), resolved.version);
            secrets.insert(name.clone(), resolved.value);
        }
        let hash = inputs_hash(&checkout.commit, &config.values, &versions);
        Ok(Inputs {
            runner: RunnerInput {
                tenant: tenant.clone(),
                environment_id: spec.environment_id.to_string(),
                stack: StackName::for_environment(tenant, &spec.environment_id),
                program_dir: checkout.program_dir,
                config: config.values,
                secrets,
                timeout,
                // Set by the step: a reconciliation refreshes, an apply excludes what its
                // plan's ignore rules left out.
                refresh: false,
                exclude: Vec::new(),
                identity,
            },
            commit: checkout.commit,
            hash,
            warnings: config.warnings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_changes_with_each_input_and_not_with_order() {
        let config = BTreeMap::from([
            ("a".to_string(), serde_json::json!(1)),
            ("b".to_string(), serde_json::json!("x")),
        ]);
        let versions = BTreeMap::from([("db".to_string(), "vault:v3".to_string())]);
        let h = inputs_hash("abc", &config, &versions);
        assert_eq!(h.len(), 64);
        assert_eq!(
            h,
            inputs_hash(
                "abc",
                &config.clone().into_iter().rev().collect(),
                &versions
            )
        );
        assert_ne!(h, inputs_hash("abd", &config, &versions));
        let v2 = BTreeMap::from([("db".to_string(), "vault:v4".to_string())]);
        assert_ne!(h, inputs_hash("abc", &config, &v2));
    }
}
