#!/usr/bin/env bash
# Many instances (Issue 12, item 4): three `ferry serve` processes, workers on, on one
# Postgres database and one NATS, behind the load generator (bench/soak.rs `write`, its
# requests spread over the three). Each instance runs the reconcile schedule, set to two
# minutes inside the load, and at the end `ferry reconcile --window W` runs three times at
# once for the same window. Then it checks (bench/soak.rs `check` and `instances`):
#   * every run applied exactly once (its events, the work queue, the runner's log lines);
#   * one Reconciliation run per environment per window, named after the window, and each
#     run of the manual window started by exactly one of the three reconcilers;
#   * one relay publishing: every event exactly once on the stream, in per-aggregate
#     order, and exactly one instance reporting itself leader (`ferry_nats_relay_leader`);
#   * the read models equal to a replay of the events, and every list (specifications,
#     runs, proposals, releases, promotions) identical on the three instances.
# Exits non-zero on any failure.
#
#   bash bench/instances.sh
#
# Knobs: INST_SECONDS=150 (load duration), INST_WRITERS=32,
# INST_PG=postgres://postgres@127.0.0.1:5432, INST_NATS_PORT=14232 (a nats-server of its
# own; NATS_SERVER=/usr/sbin/nats-server), INST_PORTS="28081 28082 28083", INST_KEEP=1,
# INST_BUILD=0 (use the binaries already built instead of building).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

INST_SECONDS=${INST_SECONDS:-150}
INST_WRITERS=${INST_WRITERS:-32}
INST_PG=${INST_PG:-postgres://postgres@127.0.0.1:5432}
INST_NATS_PORT=${INST_NATS_PORT:-14232}
INST_PORTS=${INST_PORTS:-28081 28082 28083}
INST_KEEP=${INST_KEEP:-0}
NATS_SERVER=${NATS_SERVER:-/usr/sbin/nats-server}
STREAM=FERRY_EVENTS

log() { printf '%s instances: %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# The build run.sh and .ci/run share, unless CARGO_TARGET_DIR names another.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/ferry-target}"
TARGET=$CARGO_TARGET_DIR
if [ "${INST_BUILD:-1}" = 1 ]; then
  log "building (cargo build --release --locked --bin ferry --example soak)"
  cargo build --release --locked --bin ferry --example soak
fi
FERRY=$TARGET/release/ferry
SOAK=$TARGET/release/examples/soak

WORK=$(mktemp -d /var/tmp/ferry-instances.XXXXXX)
DB_NAME=inst_$(date +%s)_$$
export DATABASE_URL=$INST_PG/$DB_NAME
psql "$INST_PG/postgres" -qc "CREATE DATABASE $DB_NAME" >/dev/null
DATA=$WORK/data
mkdir -p "$WORK/nats" "$DATA/tenants/soak"
PIDS=()

cleanup() {
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ "$INST_KEEP" = 1 ]; then
    log "kept: database $DB_NAME, work folder $WORK"
  else
    psql "$INST_PG/postgres" -qc "DROP DATABASE IF EXISTS $DB_NAME WITH (FORCE)" >/dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT

"$NATS_SERVER" -a 127.0.0.1 -p "$INST_NATS_PORT" -js -sd "$WORK/nats" >>"$WORK/nats.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do
  (exec 3<>"/dev/tcp/127.0.0.1/$INST_NATS_PORT") 2>/dev/null && break
  sleep 0.1
done

# The reconcile schedule: the next two whole minutes at least 45 s from now (the load runs
# through both when INST_SECONDS >= 150).
NOW=$(date -u +%s)
W1=$(( (NOW + 45 + 59) / 60 * 60 )); W2=$((W1 + 60))
WINDOW1=$(date -u -d "@$W1" +%Y-%m-%dT%H:%MZ); WINDOW2=$(date -u -d "@$W2" +%Y-%m-%dT%H:%MZ)
SCHEDULE="$(date -u -d "@$W1" +%-M),$(date -u -d "@$W2" +%-M) $(date -u -d "@$W1" +%-H),$(date -u -d "@$W2" +%-H) * * *"
MANUAL=soak-manual-$NOW

export NATS_URL=nats://127.0.0.1:$INST_NATS_PORT FERRY_NATS_STREAM=$STREAM
export FERRY_GRPC_ADDR=off FERRY_DATA_DIR=$DATA
export FERRY_JWT_HS256_KEY=soak-soak-soak-soak-soak-soak-soak-key-0123456789
export FERRY_WORKERS=true FERRY_VERIFICATION_WINDOW=1s FERRY_RECONCILE_SCHEDULE="$SCHEDULE"
export FERRY_LOG=warn,ferry_runners=info,ferry_workers=info,ferry_app::contexts::provisioning::work=info,ferry_app::contexts::provisioning::reconcile=info
export FERRY_LOG_FORMAT=json
# Verification probes the first instance's /healthz: loopback, reached only where a prefix
# names it.
export FERRY_TENANT_PROBE_URL_PREFIXES="http://127.0.0.1:${INST_PORTS%% *}/"
URLS=()
n=0
for port in $INST_PORTS; do
  n=$((n + 1))
  FERRY_HTTP_ADDR=127.0.0.1:$port "$FERRY" serve 2>>"$WORK/ferry.$n.log" >/dev/null &
  PIDS+=($!)
  URLS+=("http://127.0.0.1:$port")
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
    sleep 0.1
  done
  curl -sf "http://127.0.0.1:$port/healthz" >/dev/null || { log "instance $n did not start"; tail "$WORK/ferry.$n.log"; exit 1; }
done
log "3 instances on ${URLS[*]}, NATS $NATS_URL, database $DB_NAME; schedule '$SCHEDULE' (windows $WINDOW1, $WINDOW2)"

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

URL_ARGS=()
for u in "${URLS[@]}"; do URL_ARGS+=(--url "$u"); done
STARTED=$(date +%s)
log "load: $INST_WRITERS writers for $INST_SECONDS s over the three instances"
set +e
"$SOAK" write "${URL_ARGS[@]}" --token "$TOKEN" --writers "$INST_WRITERS" \
  --duration-secs "$INST_SECONDS" --database-url "$DATABASE_URL" \
  --records "$WORK/records.jsonl" --errors "$WORK/errors.jsonl" \
  --program-ref "$REPO#web" --program-version "$COMMIT" --health-url "${URLS[0]}/healthz" \
  | tee "$WORK/write.out"
WRITE_RC=${PIPESTATUS[0]}
set -e

# The environments settle (no run in flight), then three reconcilers take the same window.
for _ in $(seq 1 600); do
  busy=$(psql "$DATABASE_URL" -Atc "SELECT count(*) FROM rm_runs WHERE state IN ('Requested','Planned','Applying')")
  [ "$busy" = 0 ] && break
  sleep 1
done
log "three concurrent 'ferry reconcile --window $MANUAL'"
for i in 1 2 3; do
  "$FERRY" reconcile --window "$MANUAL" >"$WORK/reconcile.$i.json" 2>>"$WORK/reconcile.$i.log" &
  RPIDS[$i]=$!
done
for i in 1 2 3; do wait "${RPIDS[$i]}" || { log "reconcile $i failed"; cat "$WORK/reconcile.$i.log"; exit 1; }; done
for i in 1 2 3; do
  log "reconcile $i: $(jq -c '{window, runs: (.runs | length), started: ([.runs[] | select(.started)] | length), skipped: (.skipped | length)}' "$WORK/reconcile.$i.json" 2>/dev/null || head -c 200 "$WORK/reconcile.$i.json")"
done
for w in "$WINDOW1" "$WINDOW2"; do
  log "scheduled window $w: $(cat "$WORK"/ferry.*.log | grep -c "\"window\":\"$w\".*\"message\":\"reconciled\"\|\"message\":\"reconciled\".*\"window\":\"$w\"" || true) instance(s) reconciled it, $(cat "$WORK"/ferry.*.log | grep -c "another instance is reconciling this window.*$w\|$w.*another instance is reconciling this window" || true) left it to another"
done

CHECK_RC=0
"$SOAK" check --database-url "$DATABASE_URL" --nats-url "$NATS_URL" --stream "$STREAM" \
  --records "$WORK/records.jsonl" --tenant soak --settle-timeout-secs 600 \
  --reconcile-window "$MANUAL" --scheduled-window "$WINDOW1" --scheduled-window "$WINDOW2" \
  --reconcile-output "$WORK/reconcile.1.json" --reconcile-output "$WORK/reconcile.2.json" \
  --reconcile-output "$WORK/reconcile.3.json" \
  $(for f in "$WORK"/ferry.*.log; do printf -- '--runner-log %s ' "$f"; done) || CHECK_RC=$?
INSTANCES_RC=0
"$SOAK" instances "${URL_ARGS[@]}" --token "$TOKEN" || INSTANCES_RC=$?

echo
echo "== instances summary =="
echo "instances:            3 (${URLS[*]}), one database, one NATS"
echo "load:                 $(grep 'write: done' "$WORK/write.out" | tail -1)"
echo "events stored:        $(psql "$DATABASE_URL" -Atc 'SELECT count(*) FROM events')"
echo "duration:             $(( $(date +%s) - STARTED )) s"
if [ "$WRITE_RC" != 0 ] || [ "$CHECK_RC" != 0 ] || [ "$INSTANCES_RC" != 0 ]; then
  echo "RESULT: FAILED (write $WRITE_RC, check $CHECK_RC, instances $INSTANCES_RC); kept $WORK"
  INST_KEEP=1
  exit 1
fi
echo "RESULT: PASSED"
