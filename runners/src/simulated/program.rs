//! The Pulumi YAML program model: what the simulated runner reads from `Pulumi.yaml`.
//!
//! Supported: `name`, `runtime: yaml`, `config` (declared keys with optional `default`
//! and `secret`), `variables`, `resources` (`type`, `properties`, `options.protect`,
//! `options.replaceOnChanges`, `options.dependsOn`) and `outputs`. Declaration order is
//! kept so that plans and applies are deterministic and follow the file.

use ferry_domain::ports::runner::RunnerError;
use serde_json::Value;
use std::path::Path;

/// A declared configuration key.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigDecl {
    /// The key without the project prefix.
    pub name: String,
    /// The value used when none is supplied.
    pub default: Option<Value>,
    /// Whether values of this key are secret even when supplied as plain config.
    pub secret: bool,
}

/// One resource of the program.
#[derive(Debug, Clone, PartialEq)]
pub struct ResourceDecl {
    /// The logical name (the key under `resources:`).
    pub name: String,
    /// The type token.
    pub resource_type: String,
    /// The properties, still with `${...}` expressions.
    pub properties: Value,
    /// `options.protect`.
    pub protect: bool,
    /// `options.replaceOnChanges`: top-level properties whose change forces a replace.
    pub replace_on_changes: Vec<String>,
    /// `options.dependsOn`: names of resources this one waits for.
    pub depends_on: Vec<String>,
}

/// A parsed `Pulumi.yaml`.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// The project name.
    pub name: String,
    /// Declared configuration keys.
    pub config: Vec<ConfigDecl>,
    /// Variables in declaration order (name, expression).
    pub variables: Vec<(String, Value)>,
    /// Resources in declaration order.
    pub resources: Vec<ResourceDecl>,
    /// Outputs in declaration order (name, expression).
    pub outputs: Vec<(String, Value)>,
}

fn invalid(reason: impl Into<String>) -> RunnerError {
    RunnerError::InvalidProgram(reason.into())
}

impl Program {
    /// Reads `Pulumi.yaml` (or `Pulumi.yml`) from `dir`, never following a link out of it.
    pub fn load(dir: &Path) -> Result<Self, RunnerError> {
        Self::parse(&crate::checkout::read_project_file(dir)?)
    }

    /// Parses the text of a `Pulumi.yaml`.
    pub fn parse(text: &str) -> Result<Self, RunnerError> {
        let doc: serde_yaml::Value = serde_yaml::from_str(text)
            .map_err(|e| invalid(format!("Pulumi.yaml does not parse: {e}")))?;
        let root = doc
            .as_mapping()
            .ok_or_else(|| invalid("Pulumi.yaml is not a mapping"))?;
        let name = root
            .get("name")
            .and_then(|v| v.as_str())
            .filter(|n| !n.is_empty())
            .ok_or_else(|| invalid("Pulumi.yaml has no project `name`"))?
            .to_string();
        let runtime = match root.get("runtime") {
            Some(serde_yaml::Value::String(s)) => s.clone(),
            Some(serde_yaml::Value::Mapping(m)) => m
                .get("name")
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_string(),
            _ => String::new(),
        };
        if runtime != "yaml" {
            return Err(invalid(format!(
                "the simulated runner only runs `runtime: yaml` programs, not '{runtime}'"
            )));
        }
        let config = entries(root, "config")?
            .into_iter()
            .map(|(key, v)| config_decl(&name, key, v))
            .collect::<Result<_, _>>()?;
        let variables = entries(root, "variables")?
            .into_iter()
            .map(|(k, v)| Ok((k, to_json(&v, "variable")?)))
            .collect::<Result<_, RunnerError>>()?;
        let resources = entries(root, "resources")?
            .into_iter()
            .map(|(k, v)| resource_decl(k, &v))
            .collect::<Result<_, _>>()?;
        let outputs = entries(root, "outputs")?
            .into_iter()
            .map(|(k, v)| Ok((k, to_json(&v, "output")?)))
            .collect::<Result<_, RunnerError>>()?;
        Ok(Self {
            name,
            config,
            variables,
            resources,
            outputs,
        })
    }
}

/// The entries of a top-level section, in file order (a missing section is empty).
fn entries(
    root: &serde_yaml::Mapping,
    section: &str,
) -> Result<Vec<(String, serde_yaml::Value)>, RunnerError> {
    match root.get(section) {
        None | Some(serde_yaml::Value::Null) => Ok(Vec::new()),
        Some(serde_yaml::Value::Mapping(m)) => m
            .iter()
            .map(|(k, v)| {
                k.as_str()
                    .map(|k| (k.to_string(), v.clone()))
                    .ok_or_else(|| invalid(format!("`{section}` has a key that is not a string")))
            })
            .collect(),
        Some(_) => Err(invalid(format!("`{section}` must be a mapping"))),
    }
}

fn to_json(v: &serde_yaml::Value, what: &str) -> Result<Value, RunnerError> {
    serde_json::to_value(v).map_err(|e| invalid(format!("{what} is not JSON-compatible: {e}")))
}

fn config_decl(
    project: &str,
    key: String,
    v: serde_yaml::Value,
) -> Result<ConfigDecl, RunnerError> {
    let name = key
        .strip_prefix(&format!("{project}:"))
        .map(str::to_string)
        .unwrap_or(key);
    let (default, secret) = match &v {
        serde_yaml::Value::Mapping(m) => (
            m.get("default")
                .map(|d| to_json(d, "config default"))
                .transpose()?,
            m.get("secret").and_then(|s| s.as_bool()).unwrap_or(false),
        ),
        serde_yaml::Value::Null => (None, false),
        // Shorthand `key: value` declares a default value.
        other => (Some(to_json(other, "config default")?), false),
    };
    Ok(ConfigDecl {
        name,
        default,
        secret,
    })
}

fn resource_decl(name: String, v: &serde_yaml::Value) -> Result<ResourceDecl, RunnerError> {
    let m = v
        .as_mapping()
        .ok_or_else(|| invalid(format!("resource '{name}' must be a mapping")))?;
    let resource_type = m
        .get("type")
        .and_then(|t| t.as_str())
        .filter(|t| !t.is_empty())
        .ok_or_else(|| invalid(format!("resource '{name}' has no `type`")))?
        .to_string();
    let properties = match m.get("properties") {
        None | Some(serde_yaml::Value::Null) => Value::Object(Default::default()),
        Some(p @ serde_yaml::Value::Mapping(_)) => to_json(p, "properties")?,
        Some(_) => return Err(invalid(format!("properties of '{name}' must be a mapping"))),
    };
    let options = m.get("options").and_then(|o| o.as_mapping());
    let opt = |key: &str| options.and_then(|o| o.get(key));
    let protect = opt("protect").and_then(|p| p.as_bool()).unwrap_or(false);
    let strings = |key: &str| -> Result<Vec<String>, RunnerError> {
        match opt(key) {
            None | Some(serde_yaml::Value::Null) => Ok(Vec::new()),
            Some(serde_yaml::Value::Sequence(items)) => items
                .iter()
                .map(|i| {
                    i.as_str().map(str::to_string).ok_or_else(|| {
                        invalid(format!("options.{key} of '{name}' must list strings"))
                    })
                })
                .collect(),
            Some(_) => Err(invalid(format!("options.{key} of '{name}' must be a list"))),
        }
    };
    let replace_on_changes = strings("replaceOnChanges")?;
    let depends_on = strings("dependsOn")?
        .into_iter()
        .map(|d| {
            d.strip_prefix("${")
                .and_then(|d| d.strip_suffix('}'))
                .map(str::to_string)
                .unwrap_or(d)
        })
        .collect();
    Ok(ResourceDecl {
        name,
        resource_type,
        properties,
        protect,
        replace_on_changes,
        depends_on,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_program() {
        let p = Program::parse(
            r#"
name: demo
runtime: yaml
config:
  region:
    type: string
    default: eu-west-1
  demo:dbPassword:
    type: string
    secret: true
variables:
  prefix: app-${region}
resources:
  bucket:
    type: aws:s3/bucket:Bucket
    properties:
      name: ${prefix}-data
    options:
      protect: true
      replaceOnChanges: [name]
      dependsOn: ["${other}"]
  other:
    type: aws:s3/bucket:Bucket
outputs:
  bucketId: ${bucket.id}
"#,
        )
        .unwrap();
        assert_eq!(p.name, "demo");
        assert_eq!(p.config.len(), 2);
        assert_eq!(p.config[1].name, "dbPassword");
        assert!(p.config[1].secret);
        assert_eq!(p.config[0].default, Some(Value::from("eu-west-1")));
        assert_eq!(p.resources[0].name, "bucket");
        assert!(p.resources[0].protect);
        assert_eq!(p.resources[0].replace_on_changes, vec!["name"]);
        assert_eq!(p.resources[0].depends_on, vec!["other"]);
        assert_eq!(p.resources[1].properties, serde_json::json!({}));
        assert_eq!(p.outputs[0].0, "bucketId");
    }

    #[test]
    fn rejects_bad_programs() {
        for bad in [
            "name: x\nruntime: nodejs\n",
            "runtime: yaml\n",
            "name: x\nruntime: yaml\nresources:\n  r:\n    properties: {}\n",
            "name: x\nruntime: yaml\nresources: [1]\n",
            ": : :",
        ] {
            assert!(
                matches!(Program::parse(bad), Err(RunnerError::InvalidProgram(_))),
                "{bad}"
            );
        }
    }
}
