//! JSON Schemas of every message payload and the AsyncAPI 3.0 document of every subject,
//! generated from the Rust types (schemars) and written to the repository's `schemas/`.
//!
//! * `events/cloudevent.schema.json`: the envelope.
//! * `events/<event>.schema.json`: the integration payloads.
//! * `events/ferry/<aggregate>.<event>.schema.json`: the domain events on `ferry.events.*`
//!   (the inner object of each variant).
//! * `events/inbound/<event>.schema.json`: the events Ferry consumes.
//! * `asyncapi.json`: channels, operations (send = Ferry publishes, receive = Ferry consumes)
//!   and messages, referring to the files above.

use crate::cloudevent::CloudEvent;
use crate::inbound::InboundKinds;
use crate::publish::Publishers;
use crate::subjects::{self, kebab};
use serde_json::{json, Map, Value};
use std::path::Path;

/// Direction of a subject, seen from Ferry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Ferry publishes.
    Out,
    /// Ferry consumes.
    In,
    /// Ferry publishes and (for promotions) consumes.
    Both,
}

/// One documented subject.
#[derive(Debug, Clone)]
pub struct SubjectDoc {
    /// The NATS subject.
    pub subject: String,
    /// The event name.
    pub event: String,
    /// The payload schema file, relative to `schemas/`.
    pub schema: String,
    /// Who publishes it.
    pub direction: Direction,
    /// What it means.
    pub summary: String,
}

fn pretty(v: &Value) -> String {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_else(|_| "{}".to_string());
    s.push('\n');
    s
}

/// The inner object schema of each variant of an externally tagged enum, with the enum's
/// `$defs` so that references still resolve.
fn variant_schemas(root: Value) -> Vec<(String, Value)> {
    let defs = root.get("$defs").cloned();
    let dialect = root.get("$schema").cloned();
    let entries: Vec<Value> = match root.get("oneOf").or_else(|| root.get("anyOf")) {
        Some(Value::Array(list)) => list.clone(),
        _ => vec![root.clone()],
    };
    let mut out = Vec::new();
    for entry in entries {
        let Some(props) = entry.get("properties").and_then(Value::as_object) else {
            continue;
        };
        if props.len() != 1 {
            continue;
        }
        let Some((name, inner)) = props.iter().next() else {
            continue;
        };
        let mut schema = match inner {
            Value::Object(m) => m.clone(),
            other => {
                let mut m = Map::new();
                m.insert("allOf".into(), json!([other]));
                m
            }
        };
        let mut head = Map::new();
        if let Some(d) = &dialect {
            head.insert("$schema".into(), d.clone());
        }
        head.insert("title".into(), json!(name));
        if let Some(desc) = entry.get("description") {
            head.insert("description".into(), desc.clone());
        }
        head.append(&mut schema);
        if let Some(Value::Object(all)) = &defs {
            let used = used_defs(&Value::Object(head.clone()), all);
            if !used.is_empty() {
                head.insert("$defs".into(), Value::Object(used));
            }
        }
        out.push((name.clone(), Value::Object(head)));
    }
    out
}

/// The definitions `schema` refers to, directly or through other definitions.
fn used_defs(schema: &Value, all: &Map<String, Value>) -> Map<String, Value> {
    fn refs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    match (k.as_str(), x.as_str()) {
                        ("$ref", Some(r)) => {
                            if let Some(name) = r.strip_prefix("#/$defs/") {
                                out.push(name.to_string());
                            }
                        }
                        _ => refs(x, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
            _ => {}
        }
    }
    let mut used = Map::new();
    let mut todo = Vec::new();
    refs(schema, &mut todo);
    while let Some(name) = todo.pop() {
        if used.contains_key(&name) {
            continue;
        }
        if let Some(def) = all.get(&name) {
            refs(def, &mut todo);
            used.insert(name, def.clone());
        }
    }
    used
}

/// What a publisher documents: the subjects it publishes on, and the schema files (path
/// relative to `schemas/`, schema) they and its domain events refer to.
#[derive(Debug, Clone, Default)]
pub struct Documents {
    /// The subjects.
    pub subjects: Vec<SubjectDoc>,
    /// The schema files.
    pub files: Vec<(String, Value)>,
}

impl Documents {
    /// Adds `other`'s subjects and files.
    pub fn extend(&mut self, other: Documents) {
        self.subjects.extend(other.subjects);
        self.files.extend(other.files);
    }
}

/// The schema of `T` as a JSON value.
pub(crate) fn schema_value<T: schemars::JsonSchema>() -> Value {
    schemars::schema_for!(T).to_value()
}

/// The domain events of aggregate `aggregate` (event enum `E`): a schema file per variant,
/// and a `ferry.events.*` subject per variant except the integration events in
/// `integration` (which the publisher documents on their own subjects).
pub fn domain_event_docs<E: schemars::JsonSchema>(
    aggregate: &str,
    integration: &[&str],
) -> Documents {
    let mut docs = Documents::default();
    for (event, schema) in variant_schemas(schema_value::<E>()) {
        let path = domain_schema_path(aggregate, &event);
        if !integration.contains(&event.as_str()) {
            docs.subjects.push(SubjectDoc {
                subject: subjects::domain_subject(aggregate, &event),
                event: event.clone(),
                schema: path.clone(),
                direction: Direction::Out,
                summary: format!("The {aggregate} domain event {event} (audit trail)."),
            });
        }
        docs.files.push((path, schema));
    }
    docs
}

/// The schema file of a domain event on `ferry.events.*`.
pub fn domain_schema_path(aggregate: &str, event: &str) -> String {
    format!(
        "events/ferry/{}.{}.schema.json",
        kebab(aggregate),
        kebab(event)
    )
}

/// The subjects Ferry consumes (the documented ones of `inbound`), with their payload
/// schemas.
fn inbound_docs(inbound: &InboundKinds) -> Documents {
    let (subjects, files) = inbound
        .iter()
        .filter(|kind| kind.documented())
        .map(|kind| {
            let path = format!("events/inbound/{}.schema.json", kebab(kind.name()));
            (
                SubjectDoc {
                    subject: kind.subject().to_string(),
                    event: kind.name().to_string(),
                    schema: path.clone(),
                    direction: Direction::In,
                    summary: kind.summary().to_string(),
                },
                (path, kind.schema()),
            )
        })
        .unzip();
    Documents { subjects, files }
}

/// Everything documented: the inbound subjects and files, then the publishers'.
fn documents(publishers: &Publishers, inbound: &InboundKinds) -> Documents {
    let mut docs = inbound_docs(inbound);
    docs.extend(publishers.documents());
    docs
}

/// Every subject Ferry publishes (through `publishers`) or consumes, with its payload schema.
pub fn subject_docs(publishers: &Publishers, inbound: &InboundKinds) -> Vec<SubjectDoc> {
    documents(publishers, inbound).subjects
}

/// Every generated file: (path relative to `schemas/`, content ending in a newline).
pub fn published_schemas(publishers: &Publishers, inbound: &InboundKinds) -> Vec<(String, String)> {
    let docs = documents(publishers, inbound);
    let mut files: Vec<(String, String)> = vec![(
        "events/cloudevent.schema.json".into(),
        pretty(&schema_value::<CloudEvent>()),
    )];
    files.extend(
        docs.files
            .iter()
            .map(|(path, schema)| (path.clone(), pretty(schema))),
    );
    files.push(("asyncapi.json".into(), pretty(&asyncapi_of(&docs.subjects))));
    files
}

/// Writes [`published_schemas`] under `dir` (the repository's `schemas/`).
pub fn write_schemas(
    dir: &Path,
    publishers: &Publishers,
    inbound: &InboundKinds,
) -> std::io::Result<()> {
    for (path, content) in published_schemas(publishers, inbound) {
        let target = dir.join(path);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(target, content)?;
    }
    Ok(())
}

fn channel_id(subject: &str) -> String {
    subject
        .replace(['.', '{', '}'], "-")
        .replace("--", "-")
        .trim_matches('-')
        .to_string()
}

fn message(name: &str, subject_const: Option<&str>, schema: &str, summary: &str) -> Value {
    let mut envelope = json!({"data": {"$ref": format!("./{schema}")}});
    if let Some(s) = subject_const {
        envelope["type"] = json!({"const": s});
    }
    json!({
        "name": name,
        "title": name,
        "summary": summary,
        "contentType": "application/json",
        "headers": {
            "type": "object",
            "properties": {
                "Nats-Msg-Id": {"type": "string", "description": "The CloudEvent id (JetStream de-duplication)."},
                "Ferry-Position": {"type": "string", "description": "Global stream position `txid.position` (Ferry's messages only)."}
            }
        },
        "payload": {
            "allOf": [
                {"$ref": "./events/cloudevent.schema.json"},
                {"type": "object", "properties": envelope}
            ]
        }
    })
}

/// The AsyncAPI 3.0 document of every subject `publishers` publish on and of the events
/// `inbound` Ferry consumes.
pub fn asyncapi(publishers: &Publishers, inbound: &InboundKinds) -> Value {
    asyncapi_of(&subject_docs(publishers, inbound))
}

fn asyncapi_of(subject_docs: &[SubjectDoc]) -> Value {
    let mut channels = Map::new();
    let mut operations = Map::new();
    let mut messages = Map::new();
    for d in subject_docs {
        let id = channel_id(&d.subject);
        // A message is named after its event; an event name already taken by another
        // subject (the inbound EnvironmentStateChanged and the Environment domain event of
        // that name) is named after its channel instead, so each channel keeps its schema.
        let taken = messages.get(&d.event).is_some_and(|m: &Value| {
            m["payload"]["allOf"][1]["properties"]["type"]["const"] != json!(d.subject)
        });
        let name = if taken { id.clone() } else { d.event.clone() };
        messages.insert(
            name.clone(),
            message(&name, Some(&d.subject), &d.schema, &d.summary),
        );
        channels.insert(
            id.clone(),
            json!({
                "address": d.subject,
                "description": d.summary,
                "messages": {name.clone(): {"$ref": format!("#/components/messages/{name}")}}
            }),
        );
        let mut ops = Vec::new();
        if matches!(d.direction, Direction::Out | Direction::Both) {
            ops.push(("send", format!("publish{}", name)));
        }
        if matches!(d.direction, Direction::In | Direction::Both) {
            ops.push(("receive", format!("consume{}", name)));
        }
        for (action, op) in ops {
            operations.insert(
                op,
                json!({
                    "action": action,
                    "channel": {"$ref": format!("#/channels/{id}")},
                    "messages": [{"$ref": format!("#/channels/{id}/messages/{name}")}]
                }),
            );
        }
    }
    // Events of aggregates added later travel on the same pattern without a code change.
    channels.insert(
        "ferry-events-fallback".into(),
        json!({
            "address": "ferry.events.{aggregate}.{event}",
            "description": "Any other domain event: data is the event's inner object.",
            "parameters": {
                "aggregate": {"description": "The aggregate type in kebab case (e.g. provisioning-run)."},
                "event": {"description": "The event type in kebab case (e.g. provisioning-cancelled)."}
            },
            "messages": {"FerryDomainEvent": {"$ref": "#/components/messages/FerryDomainEvent"}}
        }),
    );
    messages.insert(
        "FerryDomainEvent".into(),
        json!({
            "name": "FerryDomainEvent",
            "title": "Ferry domain event",
            "contentType": "application/json",
            "payload": {"$ref": "./events/cloudevent.schema.json"}
        }),
    );
    operations.insert(
        "publishFerryDomainEvent".into(),
        json!({
            "action": "send",
            "channel": {"$ref": "#/channels/ferry-events-fallback"},
            "messages": [{"$ref": "#/channels/ferry-events-fallback/messages/FerryDomainEvent"}]
        }),
    );
    json!({
        "asyncapi": "3.0.0",
        "info": {
            "title": "Ferry events",
            "version": "1.0.0",
            "description": "CloudEvents 1.0 (JSON structured mode) on NATS JetStream. Ferry publishes to the stream FERRY_EVENTS (provisioning.>, ferry.events.>), which only Ferry may publish into, with Nats-Msg-Id = CloudEvent id; it consumes with durable pull consumers and explicit ack. The same inbound events are accepted over HTTP at POST /factory/events."
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages}
    })
}
