"""The authenticated lease service under load (issue 13): what authentication costs a
renewal, and whether 200 trainers renewing at 200 renewals/s stay under p99 100 ms.

Target (from the issue): p99 < 100 ms at 200 renewals/s on 2 cores.

The service is tests/lease_site.py's (the federation daemon's lease and key service on a
real port, no Slurm behind it), served over https with a site CA made as the sandbox makes
its own, its state in SQLite on disk (`--dir`, /var/tmp by default: not a tmpfs, so every
renewal's commit is fsynced as on a real host). It runs in a process of its own, as the
daemon does, so the load generator does not share its interpreter lock; both share the
machine's cores. Registered in it, the way lease_site registers its job: `--trainers`
logical jobs moved to `rented` as generation 1, each with its own Slurm job, secret and
key token, and one home job (generation 0 on onprem) owned by this uid.

Every request goes through the real client, slurm_geo.lease.client.FederatedRun, as a
trainer's renewal thread sends it: signed, a fresh https connection (the client opens one
per request and the server speaks HTTP/1.0), the reply parsed.

1. Round trips, one at a time, interleaved: GET /metrics (no credential: the peer), an
   off-site renewal (HMAC under the incarnation's secret) and a home renewal (a real MUNGE
   credential: a munged of our own, started in a temp dir with its own key and socket,
   stopped by pid at the end; skipped where munged is not installed).
2. Open loop: every trainer renews on its own schedule, once per `trainers / rate`
   seconds at a random phase, so the offered load is `rate` renewals/s whatever the
   latency (the lease TTL is three such periods: FederatedRun renews every third of it).
   Latency is counted from when the renewal was due (a late send counts against it) and
   from when it was sent.
3. Closed loop: `--closed` threads renew back to back, round robin over the trainers: the
   most this server answers on this machine.

Run: python bench/lease_auth.py [--trainers 200] [--rate 200] [--seconds 25]
[--closed-seconds 10] [--closed 8] [--round-trips 300] [--json PATH]; prints Markdown
for docs/benchmarks.md; exits 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import platform
import pwd
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import lease_site  # noqa: E402

from slurm_geo.federation.access.tls import server_context  # noqa: E402
from slurm_geo.federation.model import JobStatus, LogicalJob, token_digest  # noqa: E402
from slurm_geo.lease.client import FederatedRun, Placement, tls_context  # noqa: E402
from slurm_geo.lease.munge import MungeCommands  # noqa: E402
from slurm_geo.lease.protocol import METRICS_PATH, Verdict  # noqa: E402
from slurm_geo.lease.signing import new_secret  # noqa: E402
from slurm_geo.sandbox.certs import issue_server, make_ca  # noqa: E402
from slurm_geo.slurm import Owner  # noqa: E402

HOME_JOB_ID = 6
FIRST_JOB_ID = 5000


# --- munged ---------------------------------------------------------------------------------

@contextmanager
def own_munged(parent: Path) -> Iterator[Path | None]:
    """A munged of our own (key, socket, pid file in a temp dir of `parent`), stopped by
    its pid; None where munge is not installed."""
    if not all(shutil.which(p) for p in ("munged", "munge", "unmunge")):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="lease-bench-munge-", dir=parent) as tmp:
        directory = Path(tmp)
        directory.chmod(0o755)  # munged insists clients can reach its socket
        with _munged(directory) as socket:
            yield socket


@contextmanager
def _munged(directory: Path) -> Iterator[Path]:
    key = directory / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    socket = directory / "munge.socket"
    process = subprocess.Popen(
        ["munged", "--foreground", f"--socket={socket}", f"--key-file={key}",
         f"--pid-file={directory / 'munged.pid'}", f"--log-file={directory / 'munged.log'}",
         f"--seed-file={directory / 'munged.seed'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not socket.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {process.stderr.read()!r}"
                                   if process.stderr else "munged did not start")
            time.sleep(0.05)
        yield socket
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --- the service, in its own process ----------------------------------------------------------

@dataclass(frozen=True)
class Trainer:
    logical_job: str
    job_id: int
    secret: str
    token: str


@dataclass(frozen=True)
class Ready:
    url: str
    ca_pem: str
    trainers: list[Trainer]
    home_job_id: int | None


def serve_site(conn: Connection, directory: str, trainers: int, ttl_s: float,
               munge_socket: str | None) -> None:
    """The daemon's side: the site, its jobs, then answer `stats` until `stop`."""
    logging.disable(logging.WARNING)  # refusals are counted by the client, not logged here
    root = Path(directory)
    now = datetime.now(UTC)
    ca = make_ca("bench site CA", now)
    server = issue_server(ca, ["127.0.0.1", "localhost"], now)
    cert, key = root / "federation.pem", root / "federation.key"
    cert.write_bytes(server.cert_pem)
    key.write_bytes(server.key_pem)
    key.chmod(0o600)
    munged = MungeCommands(Path(munge_socket)) if munge_socket else None
    (root / "site").mkdir()
    site = lease_site.start(root / "site", tls=server_context(cert, key),
                            # Any Munge serves; lease_site names the fake its tests use.
                            munged=munged,  # type: ignore[arg-type]
                            lease_ttl_s=ttl_s)
    state, clock = site.federation.state, time.time()
    made = []
    for i in range(trainers):
        logical_job, job_id = f"onprem-{FIRST_JOB_ID + i}", FIRST_JOB_ID + i
        state.add_job(LogicalJob(logical_job=logical_job, run=f"run-{i}", home="onprem",
                                 script="#!/bin/bash\n", spec={}, directives={}, generation=0,
                                 cluster="onprem", job_id=job_id, resume_step=None,
                                 status=JobStatus.RUNNING, created_at=clock, updated_at=clock,
                                 owner=lease_site.ALICE))
        state.begin_generation(logical_job, 0, "rented", None, clock)
        secret, token = new_secret(), new_secret()
        state.identities.put_secret(logical_job, 1, secret)
        state.submitted(logical_job, 1, job_id, token_digest(token), clock)
        made.append(Trainer(logical_job, job_id, secret, token))
    home = None
    if munged is not None:
        me = pwd.getpwuid(os.getuid())
        state.add_job(LogicalJob(logical_job=f"onprem-{HOME_JOB_ID}", run="run-home", home="onprem",
                                 script="#!/bin/bash\n", spec={}, directives={}, generation=0,
                                 cluster="onprem", job_id=HOME_JOB_ID, resume_step=None,
                                 status=JobStatus.RUNNING, created_at=clock, updated_at=clock,
                                 owner=Owner(me.pw_name, me.pw_uid, me.pw_gid)))
        home = HOME_JOB_ID
    # Plain values: this module is __mp_main__ here and __main__ in the parent.
    conn.send({"url": site.url, "ca_pem": ca.cert_pem.decode(),
               "trainers": [asdict(t) for t in made], "home_job_id": home})
    while (command := conn.recv()) != "stop":
        assert command == "stats"
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)  # unmunge
        conn.send({"cpu_s": own.ru_utime + own.ru_stime,
                   "children_cpu_s": children.ru_utime + children.ru_stime,
                   "dispatched": site.server.dispatched,
                   "refused_busy": site.server.refused_busy})
    site.close()
    conn.send("stopped")


class Service:
    def __init__(self, directory: Path, trainers: int, ttl_s: float,
                 munge_socket: Path | None):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve_site, name="lease-service", args=(
            child, str(directory), trainers, ttl_s,
            None if munge_socket is None else str(munge_socket)))
        self.process.start()
        if not self.conn.poll(120):
            raise RuntimeError("the lease service did not start")
        ready = self.conn.recv()
        self.ready = Ready(ready["url"], ready["ca_pem"],
                           [Trainer(**t) for t in ready["trainers"]], ready["home_job_id"])

    def stats(self) -> dict[str, float]:
        self.conn.send("stats")
        return dict(self.conn.recv())

    def stop(self) -> None:
        self.conn.send("stop")
        if self.conn.poll(10):
            self.conn.recv()
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()


# --- the trainers' side -------------------------------------------------------------------------

class Refusals(logging.Handler):
    """What the client logs for a renewal that got no grant, counted instead of printed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.reasons[record.getMessage()[:120]] += 1


def trainer_runs(ready: Ready) -> list[FederatedRun]:
    return [FederatedRun(Placement(f"run-{i}", "rented", t.job_id, 0, 1, None, ready.url,
                                   "file:///x", "", t.token, logical_job=t.logical_job,
                                   lease_secret=t.secret, federation_ca=ready.ca_pem))
            for i, t in enumerate(ready.trainers)]


def home_run(ready: Ready, socket: Path) -> FederatedRun:
    assert ready.home_job_id is not None
    return FederatedRun(Placement("run-home", "onprem", ready.home_job_id, 0, 0, None,
                                  ready.url, "file:///x", "", munge_socket=socket,
                                  federation_ca=ready.ca_pem))


def renew(run: FederatedRun) -> bool:
    """One renewal exactly as the trainer's renewal thread sends it (FederatedRun's
    `_renew_loop` calls `_ask`); True when granted."""
    reply = run._ask(release=False)
    return reply is not None and reply.verdict is Verdict.GRANT


def metrics_get(url: str, tls: Any) -> Callable[[], bool]:
    def get() -> bool:
        with urllib.request.urlopen(url + METRICS_PATH, timeout=5, context=tls) as response:
            response.read()
            return bool(response.status == 200)
    return get


@dataclass
class Figures:
    count: int
    errors: int
    median_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: list[float], errors: int) -> Figures:
        ms = sorted(s * 1000 for s in seconds)
        if not ms:
            return cls(0, errors, float("nan"), float("nan"), float("nan"))
        return cls(len(ms), errors, statistics.median(ms), percentile(ms, 99), ms[-1])


def percentile(ordered: list[float], q: float) -> float:
    """The nearest-rank percentile: the value `q` % of the samples are at or below."""
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def round_trips(kinds: dict[str, Callable[[], bool]], count: int) -> dict[str, Figures]:
    """Each kind `count` times, one request at a time, interleaved so that the machine's
    other load falls on all of them alike."""
    times: dict[str, list[float]] = {k: [] for k in kinds}
    errors: Counter[str] = Counter()
    for _ in range(count):
        for kind, call in kinds.items():
            started = time.perf_counter()
            try:
                ok = call()
            except OSError:
                ok = False
            elapsed = time.perf_counter() - started
            if ok:
                times[kind].append(elapsed)
            else:
                errors[kind] += 1
    return {k: Figures.of(times[k], errors[k]) for k in kinds}


@dataclass
class Load:
    """One sustained phase, as the trainers saw it."""

    kind: str
    threads: int
    offered_per_s: float | None
    seconds: float
    granted: int
    errors: int
    achieved_per_s: float
    latency: Figures           # from when the renewal was due (open loop) or sent
    sent_latency: Figures      # from when it was sent
    late_p99_ms: float         # how late the generator sent, p99
    server_cpu_ms_per_renewal: float = 0.0
    server_cores: float = 0.0
    client_cores: float = 0.0
    refused_busy: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


def sustained(service: Service, refusals: Refusals, runs: list[FederatedRun], kind: str,
              seconds: float, rate: float | None, closed: int) -> Load:
    """Open loop at `rate` (one thread per trainer, each on its own schedule), or, with
    `rate` None, `closed` threads renewing back to back."""
    rng = random.Random(13)
    period = len(runs) / rate if rate else 0.0
    phases = [rng.uniform(0, period) for _ in runs]
    samples: list[tuple[float, float, float, bool]] = []  # (due, sent, done, granted)
    start = time.perf_counter() + 0.5
    end = start + seconds

    def open_trainer(run: FederatedRun, phase: float) -> None:
        due = start + phase
        while due < end:
            time.sleep(max(0.0, due - time.perf_counter()))
            sent = time.perf_counter()
            ok = renew(run)
            samples.append((due, sent, time.perf_counter(), ok))
            due += period

    def closed_thread(mine: list[FederatedRun]) -> None:
        time.sleep(max(0.0, start - time.perf_counter()))
        i = 0
        while (sent := time.perf_counter()) < end:
            ok = renew(mine[i % len(mine)])
            samples.append((sent, sent, time.perf_counter(), ok))
            i += 1

    if rate:
        threads = [threading.Thread(target=open_trainer, args=(r, p), daemon=True)
                   for r, p in zip(runs, phases, strict=True)]
    else:
        threads = [threading.Thread(target=closed_thread, args=(runs[j::closed],), daemon=True)
                   for j in range(closed)]
    refusals.reasons.clear()
    before, cpu_before = service.stats(), time.process_time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after, client_cpu = service.stats(), time.process_time() - cpu_before
    # The open loop's window is `seconds` whatever its last reply; the closed loop's ends
    # with its last reply.
    wall = max([seconds] + [s[2] - start for s in samples])
    granted = [s for s in samples if s[3]]
    errors = len(samples) - len(granted)
    server_cpu = (after["cpu_s"] - before["cpu_s"]
                  + after["children_cpu_s"] - before["children_cpu_s"])
    late = sorted((s[1] - s[0]) * 1000 for s in samples)
    return Load(kind, len(threads), rate, round(wall, 2), len(granted), errors,
                len(granted) / wall,
                Figures.of([s[2] - s[0] for s in granted], errors),
                Figures.of([s[2] - s[1] for s in granted], errors),
                percentile(late, 99) if late else float("nan"),
                server_cpu * 1000 / max(1, len(samples)), server_cpu / wall,
                client_cpu / wall, int(after["refused_busy"] - before["refused_busy"]),
                dict(refusals.reasons))


# --- the report -------------------------------------------------------------------------------

def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True).stdout.strip()
        return sha + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(result: dict[str, Any]) -> str:
    trips: dict[str, Figures] = result["round_trips"]
    peer = trips["GET /metrics (no credential)"].median_ms
    peer99 = trips["GET /metrics (no credential)"].p99_ms
    lines = [f"At {result['commit']}, {result['when']}, {result['machine']}; load average "
             f"{result['load_before']:.2f} before, {result['load_after']:.2f} after.", "",
             f"Round trips, one at a time, {result['count']} of each, interleaved "
             "(fresh https connection each, as the client makes it):", "",
             "| request | median | p99 | median vs peer | p99 vs peer | errors |",
             "|---|---|---|---|---|---|"]
    for kind, f in trips.items():
        lines.append(f"| {kind} | {f.median_ms:.2f} ms | {f.p99_ms:.2f} ms | "
                     f"{f.median_ms / peer:.2f}× | {f.p99_ms / peer99:.2f}× | {f.errors} |")
    lines += ["", f"Sustained, {result['trainers']} trainers (lease TTL "
              f"{result['ttl_s']:g} s: each renews every {result['period_s']:g} s):", "",
              "| load | threads | renewals/s offered / achieved | latency median / p99 / max "
              "| from send: median / p99 | generator late, p99 | errors | server CPU per "
              "renewal | server / client cores |",
              "|---|---|---|---|---|---|---|---|---|"]
    for load in result["loads"]:
        offered = f"{load.offered_per_s:g}" if load.offered_per_s else "closed loop"
        lat, sent = load.latency, load.sent_latency
        lines.append(
            f"| {load.kind} | {load.threads} | {offered} / {load.achieved_per_s:.1f} | "
            f"{lat.median_ms:.1f} / {lat.p99_ms:.1f} / {lat.max_ms:.1f} ms | "
            f"{sent.median_ms:.1f} / {sent.p99_ms:.1f} ms | {load.late_p99_ms:.1f} ms | "
            f"{load.errors}{f' ({load.refused_busy} refused busy)' if load.refused_busy else ''}"
            f" | {load.server_cpu_ms_per_renewal:.2f} ms | {load.server_cores:.2f} / "
            f"{load.client_cores:.2f} |")
        for reason, n in load.reasons.items():
            lines.append(f"|  | {n}× {reason} | | | | | | | |")
    target = result["target"]
    lines += ["", f"Target p99 < 100 ms at {result['rate']:g} renewals/s: "
              f"{'met' if target else 'MISSED'} (p99 from due time "
              f"{result['loads'][0].latency.p99_ms:.1f} ms, errors "
              f"{result['loads'][0].errors})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Prints Markdown for docs/benchmarks.md.")
    parser.add_argument("--trainers", type=int, default=200, help="logical jobs renewing")
    parser.add_argument("--rate", type=float, default=200.0,
                        help="renewals/s offered in the open loop (default 200)")
    parser.add_argument("--seconds", type=float, default=25.0, help="open loop length")
    parser.add_argument("--closed", type=int, default=8,
                        help="threads of the closed loop (default 8, the server's workers: "
                        "the most renewals/s here; more only queue)")
    parser.add_argument("--closed-seconds", type=float, default=10.0,
                        help="closed loop length; 0: none")
    parser.add_argument("--round-trips", type=int, default=300, help="of each kind")
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                        help="where the service's state goes (a temp dir in it)")
    parser.add_argument("--no-munge", action="store_true", help="skip the home (MUNGE) row")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    refusals = Refusals()
    client_log = logging.getLogger("slurm_geo.lease.client")
    client_log.addHandler(refusals)
    client_log.propagate = False
    period = args.trainers / args.rate
    ttl_s = 3 * period  # the client renews every third of the TTL
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="lease-bench-", dir=args.dir) as tmp:
        with own_munged(args.dir) if not args.no_munge else _none() as socket:
            service = Service(Path(tmp), args.trainers, ttl_s, socket)
            try:
                ready = service.ready
                runs = trainer_runs(ready)
                for run in runs:  # each trainer's first lease (audited once) is not a renewal
                    if not renew(run):
                        raise RuntimeError(f"no first lease for {run.placement}")
                kinds = {"GET /metrics (no credential)":
                         metrics_get(ready.url, tls_context(ready.ca_pem)),
                         "renewal off-site (HMAC)": lambda: renew(runs[0])}
                if socket is not None and ready.home_job_id is not None:
                    home = home_run(ready, socket)
                    kinds["renewal at home (MUNGE)"] = lambda: renew(home)
                for call in kinds.values():
                    call()  # warm: the home job's first lease, imports, caches
                trips = round_trips(kinds, args.round_trips)
                loads = [sustained(service, refusals, runs, "open loop", args.seconds,
                                   args.rate, 0)]
                if args.closed_seconds > 0:
                    loads.append(sustained(service, refusals, runs, "closed loop",
                                           args.closed_seconds, None, args.closed))
            finally:
                service.stop()
    first = loads[0]
    result: dict[str, Any] = {
        "commit": commit(), "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} cores, {platform.platform()}, Python "
                   f"{platform.python_version()}",
        "load_before": load_before, "load_after": os.getloadavg()[0],
        "count": args.round_trips, "trainers": args.trainers, "rate": args.rate,
        "ttl_s": ttl_s, "period_s": period, "round_trips": trips, "loads": loads,
        "target": first.latency.p99_ms < 100.0 and first.errors == 0
        and first.achieved_per_s >= 0.95 * args.rate}
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=_plain) + "\n")
    return 0 if result["target"] else 1


@contextmanager
def _none() -> Iterator[None]:
    yield None


def _plain(value: Any) -> Any:
    return asdict(value) if hasattr(value, "__dataclass_fields__") else str(value)


if __name__ == "__main__":
    sys.exit(main())
