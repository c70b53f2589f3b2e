#!/usr/bin/env bash
# Ferry's benchmark: one command, one run on this machine, every figure and ratio written to
# bench/results.json and printed as a table (bench/README.md explains each figure).
#
#   bash bench/run.sh
#
# Needs what the README's test command needs (Postgres at 127.0.0.1:5432 with trust auth,
# NATS with JetStream at 127.0.0.1:4222, jq) plus pgbench (Debian's postgresql-client).
# Knobs: BENCH_SECONDS (20, each load phase), BENCH_CLIENTS (32), BENCH_EVENTS (1000000,
# figures e and g), BENCH_E2E (64, figure f), BENCH_PORT (18080). It creates and drops its
# own databases (ferry_bench_*) and its own JetStream streams (BENCH_*).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/ferry-target}"
PGHOST=127.0.0.1 PGUSER=postgres
export PGHOST PGUSER
PG="postgres://postgres@127.0.0.1:5432"
NATS="${NATS_URL:-nats://127.0.0.1:4222}"
DURATION="${BENCH_SECONDS:-20}"
CLIENTS="${BENCH_CLIENTS:-32}"
EVENTS="${BENCH_EVENTS:-1000000}"
E2E="${BENCH_E2E:-64}"
PORT="${BENCH_PORT:-18080}"
BASE="http://127.0.0.1:$PORT"
TENANT=benchtenant

step() { printf '\n== %s\n' "$*" >&2; }
command -v pgbench >/dev/null || { echo "pgbench is needed (apt-get install postgresql-client)" >&2; exit 1; }
command -v jq >/dev/null || { echo "jq is needed" >&2; exit 1; }

step "build (release)"
cargo build -q --release --locked --bin ferry --example load --example peer --example pipeline
BIN="$CARGO_TARGET_DIR/release"
FERRY="$BIN/ferry"
work=$(mktemp -d)
server=""
stop_server() {
  if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  server=""
}
trap 'stop_server; rm -rf "$work"' EXIT
fresh_db() { dropdb --if-exists --force "$1"; createdb "$1"; }

export FERRY_JWT_HS256_KEY="ferry-bench-signing-key-0123456789abcdef"
export FERRY_HTTP_ADDR="127.0.0.1:$PORT" FERRY_GRPC_ADDR=off FERRY_LOG=warn
# The e2e phase probes Ferry's own /healthz: loopback, reached only where a prefix names it.
export FERRY_TENANT_PROBE_URL_PREFIXES="$BASE/"
SCOPES="factory.provisioning.read factory.provisioning.apply factory.delivery.read factory.delivery.promote"
TOKEN=$("$FERRY" token --tenant "$TENANT" --sub load --roles "Operator PlatformAdmin" --scopes "$SCOPES" --ttl 86400)

# serve <log name> [VAR=value...]: starts ferry serve with the given settings, waits for it.
serve() {
  local name=$1; shift
  env "$@" "$FERRY" serve >"$work/$name.log" 2>&1 &
  server=$!
  for _ in $(seq 1 600); do
    curl -sf "$BASE/healthz" -o /dev/null && return 0
    kill -0 "$server" 2>/dev/null || { cat "$work/$name.log" >&2; return 1; }
    sleep 0.1
  done
  echo "ferry serve ($name) did not come up" >&2; return 1
}
load() { "$BIN/examples/load" --base "$BASE" --token "$TOKEN" "$@"; }
rss_peak_mb() { awk '/VmHWM/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }
# CPU time, in clock ticks: the whole machine's busy and idle time (every process, Postgres
# and the kernel included), and one process's own. Their differences over a phase divided
# by its operations are what each operation costs the machine, wherever it is spent.
TICK_MS=$((1000 / $(getconf CLK_TCK)))
machine_ticks() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9, $5 + $6}' /proc/stat; }
process_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# cpu_json <busy0 idle0> <busy1 idle1> <operations> [Ferry's ticks]: the phase's CPU as JSON.
cpu_json() {
  local b0 i0 b1 i1 ferry=null
  read -r b0 i0 <<<"$1"; read -r b1 i1 <<<"$2"
  [ $# -ge 4 ] && ferry=$(($4 * TICK_MS))
  jq -n --argjson busy $(((b1 - b0) * TICK_MS)) --argjson idle $(((i1 - i0) * TICK_MS)) \
    --argjson ops "$3" --argjson ferry "$ferry" '
    {operations: $ops, busyCpuMs: $busy, idlePercent: (100 * $idle / ($busy + $idle) | round),
     busyCpuMsPerOperation: ($busy / $ops * 1000 | round / 1000)}
    + if $ferry == null then {} else
        {ferryCpuMs: $ferry, ferryCpuMsPerOperation: ($ferry / $ops * 1000 | round / 1000)} end'
}

# (a) The physical limit: one-row inserts into a table shaped like Ferry's events table.
step "(a) pgbench: one-row inserts of an events-shaped row, $CLIENTS clients"
fresh_db ferry_bench_pgbench
psql -q -d ferry_bench_pgbench <<'SQL'
CREATE TABLE events (aggregate_type text NOT NULL, aggregate_id text NOT NULL, sequence bigint NOT NULL,
  event_type text NOT NULL, event_version text NOT NULL, payload jsonb NOT NULL, metadata jsonb NOT NULL,
  global_position bigint GENERATED ALWAYS AS IDENTITY, transaction_id xid8 NOT NULL DEFAULT pg_current_xact_id(),
  event_id uuid NOT NULL DEFAULT gen_random_uuid(), recorded_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (aggregate_type, aggregate_id, sequence));
CREATE UNIQUE INDEX ON events (global_position);
CREATE UNIQUE INDEX ON events (event_id);
CREATE INDEX ON events (transaction_id, global_position);
SQL
cat >"$work/insert.sql" <<'SQL'
INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata)
VALUES ('ProvisioningRun', gen_random_uuid()::text, 1, 'PlanRequested', '1',
 '{"PlanRequested":{"tenantId":"benchtenant","provisioningRunId":"0b7c6d1e-7a53-4f43-9a55-0c8f3e1c2b11","specificationId":"5d0e2c1a-3b4f-4e6d-8a9b-1c2d3e4f5a6b","specificationVersion":7,"environmentId":"load-12-7","projectId":"load","kind":"Release","programRef":"/srv/infra#web","programVersion":"3f2a9c1","requestedBy":"load","requestedAt":"2026-12-03T21:00:00.000000Z","inputsHash":"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08","configuration":{"region":"eu-west-1","replicas":2}}}'::jsonb,
 '{"tenantId":"benchtenant","actor":"load","correlationId":"6f1c2b3a-4d5e-4f60-8a1b-2c3d4e5f6a7b","requestId":"7a8b9c0d-1e2f-4a3b-8c4d-5e6f7a8b9c0d"}'::jsonb);
SQL
m0=$(machine_ticks)
pgbench -n -c "$CLIENTS" -j 2 -T "$DURATION" -f "$work/insert.sql" ferry_bench_pgbench >"$work/pgbench.out" 2>&1
m1=$(machine_ticks)
cat "$work/pgbench.out" >&2
tps=$(awk '/^tps = / {print int($3)}' "$work/pgbench.out" | head -1)
done_a=$(awk '/number of transactions actually processed/ {split($NF, n, "/"); print n[1]}' "$work/pgbench.out")
jq -n --argjson tps "$tps" --argjson clients "$CLIENTS" --argjson cpu "$(cpu_json "$m0" "$m1" "$done_a")" \
  '{transactionsPerSecond: $tps, clients: $clients, cpu: $cpu}' >"$work/a.json"
dropdb --force ferry_bench_pgbench

# (b), (c) Ferry over HTTP on Postgres: the command mix, its latency, the projection lag.
step "(b, c) Ferry on Postgres, API only, $CLIENTS clients, ${DURATION}s"
fresh_db ferry_bench
PGFERRY=(DATABASE_URL="$PG/ferry_bench" FERRY_DATA_DIR="$work/pg" FERRY_WORKERS=false FERRY_TENANT_PROGRAM_ROOTS=/srv/infra)
serve pg "${PGFERRY[@]}"
m0=$(machine_ticks); f0=$(process_ticks "$server")
load --clients "$CLIENTS" --seconds "$DURATION" --prefix load >"$work/b-load.json"
m1=$(machine_ticks); f1=$(process_ticks "$server")
jq --argjson cpu "$(cpu_json "$m0" "$m1" "$(jq .commands.count "$work/b-load.json")" $((f1 - f0)))" \
  '. + {cpu: $cpu}' "$work/b-load.json" >"$work/b-postgres.json"
rss_b=$(rss_peak_mb "$server")
stop_server
step "(b, c) the same without read-your-writes (FERRY_READ_YOUR_WRITES_MS=0)"
serve pg-ryw0 "${PGFERRY[@]}" FERRY_READ_YOUR_WRITES_MS=0
load --clients "$CLIENTS" --seconds "$DURATION" --prefix nowait >"$work/b-postgres-ryw0.json"
stop_server

step "(b, c) Ferry on the embedded default (SQLite)"
serve sqlite FERRY_DATA_DIR="$work/sqlite" FERRY_WORKERS=false FERRY_TENANT_PROGRAM_ROOTS=/srv/infra
load --clients "$CLIENTS" --seconds "$DURATION" --prefix load >"$work/b-sqlite.json"
stop_server

# (h) The peer: plain cqrs-es + postgres-es, in process, the same mix.
for tasks in 1 8 32; do
  step "(h) plain cqrs-es 0.5 + postgres-es, $tasks tasks"
  fresh_db ferry_bench_peer
  m0=$(machine_ticks)
  "$BIN/examples/peer" "$PG/ferry_bench_peer" "$tasks" "$DURATION" >"$work/h-run.json"
  m1=$(machine_ticks)
  jq --argjson cpu "$(cpu_json "$m0" "$m1" "$(jq .commands.count "$work/h-run.json")")" \
    '. + {cpu: $cpu}' "$work/h-run.json" >"$work/h-$tasks.json"
  cat "$work/h-$tasks.json" >&2
done
dropdb --force ferry_bench_peer

# (f) End to end with workers and the simulated runner: runs applied, promotions completed.
step "(f) $E2E runs and $E2E promotions end to end (simulated runner)"
fresh_db ferry_bench_e2e
programs="$work/programs"
mkdir -p "$programs/$TENANT/infra/web"
cat >"$programs/$TENANT/infra/web/Pulumi.yaml" <<'YAML'
name: bench
runtime: yaml
resources:
  site:
    type: aws:s3/bucket:Bucket
    properties:
      bucketPrefix: bench
YAML
git -C "$programs/$TENANT/infra" init -q
git -C "$programs/$TENANT/infra" add .
git -C "$programs/$TENANT/infra" -c user.name=bench -c user.email=bench@example.com commit -qm bench
commit=$(git -C "$programs/$TENANT/infra" rev-parse HEAD)
serve e2e DATABASE_URL="$PG/ferry_bench_e2e" FERRY_DATA_DIR="$work/e2e" \
  FERRY_TENANT_PROGRAM_ROOTS="$programs/{tenant}" FERRY_VERIFICATION_WINDOW=1s
load --e2e "$E2E" --health-url "$BASE/healthz" --program "$programs/$TENANT/infra#web" --commit "$commit" --prefix e2e >"$work/f.json"
stop_server
dropdb --force ferry_bench_e2e

# (e) Rebuild over a million events: the mix's events copied under other tenants.
step "(e) seed the store to $EVENTS events"
"$BIN/examples/pipeline" seed "$PG/ferry_bench" "$EVENTS" "$TENANT" | tee "$work/seed.json" >&2
psql -q -d ferry_bench -c "VACUUM ANALYZE events" >&2
"$BIN/examples/pipeline" scan "$PG/ferry_bench" >"$work/scan.json"
cat "$work/scan.json" >&2
step "(e) ferry projections rebuild"
start=$(date +%s.%N)
m0=$(machine_ticks)
DATABASE_URL="$PG/ferry_bench" FERRY_DATA_DIR="$work/pg" /usr/bin/time -f "%M %U %S" -o "$work/rebuild.rss" \
  "$FERRY" projections rebuild >"$work/rebuild.out"
m1=$(machine_ticks)
rebuild_seconds=$(echo "$(date +%s.%N) - $start" | bc)
cat "$work/rebuild.out" >&2
total=$(psql -tA -d ferry_bench -c "SELECT count(*) FROM events")
read -r rebuild_kb rebuild_user rebuild_system <"$work/rebuild.rss"
rebuild_ticks=$(echo "($rebuild_user + $rebuild_system) * 1000 / $TICK_MS" | bc)
jq -n --argjson events "$total" --argjson s "$rebuild_seconds" --argjson rss "$rebuild_kb" \
  --slurpfile scan "$work/scan.json" --argjson cpu "$(cpu_json "$m0" "$m1" "$total" "$rebuild_ticks")" \
  --argjson cores "$(nproc)" \
  '{events: $events, seconds: ($s * 100 | round / 100), eventsPerSecond: ($events / $s | round),
    scanEventsPerSecond: $scan[0].eventsPerSecond, peakRssMb: ($rss / 1024 | round),
    cpu: ($cpu + {othersCpuMs: ($cpu.busyCpuMs - $cpu.ferryCpuMs),
      goalCpuMsOnAllCores: ($events / ($scan[0].eventsPerSecond / 2) * 1000 * $cores | round)})}' >"$work/e.json"

# (d), (g) The relay publishing the million events to a new stream, with acks; Ferry's
# peak resident memory meanwhile. The other subscriptions are moved to the head first, so
# the relay has the process to itself.
psql -q -d ferry_bench -c "UPDATE subscription_checkpoints c SET transaction_id = h.t, global_position = h.p
  FROM (SELECT transaction_id::text::bigint t, global_position p FROM events ORDER BY transaction_id DESC, global_position DESC LIMIT 1) h
  WHERE c.name NOT LIKE 'nats-relay:%'"
stream="BENCH_RELAY_$(date +%s)"
step "(d, g) the relay: the store's events to JetStream stream $stream"
serve relay DATABASE_URL="$PG/ferry_bench" FERRY_DATA_DIR="$work/pg" FERRY_WORKERS=false \
  NATS_URL="$NATS" FERRY_NATS_STREAM="$stream"
# Runs until the relay's checkpoint reaches the last stored event (a minute past a phase at
# most); the rate is taken from the stream's own clock (first message stored to last)
# afterwards. A fixed window that outlasts the work would count the idle time after it,
# and polling /metrics would slow what it measures.
last=$(psql -tA -d ferry_bench -c "SELECT max(global_position) FROM events")
relay_done() {
  [ "$(psql -tA -d ferry_bench -c "SELECT count(*) FROM subscription_checkpoints
    WHERE name = 'nats-relay:$stream' AND global_position >= $last")" = 1 ]
}
for _ in $(seq 1 $((DURATION * 5 + 300))); do relay_done && break; sleep 0.2; done
rss_g=$(rss_peak_mb "$server")
stop_server
"$BIN/examples/pipeline" drop-stream "$NATS" "$stream" >"$work/stream.json"
cat "$work/stream.json" >&2
bytes=$(jq .averageBytes "$work/stream.json")
# As many messages as the relay published (a short burst goes faster than a sustained
# stream); one at a time, 20,000 (at a few thousand a second).
relayed=$(jq .messages "$work/stream.json")
step "(d) raw JetStream publishing, $relayed $bytes-byte messages pipelined, 20000 one at a time"
"$BIN/examples/pipeline" raw "$NATS" "$relayed" "$bytes" 20000 >"$work/raw.json"
cat "$work/raw.json" >&2
jq -n --slurpfile relay "$work/stream.json" --slurpfile raw "$work/raw.json" \
  '{relayPerSecond: ($relay[0].messages / $relay[0].storedSeconds | round), relayMessages: $relay[0].messages,
    relaySeconds: ($relay[0].storedSeconds * 100 | round / 100),
    rawSequentialPerSecond: $raw[0].sequentialPerSecond,
    rawPipelinedPerSecond: $raw[0].pipelinedPerSecond, rawPipelinedMessages: $raw[0].pipelinedMessages,
    rawSequentialMessages: $raw[0].sequentialMessages, messageBytes: $raw[0].bytes}' >"$work/d.json"
jq -n --argjson serve "$rss_g" --argjson rebuild "$(jq .peakRssMb "$work/e.json")" --argjson load "$rss_b" \
  '{servePeakRssMbAt1MEvents: $serve, rebuildPeakRssMb: $rebuild, servePeakRssMbUnderLoad: $load}' >"$work/g.json"
dropdb --force ferry_bench

# Every figure and ratio, one file.
jq -n \
  --slurpfile a "$work/a.json" --slurpfile bp "$work/b-postgres.json" --slurpfile bp0 "$work/b-postgres-ryw0.json" \
  --slurpfile bs "$work/b-sqlite.json" --slurpfile d "$work/d.json" --slurpfile e "$work/e.json" \
  --slurpfile f "$work/f.json" --slurpfile g "$work/g.json" \
  --slurpfile h1 "$work/h-1.json" --slurpfile h8 "$work/h-8.json" --slurpfile h32 "$work/h-32.json" \
  --arg when "$(date -u +%Y-%m-%dT%H:%M:%SZ)" --arg commit "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
  --arg machine "$(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)" \
  --argjson cores "$(nproc)" '
  def r2: . * 100 | round / 100;
  def ceiling: $cores * 1000 / .cpu.busyCpuMsPerOperation | round;
  {measuredAt: $when, commit: $commit, machine: $machine, cores: $cores, clients: $bp[0].clients, seconds: $bp[0].seconds,
   a_pgbench: $a[0],
   b_ferryPostgres: $bp[0], b_ferryPostgresNoReadYourWrites: $bp0[0], b_ferrySqlite: $bs[0],
   c_projectionLag: {postgres: $bp[0].lag, postgresNoReadYourWrites: $bp0[0].lag, sqlite: $bs[0].lag},
   d_relay: $d[0], e_rebuild: $e[0], f_endToEnd: $f[0], g_memory: $g[0],
   h_plainCqrsEs: {"1": $h1[0], "8": $h8[0], "32": $h32[0]},
   cpuCeilings: {a_perSecond: ($a[0] | ceiling), b_perSecond: ($bp[0] | ceiling), h32_perSecond: ($h32[0] | ceiling)},
   ratios: {
     b_over_a: ($bp[0].commands.perSecond / $a[0].transactionsPerSecond | r2),
     b_over_h32: ($bp[0].commands.perSecond / $h32[0].commands.perSecond | r2),
     bNoReadYourWrites_over_a: ($bp0[0].commands.perSecond / $a[0].transactionsPerSecond | r2),
     h32_over_a: ($h32[0].commands.perSecond / $a[0].transactionsPerSecond | r2),
     d_over_rawSequential: ($d[0].relayPerSecond / $d[0].rawSequentialPerSecond | r2),
     d_over_rawPipelined: ($d[0].relayPerSecond / $d[0].rawPipelinedPerSecond | r2),
     e_over_scan: ($e[0].eventsPerSecond / $e[0].scanEventsPerSecond | r2)}}' >bench/results.json

table=$(jq -r '
  def goal(ok): if ok then "met" else "not met" end;
  # A share shown against a lower bound is cut, not rounded, to a tenth of a percent, and
  # the goals compare the measured figures, not the rounded ratios.
  def pct: . * 1000 | floor / 10;
  def s1: . / 100 | round / 10;
  (.b_ferryPostgres.commands.perSecond) as $b |
  "| figure | measured | goal | |",
  "|---|---|---|---|",
  "| (a) pgbench one-row inserts, \(.clients) clients | \(.a_pgbench.transactionsPerSecond)/s | the limit | |",
  "| (b) Ferry commands over HTTP, Postgres | \(.b_ferryPostgres.commands.perSecond)/s, p50 \(.b_ferryPostgres.commands.p50Ms) ms, p99 \(.b_ferryPostgres.commands.p99Ms) ms | ≥ 50% of (a), ≥ 2× (h), p99 ≤ 25 ms | \($b / .a_pgbench.transactionsPerSecond | pct)% of (a), \(.ratios.b_over_h32)× (h): \(goal($b / .a_pgbench.transactionsPerSecond >= 0.5 and $b / .h_plainCqrsEs["32"].commands.perSecond >= 2 and .b_ferryPostgres.commands.p99Ms <= 25)) |",
  "| (b) the same, read-your-writes off | \(.b_ferryPostgresNoReadYourWrites.commands.perSecond)/s, p99 \(.b_ferryPostgresNoReadYourWrites.commands.p99Ms) ms | | \(.ratios.bNoReadYourWrites_over_a * 100 | round)% of (a) |",
  "| (b) Ferry on SQLite (embedded default) | \(.b_ferrySqlite.commands.perSecond)/s, p99 \(.b_ferrySqlite.commands.p99Ms) ms | | |",
  "| (c) projection lag, Postgres (answer → GET sees it) | p50 \(.c_projectionLag.postgres.p50Ms) ms, p99 \(.c_projectionLag.postgres.p99Ms) ms | p99 ≤ 100 ms | \(goal(.c_projectionLag.postgres.p99Ms <= 100)) |",
  "| (c) the same, read-your-writes off | p50 \(.c_projectionLag.postgresNoReadYourWrites.p50Ms) ms, p99 \(.c_projectionLag.postgresNoReadYourWrites.p99Ms) ms | p99 ≤ 100 ms | \(goal(.c_projectionLag.postgresNoReadYourWrites.p99Ms <= 100)) |",
  "| (c) projection lag, SQLite | p50 \(.c_projectionLag.sqlite.p50Ms) ms, p99 \(.c_projectionLag.sqlite.p99Ms) ms | | |",
  "| (d) relay to JetStream with acks | \(.d_relay.relayPerSecond)/s (raw: \(.d_relay.rawSequentialPerSecond)/s one at a time, \(.d_relay.rawPipelinedPerSecond)/s pipelined, \(.d_relay.rawPipelinedMessages) messages) | ≥ 50% of raw | \(.d_relay.relayPerSecond / .d_relay.rawPipelinedPerSecond | pct)% of pipelined, \(.ratios.d_over_rawSequential * 100 | round)% of one at a time: \(goal(.d_relay.relayPerSecond / .d_relay.rawPipelinedPerSecond >= 0.5)) |",
  "| (e) projection rebuild, \(.e_rebuild.events) events | \(.e_rebuild.eventsPerSecond)/s (scan: \(.e_rebuild.scanEventsPerSecond)/s) | ≥ 50% of the scan | \(.e_rebuild.eventsPerSecond / .e_rebuild.scanEventsPerSecond | pct)%: \(goal(.e_rebuild.eventsPerSecond / .e_rebuild.scanEventsPerSecond >= 0.5)) |",
  "| (f) end to end, simulated runner | \(.f_endToEnd.runsPerSecond) runs/s, \(.f_endToEnd.promotionsPerSecond) promotions/s (\(.f_endToEnd.runs) each) | | |",
  "| (g) peak resident memory | serve at 1M events \(.g_memory.servePeakRssMbAt1MEvents) MB, rebuild \(.g_memory.rebuildPeakRssMb) MB | ≤ 200 MB | \(goal(.g_memory.servePeakRssMbAt1MEvents <= 200 and .g_memory.rebuildPeakRssMb <= 200)) |",
  "| (h) plain cqrs-es + postgres-es, 1 / 8 / 32 tasks | \(.h_plainCqrsEs["1"].commands.perSecond) / \(.h_plainCqrsEs["8"].commands.perSecond) / \(.h_plainCqrsEs["32"].commands.perSecond) per s, p99 at 32: \(.h_plainCqrsEs["32"].commands.p99Ms) ms | | \(.ratios.h32_over_a * 100 | round)% of (a) |",
  "| CPU per operation, whole machine (`/proc/stat`) | (a) \(.a_pgbench.cpu.busyCpuMsPerOperation) ms, (b) \(.b_ferryPostgres.cpu.busyCpuMsPerOperation) ms (Ferry itself \(.b_ferryPostgres.cpu.ferryCpuMsPerOperation) ms), (h) at 32 tasks \(.h_plainCqrsEs["32"].cpu.busyCpuMsPerOperation) ms; idle \(.a_pgbench.cpu.idlePercent)%, \(.b_ferryPostgres.cpu.idlePercent)%, \(.h_plainCqrsEs["32"].cpu.idlePercent)% | | at these costs \(.cores) cores give at most (b) \(.cpuCeilings.b_perSecond)/s (\(.cpuCeilings.b_perSecond / .a_pgbench.transactionsPerSecond | pct)% of (a)) |",
  "| CPU of the rebuild (e) | \(.e_rebuild.cpu.busyCpuMs | s1) core-s: Ferry \(.e_rebuild.cpu.ferryCpuMs | s1), the rest (Postgres) \(.e_rebuild.cpu.othersCpuMs | s1) | | the goal leaves \(.e_rebuild.cpu.goalCpuMsOnAllCores | s1) core-s on \(.cores) cores |"
' bench/results.json)
echo "$table"
# docs/benchmarks.md shows the last run's table, between its bench-table markers.
{ jq -r '"Measured \(.measuredAt) at commit \(.commit) on \(.machine) (`bash bench/run.sh`, \(.clients) clients, \(.seconds) s per load phase, \(.e_rebuild.events) events for (e) to (g)):"' bench/results.json
  echo; echo "$table"; } >"$work/table.md"
awk -v table="$work/table.md" '
  /<!-- bench-table -->/ { print; while ((getline line < table) > 0) print line; skip = 1; next }
  /<!-- \/bench-table -->/ { skip = 0 }
  !skip' docs/benchmarks.md >"$work/benchmarks.md" && cp "$work/benchmarks.md" docs/benchmarks.md
echo >&2
echo "written: bench/results.json, the table in docs/benchmarks.md" >&2
