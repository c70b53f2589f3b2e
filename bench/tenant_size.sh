#!/usr/bin/env bash
# Two tenants at the size limits while a third one is measured (issue 37, section 7), in one
# command:
#
#   bash bench/tenant_size.sh
#
# 1. builds Ferry (`cargo build --release --locked`), unless SIZE_FERRY_BIN names a binary;
# 2. starts `ferry serve` on 127.0.0.1:$SIZE_PORT with a data dir of its own (embedded SQLite;
#    Postgres when DATABASE_URL is set), the simulated runner, workers on, the default limits
#    (FERRY_MAX_PROGRAM_BYTES, FERRY_MAX_PLAN_RESOURCES, FERRY_MAX_RECEIPT_BYTES) unless the
#    environment sets them;
# 3. runs bench/tenant_size.py: the calm tenant's GET latency alone, then while two hog
#    tenants plan programs at the limits over and over and twenty clients read a hog's event
#    stream from `after=0`; Ferry's memory sampled from /proc; then one plan over each limit,
#    which must fail naming its setting;
# 4. prints the figures and keeps them in $SIZE_OUT (default: a file in the work folder).
#
# Settings (environment): SIZE_PORT (38090), SIZE_SECONDS (180, the loaded phase),
# SIZE_QUIET_SECONDS (30), SIZE_ENVIRONMENTS (3 per hog), SIZE_STREAMS (20), SIZE_KEEP=1 keeps
# the data dir and log, SIZE_FERRY_BIN, SIZE_OUT, CARGO_TARGET_DIR, DATABASE_URL.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PORT=${SIZE_PORT:-38090}
BASE="http://127.0.0.1:$PORT"

for tool in git curl python3; do
  command -v "$tool" >/dev/null || { echo "tenant_size.sh needs $tool" >&2; exit 2; }
done
python3 -c 'import requests' 2>/dev/null || { echo "tenant_size.sh needs python3's requests" >&2; exit 2; }

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/ferry-target}"
if [ -n "${SIZE_FERRY_BIN:-}" ]; then
  FERRY_BIN=$SIZE_FERRY_BIN
else
  cargo build --release --locked --bin ferry
  FERRY_BIN="$CARGO_TARGET_DIR/release/ferry"
fi
[ -x "$FERRY_BIN" ] || { echo "no binary at $FERRY_BIN" >&2; exit 2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferry-size.XXXXXX")
DATA="$WORK/data"; mkdir -p "$DATA"
OUT=${SIZE_OUT:-$WORK/tenant-size.json}
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  if [ "${SIZE_KEEP:-0}" = 1 ]; then echo "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

if curl -s -o /dev/null "$BASE/healthz"; then
  echo "something already answers on $BASE; set SIZE_PORT" >&2; exit 2
fi
export FERRY_DATA_DIR="$DATA"
export FERRY_HTTP_ADDR="127.0.0.1:$PORT"
export FERRY_GRPC_ADDR=off
export FERRY_JWT_HS256_KEY="size-bench-hs256-key-$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
export FERRY_RECONCILE_SCHEDULE=off
export FERRY_LOG=${SIZE_LOG:-warn}
RUN_ID=$(od -An -tx1 -N3 /dev/urandom | tr -d ' \n')

echo "starting ferry serve on $BASE (data $DATA, ${DATABASE_URL:+Postgres}${DATABASE_URL:-SQLite})"
"$FERRY_BIN" serve >"$WORK/ferry.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 300); do
  curl -sf -o /dev/null "$BASE/readyz" && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/ferry.log" >&2; echo "ferry serve exited" >&2; exit 2; }
  sleep 0.2
done
curl -sf -o /dev/null "$BASE/readyz" || { tail -50 "$WORK/ferry.log" >&2; exit 2; }

PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$ROOT/bench" python3 "$ROOT/bench/tenant_size.py" \
  --base "$BASE" --ferry "$FERRY_BIN" --data-dir "$DATA" --pid "$SERVER_PID" --run-id "$RUN_ID" \
  --max-program-bytes "${FERRY_MAX_PROGRAM_BYTES:-8388608}" \
  --max-plan-resources "${FERRY_MAX_PLAN_RESOURCES:-10000}" \
  --environments "${SIZE_ENVIRONMENTS:-3}" --seconds "${SIZE_SECONDS:-180}" \
  --quiet-seconds "${SIZE_QUIET_SECONDS:-30}" --streams "${SIZE_STREAMS:-20}" --out "$OUT"

kill -0 "$SERVER_PID" 2>/dev/null || { echo "ferry serve died" >&2; tail -50 "$WORK/ferry.log" >&2; exit 1; }
panics=$(grep -ci 'panicked' "$WORK/ferry.log" || true)
echo "ferry serve still up; $panics panics in its log; figures in $OUT"
[ "$panics" = 0 ]
