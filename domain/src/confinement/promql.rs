//! An environment's SLO query reads only its own tenant's series.
//!
//! Every tenant's query goes to one shared Prometheus, so the query as written could read
//! any tenant's series (`sum(errors{tenant="acme"})` from globex). Before a query is
//! recorded and again before it is sent, it is parsed (the `promql-parser` crate) and every
//! series selector, instant or range, at any depth, is given the tenant's matcher
//! (`<label>="<tenant>"`, the label named by the operator). A selector that already says
//! something about that label other than exactly the tenant's matcher (another tenant, `!=`,
//! a regular expression) is refused rather than rewritten, and so are constructs that read
//! series without a selector of their own to confine (`info`) or that Prometheus would read
//! differently from the parser (`or` inside braces). The rewritten query is parsed again and
//! checked, so the text sent is the text checked.

use promql_parser::label::{MatchOp, Matcher, Matchers};
use promql_parser::parser::{self, Expr, VectorSelector};

/// How deep a query may nest: deeper ones are refused rather than walked.
const MAX_DEPTH: usize = 64;

/// Functions that read series other than those of their arguments.
const READS_OTHER_SERIES: &[&str] = &["info"];

/// Whether `name` is a label name Prometheus accepts unquoted.
pub fn is_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with("__")
}

/// Why a query cannot be confined to one tenant's series; the text is what the caller is
/// told (it names the selector or construct refused).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unconfinable {
    /// The query is not PromQL.
    #[error("not a PromQL expression: {0}")]
    NotPromql(Unparsable),
    /// The rewritten query did not parse again (a parser fault: nothing is sent).
    #[error("the confined query does not parse again ({0}): refused")]
    NotReparsed(Unparsable),
    /// A selector of the rewritten query lacks the tenant's matcher (a rewriting fault).
    #[error("the confined query's selector {selector} lacks {label}=\"{tenant}\": refused")]
    Unconfined {
        /// The selector as read back.
        selector: String,
        /// The tenant label.
        label: String,
        /// The tenant.
        tenant: String,
    },
    /// The query nests deeper than [`MAX_DEPTH`].
    #[error("nests deeper than {MAX_DEPTH} levels")]
    TooDeep,
    /// A function that reads series beyond its arguments' ([`READS_OTHER_SERIES`]).
    #[error("{0}() reads series beyond its arguments' and is refused")]
    ReadsOtherSeries(&'static str),
    /// An extension expression, whose selectors the walk cannot see.
    #[error("extension expressions are refused")]
    Extension,
    /// `or` inside a selector's braces, which Prometheus reads differently from the parser.
    #[error("'or' inside a selector's braces is refused")]
    OrInBraces,
    /// A selector that names the tenant label other than as the tenant's matcher.
    #[error(
        "the selector {selector} names the label {label} other than as {label}=\"{tenant}\": \
         a query reads only its own tenant's series"
    )]
    OtherSeries {
        /// The selector as written.
        selector: String,
        /// The tenant label.
        label: String,
        /// The tenant.
        tenant: String,
    },
}

/// Why the parser did not read a query.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unparsable {
    /// The parser's own message (it reports its errors as text).
    #[error("{0}")]
    Parser(String),
    /// The parser panicked on the text.
    #[error("the parser could not read it")]
    Panicked,
}

/// `query` with `<label>="<tenant>"` on every selector, or why it cannot be confined.
pub fn confine(query: &str, label: &str, tenant: &str) -> Result<String, Unconfinable> {
    let mut expr = parse(query).map_err(Unconfinable::NotPromql)?;
    walk(&mut expr, label, tenant, 0)?;
    let confined = expr.to_string();
    // The text sent must say what was checked: read it back and check every selector.
    let mut again = parse(&confined).map_err(Unconfinable::NotReparsed)?;
    verify(&mut again, label, tenant, 0)?;
    Ok(confined)
}

/// The parser's answer; a tenant's text that made it panic is refused like any other.
fn parse(query: &str) -> Result<Expr, Unparsable> {
    std::panic::catch_unwind(|| parser::parse(query))
        .map_err(|_| Unparsable::Panicked)?
        .map_err(Unparsable::Parser)
}

fn walk(expr: &mut Expr, label: &str, tenant: &str, depth: usize) -> Result<(), Unconfinable> {
    visit(expr, depth, &mut |selector| {
        confine_selector(selector, label, tenant)
    })
}

fn verify(expr: &mut Expr, label: &str, tenant: &str, depth: usize) -> Result<(), Unconfinable> {
    visit(expr, depth, &mut |selector| {
        let ours = selector.matchers.or_matchers.is_empty()
            && selector
                .matchers
                .matchers
                .iter()
                .filter(|m| m.name == label)
                .all(|m| m.op == MatchOp::Equal && m.value == tenant)
            && selector.matchers.matchers.iter().any(|m| m.name == label);
        if ours {
            Ok(())
        } else {
            Err(Unconfinable::Unconfined {
                selector: selector.to_string(),
                label: label.to_string(),
                tenant: tenant.to_string(),
            })
        }
    })
}

/// Calls `each` on every series selector of `expr`.
fn visit(
    expr: &mut Expr,
    depth: usize,
    each: &mut dyn FnMut(&mut VectorSelector) -> Result<(), Unconfinable>,
) -> Result<(), Unconfinable> {
    if depth > MAX_DEPTH {
        return Err(Unconfinable::TooDeep);
    }
    let depth = depth + 1;
    match expr {
        Expr::VectorSelector(selector) => each(selector),
        Expr::MatrixSelector(matrix) => each(&mut matrix.vs),
        Expr::Aggregate(aggregate) => {
            visit(&mut aggregate.expr, depth, each)?;
            match &mut aggregate.param {
                Some(param) => visit(param, depth, each),
                None => Ok(()),
            }
        }
        Expr::Unary(unary) => visit(&mut unary.expr, depth, each),
        Expr::Binary(binary) => {
            visit(&mut binary.lhs, depth, each)?;
            visit(&mut binary.rhs, depth, each)
        }
        Expr::Paren(paren) => visit(&mut paren.expr, depth, each),
        Expr::Subquery(subquery) => visit(&mut subquery.expr, depth, each),
        Expr::Call(call) => {
            if READS_OTHER_SERIES.contains(&call.func.name) {
                return Err(Unconfinable::ReadsOtherSeries(call.func.name));
            }
            for arg in &mut call.args.args {
                visit(arg, depth, each)?;
            }
            Ok(())
        }
        Expr::NumberLiteral(_) | Expr::StringLiteral(_) => Ok(()),
        // The parser makes none; an extension could hide selectors from this walk.
        Expr::Extension(_) => Err(Unconfinable::Extension),
    }
}

/// Adds the tenant's matcher to one selector, or refuses one that names the label otherwise.
fn confine_selector(
    selector: &mut VectorSelector,
    label: &str,
    tenant: &str,
) -> Result<(), Unconfinable> {
    if !selector.matchers.or_matchers.is_empty() {
        return Err(Unconfinable::OrInBraces);
    }
    let mut has_ours = false;
    for matcher in selector
        .matchers
        .matchers
        .iter()
        .filter(|m| m.name == label)
    {
        if matcher.op == MatchOp::Equal && matcher.value == tenant {
            has_ours = true;
        } else {
            return Err(Unconfinable::OtherSeries {
                selector: selector.to_string(),
                label: label.to_string(),
                tenant: tenant.to_string(),
            });
        }
    }
    if !has_ours {
        let mut matchers = std::mem::replace(&mut selector.matchers, Matchers::empty()).matchers;
        matchers.push(Matcher::new(MatchOp::Equal, label, tenant));
        selector.matchers = Matchers::new(matchers);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn globex(query: &str) -> Result<String, String> {
        confine(query, "tenant", "globex").map_err(|e| e.to_string())
    }

    #[test]
    fn every_selector_gets_the_tenant_s_matcher() {
        assert_eq!(
            globex("sum(rate(http_errors_total[5m])) / sum(rate(http_requests_total{job=\"web\"}[5m]))")
                .unwrap(),
            "sum(rate(http_errors_total{tenant=\"globex\"}[5m])) / \
             sum(rate(http_requests_total{job=\"web\",tenant=\"globex\"}[5m]))"
        );
        // Already the tenant's: kept as it is.
        assert_eq!(
            globex("up{tenant=\"globex\"}").unwrap(),
            "up{tenant=\"globex\"}"
        );
        // Subqueries, offsets, aggregations' parameters, function arguments, nested
        // selectors without a metric name: all confined.
        let confined = globex(
            "max_over_time(rate({__name__=~\"req.*\"}[1m])[10m:1m] offset 5m) \
             + on(job) group_left topk(scalar(count(up)), errors) or vector(1)",
        )
        .unwrap();
        assert_eq!(
            confined.matches("tenant=\"globex\"").count(),
            3,
            "{confined}"
        );
        assert!(!confined.contains("acme"));
        // A label of another name is the operator's choice.
        assert_eq!(
            confine("up", "team", "globex").unwrap(),
            "up{team=\"globex\"}"
        );
        // Numbers alone read no series.
        assert_eq!(globex("1 + 2").unwrap(), "1 + 2");
    }

    #[test]
    fn another_tenant_s_series_are_refused_however_named() {
        for query in [
            "sum(http_errors_total{tenant=\"acme\"})",
            "sum(rate(http_errors_total{tenant=\"acme\"}[5m]))",
            "up{tenant=~\".*\"}",
            "up{tenant=~\"globex|acme\"}",
            "up{tenant!=\"globex\"}",
            "up{tenant!~\"globex\"}",
            "up{tenant=\"\"}",
            "up{tenant=\"globex\",tenant=\"acme\"}",
            "up{\"tenant\"=\"acme\"}",
            "1 + max_over_time(rate(x{tenant=\"acme\"}[1m])[5m:])",
            "label_replace(up{tenant=\"acme\"}, \"tenant\", \"globex\", \"\", \"\")",
        ] {
            let refused = globex(query).expect_err(query);
            assert!(
                refused.contains("names the label tenant other than"),
                "{query}: {refused}"
            );
        }
        assert!(globex("up{job=\"a\" or job=\"b\"}").is_err());
        assert!(globex("not promql((").is_err());
        let deep = format!("{}up{}", "(".repeat(200), ")".repeat(200));
        assert!(globex(&deep).unwrap_err().contains("deeper"));
    }

    #[test]
    fn label_names_are_checked() {
        assert!(is_label_name("tenant"));
        assert!(is_label_name("k8s_namespace"));
        assert!(!is_label_name(""));
        assert!(!is_label_name("9lives"));
        assert!(!is_label_name("__name__"));
        assert!(!is_label_name("a-b"));
    }
}
