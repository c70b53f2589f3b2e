//! The checks verification runs after an apply, each giving one [`Measurement`] (value,
//! threshold, time):
//!
//! * **health**: a GET of the environment's health URL, every round; it must answer 2xx;
//! * **smoke**: the release's smoke suite, each check a GET that must answer its expected
//!   status, in the first round (a suite is run once per deployment);
//! * **SLO**: the environment's objective, a Prometheus instant query
//!   (`<FERRY_PROMETHEUS_URL>/api/v1/query`), every round; its value must stay within the
//!   threshold.
//!
//! A check that answers wrongly fails the release (`passed: false`). A check that cannot
//! run (no Prometheus configured, Prometheus down or answering no single value, a URL or
//! query outside what the tenant may reach) says nothing about the release
//! (`passed: None`): verification is then held for an Operator. An endpoint of the release
//! that does not answer at all is the release's fault.
//!
//! Health URLs and smoke checks go through the probe client ([`super::probe`]), which
//! connects only to public addresses; the SLO query is the tenant's confined one.

use super::probe::NoProbeClient;
use chrono::{DateTime, Utc};
use ferry_domain::environment::SloObjective;
use ferry_domain::promotion::{CheckKind, Measurement};
use ferry_domain::release::SmokeCheck;
use serde_json::Value;

/// What one promotion's verification checks.
#[derive(Debug, Clone, Default)]
pub struct Checks {
    /// The environment's health URL.
    pub health_url: Option<String>,
    /// The release's smoke suite.
    pub smoke: Vec<SmokeCheck>,
    /// The environment's objective, its query confined to the tenant's series.
    pub slo: Option<SloObjective>,
    /// Checks not run because their URL or query is outside what the tenant may reach: kind,
    /// name and why (the operator narrowed the rules after they were recorded).
    pub refused: Vec<(CheckKind, String, String)>,
}

impl Checks {
    /// Nothing to check: verification cannot decide on its own.
    pub fn is_empty(&self) -> bool {
        self.health_url.is_none()
            && self.smoke.is_empty()
            && self.slo.is_none()
            && self.refused.is_empty()
    }

    /// One round: health and the SLO, and the smoke suite when `first_round`. `probes` is
    /// the probe client (`Err`: why there is none); `http` reaches Prometheus.
    pub async fn measure(
        &self,
        probes: Result<&reqwest::Client, &NoProbeClient>,
        http: &reqwest::Client,
        prometheus: Option<&str>,
        first_round: bool,
        now: DateTime<Utc>,
    ) -> Vec<Measurement> {
        let mut measurements: Vec<Measurement> = self
            .refused
            .iter()
            .map(|(kind, name, reason)| Measurement {
                kind: *kind,
                name: name.clone(),
                value: format!("not probed: {reason}"),
                threshold: None,
                passed: None,
                measured_at: now,
            })
            .collect();
        if let Some(url) = &self.health_url {
            measurements.push(health(probes, url, now).await);
        }
        if first_round {
            for check in &self.smoke {
                measurements.push(smoke(probes, check, now).await);
            }
        }
        if let Some(objective) = &self.slo {
            measurements.push(slo(http, prometheus, objective, now).await);
        }
        measurements
    }
}

/// A probe's answer: its status, or why there is none and whether that is the release's
/// fault (`Some(false)`: it did not answer) or says nothing (`None`: not probed).
async fn probe(
    probes: Result<&reqwest::Client, &NoProbeClient>,
    url: &str,
) -> Result<u16, (String, Option<bool>)> {
    let client = probes.map_err(|why| (format!("not probed: {why}"), None))?;
    match client.get(url).send().await {
        Ok(r) => Ok(r.status().as_u16()),
        Err(e) => Err(match super::probe::refused(&e) {
            Some(reason) => (format!("not probed: {reason}"), None),
            None => (format!("no answer from {url}: {e}"), Some(false)),
        }),
    }
}

async fn health(
    probes: Result<&reqwest::Client, &NoProbeClient>,
    url: &str,
    now: DateTime<Utc>,
) -> Measurement {
    let (value, passed) = match probe(probes, url).await {
        Ok(status) => (status.to_string(), Some((200..300).contains(&status))),
        Err(why) => why,
    };
    Measurement {
        kind: CheckKind::Health,
        name: url.to_string(),
        value,
        threshold: Some("2xx".to_string()),
        passed,
        measured_at: now,
    }
}

async fn smoke(
    probes: Result<&reqwest::Client, &NoProbeClient>,
    check: &SmokeCheck,
    now: DateTime<Utc>,
) -> Measurement {
    let (value, passed) = match probe(probes, check.url.as_str()).await {
        Ok(status) => (status.to_string(), Some(status == check.expected_status)),
        Err(why) => why,
    };
    Measurement {
        kind: CheckKind::Smoke,
        name: check.name.clone(),
        value,
        threshold: Some(check.expected_status.to_string()),
        passed,
        measured_at: now,
    }
}

async fn slo(
    http: &reqwest::Client,
    prometheus: Option<&str>,
    objective: &SloObjective,
    now: DateTime<Utc>,
) -> Measurement {
    let value = match prometheus {
        None => Err(Unmeasured::NoPrometheus),
        Some(base) => query(http, base, &objective.query).await,
    };
    let (value, passed) = match value {
        Ok(v) => (v.to_string(), Some(objective.met_by(v))),
        Err(reason) => (format!("not measured: {reason}"), None),
    };
    Measurement {
        kind: CheckKind::Slo,
        name: objective.query.clone(),
        value,
        threshold: Some(objective.condition()),
        passed,
        measured_at: now,
    }
}

/// Why an objective's query gave no value (recorded as "not measured: …").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unmeasured {
    /// No Prometheus is configured.
    #[error("no Prometheus is configured (FERRY_PROMETHEUS_URL)")]
    NoPrometheus,
    /// Prometheus could not be reached.
    #[error("Prometheus did not answer: {0}")]
    NoAnswer(String),
    /// Its answer was not JSON.
    #[error("Prometheus answered {status} without JSON: {reason}")]
    NotJson {
        /// The HTTP status.
        status: u16,
        /// What the parser said.
        reason: String,
    },
    /// It refused the query.
    #[error("Prometheus refused the query: {0}")]
    Refused(String),
    /// The query matched nothing.
    #[error("the query returned no series (no data yet?)")]
    NoSeries,
    /// The query matched more than one series.
    #[error("the query returned {0} series; an objective needs exactly one")]
    ManySeries(usize),
    /// The answer has no result list.
    #[error("the answer has no result list")]
    NoResultList,
    /// The answer is of another type (a matrix, a string).
    #[error("the query returned {0}; an objective needs a scalar or one series")]
    WrongType(String),
    /// The sample carries no value.
    #[error("the sample has no value")]
    NoValue,
    /// The sample's value is not a number.
    #[error("the sample {0:?} is not a number")]
    NotANumber(String),
    /// The value is NaN or infinite.
    #[error("the value is {0}")]
    NotFinite(String),
}

/// The value of `expression` now, from Prometheus at `base`.
async fn query(http: &reqwest::Client, base: &str, expression: &str) -> Result<f64, Unmeasured> {
    let url = format!("{}/api/v1/query", base.trim_end_matches('/'));
    let response = http
        .get(&url)
        .query(&[("query", expression)])
        .send()
        .await
        .map_err(|e| Unmeasured::NoAnswer(e.to_string()))?;
    let status = response.status();
    let body: Value = response.json().await.map_err(|e| Unmeasured::NotJson {
        status: status.as_u16(),
        reason: e.to_string(),
    })?;
    prometheus_value(&body)
}

/// The one value of an instant query's answer: a scalar, or a vector of exactly one series.
pub fn prometheus_value(body: &Value) -> Result<f64, Unmeasured> {
    if body["status"] != "success" {
        let reason = body["error"].as_str().unwrap_or("no reason given");
        return Err(Unmeasured::Refused(reason.to_string()));
    }
    let data = &body["data"];
    let sample = match data["resultType"].as_str() {
        Some("scalar") => &data["result"],
        Some("vector") => match data["result"].as_array().map(Vec::as_slice) {
            Some([one]) => &one["value"],
            Some([]) => return Err(Unmeasured::NoSeries),
            Some(many) => return Err(Unmeasured::ManySeries(many.len())),
            None => return Err(Unmeasured::NoResultList),
        },
        other => {
            return Err(Unmeasured::WrongType(
                other.unwrap_or("nothing").to_string(),
            ))
        }
    };
    let text = sample[1].as_str().ok_or(Unmeasured::NoValue)?;
    let value: f64 = text
        .parse()
        .map_err(|_| Unmeasured::NotANumber(text.to_string()))?;
    if value.is_finite() {
        Ok(value)
    } else {
        Err(Unmeasured::NotFinite(text.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn one_value_from_a_scalar_or_a_single_series() {
        let scalar = json!({"status": "success", "data": {"resultType": "scalar",
            "result": [1_700_000_000.0, "0.004"]}});
        assert_eq!(prometheus_value(&scalar), Ok(0.004));
        let vector = json!({"status": "success", "data": {"resultType": "vector",
            "result": [{"metric": {"job": "payments"}, "value": [1_700_000_000.0, "0.25"]}]}});
        assert_eq!(prometheus_value(&vector), Ok(0.25));
    }

    #[test]
    fn no_single_value_is_an_error_not_a_pass() {
        let none = json!({"status": "success", "data": {"resultType": "vector", "result": []}});
        assert!(prometheus_value(&none)
            .unwrap_err()
            .to_string()
            .contains("no series"));
        let two = json!({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"pod": "a"}, "value": [0, "1"]},
            {"metric": {"pod": "b"}, "value": [0, "2"]}]}});
        assert!(prometheus_value(&two)
            .unwrap_err()
            .to_string()
            .contains("2 series"));
        let refused = json!({"status": "error", "errorType": "bad_data",
            "error": "parse error at char 5"});
        assert!(prometheus_value(&refused)
            .unwrap_err()
            .to_string()
            .contains("parse error at char 5"));
        let nan = json!({"status": "success", "data": {"resultType": "scalar",
            "result": [0, "NaN"]}});
        assert!(prometheus_value(&nan).is_err());
        let matrix = json!({"status": "success", "data": {"resultType": "matrix",
            "result": []}});
        assert!(prometheus_value(&matrix)
            .unwrap_err()
            .to_string()
            .contains("matrix"));
    }
}
