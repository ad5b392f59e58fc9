"""Chargeback ingest and report over 100,000 accounting records (issue 7), and 100,000
checkpoint transfers attributed to their logical jobs (issue 14).

Targets: ingesting 100,000 records in sacct's format in <= 10 s with bounded memory; a
report over that set in <= 2 s. The records are generated as `sacct --parsable2` lines with
slurm-geo's field list (PARSABLE_FIELDS): two clusters, 40 users, 12 cost centers (some only
as accounts, some with none at all), GPU and CPU jobs, 8 % requeued (two incarnations),
1 % with an unknown TRES, 0.1 % malformed, names with quotes and SQL. They stream from a
file through `slurm_geo.slurm.parse.parsable_accounting` into `billing.ingest.ingest_records`
(batches of 5,000) in a fresh database, then the same file again (idempotent: nothing
changes). One job in ten is a federated logical job's leg (`billing.lineage.Owners`: its
logical job and recorded cost center, as the federation daemon's records give them).

Egress: `--transfers` rows in a real checkpoint-sync state (written by `StateDB`), 13
objects and one read-back per checkpoint: half of them runs of federated jobs in the sync
root `pfs`, a quarter from registered job directories (`file://...`), a quarter of runs
nobody owns; ingested by `billing.ingest.ingest_egress` twice (idempotent), then reported
with the accounting. Memory is the process's peak RSS before and after ingest (ru_maxrss).

Run: python bench/billing_ingest.py [--records 100000] [--transfers 100000]; prints
Markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import resource
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slurm_geo.billing import costs, ingest, service  # noqa: E402
from slurm_geo.billing.attribution import RegistryJob  # noqa: E402
from slurm_geo.billing.config import ClusterFacts, PriceEntry  # noqa: E402
from slurm_geo.billing.db import BillingDB  # noqa: E402
from slurm_geo.billing.lineage import FederatedJob, Leg, Owners  # noqa: E402
from slurm_geo.billing.periods import parse_period  # noqa: E402
from slurm_geo.slurm import parse  # noqa: E402
from slurm_geo.sync.jobdirs import SourceStatus  # noqa: E402
from slurm_geo.sync.state import Source, StateDB  # noqa: E402

CLUSTERS = {"onprem": ClusterFacts("onprem", "home", "onprem"),
            "rented": ClusterFacts("rented", "remote", "gpu-market")}
PRICES = [PriceEntry(0, 0.0, 0.01, 0.0, 0.0, cluster="onprem"),
          PriceEntry(0, 2.5, 0.04, 0.09, 5.0, cluster="rented"),
          PriceEntry(int(datetime(2026, 11, 16, tzinfo=UTC).timestamp()), 2.1, 0.04, 0.08, 5.0,
                     cluster="rented")]
MONTH_START = int(datetime(2026, 11, 1, tzinfo=UTC).timestamp())
NAMES = ["train", "eval", "it's \"quoted\"", "x'); DROP TABLE jobs; --", "sweep-17"]


def fmt(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def generate(path: Path, count: int, seed: int = 7) -> None:
    """`count` sacct lines (requeued jobs give two), written as they are made."""
    rng = random.Random(seed)
    written, job_id = 0, 1000
    with path.open("w") as out:
        while written < count:
            job_id += 1
            cluster = "rented" if rng.random() < 0.4 else "onprem"
            user = f"user{rng.randrange(40)}"
            center = f"cc{rng.randrange(12)}"
            admin = f"geo:cost_center={center}" if rng.random() < 0.7 else ""
            account = center if rng.random() < 0.9 else ""
            gpus = rng.choice((0, 0, 1, 2, 4, 8))
            cpus = max(1, gpus * 8) if gpus else rng.choice((1, 2, 4, 16))
            alloc = f"billing={cpus},cpu={cpus},mem={cpus * 4}G,node=1"
            if gpus:
                alloc += f",gres/gpu={gpus},gres/gpu:a100={gpus}"
            if rng.random() < 0.01:
                alloc += ",gres/fpga=1"
            submit = MONTH_START + rng.randrange(29 * 86400)
            incarnations = 2 if rng.random() < 0.08 else 1
            for n in range(incarnations):
                if written >= count:
                    break
                start = submit + rng.randrange(600)
                elapsed = rng.randrange(30, 36 * 3600)
                state = "REQUEUED" if n < incarnations - 1 else rng.choice(
                    ("COMPLETED", "COMPLETED", "FAILED", "TIMEOUT", "CANCELLED by 0"))
                line = "|".join(map(str, [
                    job_id, cluster, user, account, "gpu" if gpus else "cpu", state,
                    fmt(submit), fmt(start), fmt(start + elapsed), elapsed, alloc, "0:0",
                    f"{cluster}-n{rng.randrange(64)}", admin, "", rng.choice(NAMES)]))
                if rng.random() < 0.001:
                    line = line.replace("|", ";", 3)  # malformed: too few fields
                out.write(line + "\n")
                written += 1
                submit = start + elapsed + 1


FIRST_JOB, OBJECTS = 1001, 13


def owners(jobs: int) -> Owners:
    """One job id in ten a federated logical job (its run `fed-N` in the root `pfs`, moved
    to rented halfway through the month); one in ten more a registered job writing to
    its own directory (`dir-N`)."""
    moved = MONTH_START + 15 * 86400
    federated = [FederatedJob(f"onprem-{n}", f"fed-{n}", f"user{n % 40}", f"cc{n % 12}",
                              MONTH_START, (Leg("onprem", n, MONTH_START),
                                            Leg("rented", n, moved)))
                 for n in range(FIRST_JOB, FIRST_JOB + jobs, 10)]
    registry = [RegistryJob("onprem", n, f"onprem:{n}", f"user{n % 40}", f"cc{n % 12}",
                            f"/home/user{n % 40}/dir-{n}", MONTH_START)
                for n in range(FIRST_JOB + 5, FIRST_JOB + jobs, 10)]
    return Owners(federated, registry)


def write_transfers(path: Path, count: int, jobs: int, seed: int = 11) -> None:
    """`count` transfers, as checkpoint-sync records them, in a fresh state at `path`."""
    rng = random.Random(seed)
    state = StateDB(path)
    written, checkpoint = 0, 0
    while written < count:
        checkpoint += 1
        n = FIRST_JOB + rng.randrange(jobs // 10) * 10
        kind = rng.random()
        if kind < 0.5:
            run, root = f"fed-{n}", "pfs"
        elif kind < 0.75:
            run, root = f"dir-{n + 5}", f"file:///home/user{(n + 5) % 40}/dir-{n + 5}"
        else:
            run, root = f"nobody-{n}", "pfs"
        at = MONTH_START + rng.randrange(29 * 86400)
        [replica_id] = state.add([{"root": root, "run": run, "step": checkpoint,
                                   "destination": "offsite", "sequence": 1,
                                   "status": "pending"}], now=at)
        replica = state.replica(replica_id)
        for i in range(min(OBJECTS + 1, count - written)):
            last = i == OBJECTS
            state.record_transfer(replica, {
                "object": f"manifests/{run}/{checkpoint}" if last else f"packs/{checkpoint}-{i}",
                "kind": "verify" if last else "pack", "bytes": rng.randrange(1, 64 * 2**20),
                "source": "offsite" if last else root, "source_region":
                "remote" if last else "home", "destination_region": "home" if last else "remote",
                "started_at": at + i, "finished_at": at + i + 1})
            written += 1
    state.record_sources([Source(f"file:///home/user{n % 40}/dir-{n}", "job",
                                 f"/home/user{n % 40}/dir-{n}", SourceStatus.WATCHED,
                                 (f"onprem:{n}",), (f"user{n % 40}",))
                          for n in range(FIRST_JOB + 5, FIRST_JOB + jobs, 10)])
    state.close()


def digest(db: BillingDB) -> str:
    """A hash of every table's rows in key order, computed without holding them."""
    hasher = hashlib.sha256()
    tables = [r[0] for r in db.conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
    for name in tables:
        width = len(db.conn.execute(f"SELECT * FROM [{name}] LIMIT 1").description or ())
        order = ", ".join(str(i + 1) for i in range(width))
        for row in db.conn.execute(f"SELECT * FROM [{name}] ORDER BY {order}"):
            hasher.update(repr(tuple(row)).encode())
    return hasher.hexdigest()


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(count: int, transfers: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        source, sync_state = Path(tmp) / "sacct.txt", Path(tmp) / "sync.db"
        generate(source, count)
        size_mb = source.stat().st_size / 1e6
        write_transfers(sync_state, transfers, count)
        table = costs.PriceTable(PRICES, CLUSTERS)
        rss_before = rss_mb()
        timings = []
        began, cpu_began = time.perf_counter(), time.process_time()
        known = owners(count)
        lineage = known.lineage()
        indexed = (time.perf_counter() - began, time.process_time() - cpu_began)
        with BillingDB(Path(tmp) / "billing.db") as db:
            db.set_prices(PRICES, CLUSTERS)
            for _ in range(2):
                began, cpu_began = time.perf_counter(), time.process_time()
                stats = ingest.IngestStats("bench", 0, 0)
                with source.open() as lines:
                    ingest.ingest_records(db, parse.parsable_accounting(lines, "onprem", tz=UTC),
                                          stats, lineage, MONTH_START + 31 * 86400, table)
                db.count_restarts()
                timings.append((time.perf_counter() - began, time.process_time() - cpu_began))
                if len(timings) == 1:
                    rss_after = rss_mb()
                    snapshot = digest(db)
            unchanged = digest(db) == snapshot
            egress = []
            for _ in range(2):
                began, cpu_began = time.perf_counter(), time.process_time()
                moved = ingest.ingest_egress(db, sync_state, None, known, table, MONTH_START,
                                             MONTH_START + 31 * 86400)
                egress.append((time.perf_counter() - began, time.process_time() - cpu_began))
                if len(egress) == 1:
                    snapshot = digest(db)
            egress_unchanged = digest(db) == snapshot
            owned = db.conn.execute("SELECT COUNT(*) FROM egress WHERE cost_center != ''"
                                    ).fetchone()[0]
            reports = {}
            for by, stored in (("cost-center", True), ("job", True), ("cost-center", False)):
                began, cpu_began = time.perf_counter(), time.process_time()
                result = service.report(db, parse_period("2026-11"), by, stored=stored)
                by += "" if stored else ", priced on the fly as for a START..END window"
                reports[by] = (time.perf_counter() - began, time.process_time() - cpu_began,
                               len(result.groups), len(result.flags))
            db_mb = Path(db.path).stat().st_size / 1e6
    print(f"{count:,} records ({size_mb:.1f} MB of sacct lines; {stats.incarnations:,} "
          f"incarnations, {stats.malformed} malformed)\n")
    print("| step | wall | CPU |\n|---|---|---|")
    print(f"| index {len(known.federated):,} federated and {len(known.registry):,} registered "
          f"jobs ({len(lineage):,} legs) | {indexed[0]:.2f} s | {indexed[1]:.2f} s |")
    print(f"| ingest, fresh database | {timings[0][0]:.2f} s | {timings[0][1]:.2f} s |")
    print(f"| ingest again (idempotent; database unchanged: {unchanged}) | "
          f"{timings[1][0]:.2f} s | {timings[1][1]:.2f} s |")
    print(f"| ingest {moved:,} transfers ({owned:,} attributed to a cost center) | "
          f"{egress[0][0]:.2f} s | {egress[0][1]:.2f} s |")
    print(f"| ingest them again (database unchanged: {egress_unchanged}) | "
          f"{egress[1][0]:.2f} s | {egress[1][1]:.2f} s |")
    for by, (seconds, cpu, groups, flags) in reports.items():
        print(f"| report 2026-11 --by {by} ({groups:,} rows, {flags:,} flags) | "
              f"{seconds:.2f} s | {cpu:.2f} s |")
    print(f"\npeak RSS before / after ingest: {rss_before:.0f} MB / {rss_after:.0f} MB; "
          f"database {db_mb:.0f} MB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--transfers", type=int, default=100_000)
    arguments = parser.parse_args()
    run(arguments.records, arguments.transfers)
