//! Evaluates a [`Program`]: `${...}` interpolation of configuration, secrets, variables and
//! resource properties, in dependency order, with cycle and unknown-reference detection.
//!
//! Every value is carried twice ([`Val`]): the `plain` value the program computes with,
//! and a `masked` copy in which anything derived from a secret reads `[secret]`. Only the
//! masked copy is ever stored, printed or compared, so secrets never leave memory.

use super::program::{Program, ResourceDecl};
use ferry_domain::ports::runner::{RunnerError, RunnerInput};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// What a secret (or anything computed from one) reads as outside memory.
pub const SECRET_MARKER: &str = "[secret]";

/// A value and its masked twin.
#[derive(Debug, Clone, PartialEq)]
pub struct Val {
    /// The real value, for computing only.
    pub plain: Value,
    /// The value as it may be stored and shown.
    pub masked: Value,
}

impl Val {
    fn public(v: Value) -> Self {
        Self {
            plain: v.clone(),
            masked: v,
        }
    }
    fn secret(v: Value) -> Self {
        Self {
            plain: v,
            masked: Value::from(SECRET_MARKER),
        }
    }
    fn is_secret(&self) -> bool {
        self.plain != self.masked
    }
}

/// A resource after evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct EvaluatedResource {
    /// The logical name.
    pub name: String,
    /// The URN (`urn:pulumi:<stack>::<project>::<type>::<name>`).
    pub urn: String,
    /// The type token.
    pub resource_type: String,
    /// The evaluated input properties.
    pub inputs: Val,
    /// The id the resource has (or will have) in the simulated cloud.
    pub id: String,
    /// `options.protect`.
    pub protect: bool,
    /// `options.replaceOnChanges`.
    pub replace_on_changes: Vec<String>,
    /// URNs of the resources it depends on.
    pub dependencies: Vec<String>,
}

/// The evaluated program: resources in dependency order, and the outputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// Resources, each after everything it refers to.
    pub resources: Vec<EvaluatedResource>,
    /// Outputs by name.
    pub outputs: BTreeMap<String, Val>,
}

/// Why an expression cannot be evaluated; the text follows the name of the variable,
/// resource or output that holds it in [`RunnerError::InvalidProgram`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum ExprError {
    /// A `${` without its `}` (the whole string).
    #[error("unterminated '${{' in '{0}'")]
    Unterminated(String),
    /// A reference that is not `root(.key|[index]|["key"])*`.
    #[error("cannot parse reference '${{{0}}}'")]
    Unparsable(String),
    /// A reference to nothing declared.
    #[error("unknown reference '${{{0}}}'")]
    Unknown(String),
    /// A path into a value that does not have it.
    #[error("'${{{0}}}' names a property that does not exist")]
    NoProperty(String),
}

fn invalid(reason: impl Into<String>) -> RunnerError {
    RunnerError::InvalidProgram(reason.into())
}

/// The URN of a resource of this program on this stack.
pub fn urn_of(stack: &str, project: &str, resource_type: &str, name: &str) -> String {
    format!("urn:pulumi:{stack}::{project}::{resource_type}::{name}")
}

/// Evaluates `program` for `input`. `id_for(resource, inputs)` gives each resource's id
/// (the caller knows the cloud state: kept ids stay, new and replaced ones are minted).
pub fn evaluate(
    program: &Program,
    input: &RunnerInput,
    mut id_for: impl FnMut(&EvaluatedResource) -> String,
) -> Result<Evaluation, RunnerError> {
    let stack = input.stack.as_str();
    let mut scope = Scope {
        config: config_values(program, input)?,
        values: HashMap::new(),
        builtins: Val::public(serde_json::json!({"stack": stack, "project": program.name})),
        project: program.name.clone(),
    };
    let order = dependency_order(program, &scope)?;
    let mut resources = Vec::new();
    for node in order {
        match node {
            Node::Variable(i) => {
                let (name, expr) = &program.variables[i];
                let v = scope
                    .eval(expr)
                    .map_err(|e| invalid(format!("variable '{name}': {e}")))?;
                scope.values.insert(name.clone(), v);
            }
            Node::Resource(i) => {
                let decl = &program.resources[i];
                let inputs = scope
                    .eval(&decl.properties)
                    .map_err(|e| invalid(format!("resource '{}': {e}", decl.name)))?;
                let mut res = EvaluatedResource {
                    name: decl.name.clone(),
                    urn: urn_of(stack, &program.name, &decl.resource_type, &decl.name),
                    resource_type: decl.resource_type.clone(),
                    inputs,
                    id: String::new(),
                    protect: decl.protect,
                    replace_on_changes: decl.replace_on_changes.clone(),
                    dependencies: resource_deps(decl, &scope, program)
                        .into_iter()
                        .map(|d| {
                            let t = program
                                .resources
                                .iter()
                                .find(|r| r.name == d)
                                .map(|r| r.resource_type.as_str())
                                .unwrap_or_default();
                            urn_of(stack, &program.name, t, &d)
                        })
                        .collect(),
                };
                res.id = id_for(&res);
                scope.values.insert(decl.name.clone(), resource_value(&res));
                resources.push(res);
            }
        }
    }
    let mut outputs = BTreeMap::new();
    for (name, expr) in &program.outputs {
        let v = scope
            .eval(expr)
            .map_err(|e| invalid(format!("output '{name}': {e}")))?;
        outputs.insert(name.clone(), v);
    }
    Ok(Evaluation { resources, outputs })
}

/// What `${resource}` refers to: its inputs plus `id` and `urn`.
fn resource_value(res: &EvaluatedResource) -> Val {
    let with_ids = |v: &Value| {
        let mut m = v.as_object().cloned().unwrap_or_default();
        m.insert("id".into(), Value::from(res.id.clone()));
        m.insert("urn".into(), Value::from(res.urn.clone()));
        Value::Object(m)
    };
    Val {
        plain: with_ids(&res.inputs.plain),
        masked: with_ids(&res.inputs.masked),
    }
}

/// Supplied config and secrets (by key without the project prefix), declared defaults,
/// and a check that every declared key without a default has a value.
fn config_values(
    program: &Program,
    input: &RunnerInput,
) -> Result<HashMap<String, Val>, RunnerError> {
    let prefix = format!("{}:", program.name);
    let short = |k: &str| k.strip_prefix(&prefix).unwrap_or(k).to_string();
    let declared_secret: BTreeSet<&str> = program
        .config
        .iter()
        .filter(|c| c.secret)
        .map(|c| c.name.as_str())
        .collect();
    let mut values = HashMap::new();
    for (k, v) in &input.config {
        let k = short(k);
        let val = if declared_secret.contains(k.as_str()) {
            Val::secret(v.clone())
        } else {
            Val::public(v.clone())
        };
        values.insert(k, val);
    }
    for (k, s) in &input.secrets {
        values.insert(short(k), Val::secret(Value::from(s.expose())));
    }
    for decl in &program.config {
        if values.contains_key(&decl.name) {
            continue;
        }
        match &decl.default {
            Some(d) if decl.secret => values.insert(decl.name.clone(), Val::secret(d.clone())),
            Some(d) => values.insert(decl.name.clone(), Val::public(d.clone())),
            None => {
                return Err(invalid(format!(
                    "configuration key '{}' is declared without a default and has no value",
                    decl.name
                )))
            }
        };
    }
    Ok(values)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    Variable(usize),
    Resource(usize),
}

struct Scope {
    config: HashMap<String, Val>,
    values: HashMap<String, Val>,
    builtins: Val,
    project: String,
}

impl Scope {
    fn is_config(&self, root: &str) -> bool {
        self.config_key(root).is_some()
    }
    fn config_key<'a>(&'a self, root: &'a str) -> Option<&'a Val> {
        let prefix = format!("{}:", self.project);
        self.config
            .get(root)
            .or_else(|| self.config.get(root.strip_prefix(&prefix)?))
    }

    fn lookup(&self, r: &Ref) -> Result<Val, ExprError> {
        let base = if let Some(v) = self.values.get(&r.root) {
            v
        } else if let Some(v) = self.config_key(&r.root) {
            v
        } else if r.root == "pulumi" {
            &self.builtins
        } else {
            return Err(ExprError::Unknown(r.text.clone()));
        };
        let mut plain = &base.plain;
        let mut masked = Some(&base.masked);
        for seg in &r.path {
            plain = step(plain, seg).ok_or_else(|| ExprError::NoProperty(r.text.clone()))?;
            masked = masked.and_then(|m| step(m, seg));
        }
        // A secret masks its whole subtree, so a path into it is secret too.
        let masked = masked
            .cloned()
            .unwrap_or_else(|| Value::from(SECRET_MARKER));
        Ok(Val {
            plain: plain.clone(),
            masked,
        })
    }

    fn eval(&self, expr: &Value) -> Result<Val, ExprError> {
        match expr {
            Value::String(s) => self.eval_string(s),
            Value::Array(items) => {
                let vals = items
                    .iter()
                    .map(|i| self.eval(i))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Val {
                    plain: Value::Array(vals.iter().map(|v| v.plain.clone()).collect()),
                    masked: Value::Array(vals.into_iter().map(|v| v.masked).collect()),
                })
            }
            Value::Object(m) => {
                let mut plain = Map::new();
                let mut masked = Map::new();
                for (k, v) in m {
                    let v = self.eval(v)?;
                    plain.insert(k.clone(), v.plain);
                    masked.insert(k.clone(), v.masked);
                }
                Ok(Val {
                    plain: Value::Object(plain),
                    masked: Value::Object(masked),
                })
            }
            other => Ok(Val::public(other.clone())),
        }
    }

    fn eval_string(&self, s: &str) -> Result<Val, ExprError> {
        let parts = parse_template(s)?;
        // A string that is exactly one reference takes the referenced value as is.
        if let [Part::Ref(r)] = parts.as_slice() {
            return self.lookup(r);
        }
        let mut plain = String::new();
        let mut secret = false;
        for part in &parts {
            match part {
                Part::Lit(l) => plain.push_str(l),
                Part::Ref(r) => {
                    let v = self.lookup(r)?;
                    secret |= v.is_secret();
                    match &v.plain {
                        Value::String(s) => plain.push_str(s),
                        other => plain.push_str(&other.to_string()),
                    }
                }
            }
        }
        Ok(if secret {
            Val::secret(Value::from(plain))
        } else {
            Val::public(Value::from(plain))
        })
    }
}

fn step<'a>(v: &'a Value, seg: &Seg) -> Option<&'a Value> {
    match seg {
        Seg::Key(k) => v.as_object()?.get(k),
        Seg::Index(i) => v.as_array()?.get(*i),
    }
}

/// Orders variables and resources so that each comes after what it refers to; reports
/// unknown references and cycles by name.
fn dependency_order(program: &Program, scope: &Scope) -> Result<Vec<Node>, RunnerError> {
    let mut nodes: Vec<(String, Node)> = Vec::new();
    let mut by_name: HashMap<String, Node> = HashMap::new();
    let declared = program
        .variables
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (n.clone(), Node::Variable(i)))
        .chain(
            program
                .resources
                .iter()
                .enumerate()
                .map(|(i, r)| (r.name.clone(), Node::Resource(i))),
        );
    for (name, node) in declared {
        if by_name.insert(name.clone(), node).is_some() {
            return Err(invalid(format!("'{name}' is declared twice")));
        }
        nodes.push((name, node));
    }
    let mut deps: HashMap<String, Vec<String>> = HashMap::new();
    for (name, node) in &nodes {
        let (expr, explicit, what) = match *node {
            Node::Variable(i) => (&program.variables[i].1, Vec::new(), "variable"),
            Node::Resource(i) => {
                let r = &program.resources[i];
                for d in &r.depends_on {
                    if !matches!(by_name.get(d), Some(Node::Resource(_))) {
                        return Err(invalid(format!(
                            "resource '{name}' dependsOn unknown resource '{d}'"
                        )));
                    }
                }
                (&r.properties, r.depends_on.clone(), "resource")
            }
        };
        let mut list = explicit;
        for r in refs_in(expr).map_err(|e| invalid(format!("{what} '{name}': {e}")))? {
            if by_name.contains_key(&r.root) {
                list.push(r.root);
            } else if !scope.is_config(&r.root) && r.root != "pulumi" {
                return Err(invalid(format!(
                    "{what} '{name}' refers to unknown '${{{}}}'",
                    r.text
                )));
            }
        }
        deps.insert(name.clone(), list);
    }
    for (name, expr) in &program.outputs {
        for r in refs_in(expr).map_err(|e| invalid(format!("output '{name}': {e}")))? {
            if !by_name.contains_key(&r.root) && !scope.is_config(&r.root) && r.root != "pulumi" {
                return Err(invalid(format!(
                    "output '{name}' refers to unknown '${{{}}}'",
                    r.text
                )));
            }
        }
    }
    // Depth-first, in declaration order, so the order follows the file where it can.
    let mut done: BTreeSet<String> = BTreeSet::new();
    let mut order = Vec::new();
    for (name, _) in &nodes {
        let mut path = Vec::new();
        visit(name, &deps, &by_name, &mut path, &mut done, &mut order)?;
    }
    Ok(order)
}

fn visit(
    name: &str,
    deps: &HashMap<String, Vec<String>>,
    by_name: &HashMap<String, Node>,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
    order: &mut Vec<Node>,
) -> Result<(), RunnerError> {
    if done.contains(name) {
        return Ok(());
    }
    if let Some(start) = path.iter().position(|p| p == name) {
        let mut cycle = path[start..].to_vec();
        cycle.push(name.to_string());
        return Err(invalid(format!("dependency cycle: {}", cycle.join(" -> "))));
    }
    path.push(name.to_string());
    for d in deps.get(name).into_iter().flatten() {
        visit(d, deps, by_name, path, done, order)?;
    }
    path.pop();
    done.insert(name.to_string());
    if let Some(node) = by_name.get(name) {
        order.push(*node);
    }
    Ok(())
}

/// Names of the resources a resource refers to or depends on (deduplicated, in order).
fn resource_deps(decl: &ResourceDecl, scope: &Scope, program: &Program) -> Vec<String> {
    let mut out: Vec<String> = decl.depends_on.clone();
    for r in refs_in(&decl.properties).unwrap_or_default() {
        if !scope.is_config(&r.root) && program.resources.iter().any(|x| x.name == r.root) {
            out.push(r.root);
        }
    }
    let mut seen = BTreeSet::new();
    out.retain(|n| seen.insert(n.clone()));
    out
}

#[derive(Debug, Clone, PartialEq)]
enum Seg {
    Key(String),
    Index(usize),
}

#[derive(Debug, Clone, PartialEq)]
struct Ref {
    text: String,
    root: String,
    path: Vec<Seg>,
}

#[derive(Debug, Clone, PartialEq)]
enum Part {
    Lit(String),
    Ref(Ref),
}

/// Every reference in an expression tree.
fn refs_in(expr: &Value) -> Result<Vec<Ref>, ExprError> {
    let mut out = Vec::new();
    collect_refs(expr, &mut out)?;
    Ok(out)
}

fn collect_refs(expr: &Value, out: &mut Vec<Ref>) -> Result<(), ExprError> {
    match expr {
        Value::String(s) => {
            for p in parse_template(s)? {
                if let Part::Ref(r) = p {
                    out.push(r);
                }
            }
        }
        Value::Array(items) => {
            for i in items {
                collect_refs(i, out)?;
            }
        }
        Value::Object(m) => {
            for v in m.values() {
                collect_refs(v, out)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// Splits `a-${x.y[0]}-b` into literal and reference parts; `$${` is a literal `${`.
fn parse_template(s: &str) -> Result<Vec<Part>, ExprError> {
    let mut parts = Vec::new();
    let mut lit = String::new();
    let mut rest = s;
    while let Some(pos) = rest.find("${") {
        if rest[..pos].ends_with('$') {
            lit.push_str(&rest[..pos - 1]);
            lit.push_str("${");
            rest = &rest[pos + 2..];
            continue;
        }
        lit.push_str(&rest[..pos]);
        let after = &rest[pos + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| ExprError::Unterminated(s.to_string()))?;
        if !lit.is_empty() {
            parts.push(Part::Lit(std::mem::take(&mut lit)));
        }
        parts.push(Part::Ref(parse_ref(after[..end].trim())?));
        rest = &after[end + 1..];
    }
    lit.push_str(rest);
    if !lit.is_empty() {
        parts.push(Part::Lit(lit));
    }
    Ok(parts)
}

fn parse_ref(text: &str) -> Result<Ref, ExprError> {
    let bad = || ExprError::Unparsable(text.to_string());
    let root_end = text.find(['.', '[']).unwrap_or(text.len());
    let root = &text[..root_end];
    if root.is_empty() {
        return Err(bad());
    }
    let mut path = Vec::new();
    let mut rest = &text[root_end..];
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('.') {
            let end = r.find(['.', '[']).unwrap_or(r.len());
            if end == 0 {
                return Err(bad());
            }
            path.push(Seg::Key(r[..end].to_string()));
            rest = &r[end..];
        } else if let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']').ok_or_else(bad)?;
            let inner = r[..end].trim();
            let seg = if let Some(q) = inner.strip_prefix('"').and_then(|q| q.strip_suffix('"')) {
                Seg::Key(q.to_string())
            } else {
                Seg::Index(inner.parse().map_err(|_| bad())?)
            };
            path.push(seg);
            rest = &r[end + 1..];
        } else {
            return Err(bad());
        }
    }
    Ok(Ref {
        text: text.to_string(),
        root: root.to_string(),
        path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_domain::ports::SecretValue;
    use serde_json::json;
    use std::time::Duration;

    fn input() -> RunnerInput {
        let tenant = ferry_domain::TenantId::parse("acme").unwrap();
        let environment = ferry_domain::EnvironmentId::parse("dev").unwrap();
        RunnerInput {
            stack: ferry_domain::ports::runner::StackName::for_environment(&tenant, &environment),
            tenant,
            environment_id: "dev".into(),
            program_dir: ".".into(),
            config: BTreeMap::from([
                ("demo:region".into(), json!("eu-west-1")),
                ("size".into(), json!(3)),
            ]),
            secrets: BTreeMap::from([("dbPassword".into(), SecretValue::new("hunter2"))]),
            timeout: Duration::from_secs(5),
            refresh: false,
            exclude: Vec::new(),
            identity: None,
        }
    }

    fn eval(yaml: &str) -> Result<Evaluation, RunnerError> {
        let p = Program::parse(yaml)?;
        evaluate(&p, &input(), |r| format!("{}-id", r.name))
    }

    #[test]
    fn templates() {
        let parts = parse_template("a-${x.y[0][\"k\"]}-$${lit}").unwrap();
        assert_eq!(parts.len(), 3);
        assert_eq!(
            parts[1],
            Part::Ref(Ref {
                text: "x.y[0][\"k\"]".into(),
                root: "x".into(),
                path: vec![Seg::Key("y".into()), Seg::Index(0), Seg::Key("k".into())],
            })
        );
        assert_eq!(parts[2], Part::Lit("-${lit}".into()));
        assert!(parse_template("${unterminated").is_err());
        assert!(parse_template("${a..b}").is_err());
    }

    #[test]
    fn interpolates_in_dependency_order() {
        let e = eval(
            r#"
name: demo
runtime: yaml
variables:
  prefix: app-${region}
resources:
  web:
    type: test:Web
    properties:
      bucket: ${bucket.name}
      bucketId: ${bucket.id}
      count: ${size}
      urn: ${bucket.urn}
      stack: ${pulumi.stack}
  bucket:
    type: test:Bucket
    properties:
      name: ${prefix}-data
      tags: [a, "${demo:region}"]
outputs:
  webBucket: ${web.bucket}
  firstTag: ${bucket.tags[0]}
"#,
        )
        .unwrap();
        assert_eq!(e.resources[0].name, "bucket");
        assert_eq!(e.resources[1].name, "web");
        assert_eq!(
            e.resources[1].inputs.plain,
            json!({"bucket": "app-eu-west-1-data", "bucketId": "bucket-id", "count": 3,
                   "urn": "urn:pulumi:acme.dev::demo::test:Bucket::bucket", "stack": "acme.dev"})
        );
        assert_eq!(
            e.resources[1].dependencies,
            vec!["urn:pulumi:acme.dev::demo::test:Bucket::bucket"]
        );
        assert_eq!(e.outputs["webBucket"].plain, json!("app-eu-west-1-data"));
        assert_eq!(e.outputs["firstTag"].plain, json!("a"));
    }

    #[test]
    fn secrets_are_masked_wherever_they_flow() {
        let e = eval(
            r#"
name: demo
runtime: yaml
resources:
  db:
    type: test:Db
    properties:
      password: ${dbPassword}
      dsn: postgres://u:${dbPassword}@host/db
      user: u
  app:
    type: test:App
    properties:
      dbPassword: ${db.password}
outputs:
  dsn: ${db.dsn}
"#,
        )
        .unwrap();
        let db = &e.resources[0];
        assert_eq!(
            db.inputs.plain["dsn"],
            json!("postgres://u:hunter2@host/db")
        );
        assert_eq!(
            db.inputs.masked,
            json!({"password": "[secret]", "dsn": "[secret]", "user": "u"})
        );
        assert_eq!(
            e.resources[1].inputs.masked,
            json!({"dbPassword": "[secret]"})
        );
        assert_eq!(e.outputs["dsn"].masked, json!("[secret]"));
    }

    #[test]
    fn unknown_references_and_cycles_are_named() {
        let unknown = eval("name: d\nruntime: yaml\nresources:\n  a:\n    type: t:T\n    properties:\n      x: ${nope.id}\n");
        match unknown {
            Err(RunnerError::InvalidProgram(r)) => {
                assert!(r.contains("'a'") && r.contains("nope"), "{r}")
            }
            other => panic!("{other:?}"),
        }
        let cycle = eval(
            "name: d\nruntime: yaml\nresources:\n  a:\n    type: t:T\n    properties:\n      x: ${b.id}\n  b:\n    type: t:T\n    properties:\n      y: ${a.id}\n",
        );
        match cycle {
            Err(RunnerError::InvalidProgram(r)) => assert!(r.contains("cycle: a -> b -> a"), "{r}"),
            other => panic!("{other:?}"),
        }
        let missing_prop = eval("name: d\nruntime: yaml\nresources:\n  a:\n    type: t:T\n  b:\n    type: t:T\n    properties:\n      y: ${a.missing}\n");
        assert!(
            matches!(missing_prop, Err(RunnerError::InvalidProgram(r)) if r.contains("a.missing"))
        );
        let bad_dep = eval("name: d\nruntime: yaml\nresources:\n  a:\n    type: t:T\n    options:\n      dependsOn: [\"${ghost}\"]\n");
        assert!(matches!(bad_dep, Err(RunnerError::InvalidProgram(r)) if r.contains("ghost")));
        let missing_cfg = eval("name: d\nruntime: yaml\nconfig:\n  required: {type: string}\n");
        assert!(
            matches!(missing_cfg, Err(RunnerError::InvalidProgram(r)) if r.contains("required"))
        );
        let bad_output = eval("name: d\nruntime: yaml\noutputs:\n  o: ${ghost.id}\n");
        assert!(matches!(bad_output, Err(RunnerError::InvalidProgram(r)) if r.contains("ghost")));
    }
}
