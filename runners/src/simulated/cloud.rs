//! The simulated cloud: one JSON state file per environment, written atomically.
//!
//! Layout: `<data_dir>/simulated-cloud/<tenant>/<environmentId>/state.json`, a
//! [`CloudState`] (one cloud per tenant: tenant A's `prod` is not tenant B's):
//! resources by URN with their type, inputs, outputs (inputs plus a deterministic `id`),
//! protect flag and dependencies, and the stack outputs of the last successful apply.
//! Secret-derived values are stored as `[secret]`. Editing the file by hand is drift: a
//! changed input shows as an update, a removed resource as a create, an added one as a
//! delete in the next preview. (A rotated secret is not a diff: both sides read `[secret]`.)

use ferry_domain::ports::runner::RunnerError;
use ferry_domain::TenantId;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// One resource as the simulated cloud holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredResource {
    /// The type token.
    #[serde(rename = "type")]
    pub resource_type: String,
    /// The cloud-assigned id.
    pub id: String,
    /// Input properties (secrets masked).
    #[serde(default)]
    pub inputs: Value,
    /// Output properties: the inputs plus `id` (secrets masked).
    #[serde(default)]
    pub outputs: Value,
    /// Protected from deletion.
    #[serde(default)]
    pub protect: bool,
    /// URNs this resource depends on.
    #[serde(default)]
    pub dependencies: Vec<String>,
}

/// The state of one environment's simulated cloud.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CloudState {
    /// The tenant this state belongs to.
    #[serde(default)]
    pub tenant_id: String,
    /// The environment this state belongs to.
    #[serde(default)]
    pub environment_id: String,
    /// The stack (tenant and environment).
    #[serde(default)]
    pub stack: String,
    /// Resources by URN.
    #[serde(default)]
    pub resources: BTreeMap<String, StoredResource>,
    /// Stack outputs of the last complete apply (secrets masked).
    #[serde(default)]
    pub outputs: BTreeMap<String, Value>,
}

/// Where a tenant's environment's state lives; rejects environment ids that are not safe
/// folder names.
pub fn state_path(
    data_dir: &Path,
    tenant: &TenantId,
    environment_id: &str,
) -> Result<PathBuf, RunnerError> {
    let safe = !environment_id.is_empty()
        && environment_id != "."
        && environment_id != ".."
        && environment_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !safe {
        return Err(RunnerError::InvalidProgram(format!(
            "environment id '{environment_id}' is not usable as a stack name"
        )));
    }
    Ok(data_dir
        .join("simulated-cloud")
        .join(tenant.path_component())
        .join(environment_id)
        .join("state.json"))
}

/// Reads the state; a missing file is an empty cloud.
pub fn load(path: &Path) -> Result<CloudState, RunnerError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
            RunnerError::BadOutput(format!(
                "simulated cloud state {} is corrupt: {e}",
                path.display()
            ))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(CloudState::default()),
        Err(e) => Err(RunnerError::Unavailable(format!(
            "cannot read simulated cloud state {}: {e}",
            path.display()
        ))),
    }
}

/// Writes the state atomically: a temporary file beside it, then a rename, so a crash
/// never leaves a half-written state.
pub fn save(path: &Path, state: &CloudState) -> Result<(), RunnerError> {
    let fail = |what: &str, e: std::io::Error| {
        RunnerError::Unavailable(format!(
            "cannot {what} simulated cloud state {}: {e}",
            path.display()
        ))
    };
    let dir = path.parent().ok_or_else(|| {
        RunnerError::Unavailable(format!("{} has no parent folder", path.display()))
    })?;
    std::fs::create_dir_all(dir).map_err(|e| fail("create the folder of", e))?;
    let bytes = serde_json::to_vec_pretty(state)
        .map_err(|e| RunnerError::BadOutput(format!("cannot serialise state: {e}")))?;
    // Unique per process and call, so concurrent writers never share a temporary file.
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!("state.json.tmp-{}-{n}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| fail("write", e))?;
    std::fs::rename(&tmp, path).map_err(|e| fail("replace", e))
}

/// A deterministic id for a new resource: its name and a hash of its URN and (masked)
/// inputs, so a replacement with different inputs gets a different id.
pub fn mint_id(name: &str, urn: &str, masked_inputs: &Value) -> String {
    let mut h = Sha256::new();
    h.update(urn.as_bytes());
    h.update(b"\n");
    h.update(masked_inputs.to_string().as_bytes());
    let digest = hex::encode(h.finalize());
    format!("{name}-{}", &digest[..8])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_layout() {
        let dir = tempfile::tempdir().unwrap();
        let acme = TenantId::parse("acme").unwrap();
        let path = state_path(dir.path(), &acme, "dev").unwrap();
        assert!(path.ends_with("simulated-cloud/acme/dev/state.json"));
        let dots = TenantId::parse("..").unwrap();
        assert!(state_path(dir.path(), &dots, "dev")
            .unwrap()
            .ends_with("simulated-cloud/%2E%2E/dev/state.json"));
        assert_eq!(load(&path).unwrap(), CloudState::default());
        let mut state = CloudState {
            environment_id: "dev".into(),
            ..Default::default()
        };
        state.resources.insert(
            "urn:x".into(),
            StoredResource {
                resource_type: "t:T".into(),
                id: "x-1".into(),
                inputs: serde_json::json!({"a": 1}),
                outputs: serde_json::json!({"a": 1, "id": "x-1"}),
                protect: true,
                dependencies: vec![],
            },
        );
        save(&path, &state).unwrap();
        assert_eq!(load(&path).unwrap(), state);
        let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temporary file left behind");
        std::fs::write(&path, b"{not json").unwrap();
        assert!(matches!(load(&path), Err(RunnerError::BadOutput(_))));
    }

    #[test]
    fn unsafe_environment_ids_are_rejected() {
        let acme = TenantId::parse("acme").unwrap();
        for bad in ["", "..", "../etc", "a/b", "a b"] {
            assert!(state_path(Path::new("/d"), &acme, bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ids_are_deterministic() {
        let v = serde_json::json!({"a": 1});
        assert_eq!(mint_id("n", "u", &v), mint_id("n", "u", &v));
        assert_ne!(
            mint_id("n", "u", &v),
            mint_id("n", "u", &serde_json::json!({"a": 2}))
        );
        assert!(mint_id("n", "u", &v).starts_with("n-"));
    }
}
