//! The message schemas the provisioning context publishes are the ones in the
//! repository's `schemas/` folder. The AsyncAPI document covers every bounded context of the
//! process, so the application checks it (`tests/http.rs`); regenerate everything with
//! `cargo run -- schemas`.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::PathBuf;

fn schemas_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../schemas")
}

#[test]
fn the_schema_files_are_current() {
    let dir = schemas_dir();
    let mut stale = Vec::new();
    for (path, content) in ferry_messaging::published_schemas(
        &ferry_app::contexts::provisioning::events::publishers(),
        &ferry_app::Contexts::builtin().inbound_kinds().unwrap(),
    ) {
        assert!(content.ends_with('\n'), "{path} ends with a newline");
        if path == "asyncapi.json" {
            continue;
        }
        let on_disk = std::fs::read_to_string(dir.join(&path)).unwrap_or_default();
        if on_disk != content {
            stale.push(path);
        }
    }
    assert!(
        stale.is_empty(),
        "stale or missing under schemas/: {stale:?}; run `cargo run -- schemas`"
    );
}

#[test]
fn every_schema_is_a_valid_json_schema() {
    for (path, content) in ferry_messaging::published_schemas(
        &ferry_app::contexts::provisioning::events::publishers(),
        &ferry_app::Contexts::builtin().inbound_kinds().unwrap(),
    ) {
        let value: serde_json::Value = serde_json::from_str(&content).unwrap();
        if path.ends_with(".schema.json") {
            jsonschema::validator_for(&value)
                .unwrap_or_else(|e| panic!("{path} is not a valid schema: {e}"));
        }
    }
}
