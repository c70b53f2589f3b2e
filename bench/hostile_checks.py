"""Hostile-input checks for `bench/hostile.sh` (Issue 12, item 5).

Two uses:

* Imported by schemathesis (`SCHEMATHESIS_HOOKS=hostile_checks`, with `bench/` on
  `PYTHONPATH`): registers the check `problem_json_errors`, which every response of every
  generated case must pass: a status of 400 or more is `application/problem+json` and an
  RFC 9457 problem whose `status` is the response's.
* Run as a script: `seed` records tenant A's data as docs/walkthroughs.md does and
  writes the ids it made; `explicit` sends the hand-made hostile requests (oversized,
  deeply nested and non-UTF-8 bodies, tenant B's token on tenant A's ids, forged
  authorities, forged tokens); `schemathesis` turns a schemathesis run's reports into rows;
  `summary` prints the table of every row and exits non-zero when one failed.

Rows are appended to a JSON-lines file (`--results`): `{"section", "check", "ok", "detail"}`.
Only the standard library is needed, besides `requests` (a dependency of schemathesis).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time
import uuid
from typing import Any, Callable, Iterable

try:  # Imported by schemathesis as its hooks module.
    import schemathesis
except ImportError:  # pragma: no cover - the script itself does not need it
    schemathesis = None

PROBLEM = "application/problem+json"
PROBLEM_TYPE = re.compile(r"^urn:ferry:problem:[a-z0-9-]+$")


def problem_errors(status: int, content_type: str, body: bytes) -> list[str]:
    """What is wrong with an error response (empty when it is a proper problem+json)."""
    wrong = []
    media = content_type.split(";")[0].strip().lower()
    if media != PROBLEM:
        wrong.append(f"content-type {content_type!r}, not {PROBLEM}")
    try:
        doc = json.loads(body)
    except ValueError:
        wrong.append(f"body is not JSON: {body[:120]!r}")
        return wrong
    if not isinstance(doc, dict):
        wrong.append("body is not a JSON object")
        return wrong
    if doc.get("status") != status:
        wrong.append(f"problem status {doc.get('status')!r} != response status {status}")
    if not isinstance(doc.get("type"), str) or not PROBLEM_TYPE.match(doc["type"]):
        wrong.append(f"problem type {doc.get('type')!r}")
    for member in ("title", "detail"):
        if not isinstance(doc.get(member), str) or not doc[member]:
            wrong.append(f"problem {member} missing")
    return wrong


if schemathesis is not None:

    @schemathesis.check
    def problem_json_errors(ctx, response, case):  # noqa: ARG001 - schemathesis' signature
        """Every 4xx/5xx answer is an RFC 9457 problem+json document with its status."""
        if response.status_code < 400:
            return None
        values = response.headers.get("content-type") or response.headers.get("Content-Type") or [""]
        content_type = values[0] if isinstance(values, list) else str(values)
        wrong = problem_errors(response.status_code, content_type, response.content)
        if wrong:
            raise AssertionError(
                f"{response.status_code} is not problem+json: " + "; ".join(wrong)
            )
        return None


# ---------------------------------------------------------------------------------------
# The script.

READ = "factory.provisioning.read"
APPLY = "factory.provisioning.apply"
D_READ = "factory.delivery.read"
PROMOTE = "factory.delivery.promote"
OPERATE = "factory.delivery.operate"
PUBLISH = "factory.events.publish"
PERSON_SCOPES = [READ, APPLY, D_READ, PROMOTE, OPERATE]
ALL_SCOPES = PERSON_SCOPES + [PUBLISH]


class Results:
    """The rows of the summary, appended to a JSON-lines file as they are decided."""

    def __init__(self, path: str, section: str):
        self.path = path
        self.section = section
        self.failed = 0

    def row(self, check: str, ok: bool, detail: str = "") -> bool:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"section": self.section, "check": check, "ok": bool(ok), "detail": detail}) + "\n")
        mark = "ok  " if ok else "FAIL"
        print(f"  [{mark}] {self.section}: {check}" + (f" ({detail})" if detail and not ok else ""), flush=True)
        if not ok:
            self.failed += 1
        return ok


class Ferry:
    """A client of one running Ferry."""

    def __init__(self, base: str, binary: str):
        import requests

        self.base = base.rstrip("/")
        self.binary = binary
        self.http = requests.Session()
        self._tokens: dict[tuple, str] = {}

    def token(self, tenant: str, sub: str, roles: Iterable[str] = (), scopes: Iterable[str] | None = None) -> str:
        """`ferry token`: every scope a person may hold, or (no role) every scope."""
        roles = tuple(roles)
        scopes = tuple(scopes if scopes is not None else (PERSON_SCOPES if roles else ALL_SCOPES))
        key = (tenant, sub, roles, scopes)
        if key not in self._tokens:
            cmd = [self.binary, "token", "--tenant", tenant, "--sub", sub, "--scopes", " ".join(scopes)]
            if roles:
                cmd += ["--roles", " ".join(roles)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True)
            self._tokens[key] = out.stdout.strip()
        return self._tokens[key]

    def call(self, method: str, path: str, token: str | None = None, body: Any = None, *,
             data: bytes | None = None, headers: dict | None = None, timeout: float = 30):
        h = dict(headers or {})
        if token is not None:
            h.setdefault("Authorization", f"Bearer {token}")
        if body is not None:
            data = json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        return self.http.request(method, self.base + path, data=data, headers=h, timeout=timeout)

    def call_uploading(self, method: str, path: str, token: str, data: Any, ctype: str):
        """A body past the limit. Ferry answers 413 from the announced length and closes the
        connection without reading the rest; a client still uploading can meet the close
        before it reads the answer (its race, not a refusal missed: seen on a slow moment of
        the machine). The request is sent again, up to five times; None if every one met
        the close. `data` may be a function making the body (an iterator is used up)."""
        import requests
        for _ in range(5):
            body = data() if callable(data) else data
            try:
                return self.call(method, path, token, data=body, headers={"Content-Type": ctype})
            except requests.ConnectionError:
                continue
        return None


def j(r) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


def need(r, *statuses: int) -> Any:
    """The JSON of `r`, which must have one of `statuses` (seeding cannot go on otherwise)."""
    if r.status_code not in statuses:
        raise SystemExit(f"seeding: {r.request.method} {r.request.url} answered {r.status_code}: {r.text[:500]}")
    return j(r)


def eventually(what: str, fn: Callable[[], Any], timeout: float = 90, every: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        ok, last = fn()
        if ok:
            return last
        time.sleep(every)
    raise SystemExit(f"seeding: timed out waiting for {what}; last seen: {json.dumps(last)[:600]}")


# --- seed ------------------------------------------------------------------------------


SHOP_PROGRAM = ("name: shop\nruntime: yaml\nresources:\n  site:\n    type: aws:s3/bucket:Bucket\n"
                "    properties:\n      bucketPrefix: shop\noutputs:\n  siteId: ${site.id}\n")
GIT_USER = ["-c", "user.name=hostile", "-c", "user.email=hostile@example.com"]


def git(repo: pathlib.Path, *args: str, data: bytes | None = None) -> str:
    out = subprocess.run(["git", "-C", str(repo), *GIT_USER, *args], check=True, capture_output=True, input=data)
    return out.stdout.decode().strip()


def program_repo(data_dir: str, tenant: str, name: str = "hostile-demo") -> tuple[str, str]:
    """A Git repository with a Pulumi YAML program in the tenant's folder (its program
    root): the program reference and the commit."""
    repo = pathlib.Path(data_dir, "tenants", tenant).resolve() / name / "infra"
    (repo / "web").mkdir(parents=True, exist_ok=True)
    (repo / "web" / "Pulumi.yaml").write_text(SHOP_PROGRAM)
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "shop")
    return f"{repo}#web", git(repo, "rev-parse", "HEAD")


def crafted_repo(data_dir: str, tenant: str, name: str, entries: list[tuple[str, str, bytes]]) -> tuple[str, str]:
    """A repository whose commit's `infra` folder is exactly `entries` (mode, name, blob
    content), written as a raw tree object (`git hash-object -t tree --literally`), so it
    may hold what `git add` never would: the same name twice, links leaving the folder."""
    repo = pathlib.Path(data_dir, "tenants", tenant).resolve() / name
    repo.mkdir(parents=True, exist_ok=True)
    git(repo, "init", "-q")

    def tree(items: list[tuple[str, str, bytes]]) -> str:
        raw = b""
        for mode, entry, sha in items:
            raw += mode.encode() + b" " + entry.encode() + b"\0" + bytes.fromhex(sha.decode())
        return git(repo, "hash-object", "-t", "tree", "--literally", "-w", "--stdin", data=raw)

    blobs = [(mode, entry, git(repo, "hash-object", "-w", "--stdin", data=content).encode())
             for mode, entry, content in entries]
    infra = tree(blobs)
    root = tree([("40000", "infra", infra.encode())])
    commit = git(repo, "commit-tree", root, "-m", "crafted")
    return f"{repo}#infra", commit


def seed(args) -> None:
    f = Ferry(args.base, args.ferry)
    a = args.tenant_a
    admin = f.token(a, "platform", ["PlatformAdmin"])
    alice = f.token(a, "alice", ["Operator", "Reviewer"])
    # Environment names without the tenant's, so that the tenant's name in an answer to
    # tenant B can only be a leak.
    tag = a.rsplit("-", 1)[-1]
    env = {k: f"shop{tag}-{k}" for k in ("dev", "test", "staging", "prod", "ops")}
    classes = {"dev": "development", "test": "test", "staging": "staging", "prod": "production", "ops": "production"}

    program, commit = program_repo(args.data_dir, a)

    for k, name in env.items():
        need(f.call("PUT", f"/factory/environments/{name}", admin,
                    {"environmentClass": classes[k], "healthUrl": f"{f.base}/healthz"}), 200, 201)

    def declare(environment: str) -> dict:
        return need(f.call("POST", "/factory/provisioning/specifications", alice, {
            "environmentId": environment, "projectId": "shop", "kind": "Workload",
            "programRef": program, "programVersion": commit}), 201)

    def plan(spec: dict) -> str:
        run = need(f.call("POST", "/factory/provisioning/runs", alice, {
            "specificationId": spec["specificationId"], "specificationVersion": spec["version"],
            "environmentId": spec["environmentId"], "kind": "Release"}), 201)
        return run["provisioningRunId"]

    def run_state(run: str, *states: str) -> dict:
        def probe():
            r = j(f.call("GET", f"/factory/provisioning/runs/{run}", alice))
            return (r or {}).get("state") in states, r
        return eventually(f"run {run} in {states}", probe)

    spec_dev = declare(env["dev"])
    run_dev = plan(spec_dev)
    run_dev_view = run_state(run_dev, "Applied")
    spec_ops = declare(env["ops"])
    run_ops = plan(spec_ops)
    run_state(run_ops, "AwaitingApproval")
    print(f"  seeded runs: {run_dev} Applied in {env['dev']}, {run_ops} AwaitingApproval in {env['ops']}", flush=True)

    def release(version: str) -> str:
        rid = str(uuid.uuid4())
        need(f.call("PUT", f"/factory/delivery/releases/{rid}", admin, {
            "projectId": "shop", "version": version, "programRef": program, "programVersion": commit,
            "pipeline": [{"name": "unit", "result": "passed"}],
            "smokeChecks": [{"name": "api", "url": f"{f.base}/openapi.json"}]}), 201)
        return rid

    def promote(rid: str, environment: str) -> str:
        return need(f.call("POST", "/factory/delivery/promotions", alice,
                           {"releaseId": rid, "environmentId": environment}), 201)["promotionId"]

    def promotion(pid: str, cond: Callable[[dict], bool], what: str) -> dict:
        def probe():
            p = j(f.call("GET", f"/factory/delivery/promotions/{pid}", alice)) or {}
            if p.get("state") in ("Rejected", "Failed") and "Rejected" not in what and "Failed" not in what:
                raise SystemExit(f"seeding: promotion {pid} ended {p.get('state')}: {json.dumps(p)[:800]}")
            return cond(p), p
        return eventually(f"promotion {pid}: {what}", probe, timeout=120)

    r1 = release("1.0.0")
    promotions = {}
    for k in ("dev", "test", "staging"):
        promotions[k] = promote(r1, env[k])
        promotion(promotions[k], lambda p: p.get("state") == "Completed", "Completed")
    promotions["prod"] = promote(r1, env["prod"])
    promotion(promotions["prod"], lambda p: p.get("state") == "AwaitingApproval" and p.get("approval"),
              "AwaitingApproval with its approval")
    r2 = release("1.1.0")
    rolled = promote(r2, env["dev"])
    promotion(rolled, lambda p: p.get("state") == "Completed", "Completed")
    need(f.call("POST", f"/factory/delivery/promotions/{rolled}/rollback", alice,
                {"reason": "hostile bench: quarantine a release"}), 200)
    promotion(rolled, lambda p: p.get("state") == "RolledBack", "RolledBack")
    print(f"  seeded releases {r1}, {r2}; promotions {', '.join(promotions.values())}, {rolled} (RolledBack)", flush=True)

    urns = [res["urn"] for res in (run_dev_view.get("planReceipt") or {}).get("resources", []) if res.get("urn")]
    if not urns:
        raise SystemExit(f"seeding: run {run_dev} has no resources in its plan: {json.dumps(run_dev_view)[:600]}")
    rule = need(f.call("POST", f"/factory/provisioning/environments/{env['dev']}/ignore-rules", alice,
                       {"urn": urns[0], "property": "bucketPrefix", "reason": "hostile bench"}), 201)

    ids = {
        "tenantA": a, "tenantB": args.tenant_b, "environments": env, "program": program, "commit": commit,
        "specifications": {"dev": spec_dev["specificationId"], "ops": spec_ops["specificationId"]},
        "runs": {"devApplied": run_dev, "opsAwaitingApproval": run_ops},
        "releases": {"r1": r1, "r2Quarantined": r2},
        "promotions": {**promotions, "rolledBack": rolled},
        "ignoreRule": rule["ruleId"], "urn": urns[0],
    }
    pathlib.Path(args.out).write_text(json.dumps(ids, indent=2))
    print(f"  seeded tenant {a}: ids in {args.out}", flush=True)


# --- explicit checks -------------------------------------------------------------------


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def hs256(claims: dict, key: bytes, header: dict | None = None) -> str:
    head = b64url(json.dumps(header or {"alg": "HS256", "typ": "JWT"}).encode())
    body = b64url(json.dumps(claims).encode())
    sig = b64url(hmac.new(key, f"{head}.{body}".encode(), hashlib.sha256).digest())
    return f"{head}.{body}.{sig}"


def nested(depth: int) -> bytes:
    return b'{"environmentId":' + b"[" * depth + b"]" * depth + b"}"


def ids_in(text: str, ids: dict, sent: str = "") -> list[str]:
    """Which of tenant A's ids (and its name) occur in `text`, other than those the request
    itself carried (`sent`: an answer may name the id it was asked about)."""
    secrets = [ids["tenantA"], ids["urn"]]
    secrets += list(ids["specifications"].values()) + list(ids["runs"].values())
    secrets += list(ids["releases"].values()) + list(ids["promotions"].values()) + [ids["ignoreRule"]]
    return [s for s in secrets if s and s in text and s not in sent]


def explicit(args) -> None:
    ids = json.loads(pathlib.Path(args.ids).read_text())
    f = Ferry(args.base, args.ferry)
    a, b = ids["tenantA"], ids["tenantB"]
    env, runs, rel, prom = ids["environments"], ids["runs"], ids["releases"], ids["promotions"]
    alice = f.token(a, "alice", ["Operator", "Reviewer"])
    bob = f.token(a, "bob", ["Operator"])
    rita = f.token(a, "rita", ["Reviewer"])
    olga = f.token(a, "olga", ["Observer"])
    admin = f.token(a, "platform", ["PlatformAdmin"])
    service_a = f.token(a, "svc-runcontrol", [], [PUBLISH])
    b_person = f.token(b, "mallory", ["Operator", "PlatformAdmin", "Reviewer", "Observer"], PERSON_SCOPES)
    b_service = f.token(b, "svc-mallory", [], ALL_SCOPES)

    def problem_row(res: Results, name: str, r, statuses: Iterable[int], extra: Callable[[Any], str | None] | None = None):
        statuses = tuple(statuses)
        wrong = []
        if r.status_code not in statuses:
            wrong.append(f"status {r.status_code}, expected {'/'.join(map(str, statuses))}")
        if r.status_code >= 400:
            wrong += problem_errors(r.status_code, r.headers.get("content-type", ""), r.content)
        if extra is not None and not wrong:
            more = extra(j(r))
            if more:
                wrong.append(more)
        detail = "; ".join(wrong)
        if wrong:
            detail += f" | body: {r.text[:300]}"
        return res.row(name, not wrong, detail)

    def field_named(*fields: str):
        def check(doc):
            named = {e.get("field") for e in (doc or {}).get("errors", [])}
            if not (named & set(fields)) and not any(fld in json.dumps(doc) for fld in fields):
                return f"the problem names none of {fields}"
            return None
        return check

    # --- 1. hostile input --------------------------------------------------------------
    res = Results(args.results, "hostile input")
    huge = {"environmentId": env["dev"], "projectId": "shop", "kind": "Workload", "programRef": ids["program"],
            "programVersion": ids["commit"], "configRefs": {"pad": "file:///" + "x" * (300 * 1024)}}
    for path, token, ctype in [
        ("/factory/provisioning/specifications", alice, "application/json"),
        (f"/factory/provisioning/runs/{runs['opsAwaitingApproval']}/approval", bob, "application/json"),
        (f"/factory/environments/{env['dev']}", admin, "application/json"),
        ("/factory/events", service_a, "application/cloudevents+json"),
    ]:
        for size, data in [("300 KiB", json.dumps(huge).encode()), ("8 MiB", b'{"a":"' + b"x" * (8 << 20) + b'"}')]:
            method = "PUT" if path.startswith("/factory/environments/") else "POST"
            r = f.call_uploading(method, path, token, data, ctype)
            name = f"{size} body → {method} {short(path)}"
            if r is None:
                res.row(name, False, "the connection closed before an answer, five times")
            else:
                problem_row(res, name, r, range(400, 500))
    # A body past the limit whose length is not announced (chunked).
    name = "512 KiB chunked body → POST specifications"
    r = f.call_uploading("POST", "/factory/provisioning/specifications", alice,
                         lambda: iter([b'{"a":"'] + [b"x" * 65536] * 8 + [b'"}']), "application/json")
    if r is None:
        res.row(name, False, "the connection closed before an answer, five times")
    else:
        problem_row(res, name, r, range(400, 500))
    for path, token, ctype, method in [
        ("/factory/provisioning/specifications", alice, "application/json", "POST"),
        ("/factory/provisioning/runs", alice, "application/json", "POST"),
        (f"/factory/environments/{env['dev']}", admin, "application/json", "PUT"),
        ("/factory/delivery/promotions", alice, "application/json", "POST"),
        (f"/factory/provisioning/runs/{runs['opsAwaitingApproval']}/cancel", bob, "application/json", "POST"),
        ("/factory/provisioning/reconcile", alice, "application/json", "POST"),
        ("/factory/events", service_a, "application/cloudevents+json", "POST"),
    ]:
        r = f.call(method, path, token, data=nested(100_000), headers={"Content-Type": ctype})
        problem_row(res, f"100,000-deep JSON → {method} {short(path)}", r, range(400, 500))
    # 200 levels: past serde_json's limit of 128 yet far from the stack's.
    r = f.call("POST", "/factory/provisioning/specifications", alice, data=nested(200),
               headers={"Content-Type": "application/json"})
    problem_row(res, "200-deep JSON → POST specifications", r, range(400, 500))
    bad_utf8 = [
        ("lone continuation byte", b'{"environmentId": "\x80dev", "projectId": "shop"}'),
        ("overlong encoding", b'{"environmentId": "\xc0\xafdev"}'),
        ("UTF-16 surrogate as UTF-8", b'{"reason": "\xed\xa0\x80"}'),
        ("truncated sequence", b'{"reason": "\xe2\x82"}'),
        ("0xFF byte outside strings", b'{"reason": "x"}\xff'),
        ("lone surrogate escape", b'{"decision": "approve", "reason": "\\ud800"}'),
    ]
    for label, data in bad_utf8:
        for path, token, ctype, method in [
            ("/factory/provisioning/specifications", alice, "application/json", "POST"),
            (f"/factory/provisioning/runs/{runs['opsAwaitingApproval']}/approval", bob, "application/json", "POST"),
            ("/factory/events", service_a, "application/cloudevents+json", "POST"),
        ]:
            r = f.call(method, path, token, data=data, headers={"Content-Type": ctype})
            problem_row(res, f"invalid UTF-8 ({label}) → {method} {short(path)}", r, range(400, 500))
    for label, path in [
        ("path segment %FF", "/factory/provisioning/runs/%FF"),
        ("path segment %C0%AF", "/factory/environments/%C0%AF"),
        ("environment path %FF", "/factory/provisioning/environments/%FF/ignore-rules"),
        ("release path %ED%A0%80", "/factory/delivery/releases/%ED%A0%80"),
        ("query value %FF", "/factory/provisioning/runs?environmentId=%FF"),
        ("query name %FF", "/factory/delivery/promotions?%FF=1"),
    ]:
        r = f.call("GET", path, alice)
        problem_row(res, f"invalid UTF-8 in {label} → GET", r, range(400, 500))
    r = f.call("POST", "/factory/provisioning/runs/%FF/cancel", alice)
    problem_row(res, "invalid UTF-8 in path → POST cancel", r, range(400, 500))
    r = f.call("POST", f"/factory/delivery/releases/{rel['r2Quarantined']}/quarantines/%FF/lift", alice,
               {"reason": "x"})
    problem_row(res, "invalid UTF-8 in path → POST lift", r, range(400, 500))
    # Non-UTF-8 bytes in headers (raw latin-1 on the wire).
    r = f.call("GET", "/factory/provisioning/runs", headers={"Authorization": b"Bearer \xff\xfe"})
    problem_row(res, "invalid UTF-8 Authorization header → 401", r, [401])
    r = f.call("POST", "/factory/provisioning/runs", alice, data=b"{}",
               headers={"Content-Type": "application/json", "Idempotency-Key": b"k\xff"})
    problem_row(res, "invalid UTF-8 Idempotency-Key header → 4xx", r, range(400, 500))
    r = f.call("POST", "/factory/provisioning/specifications", alice, data=b'{"a":1}',
               headers={"Content-Type": b"application/json; charset=\xff"})
    problem_row(res, "invalid UTF-8 Content-Type header → 4xx", r, range(400, 500))
    # Other malformed requests.
    for label, method, path, token, data, ctype, statuses in [
        ("not JSON → 415", "POST", "/factory/provisioning/specifications", alice, b"environmentId=x", "application/x-www-form-urlencoded", [415]),
        ("no Content-Type → 415", "POST", "/factory/provisioning/specifications", alice, b"{}", None, [415]),
        ("empty body → 4xx", "POST", "/factory/provisioning/specifications", alice, b"", "application/json", range(400, 500)),
        ("JSON null → 4xx", "POST", "/factory/provisioning/runs", alice, b"null", "application/json", range(400, 500)),
        ("JSON array → 4xx", "POST", "/factory/delivery/promotions", alice, b"[]", "application/json", range(400, 500)),
        ("truncated JSON → 400", "POST", "/factory/provisioning/runs", alice, b'{"kind": "Rel', "application/json", [400]),
        ("NUL bytes in strings → 4xx", "POST", "/factory/provisioning/specifications", alice,
         json.dumps({"environmentId": "a\u0000b", "projectId": "\u0000", "kind": "Workload", "programRef": "\u0000#x", "programVersion": "\u0000"}).encode(), "application/json", range(400, 500)),
        ("1e400 number → 4xx", "POST", "/factory/provisioning/runs", alice, b'{"specificationVersion": 1e400}', "application/json", range(400, 500)),
        ("2^64 version → 4xx", "POST", "/factory/provisioning/runs", alice,
         json.dumps({"specificationId": ids["specifications"]["dev"], "specificationVersion": 2**64, "environmentId": env["dev"], "kind": "Release"}).encode(), "application/json", range(400, 500)),
        ("unknown path → 404", "GET", "/factory/nothing-here", alice, None, None, [404]),
        ("wrong method → 405", "DELETE", f"/factory/provisioning/runs/{runs['devApplied']}", alice, None, None, [405]),
        ("run id not a UUID → 404", "GET", "/factory/provisioning/runs/..%2F..%2Fetc%2Fpasswd", alice, None, None, [404]),
        ("environment id with a slash → 4xx", "GET", "/factory/environments/a%2Fb", alice, None, None, range(400, 500)),
        ("unknown query parameter → 400", "GET", "/factory/provisioning/runs?tenant=" + b, alice, None, None, [400]),
        ("limit 0 → 400", "GET", "/factory/delivery/promotions?limit=0", alice, None, None, [400]),
        ("forged cursor → 400", "GET", "/factory/provisioning/runs?cursor=" + "A" * 64, alice, None, None, [400]),
        ("SSE after= not a position → 400", "GET", "/factory/events/stream?after=-1", alice, None, None, [400]),
    ]:
        headers = {"Content-Type": ctype} if ctype else {}
        r = f.call(method, path, token, data=data, headers=headers)
        problem_row(res, label, r, statuses)
    r = f.call("GET", "/factory/provisioning/runs", headers={"Authorization": "Bearer " + "a" * 20000})
    problem_row(res, "20 kB bearer token → 4xx", r, range(400, 500))
    res.row("server still answers after the hostile input",
            f.call("GET", "/healthz").status_code == 200)

    # --- 2. tenant B on tenant A's ids -------------------------------------------------
    res = Results(args.results, "tenancy")

    def cross(name: str, method: str, path: str, random_path: str | None, body: Any = None,
              statuses: Iterable[int] = (404,), token: str = b_person, headers: dict | None = None):
        """B's token on A's id: the expected status, none of A's data, and the same answer as
        for an id that exists nowhere (else the answer tells A's ids from unknown ones)."""
        r = f.call(method, path, token, body, headers=headers)
        leaked = ids_in(r.text, ids, sent=path + json.dumps(body))
        ok = problem_row(res, name, r, statuses, lambda _doc: f"A's data in the answer: {leaked}" if leaked else None)
        if ok and random_path is not None:
            other = f.call(method, random_path, token, body, headers=headers)
            same = other.status_code == r.status_code
            res.row(f"{name}: same answer as an unknown id", same,
                    "" if same else f"A's id {r.status_code}, unknown id {other.status_code}")

    def fresh():
        return str(uuid.uuid4())

    def random_env():
        return f"nowhere-{uuid.uuid4().hex[:8]}"

    run_a, run_ops = runs["devApplied"], runs["opsAwaitingApproval"]
    cross("GET run", "GET", f"/factory/provisioning/runs/{run_a}", f"/factory/provisioning/runs/{fresh()}")
    cross("GET run awaiting approval", "GET", f"/factory/provisioning/runs/{run_ops}", None)
    cross("GET run logs", "GET", f"/factory/provisioning/runs/{run_a}/logs", f"/factory/provisioning/runs/{fresh()}/logs")
    cross("GET environment", "GET", f"/factory/environments/{env['dev']}", f"/factory/environments/{random_env()}")
    cross("GET current specification", "GET", f"/factory/provisioning/environments/{env['dev']}/current-specification",
          f"/factory/provisioning/environments/{random_env()}/current-specification")
    cross("GET current release", "GET", f"/factory/environments/{env['dev']}/current-release",
          f"/factory/environments/{random_env()}/current-release")
    cross("GET release", "GET", f"/factory/delivery/releases/{rel['r1']}", f"/factory/delivery/releases/{fresh()}")
    cross("GET quarantined release", "GET", f"/factory/delivery/releases/{rel['r2Quarantined']}", None)
    for k in ("dev", "prod", "rolledBack"):
        cross(f"GET promotion ({k})", "GET", f"/factory/delivery/promotions/{prom[k]}",
              f"/factory/delivery/promotions/{fresh()}" if k == "dev" else None)
    # A list of an environment's rules is 200 (documented without 404): never A's rules.
    cross("GET ignore rules (a list: 200, empty)", "GET", f"/factory/provisioning/environments/{env['dev']}/ignore-rules",
          f"/factory/provisioning/environments/{random_env()}/ignore-rules", statuses=[200])
    for label, path in [
        ("runs?environmentId", f"/factory/provisioning/runs?environmentId={env['dev']}"),
        ("runs", "/factory/provisioning/runs?limit=200"),
        ("specifications?specificationId", f"/factory/provisioning/specifications?specificationId={ids['specifications']['dev']}"),
        ("specifications?environmentId", f"/factory/provisioning/specifications?environmentId={env['ops']}"),
        ("specifications", "/factory/provisioning/specifications?limit=200"),
        ("promotions?releaseId", f"/factory/delivery/promotions?releaseId={rel['r1']}"),
        ("promotions?environmentId", f"/factory/delivery/promotions?environmentId={env['prod']}"),
        ("promotions", "/factory/delivery/promotions?limit=200"),
        ("releases?projectId", "/factory/delivery/releases?projectId=shop"),
        ("proposals?environmentId", f"/factory/provisioning/proposals?environmentId={env['dev']}"),
    ]:
        r = f.call("GET", path, b_person)
        doc = j(r) or {}
        leaked = ids_in(r.text, ids, sent=path)
        res.row(f"list {label}: 200, no A item", r.status_code == 200 and not leaked and isinstance(doc.get("items"), list),
                f"status {r.status_code}, A's ids {leaked}")
    # The event stream: B's events only.
    text = sse(f, "/factory/events/stream?after=0", b_person, seconds=3)
    leaked = ids_in(text, ids)
    res.row("SSE stream from 0: no A event", not leaked, f"A's ids in B's stream: {leaked}")
    # Commands on A's ids.
    cross("POST approve A's run", "POST", f"/factory/provisioning/runs/{run_ops}/approval",
          f"/factory/provisioning/runs/{fresh()}/approval", {"decision": "approve", "reason": "b"})
    cross("POST cancel A's run", "POST", f"/factory/provisioning/runs/{run_ops}/cancel",
          f"/factory/provisioning/runs/{fresh()}/cancel", {"reason": "b"})
    cross("POST approve A's promotion", "POST", f"/factory/delivery/promotions/{prom['prod']}/approval",
          f"/factory/delivery/promotions/{fresh()}/approval", {"decision": "approve"})
    cross("POST roll A's promotion back", "POST", f"/factory/delivery/promotions/{prom['staging']}/rollback",
          f"/factory/delivery/promotions/{fresh()}/rollback", {"reason": "b"})
    cross("POST decide A's verification", "POST", f"/factory/delivery/promotions/{prom['dev']}/verification",
          f"/factory/delivery/promotions/{fresh()}/verification", {"outcome": "Failed", "reason": "b"})
    # 409 "not quarantined" by design (tests/promotions.rs: "another tenant sees no
    # quarantine"), the answer for any release B does not have.
    cross("POST lift A's quarantine (404/409)", "POST",
          f"/factory/delivery/releases/{rel['r2Quarantined']}/quarantines/{env['dev']}/lift",
          f"/factory/delivery/releases/{fresh()}/quarantines/{env['dev']}/lift", {"reason": "b"},
          statuses=[404, 409])
    cross("POST remove A's ignore rule", "POST",
          f"/factory/provisioning/environments/{env['dev']}/ignore-rules/{ids['ignoreRule']}/remove",
          f"/factory/provisioning/environments/{random_env()}/ignore-rules/{fresh()}/remove", {"reason": "b"})
    cross("POST reconcile A's environment", "POST", "/factory/provisioning/reconcile", None,
          {"environmentId": env["dev"]})
    # Bodies naming A's records: an unknown referenced record (422), as for any unknown id.
    cross("POST run of A's specification (body)", "POST", "/factory/provisioning/runs", None,
          {"specificationId": ids["specifications"]["dev"], "specificationVersion": 1,
           "environmentId": env["dev"], "kind": "Release"}, statuses=[422])
    cross("POST promotion of A's release (body)", "POST", "/factory/delivery/promotions", None,
          {"releaseId": rel["r1"], "environmentId": env["dev"]}, statuses=[422])
    # Events: B's service speaking for A, or naming A's run from B.
    decided = lambda tenant, run, approval=None, **data: {  # noqa: E731
        "specversion": "1.0", "id": f"hostile-{uuid.uuid4()}", "source": "urn:runcontrol",
        "type": "runcontrol.approvals.v1.approval-decided", "tenantid": tenant,
        "data": {"approvalId": approval or str(uuid.uuid4()), "tenantId": tenant, "provisioningRunId": run,
                 "decision": "approve", "decidedBy": "bob", **data}}
    r = f.call("POST", "/factory/events", b_service, data=json.dumps(decided(a, run_ops)).encode(),
               headers={"Content-Type": "application/cloudevents+json"})
    problem_row(res, "B's service posts an ApprovalDecided for tenant A → 403", r, [403])
    r = f.call("POST", "/factory/events", b_service, data=json.dumps(decided(b, run_ops)).encode(),
               headers={"Content-Type": "application/cloudevents+json"})
    res.row("B's service approves A's run id in B's name: no effect on A", r.status_code < 500,
            f"status {r.status_code}: {r.text[:200]}")
    # B records an environment and a release under A's names and ids: B's own, new records.
    r = f.call("PUT", f"/factory/environments/{env['ops']}", b_person, {"environmentClass": "development"})
    res.row("PUT A's environment name from B: a new record of B's (201)", r.status_code == 201 and not ids_in(r.text, ids),
            f"status {r.status_code}: {r.text[:200]}")
    r = f.call("PUT", f"/factory/delivery/releases/{rel['r1']}", b_person, {
        "projectId": "mallory", "version": "6.6.6", "programRef": f"/nowhere/{b}#x", "programVersion": "3f2a9c1",
        "pipeline": []})
    res.row("PUT A's release id from B: never A's record", r.status_code in (201, 422) and not ids_in(r.text, ids, sent=rel["r1"]),
            f"status {r.status_code}: {r.text[:200]}")

    # --- 3. forged authorities (tenant A) ----------------------------------------------
    res = Results(args.results, "forged authority")
    spec_ops = ids["specifications"]["ops"]
    plan_body = {"specificationId": spec_ops, "specificationVersion": 1, "environmentId": env["ops"], "kind": "Release"}
    for extra in [{"promotionId": prom["prod"]}, {"approvalId": str(uuid.uuid4())},
                  {"promotionId": prom["prod"], "approvalId": str(uuid.uuid4())}]:
        r = f.call("POST", "/factory/provisioning/runs", alice, {**plan_body, **extra})
        problem_row(res, f"plan naming {'+'.join(extra)} → 422", r, [422], field_named(*extra))
    forged_fields = {
        "POST run approval": ("POST", f"/factory/provisioning/runs/{run_ops}/approval", bob,
                              {"decision": "approve"}, ["decidedBy", "approvedBy", "approvalId", "tenantId", "actor"]),
        "POST promotion approval": ("POST", f"/factory/delivery/promotions/{prom['prod']}/approval", rita,
                                    {"decision": "approve"}, ["decidedBy", "approvedBy", "approvalId", "tenantId", "requestedBy"]),
        "POST ignore rule": ("POST", f"/factory/provisioning/environments/{env['dev']}/ignore-rules", alice,
                             {"urn": ids["urn"], "reason": "r"}, ["addedBy", "tenantId", "ruleId", "addedAt"]),
        "POST run": ("POST", "/factory/provisioning/runs", alice, plan_body, ["requestedBy", "tenantId", "environmentClass"]),
        "POST promotion": ("POST", "/factory/delivery/promotions", alice, {"releaseId": rel["r1"], "environmentId": env["prod"]},
                           ["approvalId", "approvedBy", "requestedBy", "tenantId"]),
        "PUT environment": ("PUT", f"/factory/environments/{env['ops']}", admin, {"environmentClass": "development"},
                            ["recordedBy", "tenantId", "loweredBy"]),
        "POST specification": ("POST", "/factory/provisioning/specifications", alice,
                               {"environmentId": env["ops"], "projectId": "shop", "kind": "Workload",
                                "programRef": ids["program"], "programVersion": ids["commit"]},
                               ["declaredBy", "tenantId", "specificationId"]),
        "PUT release": ("PUT", f"/factory/delivery/releases/{rel['r1']}", admin,
                        {"projectId": "shop", "version": "1.0.0", "programRef": ids["program"],
                         "programVersion": ids["commit"], "pipeline": []}, ["recordedBy", "tenantId"]),
        "POST cancel": ("POST", f"/factory/provisioning/runs/{run_ops}/cancel", alice, {"reason": "r"},
                        ["cancelledBy", "tenantId"]),
        "POST rollback": ("POST", f"/factory/delivery/promotions/{prom['staging']}/rollback", alice, {"reason": "r"},
                          ["rolledBackBy", "tenantId", "restoredReleaseId"]),
        "POST lift": ("POST", f"/factory/delivery/releases/{rel['r2Quarantined']}/quarantines/{env['dev']}/lift", alice,
                      {"reason": "r"}, ["promotionId", "liftedBy", "tenantId"]),
        "POST verification": ("POST", f"/factory/delivery/promotions/{prom['dev']}/verification", alice,
                              {"outcome": "Passed", "reason": "r"}, ["decidedBy", "tenantId"]),
        "POST reconcile": ("POST", "/factory/provisioning/reconcile", alice, {"environmentId": env["dev"]},
                           ["tenantId", "requestedBy"]),
    }
    for label, (method, path, token, body, fields) in forged_fields.items():
        for fld in fields:
            value = a if fld == "tenantId" else (str(uuid.uuid4()) if fld.endswith("Id") else "someone-else")
            r = f.call(method, path, token, {**body, fld: value})
            problem_row(res, f"{label} carrying {fld} → 422", r, [422], field_named(fld))
    # The requester cannot approve.
    r = f.call("POST", f"/factory/provisioning/runs/{run_ops}/approval", alice, {"decision": "approve"})
    problem_row(res, "requester approves her own run → 403", r, [403])
    # Another spelling of the requester is the requester (`ferry token` refuses a hidden
    # character in --sub, as the API refuses such a token: tests/security.rs).
    for sub in ["Alice", "alice ", "ＡＬＩＣＥ"]:
        r = f.call("POST", f"/factory/provisioning/runs/{run_ops}/approval",
                   f.token(a, sub, ["Operator"]), {"decision": "approve"})
        problem_row(res, f"requester as {sub!r} approves her own run → 403", r, [403])
    r = f.call("POST", f"/factory/delivery/promotions/{prom['prod']}/approval", alice, {"decision": "approve"})
    problem_row(res, "requester (also a Reviewer) approves her own promotion → 403", r, [403])
    # Roles a token does not carry.
    for label, method, path, token, body in [
        ("Observer (every scope) approves a run", "POST", f"/factory/provisioning/runs/{run_ops}/approval", olga, {"decision": "approve"}),
        ("Observer (every scope) cancels a run", "POST", f"/factory/provisioning/runs/{run_ops}/cancel", olga, None),
        ("Reviewer approves a run (needs Operator/PlatformAdmin)", "POST", f"/factory/provisioning/runs/{run_ops}/approval", rita, {"decision": "approve"}),
        ("Operator approves a promotion (needs Reviewer/PlatformAdmin)", "POST", f"/factory/delivery/promotions/{prom['prod']}/approval", bob, {"decision": "approve"}),
        ("Operator records an environment (needs PlatformAdmin)", "PUT", f"/factory/environments/{env['ops']}", bob, {"environmentClass": "development"}),
        ("Operator records a release (needs PlatformAdmin)", "PUT", f"/factory/delivery/releases/{uuid.uuid4()}", bob,
         {"projectId": "shop", "version": "9.9.9", "programRef": ids["program"], "programVersion": ids["commit"], "pipeline": []}),
        ("Reviewer requests a promotion", "POST", "/factory/delivery/promotions", rita, {"releaseId": rel["r1"], "environmentId": env["prod"]}),
        ("Observer adds an ignore rule", "POST", f"/factory/provisioning/environments/{env['dev']}/ignore-rules", olga, {"urn": ids["urn"], "reason": "r"}),
        ("Observer reconciles", "POST", "/factory/provisioning/reconcile", olga, None),
    ]:
        r = f.call(method, path, token, body)
        problem_row(res, f"{label} → 403", r, [403])
    # Another service's events from a person, and the requester through run control.
    # `ferry token` will not mint these (a person's token with the publish scope); an
    # identity provider might: signed here with the server's key.
    key = os.environ.get("FERRY_JWT_HS256_KEY", "").encode()
    now = int(time.time())
    person = lambda sub, roles: hs256({"sub": sub, "tenant": a, "scope": " ".join(ALL_SCOPES),  # noqa: E731
                                       "roles": roles, "exp": now + 600, "iat": now}, key)
    person_publisher = person("alice", ["Operator", "Reviewer"])
    admin_publisher = person("platform", ["PlatformAdmin"])
    for label, token in [("Operator with the publish scope", person_publisher),
                         ("PlatformAdmin with the publish scope", admin_publisher)]:
        r = f.call("POST", "/factory/events", token, data=json.dumps(decided(a, run_ops)).encode(),
                   headers={"Content-Type": "application/cloudevents+json"})
        problem_row(res, f"{label} posts run control's ApprovalDecided → 403", r, [403])
    env_created = {"specversion": "1.0", "id": f"hostile-{uuid.uuid4()}", "source": "urn:environments",
                   "type": "environments.v1.environment-created", "tenantid": a,
                   "data": {"environmentId": env["ops"], "tenantId": a, "environmentClass": "development"}}
    r = f.call("POST", "/factory/events", person_publisher, data=json.dumps(env_created).encode(),
               headers={"Content-Type": "application/cloudevents+json"})
    problem_row(res, "a person re-classes production through EnvironmentCreated → 403", r, [403])
    r = f.call("POST", "/factory/events", service_a, data=json.dumps(decided(a, run_ops, decidedBy="alice")).encode(),
               headers={"Content-Type": "application/cloudevents+json"})
    problem_row(res, "run control names the requester as approver → refused", r, range(400, 500))
    promo_view = j(f.call("GET", f"/factory/delivery/promotions/{prom['prod']}", alice)) or {}
    wrong = {"specversion": "1.0", "id": f"hostile-{uuid.uuid4()}", "source": "urn:runcontrol",
             "type": "runcontrol.approvals.v1.approval-decided", "tenantid": a,
             "data": {"approvalId": str(uuid.uuid4()), "tenantId": a, "promotionId": prom["prod"],
                      "decision": "approve", "decidedBy": "carol"}}
    r = f.call("POST", "/factory/events", service_a, data=json.dumps(wrong).encode(),
               headers={"Content-Type": "application/cloudevents+json"})
    problem_row(res, "ApprovalDecided with another approval's id for the promotion → refused", r, range(400, 500))
    # Forged tokens.
    good_claims = {"sub": "alice", "tenant": a, "scope": " ".join(ALL_SCOPES), "roles": ["PlatformAdmin", "Operator", "Reviewer"], "exp": now + 600, "iat": now}
    b_token_parts = b_person.split(".")
    tampered = b_token_parts[0] + "." + b64url(json.dumps({**json.loads(base64.urlsafe_b64decode(b_token_parts[1] + "==")), "tenant": a}).encode()) + "." + b_token_parts[2]
    for label, token in [
        ("alg none", b64url(b'{"alg":"none","typ":"JWT"}') + "." + b64url(json.dumps(good_claims).encode()) + "."),
        ("signed with another key", hs256(good_claims, b"not-the-key-of-this-ferry-0123456789abcdef")),
        ("B's token with its tenant changed to A", tampered),
        ("expired", hs256({**good_claims, "exp": now - 3600}, key)),
        ("HS256 token signed with an empty key", hs256(good_claims, b"")),
        ("RS256 header on an HS256 signature", hs256(good_claims, key, {"alg": "RS256", "typ": "JWT"})),
        ("garbage", "not.a.token"),
    ]:
        r = f.call("POST", f"/factory/provisioning/runs/{run_ops}/approval", token, {"decision": "approve"})
        problem_row(res, f"token {label} → 401", r, [401])
    if key:
        r = f.call("GET", f"/factory/provisioning/runs/{run_ops}", hs256({**good_claims, "tenant": None}, key))
        problem_row(res, "a verified token without a tenant → 401/403", r, [401, 403])
    r = f.call("GET", "/factory/provisioning/runs", headers={"Authorization": "Basic YWxpY2U6YWxpY2U="})
    problem_row(res, "Basic credentials → 401", r, [401])

    # --- probes and queries: only what the tenant may reach (issue 37, section 6) -----
    res = Results(args.results, "probes and queries")
    port = args.base.rsplit(":", 1)[-1]
    for url in [f"http://2130706433:{port}/metrics", f"http://0x7f.1:{port}/metrics",
                f"http://[::ffff:127.0.0.1]:{port}/metrics", f"http://localhost:{port}/metrics",
                "http://169.254.169.254/latest/meta-data/", "http://10.0.0.7:9000/admin"]:
        r = f.call("PUT", f"/factory/environments/{env['dev']}", admin,
                   {"environmentClass": "development", "healthUrl": url})
        problem_row(res, f"health URL {url} → 422", r, [422], field_named("healthUrl"))
    for query in ['sum(rate(errors{tenant="%s"}[5m]))' % b, 'sum(errors{tenant=~".*"})',
                  'sum(errors{tenant!="%s"})' % a]:
        r = f.call("PUT", f"/factory/environments/{env['dev']}", admin,
                   {"environmentClass": "development", "slo": {"query": query, "threshold": 1}})
        problem_row(res, f"SLO query naming another tenant's series {query} → 422", r, [422],
                    field_named("slo.query"))

    # --- tenant isolation (issue 37): checkouts, ids, loops, authority, text ---------
    res = Results(args.results, "tenant isolation")
    iso_env = f"{env['dev']}-iso"
    need(f.call("PUT", f"/factory/environments/{iso_env}", admin, {"environmentClass": "development"}), 200, 201)

    def plan_failure(program: str, commit: str) -> dict:
        spec = need(f.call("POST", "/factory/provisioning/specifications", alice, {
            "environmentId": iso_env, "projectId": "shop", "kind": "Workload",
            "programRef": program, "programVersion": commit}), 201)
        run = need(f.call("POST", "/factory/provisioning/runs", alice, {
            "specificationId": spec["specificationId"], "specificationVersion": spec["version"],
            "environmentId": iso_env, "kind": "Release"}), 201)["provisioningRunId"]

        def probe():
            v = j(f.call("GET", f"/factory/provisioning/runs/{run}", alice)) or {}
            return v.get("state") not in ("Requested", None), v
        return eventually(f"run {run} planned or failed", probe)

    # 1. A chain of links that leaves the checkout, then a name twice (a link out, then a blob).
    sentinel = pathlib.Path(args.data_dir, "sentinel.txt")
    sentinel.write_text("untouched")
    link, blob = "120000", "100644"
    chain = pathlib.Path(args.data_dir, "tenants", a).resolve() / "chain"
    (chain / "infra" / "a" / "b" / "c" / "d").mkdir(parents=True, exist_ok=True)
    # Each link is inside the program when read alone; followed, the second lands outside.
    os.symlink("../../../..", chain / "infra" / "a" / "b" / "c" / "d" / "l")
    os.symlink("a/b/c/d/l/../../../../../../../../sentinel.txt", chain / "infra" / "Pulumi.yaml")
    git(chain, "init", "-q")
    git(chain, "add", ".")
    git(chain, "commit", "-qm", "chain")
    program, commit = f"{chain}#infra", git(chain, "rev-parse", "HEAD")
    view = plan_failure(program, commit)
    res.row("a program whose link leaves the checkout fails naming the entry",
            view.get("state") == "Failed" and "infra/Pulumi.yaml" in json.dumps(view), json.dumps(view)[:400])
    program, commit = crafted_repo(args.data_dir, a, "twice", [
        (blob, "Pulumi.yaml", SHOP_PROGRAM.encode()),
        (link, "x", str(sentinel).encode()),
        (blob, "x", b"PWNED"),
    ])
    view = plan_failure(program, commit)
    res.row("a tree holding a name twice (link, then blob) fails naming it",
            view.get("state") == "Failed" and "infra/x" in json.dumps(view), json.dumps(view)[:400])
    res.row("nothing outside the checkout was written", sentinel.read_text() == "untouched", sentinel.read_text()[:80])

    # 2. A tenant named like Ferry's internal names takes none of A's ids.
    squatter = f.token("promotion", "mallory", ["PlatformAdmin", "Operator"])
    need(f.call("PUT", "/factory/environments/p-dev", squatter, {"environmentClass": "development"}), 200, 201)
    s_program, s_commit = program_repo(args.data_dir, "promotion", "squat")
    s_spec = need(f.call("POST", "/factory/provisioning/specifications", squatter, {
        "environmentId": "p-dev", "projectId": "shop", "kind": "Workload",
        "programRef": s_program, "programVersion": s_commit}), 201)
    before = json.dumps(j(f.call("GET", f"/factory/delivery/promotions/{prom['prod']}", alice)) or {})
    for key in (f"{prom['prod']}/0", f"{prom['prod']}/1", f"promotion/{prom['prod']}/0"):
        r = f.call("POST", "/factory/provisioning/runs", squatter, {
            "specificationId": s_spec["specificationId"], "specificationVersion": s_spec["version"],
            "environmentId": "p-dev", "kind": "Release"}, headers={"Idempotency-Key": key})
        rid = (j(r) or {}).get("provisioningRunId", "")
        res.row(f"tenant 'promotion' with Idempotency-Key {key!r} gets none of A's run ids",
                r.status_code == 201 and rid and rid not in before, f"{r.status_code}: {r.text[:200]}")

    # 3. A request a loop would fail on is refused when made.
    r = f.call("POST", "/factory/provisioning/specifications", alice, {
        "environmentId": env["dev"], "projectId": "other", "kind": "Workload",
        "programRef": ids["program"], "programVersion": ids["commit"]})
    problem_row(res, "re-declaring a specification under another project → 422 projectId", r, [422],
                field_named("projectId"))

    # 5. One PlatformAdmin alone cannot take production out of production.
    r = f.call("PUT", f"/factory/environments/{env['ops']}", admin, {"environmentClass": "development"})
    lowered = j(r) or {}
    res.row("a lone PlatformAdmin lowering production → 202, still production",
            r.status_code == 202 and lowered.get("environmentClass") == "production", f"{r.status_code}: {r.text[:200]}")
    r = f.call("POST", f"/factory/environments/{env['ops']}/class-lowering", admin, {"decision": "approve"})
    problem_row(res, "the same PlatformAdmin approving her own lowering → 403", r, [403])
    r = f.call("POST", f"/factory/environments/{env['ops']}/class-lowering", f.token(a, "patty", ["PlatformAdmin"]),
               {"decision": "reject"})
    res.row("a second PlatformAdmin refuses it → 200", r.status_code == 200, f"{r.status_code}: {r.text[:200]}")

    # 8. Text and links a console will render.
    def release_with(pipeline: list, **extra) -> Any:
        return f.call("PUT", f"/factory/delivery/releases/{uuid.uuid4()}", admin, {
            "projectId": "shop", "version": "8.0.0", "programRef": ids["program"], "programVersion": ids["commit"],
            "pipeline": pipeline, **extra})
    for label, pipeline, fld in [
        ("javascript: link", [{"name": "unit", "result": "passed", "url": "javascript:alert(1)"}], "pipeline[0].url"),
        ("data: link", [{"name": "unit", "result": "passed", "url": "data:text/html,<script>alert(1)</script>"}], "pipeline[0].url"),
        ("ANSI escapes in a name", [{"name": "\x1b[2J\x1b[31munit", "result": "passed"}], "pipeline[0].name"),
        ("a right-to-left override in a name", [{"name": "unit\u202etxt.exe", "result": "passed"}], "pipeline[0].name"),
        ("a 300-character name", [{"name": "n" * 300, "result": "passed"}], "pipeline[0].name"),
    ]:
        problem_row(res, f"release pipeline with {label} → 422 {fld}", release_with(pipeline), [422], field_named(fld))
    r = release_with([{"name": "unit", "result": "passed"}], hasAgentGeneratedAssets=True,
                     evaluationEvidence={"passed": True, "summary": "s" * 250_000})
    problem_row(res, "a 250 KB evaluation summary → 422", r, [422], field_named("evaluationEvidence.summary"))
    r = release_with([{"name": "<script>alert(1)</script>", "result": "passed", "url": "https://ci.example.com/1"}])
    res.row("markup in a name is kept as text and answered as JSON",
            r.status_code == 201 and r.headers.get("content-type", "").startswith("application/json")
            and "<script>alert(1)</script>" in r.text, f"{r.status_code}: {r.text[:200]}")
    r = f.call("POST", f"/factory/delivery/releases/{rel['r2Quarantined']}/quarantines/{env['dev']}/lift", bob,
               {"reason": "r" * 250_000})
    problem_row(res, "a 250 KB reason → 422 reason", r, [422], field_named("reason"))
    r = f.call("POST", f"/factory/provisioning/runs/{runs['opsAwaitingApproval']}/cancel", bob,
               {"reason": "ok\x1b]8;;https://evil.example\x07click\x1b]8;;\x07"})
    problem_row(res, "a terminal hyperlink escape in a reason → 422 reason", r, [422], field_named("reason"))

    # --- 4. afterwards: nothing moved, and the rules are not merely broken -------------
    res = Results(args.results, "state after")
    run_view = j(f.call("GET", f"/factory/provisioning/runs/{run_ops}", alice)) or {}
    res.row("A's production run still AwaitingApproval, unapproved", run_view.get("state") == "AwaitingApproval"
            and not (run_view.get("authorization") or {}).get("approvedBy"), json.dumps(run_view)[:300])
    p = j(f.call("GET", f"/factory/delivery/promotions/{prom['prod']}", alice)) or {}
    res.row("A's production promotion still AwaitingApproval, undecided",
            p.get("state") == "AwaitingApproval" and not p.get("approvalDecision"), json.dumps(p)[:300])
    rules = j(f.call("GET", f"/factory/provisioning/environments/{env['dev']}/ignore-rules", alice)) or {}
    res.row("A's ignore rule still in force", any(x.get("ruleId") == ids["ignoreRule"] for x in rules.get("rules", [])),
            json.dumps(rules)[:300])
    ops_env = j(f.call("GET", f"/factory/environments/{env['ops']}", alice)) or {}
    res.row("A's production environment still production", ops_env.get("environmentClass") == "production",
            json.dumps(ops_env)[:300])
    r1 = j(f.call("GET", f"/factory/delivery/releases/{rel['r1']}", alice)) or {}
    res.row("A's release unchanged", (r1.get("release") or r1).get("version") == "1.0.0" or r1.get("version") == "1.0.0",
            json.dumps(r1)[:300])
    staging = j(f.call("GET", f"/factory/delivery/promotions/{prom['staging']}", alice)) or {}
    res.row("A's staging promotion not rolled back", staging.get("state") == "Completed", json.dumps(staging)[:200])
    lift = f.call("POST", f"/factory/delivery/releases/{rel['r2Quarantined']}/quarantines/{env['dev']}/lift", bob,
                  {"reason": "hostile bench: positive control"})
    res.row("control: A's Operator lifts A's quarantine → 200", lift.status_code == 200, f"{lift.status_code}: {lift.text[:200]}")
    ok = f.call("POST", f"/factory/provisioning/runs/{run_ops}/approval", bob, {"decision": "approve", "reason": "control"})
    res.row("control: another Operator approves the run → 200", ok.status_code == 200, f"{ok.status_code}: {ok.text[:200]}")
    ok = f.call("POST", f"/factory/delivery/promotions/{prom['prod']}/approval", rita, {"decision": "approve", "reason": "control"})
    res.row("control: another Reviewer approves the promotion → 200", ok.status_code == 200
            and ((j(ok) or {}).get("approvalDecision") or {}).get("decidedBy") == "rita", f"{ok.status_code}: {ok.text[:200]}")

    def handed_off():
        p = j(f.call("GET", f"/factory/delivery/promotions/{prom['prod']}", alice)) or {}
        return p.get("state") in ("Deploying", "Verifying", "Completed"), p
    try:
        eventually("A's approved production promotion hands off", handed_off, timeout=60)
        res.row("control: A's approved production promotion hands off (its run id is its own)", True)
    except SystemExit as e:
        res.row("control: A's approved production promotion hands off (its run id is its own)", False, str(e)[:300])
    res.row("server still ready", f.call("GET", "/readyz").status_code == 200)
    del promo_view


def short(path: str) -> str:
    return re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "{id}", path)


def sse(f: Ferry, path: str, token: str, seconds: float) -> str:
    """What an event stream sends in `seconds`."""
    import requests

    chunks = []
    deadline = time.monotonic() + seconds
    try:
        with requests.get(f.base + path, headers={"Authorization": f"Bearer {token}"}, stream=True,
                          timeout=(5, seconds)) as r:
            for chunk in r.iter_content(chunk_size=None):
                chunks.append(chunk.decode("utf-8", "replace"))
                if time.monotonic() > deadline:
                    break
    except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError, socket.timeout):
        pass
    return "".join(chunks)


# --- abandoned event streams -------------------------------------------------------------


def abandon(args) -> None:
    """Clients that leave the event stream after its first bytes while others write: every
    write must still be answered (no 5xx, no timeout), and the store must stay writable."""
    import threading
    import requests

    ids = json.loads(pathlib.Path(args.ids).read_text())
    f = Ferry(args.base, args.ferry)
    alice = f.token(ids["tenantA"], "alice", ["Operator", "Reviewer"])
    h = {"Authorization": f"Bearer {alice}"}
    spec = {"environmentId": ids["environments"]["ops"], "projectId": "shop", "kind": "Workload",
            "programRef": ids["program"], "programVersion": ids["commit"]}
    end = time.monotonic() + args.seconds
    writes: dict[str, int] = {}
    lock = threading.Lock()

    def count(key: str) -> None:
        with lock:
            writes[key] = writes.get(key, 0) + 1

    def reader() -> None:
        while time.monotonic() < end:
            try:
                with requests.get(f.base + "/factory/events/stream?after=0", headers=h, stream=True, timeout=5) as r:
                    for i, _ in enumerate(r.iter_content(256)):
                        if i >= 2:
                            break
            except requests.RequestException:
                pass

    def writer() -> None:
        s = requests.Session()
        while time.monotonic() < end:
            try:
                r = s.post(f.base + "/factory/provisioning/specifications", json=spec, headers=h, timeout=20)
                count(str(r.status_code))
            except requests.RequestException as e:
                count(type(e).__name__)

    threads = [threading.Thread(target=reader) for _ in range(6)] + [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    res = Results(args.results, "abandoned event streams")
    bad = {k: v for k, v in writes.items() if not k.startswith(("2", "4"))}
    res.row(f"writes while 6 clients leave the stream early for {args.seconds:.0f} s: no 5xx, no timeout",
            not bad and bool(writes), f"answers {writes}")
    try:
        r = f.call("POST", "/factory/provisioning/specifications", alice, spec, timeout=25)
        res.row("the store is still writable afterwards", r.status_code == 201, f"{r.status_code}: {r.text[:200]}")
    except requests.RequestException as e:
        res.row("the store is still writable afterwards", False, f"{type(e).__name__}: {e}")


# --- schemathesis reports ----------------------------------------------------------------


def schemathesis_rows(args) -> None:
    """Rows from one schemathesis run: its exit code, its JUnit report (one test case per
    operation) and the totals it printed."""
    res = Results(args.results, f"schemathesis {args.identity}")
    import xml.etree.ElementTree as ET

    # A <failure> is a check that failed; an <error> is a request that could not complete
    # (e.g. "Network Error": Ferry did not answer in time) or schemathesis' own crash
    # ("Runtime Error" with a Python traceback, not Ferry's doing: reported, not failed).
    operations, failed_ops, messages, tool_errors = 0, [], [], []
    if os.path.exists(args.junit):
        for case in ET.parse(args.junit).getroot().iter("testcase"):
            operations += 1
            for b in case.findall("failure") + case.findall("error"):
                text = (b.get("message") or b.text or "").strip()
                first = text.splitlines()[0] if text else b.tag
                if b.tag == "error" and first.startswith("Runtime Error") and "Traceback" in text:
                    tool_errors.append(f"{case.get('name')}: schemathesis crashed ({text.splitlines()[2] if len(text.splitlines()) > 2 else ''})")
                    continue
                failed_ops.append(case.get("name", "?"))
                messages.append(f"{case.get('name')}: {first}")
    log = pathlib.Path(args.log).read_text(errors="replace") if os.path.exists(args.log) else ""
    log = re.sub(r"\x1b\[[0-9;]*m", "", log)
    cases = re.findall(r"Test cases:\s*\n?\s*(\d+) generated", log) or re.findall(r"(\d+) generated", log)
    total = int(cases[-1]) if cases else 0
    stats = {"identity": args.identity, "operations": operations, "cases": total, "failedOperations": failed_ops}
    with open(args.results + ".schemathesis", "a", encoding="utf-8") as f:
        f.write(json.dumps(stats) + "\n")
    ok = operations > 0 and not failed_ops and (args.exit_code == 0 or tool_errors)
    if tool_errors:
        print("  schemathesis' own errors (not Ferry's): " + "; ".join(tool_errors), flush=True)
    res.row(f"{operations} operations, {total} test cases, exit {args.exit_code}"
            + (f", {len(tool_errors)} schemathesis crash(es)" if tool_errors else ""),
            ok, "; ".join(messages[:6]) or f"exit code {args.exit_code}, see {args.log}")


# --- summary -----------------------------------------------------------------------------


def summary(args) -> None:
    rows = [json.loads(line) for line in open(args.results, encoding="utf-8") if line.strip()]
    sections: dict[str, list[dict]] = {}
    for row in rows:
        sections.setdefault(row["section"], []).append(row)
    width = max([len(s) for s in sections] + [10])
    print()
    print(f"{'section'.ljust(width)}  {'checks':>6}  {'passed':>6}  {'failed':>6}")
    print(f"{'-' * width}  {'-' * 6}  {'-' * 6}  {'-' * 6}")
    failed = []
    for section, items in sections.items():
        bad = [r for r in items if not r["ok"]]
        failed += bad
        print(f"{section.ljust(width)}  {len(items):>6}  {len(items) - len(bad):>6}  {len(bad):>6}")
    print(f"{'-' * width}  {'-' * 6}  {'-' * 6}  {'-' * 6}")
    print(f"{'total'.ljust(width)}  {len(rows):>6}  {len(rows) - len(failed):>6}  {len(failed):>6}")
    stats_file = args.results + ".schemathesis"
    if os.path.exists(stats_file):
        stats = [json.loads(line) for line in open(stats_file, encoding="utf-8") if line.strip()]
        print()
        print("schemathesis: " + ", ".join(f"{s['identity']} {s['operations']} operations / {s['cases']} cases" for s in stats)
              + f"; {sum(s['cases'] for s in stats)} test cases in all")
    if failed:
        print("\nFAILED:")
        for r in failed:
            print(f"  {r['section']}: {r['check']}\n      {r['detail'][:600]}")
    sys.exit(1 if failed or not rows else 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("seed")
    s.add_argument("--base", required=True)
    s.add_argument("--ferry", required=True)
    s.add_argument("--data-dir", required=True)
    s.add_argument("--tenant-a", required=True)
    s.add_argument("--tenant-b", required=True)
    s.add_argument("--out", required=True)
    e = sub.add_parser("explicit")
    e.add_argument("--base", required=True)
    e.add_argument("--ferry", required=True)
    e.add_argument("--ids", required=True)
    e.add_argument("--data-dir", required=True)
    e.add_argument("--results", required=True)
    st = sub.add_parser("schemathesis")
    st.add_argument("--identity", required=True)
    st.add_argument("--junit", required=True)
    st.add_argument("--log", required=True)
    st.add_argument("--exit-code", type=int, required=True)
    st.add_argument("--results", required=True)
    ab = sub.add_parser("abandon")
    ab.add_argument("--base", required=True)
    ab.add_argument("--ferry", required=True)
    ab.add_argument("--ids", required=True)
    ab.add_argument("--seconds", type=float, default=45)
    ab.add_argument("--results", required=True)
    su = sub.add_parser("summary")
    su.add_argument("--results", required=True)
    args = p.parse_args()
    {"seed": seed, "explicit": explicit, "schemathesis": schemathesis_rows, "abandon": abandon,
     "summary": summary}[args.command](args)


if __name__ == "__main__":
    main()
