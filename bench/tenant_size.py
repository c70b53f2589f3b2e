"""Two tenants at the size limits, a third one measured (`bench/tenant_size.sh`).

Issue 37, section 7: a 200,000-resource program took Ferry to 2.3 GB and two at once pushed
another tenant's GET p99 to 19 s; twenty event streams from `after=0` took 2.7 GB. This
measures the same at the default limits:

1. `quiet`: the calm tenant's GETs alone (a run, the list of its runs), for the baseline p99;
2. `hogs`: two hog tenants each with a program at the limits (as many resources as
   `FERRY_MAX_PLAN_RESOURCES` allows, padded to just under `FERRY_MAX_PROGRAM_BYTES`) ask
   for plans again and again in several environments, twenty clients read a hog's event
   stream from `after=0`, and the calm tenant's GETs go on; its p99 and Ferry's memory
   (VmRSS sampled, VmHWM at the end) are recorded;
3. one more hog plan over each limit, to show it fails naming the setting.

Writes a JSON document of the figures (`--out`) and prints them. Only the standard library
and `requests`, with `Ferry`, `need`, `eventually` and `j` of `bench/hostile_checks.py`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import threading
import time

from hostile_checks import Ferry, eventually, j, need

RESOURCE_TYPE = "aws:s3/bucket:Bucket"


def program_text(resources: int, max_bytes: int, name: str) -> str:
    """A Pulumi YAML program of `resources` buckets, each padded so the file ends just under
    `max_bytes` (the folder also holds Git's nothing: the checkout writes only the folder)."""
    head = f"name: {name}\nruntime: yaml\nresources:\n"
    one = "  r{i:06d}:\n    type: " + RESOURCE_TYPE + "\n    properties:\n      bucketPrefix: b{i:06d}\n      tags:\n        pad: '{pad}'\n"
    bare = len(one.format(i=0, pad=""))
    room = max(0, (max_bytes - len(head) - 256) // resources - bare - 1)
    pad = "x" * room
    return head + "".join(one.format(i=i, pad=pad) for i in range(resources))


def git_program(data_dir: str, tenant: str, text: str, label: str) -> tuple[str, str]:
    repo = pathlib.Path(data_dir, "tenants", tenant).resolve() / f"size-{label}"
    (repo / "prog").mkdir(parents=True, exist_ok=True)
    (repo / "prog" / "Pulumi.yaml").write_text(text)
    git = ["git", "-C", str(repo)]
    if not (repo / ".git").exists():
        subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["-c", "user.name=size", "-c", "user.email=size@example.com", "commit", "-qm", label],
                   check=True)
    commit = subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    return f"{repo}#prog", commit


class Tenant:
    def __init__(self, f: Ferry, name: str):
        self.f = f
        self.name = name
        self.admin = f.token(name, "platform", ["PlatformAdmin"])
        self.alice = f.token(name, "alice", ["Operator", "Reviewer"])

    def environment(self, env: str) -> None:
        need(self.f.call("PUT", f"/factory/environments/{env}", self.admin,
                         {"environmentClass": "development"}), 200, 201)

    def declare(self, env: str, program: str, commit: str) -> dict:
        return need(self.f.call("POST", "/factory/provisioning/specifications", self.alice, {
            "environmentId": env, "projectId": "size", "kind": "Workload",
            "programRef": program, "programVersion": commit}), 201)

    def plan(self, spec: dict) -> str:
        r = self.f.call("POST", "/factory/provisioning/runs", self.alice, {
            "specificationId": spec["specificationId"], "specificationVersion": spec["version"],
            "environmentId": spec["environmentId"], "kind": "Release"}, timeout=120)
        return need(r, 201)["provisioningRunId"]

    def run(self, run: str) -> dict:
        return j(self.f.call("GET", f"/factory/provisioning/runs/{run}", self.alice, timeout=120)) or {}

    def settled(self, run: str, timeout: float = 900) -> dict:
        def probe():
            r = self.run(run)
            return r.get("state") in ("Applied", "Failed", "AwaitingApproval", "Rejected", "Superseded"), r
        return eventually(f"run {run} settled", probe, timeout=timeout, every=1)


def rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of `pid` in KiB."""
    fields = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def calm_gets(calm: Tenant, run: str, seconds: float) -> dict:
    """The calm tenant's GETs (its run, its runs' list) one after another for `seconds`."""
    import requests

    s = requests.Session()
    h = {"Authorization": f"Bearer {calm.alice}"}
    times: list[float] = []
    errors = 0
    end = time.monotonic() + seconds
    paths = [f"/factory/provisioning/runs/{run}", "/factory/provisioning/runs"]
    i = 0
    while time.monotonic() < end:
        started = time.monotonic()
        try:
            r = s.get(calm.f.base + paths[i % 2], headers=h, timeout=60)
            if r.status_code != 200:
                errors += 1
        except requests.RequestException:
            errors += 1
        times.append((time.monotonic() - started) * 1000)
        i += 1
        time.sleep(0.02)
    return {"requests": len(times), "errors": errors, "p50Ms": round(percentile(times, 0.5), 1),
            "p99Ms": round(percentile(times, 0.99), 1), "maxMs": round(max(times, default=0), 1),
            "meanMs": round(statistics.fmean(times), 1) if times else None}


def streams(f: Ferry, token: str, clients: int, seconds: float, counts: list[int]) -> list[threading.Thread]:
    import requests

    def reader(k: int) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                with requests.get(f.base + "/factory/events/stream?after=0",
                                  headers={"Authorization": f"Bearer {token}"}, stream=True,
                                  timeout=(5, 30)) as r:
                    for chunk in r.iter_content(65536):
                        counts[k] += len(chunk)
                        # A slow client: the server must not hold what it has not sent.
                        time.sleep(0.01)
                        if time.monotonic() > end:
                            break
            except requests.RequestException:
                time.sleep(0.2)

    threads = [threading.Thread(target=reader, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    return threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True)
    p.add_argument("--ferry", required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--max-program-bytes", type=int, default=8 * 1024 * 1024)
    p.add_argument("--max-plan-resources", type=int, default=10_000)
    p.add_argument("--environments", type=int, default=3)
    p.add_argument("--seconds", type=float, default=180)
    p.add_argument("--quiet-seconds", type=float, default=30)
    p.add_argument("--streams", type=int, default=20)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    f = Ferry(args.base, args.ferry)
    calm = Tenant(f, f"calm-{args.run_id}")
    hogs = [Tenant(f, f"hog{k}-{args.run_id}") for k in (1, 2)]

    print("  calm tenant: one small applied run", flush=True)
    small, small_commit = git_program(args.data_dir, calm.name, program_text(1, 400, "calm"), "small")
    calm.environment("calm-dev")
    calm_run = calm.plan(calm.declare("calm-dev", small, small_commit))
    calm.settled(calm_run, timeout=120)

    rss0 = rss(args.pid)
    print(f"  quiet: the calm tenant's GETs alone for {args.quiet_seconds:.0f} s", flush=True)
    quiet = calm_gets(calm, calm_run, args.quiet_seconds)
    print(f"    {quiet}", flush=True)

    print(f"  hogs: programs of {args.max_plan_resources} resources, under {args.max_program_bytes} bytes", flush=True)
    big = program_text(args.max_plan_resources, args.max_program_bytes, "hog")
    specs = []
    for hog in hogs:
        program, commit = git_program(args.data_dir, hog.name, big, "big")
        for e in range(args.environments):
            env = f"hog-dev{e}"
            hog.environment(env)
            specs.append((hog, hog.declare(env, program, commit)))
    stop = threading.Event()
    plans: dict[str, list] = {"requested": [], "settled": []}
    lock = threading.Lock()

    def hog_loop(hog: Tenant, spec: dict) -> None:
        while not stop.is_set():
            try:
                run = hog.plan(spec)
                with lock:
                    plans["requested"].append(run)
                view = hog.settled(run)
                with lock:
                    plans["settled"].append({"run": run, "state": view.get("state")})
            except SystemExit as e:  # a timed-out wait: counted, the loop goes on
                with lock:
                    plans["settled"].append({"error": str(e)[:200]})

    samples: list[int] = []

    def sampler() -> None:
        while not stop.is_set():
            samples.append(rss(args.pid)[0])
            time.sleep(0.2)

    threads = [threading.Thread(target=hog_loop, args=(h, s), daemon=True) for h, s in specs]
    threads.append(threading.Thread(target=sampler, daemon=True))
    for t in threads:
        t.start()
    # Let the first plans start (and the hogs' history grow) before the streams come.
    time.sleep(5)
    streamed = [0] * args.streams
    stream_threads = streams(f, hogs[0].alice, args.streams, args.seconds, streamed)
    loaded = calm_gets(calm, calm_run, args.seconds)
    stop.set()
    for t in stream_threads:
        t.join(timeout=60)
    rss1 = rss(args.pid)
    print(f"    {loaded}; memory: max sampled {max(samples, default=0) // 1024} MiB, "
          f"peak {rss1[1] // 1024} MiB", flush=True)

    print("  over the limits: one plan each", flush=True)
    over = {}
    hog = hogs[0]
    hog.environment("hog-over")
    for label, text in (
        ("resources", program_text(args.max_plan_resources + 1, args.max_program_bytes, "hog")),
        ("bytes", program_text(10, args.max_program_bytes + 1024, "hog") + "#" + "x" * 2048 + "\n"),
    ):
        try:
            program, commit = git_program(args.data_dir, hog.name, text, f"over-{label}")
            run = hog.plan(hog.declare("hog-over", program, commit))
            view = hog.settled(run)
            over[label] = {"state": view.get("state"), "reason": (view.get("failure") or {}).get("reason")}
        except SystemExit as e:  # recorded: the figures above are still written
            over[label] = {"error": str(e)[:300]}
        print(f"    {label}: {over[label]}", flush=True)

    settled = plans["settled"]
    doc = {
        "limits": {"maxProgramBytes": args.max_program_bytes, "maxPlanResources": args.max_plan_resources,
                   "programFileBytes": len(big.encode())},
        "quiet": quiet,
        "hogs": {
            "seconds": args.seconds, "environmentsPerHog": args.environments,
            "plansRequested": len(plans["requested"]),
            "plansSettled": len([s for s in settled if "state" in s]),
            "states": {st: len([s for s in settled if s.get("state") == st])
                       for st in sorted({s.get("state") for s in settled if "state" in s})},
            "streams": args.streams, "streamedBytes": sum(streamed),
            "calm": loaded,
        },
        "memory": {"rssBeforeMiB": round(rss0[0] / 1024, 1),
                   "rssMaxSampledMiB": round(max(samples, default=0) / 1024, 1),
                   "rssAfterMiB": round(rss1[0] / 1024, 1),
                   "peakVmHWMMiB": round(rss1[1] / 1024, 1)},
        "overTheLimits": over,
    }
    pathlib.Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2), flush=True)


if __name__ == "__main__":
    main()
