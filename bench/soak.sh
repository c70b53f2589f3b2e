#!/usr/bin/env bash
# Crash soak (Issue 12, item 3): 32 writers against one Ferry on Postgres and NATS, mixing
# provisioning and promotion commands, while Ferry is killed with SIGKILL every 20-40 s (at
# least 3 times), NATS is restarted once (gracefully) and once killed with SIGKILL and made
# to lose the unsynced tail of its newest message block. Then it waits for the relay and the
# projections to catch up and checks (bench/soak.rs, `check`): every stored event exactly
# once on JetStream, in per-aggregate order, every read model equal to a replay of the
# events, no 2xx answer lost, no run applied twice. Exits non-zero on any loss or duplicate.
#
#   bash bench/soak.sh                      # from a clean clone; builds what it needs
#
# Knobs (environment):
#   SOAK_EVENTS=200000      stop writing once the store holds this many events
#   SOAK_MAX_SECONDS=2400   ... or after this long, whichever comes first
#   SOAK_WRITERS=32         concurrent writers
#   SOAK_DEV_ENVS=24 SOAK_PROD_ENVS=8   environments the writers declare into: each holds one
#                           specification whose every version a declaration re-reads, so
#                           few environments make long histories and a falling write rate
#   SOAK_KILL_MIN=20 SOAK_KILL_MAX=40   seconds between two faults
#   SOAK_MIN_KILLS=3        Ferry kills before the writers may stop
#   SOAK_PG=postgres://postgres@127.0.0.1:5432   Postgres server (a soak_* database is made)
#   SOAK_HTTP_PORT=28080 SOAK_NATS_PORT=14222    ports of the Ferry and NATS this starts
#   NATS_SERVER=/usr/sbin/nats-server
#   SOAK_KEEP=1             keep the database and the work folder (logs, records) afterwards
#   SOAK_SETTLE_SECONDS=1200  how long the check waits for Ferry to catch up
#   SOAK_BUILD=0            use the binaries already built (CARGO_TARGET_DIR) instead of building
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

SOAK_EVENTS=${SOAK_EVENTS:-200000}
SOAK_MAX_SECONDS=${SOAK_MAX_SECONDS:-2400}
SOAK_WRITERS=${SOAK_WRITERS:-32}
SOAK_DEV_ENVS=${SOAK_DEV_ENVS:-24}
SOAK_PROD_ENVS=${SOAK_PROD_ENVS:-8}
SOAK_KILL_MIN=${SOAK_KILL_MIN:-20}
SOAK_KILL_MAX=${SOAK_KILL_MAX:-40}
SOAK_MIN_KILLS=${SOAK_MIN_KILLS:-3}
SOAK_PG=${SOAK_PG:-postgres://postgres@127.0.0.1:5432}
SOAK_HTTP_PORT=${SOAK_HTTP_PORT:-28080}
SOAK_NATS_PORT=${SOAK_NATS_PORT:-14222}
SOAK_SETTLE_SECONDS=${SOAK_SETTLE_SECONDS:-1200}
NATS_SERVER=${NATS_SERVER:-/usr/sbin/nats-server}
SOAK_KEEP=${SOAK_KEEP:-0}
STREAM=FERRY_EVENTS

log() { printf '%s soak: %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# ---- build -----------------------------------------------------------------------------
# The build run.sh and .ci/run share, unless CARGO_TARGET_DIR names another.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/ferry-target}"
TARGET=$CARGO_TARGET_DIR
if [ "${SOAK_BUILD:-1}" = 1 ]; then
  log "building (cargo build --release --locked --bin ferry --example soak)"
  cargo build --release --locked --bin ferry --example soak
fi
FERRY=$TARGET/release/ferry
SOAK=$TARGET/release/examples/soak

# ---- the world: a database, a NATS, a data dir, a program -------------------------------
WORK=$(mktemp -d /var/tmp/ferry-soak.XXXXXX)
DB_NAME=soak_$(date +%s)_$$
DATABASE_URL=$SOAK_PG/$DB_NAME
createdb -h "$(sed -E 's#.*@([^:/]+).*#\1#' <<<"$SOAK_PG")" -U postgres "$DB_NAME" 2>/dev/null ||
  psql "$SOAK_PG/postgres" -qc "CREATE DATABASE $DB_NAME" >/dev/null
NATS_DIR=$WORK/nats
DATA=$WORK/data
mkdir -p "$NATS_DIR" "$DATA/tenants/soak"
FERRY_PID= NATS_PID= WRITER_PID=

cleanup() {
  for pid in ${TAIL_PID:-} $WRITER_PID $FERRY_PID $NATS_PID; do kill -9 "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ "$SOAK_KEEP" = 1 ]; then
    log "kept: database $DB_NAME, work folder $WORK"
  else
    psql "$SOAK_PG/postgres" -qc "DROP DATABASE IF EXISTS $DB_NAME WITH (FORCE)" >/dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT

start_nats() {
  "$NATS_SERVER" -a 127.0.0.1 -p "$SOAK_NATS_PORT" -js -sd "$NATS_DIR" >>"$WORK/nats.log" 2>&1 &
  NATS_PID=$!
  for _ in $(seq 1 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$SOAK_NATS_PORT") 2>/dev/null && return 0
    sleep 0.1
  done
  log "nats-server did not start"; tail -20 "$WORK/nats.log"; return 1
}

export DATABASE_URL NATS_URL=nats://127.0.0.1:$SOAK_NATS_PORT FERRY_NATS_STREAM=$STREAM
export FERRY_HTTP_ADDR=127.0.0.1:$SOAK_HTTP_PORT FERRY_GRPC_ADDR=off FERRY_DATA_DIR=$DATA
export FERRY_JWT_HS256_KEY=soak-soak-soak-soak-soak-soak-soak-key-0123456789
export FERRY_WORKERS=true FERRY_VERIFICATION_WINDOW=1s FERRY_RECONCILE_SCHEDULE=off
# Verification probes Ferry's own /healthz: loopback, reached only where a prefix names it.
export FERRY_TENANT_PROBE_URL_PREFIXES=http://127.0.0.1:$SOAK_HTTP_PORT/
# Short leases so that an apply cut by a kill is settled within seconds, not minutes.
export FERRY_WORKER_LEASE_SECONDS=10 FERRY_WORKER_RECOVERY_GRACE_SECONDS=2
# JSON logs; the simulated runner's lines, inside the workers' "work" span, say which run
# each apply was (checked per run).
export FERRY_LOG=warn,ferry_runners=info,ferry_workers=info,ferry_app::contexts::provisioning::work=info FERRY_LOG_FORMAT=json
FERRY_URL=http://127.0.0.1:$SOAK_HTTP_PORT
FERRY_STARTS=0

start_ferry() {
  FERRY_STARTS=$((FERRY_STARTS + 1))
  "$FERRY" serve 2>>"$WORK/ferry.$FERRY_STARTS.log" >/dev/null &
  FERRY_PID=$!
  for _ in $(seq 1 600); do
    curl -sf "$FERRY_URL/healthz" >/dev/null 2>&1 && return 0
    kill -0 "$FERRY_PID" 2>/dev/null || { log "ferry exited"; tail -20 "$WORK/ferry.$FERRY_STARTS.log"; return 1; }
    sleep 0.1
  done
  log "ferry did not answer /healthz"; return 1
}

start_nats
start_ferry
log "ferry (pid $FERRY_PID) on $FERRY_URL, NATS (pid $NATS_PID) on $NATS_URL, database $DB_NAME, work folder $WORK"

REPO=$DATA/tenants/soak/infra
mkdir -p "$REPO/web"
cat >"$REPO/web/Pulumi.yaml" <<'YAML'
name: soak
runtime: yaml
resources:
  site:
    type: aws:s3/bucket:Bucket
    properties:
      bucketPrefix: soak
outputs:
  siteId: ${site.id}
YAML
git -C "$REPO" init -q && git -C "$REPO" add . &&
  git -C "$REPO" -c user.name=soak -c user.email=soak@example.com commit -qm soak
COMMIT=$(git -C "$REPO" rev-parse HEAD)
TOKEN=$("$FERRY" token --tenant soak --sub soak-writer --roles "Operator PlatformAdmin" \
  --scopes "factory.provisioning.read factory.provisioning.apply factory.delivery.read factory.delivery.promote factory.delivery.operate")

# ---- load and faults ---------------------------------------------------------------------
RECORDS=$WORK/records.jsonl
STARTED=$(date +%s)
WRITE_ROUNDS=0
start_writer() { # seconds, target events (0: none)
  WRITE_ROUNDS=$((WRITE_ROUNDS + 1))
  "$SOAK" write --url "$FERRY_URL" --token "$TOKEN" --writers "$SOAK_WRITERS" \
    --dev-envs "$SOAK_DEV_ENVS" --prod-envs "$SOAK_PROD_ENVS" \
    --target-events "$2" --duration-secs "$1" --database-url "$DATABASE_URL" \
    --records "$RECORDS" --errors "$WORK/errors.jsonl" \
    --program-ref "$REPO#web" --program-version "$COMMIT" --health-url "$FERRY_URL/healthz" \
    >>"$WORK/write.out" 2>&1 &
  WRITER_PID=$!
}
: >"$WORK/write.out"
tail -n +1 -f "$WORK/write.out" &
TAIL_PID=$!
start_writer "$SOAK_MAX_SECONDS" "$SOAK_EVENTS"

KILLS=0 NATS_RESTARTS=0 NATS_TAIL_LOSSES=0
# Group commit's counters, summed over Ferry's lives (each start counts from zero), read
# just before each kill and at the end: how the racing writers' commands were grouped and
# how often Postgres refused a group as a whole.
GC_GROUPS=0 GC_COMMANDS=0 GC_SPLIT=0
count_groups() {
  local metrics
  metrics=$(curl -sf --max-time 5 "$FERRY_URL/metrics" || true)
  counter() { awk -v n="$1" '$1 == n {v = $2} END {print v + 0}' <<<"$metrics"; }
  GC_GROUPS=$((GC_GROUPS + $(counter ferry_append_groups_total)))
  GC_COMMANDS=$((GC_COMMANDS + $(counter ferry_append_group_commands_total)))
  GC_SPLIT=$((GC_SPLIT + $(counter ferry_append_groups_split_total)))
}
# The fault plan: Ferry kills, with NATS's restart and its lost tail in between.
PLAN=(ferry nats-restart ferry nats-lose-tail ferry)
step=0
WRITER_RC=0
while :; do
  wait_for=$((SOAK_KILL_MIN + RANDOM % (SOAK_KILL_MAX - SOAK_KILL_MIN + 1)))
  for _ in $(seq 1 "$wait_for"); do
    kill -0 "$WRITER_PID" 2>/dev/null || break
    sleep 1
  done
  writer_done=0
  if ! kill -0 "$WRITER_PID" 2>/dev/null; then
    wait "$WRITER_PID" || WRITER_RC=$?
    writer_done=1
  fi
  plan_done=$(( step >= ${#PLAN[@]} && KILLS >= SOAK_MIN_KILLS ))
  if [ "$writer_done" = 1 ] && [ "$plan_done" = 1 ]; then break; fi
  # The writers reached the target before the faults were all made: write on meanwhile.
  if [ "$writer_done" = 1 ]; then start_writer "$SOAK_KILL_MAX" 0; fi
  action=ferry
  if [ "$step" -lt ${#PLAN[@]} ]; then action=${PLAN[$step]}; fi
  step=$((step + 1))
  case $action in
    ferry)
      KILLS=$((KILLS + 1))
      log "fault: kill -9 ferry (pid $FERRY_PID), kill $KILLS"
      count_groups
      kill -9 "$FERRY_PID"; wait "$FERRY_PID" 2>/dev/null || true
      start_ferry
      log "ferry restarted (pid $FERRY_PID)"
      ;;
    nats-restart)
      NATS_RESTARTS=$((NATS_RESTARTS + 1))
      log "fault: NATS restarted gracefully (SIGTERM, pid $NATS_PID)"
      kill -TERM "$NATS_PID"; wait "$NATS_PID" 2>/dev/null || true
      sleep 2
      start_nats
      ;;
    nats-lose-tail)
      NATS_TAIL_LOSSES=$((NATS_TAIL_LOSSES + 1))
      log "fault: kill -9 NATS (pid $NATS_PID) and cut its stream's unsynced tail"
      kill -9 "$NATS_PID"; wait "$NATS_PID" 2>/dev/null || true
      "$SOAK" lose-tail --store-dir "$NATS_DIR" --stream "$STREAM" --drop 300
      start_nats
      ;;
  esac
done
WROTE=$(( $(date +%s) - STARTED ))
kill "$TAIL_PID" 2>/dev/null || true
log "writing done after ${WROTE} s ($WRITE_ROUNDS writer round(s), writer exit $WRITER_RC); faults: $KILLS ferry kills, $NATS_RESTARTS NATS restarts, $NATS_TAIL_LOSSES NATS tail losses"

# ---- catch up and check --------------------------------------------------------------------
log "waiting for the relay and the projections, then checking"
CHECK_RC=0
"$SOAK" check --database-url "$DATABASE_URL" --nats-url "$NATS_URL" --stream "$STREAM" \
  --records "$RECORDS" --tenant soak --settle-timeout-secs "$SOAK_SETTLE_SECONDS" \
  $(for f in "$WORK"/ferry.*.log; do printf -- '--runner-log %s ' "$f"; done) || CHECK_RC=$?
CHECKED=$(( $(date +%s) - STARTED - WROTE ))
EVENTS=$(psql "$DATABASE_URL" -Atc "SELECT count(*) FROM events")
REPUBLISHED=$(curl -sf "$FERRY_URL/metrics" | grep -E '^ferry_nats_relay_(republished|refused|stream_resets)_total' | tr '\n' ' ' || true)
FIVEXX=$( [ -f "$WORK/errors.jsonl" ] && wc -l <"$WORK/errors.jsonl" || echo 0)
count_groups

echo
echo "== soak summary =="
echo "events stored:        $EVENTS (target $SOAK_EVENTS)"
echo "writing:              ${WROTE} s with $SOAK_WRITERS writers, $((EVENTS / (WROTE > 0 ? WROTE : 1))) events/s"
echo "faults:               $KILLS ferry kill -9 (restarts: $((FERRY_STARTS - 1))), $NATS_RESTARTS NATS restart, $NATS_TAIL_LOSSES NATS kill -9 with lost tail"
echo "relay (since last start): $REPUBLISHED"
echo "group commit:         $GC_COMMANDS commands in $GC_GROUPS groups ($(awk -v c="$GC_COMMANDS" -v g="$GC_GROUPS" 'BEGIN {printf "%.2f", g ? c / g : 0}') per group), $GC_SPLIT split (counted to each kill)"
echo "5xx answers (not 503): $FIVEXX"
echo "catch-up and check:   ${CHECKED} s"
echo "last writer line:     $(grep 'write: done' "$WORK/write.out" | tail -1)"
if [ "$CHECK_RC" != 0 ] || [ "$FIVEXX" != 0 ]; then
  echo "RESULT: FAILED (check exit $CHECK_RC, $FIVEXX 5xx answers); logs kept in $WORK"
  SOAK_KEEP=1
  exit 1
fi
echo "RESULT: PASSED"
