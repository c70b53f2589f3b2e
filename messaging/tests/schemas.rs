//! The generated schemas in the repository's `schemas/` folder are current.
//! Regenerate with `FERRY_UPDATE_SCHEMAS=1 cargo test -p ferry-messaging --test schemas`.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::PathBuf;

fn schemas_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../schemas")
}

#[test]
fn the_schema_files_are_current() {
    let dir = schemas_dir();
    if std::env::var_os("FERRY_UPDATE_SCHEMAS").is_some() {
        ferry_messaging::write_schemas(&dir, &ferry_messaging::Publishers::provisioning()).unwrap();
    }
    let mut stale = Vec::new();
    for (path, content) in
        ferry_messaging::published_schemas(&ferry_messaging::Publishers::provisioning())
    {
        assert!(content.ends_with('\n'), "{path} ends with a newline");
        let on_disk = std::fs::read_to_string(dir.join(&path)).unwrap_or_default();
        if on_disk != content {
            stale.push(path);
        }
    }
    assert!(
        stale.is_empty(),
        "stale or missing under schemas/: {stale:?}; run FERRY_UPDATE_SCHEMAS=1 cargo test -p ferry-messaging --test schemas"
    );
}

#[test]
fn every_schema_is_a_valid_json_schema() {
    for (path, content) in
        ferry_messaging::published_schemas(&ferry_messaging::Publishers::provisioning())
    {
        let value: serde_json::Value = serde_json::from_str(&content).unwrap();
        if path.ends_with(".schema.json") {
            jsonschema::validator_for(&value)
                .unwrap_or_else(|e| panic!("{path} is not a valid schema: {e}"));
        }
    }
}
