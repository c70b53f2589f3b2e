#!/usr/bin/env bash
# Hostile input against a real `ferry serve` (Issue 12, item 5), in one command from a clean
# clone:
#
#   bash bench/hostile.sh
#
# 1. builds Ferry (`cargo build --release --locked`) and installs schemathesis 4 from PyPI
#    into a virtual environment when `st` (4.x) is not installed already;
# 2. starts `ferry serve` on 127.0.0.1:$HOSTILE_PORT with a data dir of its own (embedded
#    SQLite; Postgres when DATABASE_URL is set), its own HS256 key, gRPC off, workers on;
# 3. seeds tenant A as docs/walkthroughs.md does: five environments, two
#    specifications, a run applied in development and one awaiting approval in production, two
#    releases, promotions completed through development, test and staging, one awaiting its
#    production approval, one rolled back (its release quarantined), an ignore rule;
# 4. runs schemathesis against /openapi.json once per identity: a token of each role
#    (Operator, PlatformAdmin, Observer, Reviewer, each with every scope a person may hold,
#    so the role is what decides) and a service token (no role, every scope), all of tenant A;
# 5. sends the hand-made hostile requests (bench/hostile_checks.py): oversized, 100,000-deep
#    and non-UTF-8 bodies, paths, queries and headers; tenant B's token on every path and
#    body that takes tenant A's ids; forged authorities (actors and approvals in bodies, a
#    requester approving her own run and promotion, roles a token lacks, another service's
#    events from a person, forged tokens); tenant isolation (crafted Git trees: a chain of
#    links leaving the checkout, a name twice; a tenant named `promotion` aiming
#    Idempotency-Keys at A's hand-off run ids; a specification re-declared under another
#    project; a lone PlatformAdmin lowering production; ANSI, bidirectional and
#    `javascript:` text, 250 KB reasons; probes of loopback and metadata addresses, SLO
#    queries naming another tenant); then checks that nothing of A's moved, that nothing
#    outside the checkout was written, and that the legitimate decisions still pass (A's
#    approved production promotion hands off under its own run id);
# 6. lets six clients leave the event stream after its first bytes while two others write,
#    then checks that every write was answered and the store is still writable; checks that
#    the server is still up, its log has no panic and no internal error;
# 7. prints a table of every check and exits non-zero when one failed.
#
# Schemathesis checks (all on every response of every generated case):
#   not_a_server_error          no 5xx, ever;
#   status_code_conformance     the status is one the operation documents;
#   content_type_conformance    the content type is the documented one (problem+json for errors);
#   response_schema_conformance the body matches the documented schema (views and Problem);
#   problem_json_errors         (ours, bench/hostile_checks.py) every status >= 400 is an
#                               RFC 9457 problem+json whose `status` is the response's.
# Left out, with the reason: negative_data_rejection and positive_data_acceptance (the document
# cannot state Ferry's cross-field rules, e.g. a specification must exist, so a schema-valid
# body is often rightly 422 and a schema-invalid one is not always detectably so), use_after_free
# / ensure_resource_availability (need links the document does not declare),
# ignored_auth (needs schemathesis to send requests without the token; our explicit checks do
# that with forged tokens instead), missing_required_header / unsupported_method (405 is checked
# explicitly). GET /factory/events/stream is an endless Server-Sent Events stream: schemathesis
# reads at most a few events of it (max-stream-events) within the request timeout, in a short
# run of its own per identity without response_schema_conformance (see below).
#
# Settings (environment): HOSTILE_PORT (38080), HOSTILE_MAX_EXAMPLES (cases per operation
# and phase, 12), HOSTILE_MAX_TIME (seconds per identity, 65), HOSTILE_WORKERS (2),
# HOSTILE_KEEP=1 keeps the data dir and logs, HOSTILE_FERRY_BIN (a built binary: no build),
# HOSTILE_IDENTITIES (a subset of the five), HOSTILE_ABANDON_SECONDS (40), CARGO_TARGET_DIR,
# DATABASE_URL. The whole run takes about 9 minutes on 2 cores once built.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PORT=${HOSTILE_PORT:-38080}
MAX_EXAMPLES=${HOSTILE_MAX_EXAMPLES:-12}
MAX_TIME=${HOSTILE_MAX_TIME:-65}
WORKERS=${HOSTILE_WORKERS:-2}
BASE="http://127.0.0.1:$PORT"
STARTED=$(date +%s)

say() { printf '\n== %s (%ss)\n' "$*" "$(($(date +%s) - STARTED))"; }

for tool in cargo git curl python3; do
  command -v "$tool" >/dev/null || { echo "hostile.sh needs $tool" >&2; exit 2; }
done

# --- 1. build and tools -----------------------------------------------------------------
# The build run.sh and .ci/run share, unless CARGO_TARGET_DIR names another.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/ferry-target}"
if [ -n "${HOSTILE_FERRY_BIN:-}" ]; then
  FERRY_BIN=$HOSTILE_FERRY_BIN # a binary built already (skips the build)
else
  say "building ferry (cargo build --release --locked)"
  cargo build --release --locked --bin ferry
  FERRY_BIN="$CARGO_TARGET_DIR/release/ferry"
fi
[ -x "$FERRY_BIN" ] || { echo "no binary at $FERRY_BIN" >&2; exit 2; }

say "schemathesis"
st_ok() { # an `st` of version 4 whose python imports schemathesis and requests
  "$1" --version 2>/dev/null | grep -Eq 'version 4\.' &&
    "$2" -c 'import schemathesis, requests' 2>/dev/null
}
ST=""; PY=""
if command -v st >/dev/null; then
  candidate_py=$(head -1 "$(command -v st)" | sed -n 's/^#!//p' | awk '{print $1}')
  # pyenv shims are shell scripts: ask the python on PATH then.
  case "$candidate_py" in *python*) ;; *) candidate_py=python3 ;; esac
  if st_ok st "$candidate_py"; then ST=st; PY=$candidate_py; fi
fi
if [ -z "$ST" ]; then
  VENV=${HOSTILE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry-hostile-venv}
  if ! st_ok "$VENV/bin/st" "$VENV/bin/python"; then
    echo "installing schemathesis 4 into $VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q 'schemathesis>=4,<5'
  fi
  ST="$VENV/bin/st"; PY="$VENV/bin/python"
fi
echo "$($ST --version) ($PY)"

# --- 2. ferry serve ---------------------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferry-hostile.XXXXXX")
DATA="$WORK/data"; mkdir -p "$DATA"
RESULTS="$WORK/results.jsonl"; : > "$RESULTS"
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  if [ "${HOSTILE_KEEP:-0}" = 1 ]; then echo "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

if curl -s -o /dev/null "$BASE/healthz"; then
  echo "something already answers on $BASE; set HOSTILE_PORT" >&2; exit 2
fi
export FERRY_DATA_DIR="$DATA"
export FERRY_HTTP_ADDR="127.0.0.1:$PORT"
export FERRY_GRPC_ADDR=off
export FERRY_JWT_HS256_KEY=${HOSTILE_JWT_KEY:-"hostile-bench-hs256-key-$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"}
export FERRY_VERIFICATION_WINDOW=3s
# The seed's health URL and smoke check are Ferry's own: loopback, which probes reach only
# where a prefix names it.
export FERRY_TENANT_PROBE_URL_PREFIXES="$BASE/"
export FERRY_RECONCILE_SCHEDULE=off
export FERRY_LOG=${HOSTILE_LOG:-warn}
RUN_ID=$(od -An -tx1 -N3 /dev/urandom | tr -d ' \n')
TENANT_A="hostile-a-$RUN_ID"
TENANT_B="hostile-b-$RUN_ID"

say "starting ferry serve on $BASE (data $DATA, ${DATABASE_URL:+Postgres}${DATABASE_URL:-SQLite})"
"$FERRY_BIN" serve >"$WORK/ferry.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 300); do
  curl -sf -o /dev/null "$BASE/readyz" && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/ferry.log" >&2; echo "ferry serve exited" >&2; exit 2; }
  sleep 0.2
done
curl -sf -o /dev/null "$BASE/readyz" || { tail -50 "$WORK/ferry.log" >&2; exit 2; }

checks() { PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$ROOT/bench" "$PY" "$ROOT/bench/hostile_checks.py" "$@"; }

# --- 3. seed tenant A ---------------------------------------------------------------------
say "seeding tenant $TENANT_A"
checks seed --base "$BASE" --ferry "$FERRY_BIN" --data-dir "$DATA" \
  --tenant-a "$TENANT_A" --tenant-b "$TENANT_B" --out "$WORK/ids.json"

# --- 4. explicit hostile requests ------------------------------------------------------
say "explicit checks: hostile input, tenancy, forged authority"
checks explicit --base "$BASE" --ferry "$FERRY_BIN" --ids "$WORK/ids.json" --data-dir "$DATA" --results "$RESULTS" ||
  echo "explicit checks stopped with an error (status $?)" | tee -a "$WORK/explicit-error"
if [ -e "$WORK/explicit-error" ]; then
  echo '{"section": "explicit", "check": "ran to the end", "ok": false, "detail": "see the output above"}' >>"$RESULTS"
fi

# --- 5. schemathesis, once per identity --------------------------------------------------
cat >"$WORK/schemathesis.toml" <<TOML
request-timeout = 10
max-stream-events = 3
[generation]
max-examples = $MAX_EXAMPLES
TOML
mint() { "$FERRY_BIN" token --tenant "$TENANT_A" "$@"; }
ALL="factory.provisioning.read factory.provisioning.apply factory.delivery.read factory.delivery.promote factory.delivery.operate factory.events.publish"
CHECKS=not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,problem_json_errors
# The event stream's 200 is documented as text/event-stream of type string (the whole
# stream, as OpenAPI 3.1 has it); schemathesis validates each event against that schema
# instead (OpenAPI 3.2's itemSchema reading), so the stream gets a short run of its own
# without response_schema_conformance (its errors are still checked by problem_json_errors).
STREAM=/factory/events/stream
st_run() { # label, seconds, checks, filter...
  local label=$1 seconds=$2 checks=$3 code
  shift 3
  say "schemathesis as $label"
  set +e
  (
    cd "$WORK" &&
      PYTHONDONTWRITEBYTECODE=1 SCHEMATHESIS_HOOKS=hostile_checks PYTHONPATH="$ROOT/bench" timeout $((seconds + 120)) \
        "$ST" --config-file "$WORK/schemathesis.toml" --no-color run "$BASE/openapi.json" \
        --header "Authorization: Bearer $TOKEN" --checks "$checks" "$@" \
        --phases examples,coverage,fuzzing \
        --max-examples "$MAX_EXAMPLES" --max-time "$seconds" --workers "$WORKERS" \
        --continue-on-failure --seed 12005 \
        --suppress-health-check all \
        --report junit --report-junit-path "$WORK/junit-$label.xml"
  ) >"$WORK/st-$label.log" 2>&1
  code=$?
  set -e
  tail -12 "$WORK/st-$label.log"
  checks schemathesis --identity "$label" --junit "$WORK/junit-$label.xml" \
    --log "$WORK/st-$label.log" --exit-code "$code" --results "$RESULTS"
}
for identity in ${HOSTILE_IDENTITIES:-Operator PlatformAdmin Observer Reviewer service}; do
  if [ "$identity" = service ]; then
    TOKEN=$(mint --sub "svc-hostile" --scopes "$ALL")
  else
    TOKEN=$(mint --sub "st-$identity" --roles "$identity" --scopes "${ALL% factory.events.publish}")
  fi
  st_run "$identity" "$MAX_TIME" "$CHECKS" --exclude-path "$STREAM"
done
# The event stream last: on the embedded SQLite store a client leaving it early can leave a
# pooled connection inside `BEGIN IMMEDIATE` (found by this script), which wedges every later
# write; that must not spoil the other operations' results.
for identity in ${HOSTILE_IDENTITIES:-Operator PlatformAdmin Observer Reviewer service}; do
  if [ "$identity" = service ]; then
    TOKEN=$(mint --sub "svc-hostile" --scopes "$ALL")
  else
    TOKEN=$(mint --sub "st-$identity" --roles "$identity" --scopes "${ALL% factory.events.publish}")
  fi
  st_run "$identity-stream" 8 "${CHECKS/,response_schema_conformance/}" --include-path "$STREAM"
done

say "clients leaving the event stream early while others write"
checks abandon --base "$BASE" --ferry "$FERRY_BIN" --ids "$WORK/ids.json" \
  --seconds "${HOSTILE_ABANDON_SECONDS:-40}" --results "$RESULTS"

# --- 6. the server survived, and its log holds no panic ----------------------------------
say "afterwards"
if curl -sf -o /dev/null "$BASE/readyz" && kill -0 "$SERVER_PID" 2>/dev/null; then
  echo '{"section": "server", "check": "ferry serve still up and ready", "ok": true, "detail": ""}' >>"$RESULTS"
else
  echo '{"section": "server", "check": "ferry serve still up and ready", "ok": false, "detail": "it is not"}' >>"$RESULTS"
fi
panics=$(grep -ci 'panicked' "$WORK/ferry.log" || true)
errors=$(grep -c '"level":"ERROR"' "$WORK/ferry.log" || true)
printf '{"section": "server", "check": "no panic in the log", "ok": %s, "detail": "%s panics"}\n' \
  "$([ "$panics" = 0 ] && echo true || echo false)" "$panics" >>"$RESULTS"
printf '{"section": "server", "check": "no internal error logged", "ok": %s, "detail": "%s ERROR lines (see ferry.log)"}\n' \
  "$([ "$errors" = 0 ] && echo true || echo false)" "$errors" >>"$RESULTS"
[ "$errors" = 0 ] || grep -m5 '"level":"ERROR"' "$WORK/ferry.log" | cut -c1-400

say "summary"
set +e
checks summary --results "$RESULTS"
status=$?
set -e
[ "$status" = 0 ] || HOSTILE_KEEP=1
echo "took $(($(date +%s) - STARTED)) s"
exit "$status"
