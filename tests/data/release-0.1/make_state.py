"""Write the state of slurm-geo 0.1 (commit a4963d1) that tests/test_upgrade.py opens with
this release's code. Run it with that release's code first on the path, never installed:

    git worktree add /var/tmp/release-0.1 a4963d1
    PYTHONPATH=/var/tmp/release-0.1 python tests/data/release-0.1/make_state.py \\
        tests/data/release-0.1 [--etcd]

It fills each database through the release's own interfaces (tests/upgrade_state.py, the
same scenario on each backend) and writes expected.json: what the release itself read
back, which the current code must read back the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent.parent.parent))  # the checkout's tests.upgrade_state, last

import slurm_geo  # noqa: E402  (the release's: first on PYTHONPATH)
from tests import upgrade_state as u  # noqa: E402

FIXED = u.NOW


def main(out: Path, etcd: bool) -> None:
    from slurm_geo.federation.audit import SCHEMA_VERSION as AUDIT
    from slurm_geo.federation.audit import AuditLog

    from slurm_geo.billing.db import SCHEMA_VERSION as BILLING
    from slurm_geo.billing.db import BillingDB
    from slurm_geo.federation.state import SCHEMA_VERSION as FEDERATION
    from slurm_geo.federation.state import FederationState
    from slurm_geo.registry.db import Registry
    from slurm_geo.sync.state import SCHEMA_VERSION as SYNC
    from slurm_geo.sync.state import StateDB

    assert Path(slurm_geo.__file__).resolve().parent.parent != HERE.parent.parent.parent, \
        "run with the release's code first on PYTHONPATH"
    out.mkdir(parents=True, exist_ok=True)
    expected = json.loads((out / "expected.json").read_text()) \
        if (out / "expected.json").exists() else {}
    expected["release"] = {"version": slurm_geo.__version__, "commit": _commit()}
    expected["versions"] = {"federation": FEDERATION, "audit": AUDIT, "billing": BILLING,
                            "sync": SYNC}
    for name in ("federation.db", "audit.db", "billing.db", "checkpoint-sync.db",
                 "registry.db"):
        (out / name).unlink(missing_ok=True)
    state = FederationState(out / "federation.db")
    u.populate_federation(state)
    expected["federation"] = u.readback_federation(state)
    state.close()
    with AuditLog(out / "audit.db", clock=lambda: FIXED) as log:
        u.populate_audit(log)
        expected["audit"] = u.readback_audit(log)
    with BillingDB(out / "billing.db") as billing:
        u.populate_billing(billing)
        expected["billing"] = u.readback_billing(billing)
    sync = StateDB(out / "checkpoint-sync.db")
    u.populate_sync(sync)
    expected["sync"] = u.readback_sync(sync)
    sync.close()
    with Registry(out / "registry.db") as registry:
        u.populate_registry(registry)
        expected["registry"] = u.readback_registry(registry)
    store = out / "store"
    if not store.exists():
        store.mkdir()
        u.populate_store(store)
    expected["store"] = u.readback_store(store)
    if etcd:
        expected.update(_etcd(out))
    for wal in out.glob("*-wal"):
        raise SystemExit(f"{wal} left behind: a database was not closed")
    (out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


def _etcd(out: Path) -> dict[str, object]:
    """The same state in etcd (one member), as the replicated daemon lays it out; saved as
    an etcd snapshot (revisions and versions kept: every value is sealed for them)."""
    from slurm_geo.federation.etcd.audit import EtcdAuditLog

    from tests.etcd_server import open_replica, start_cluster, stop_cluster

    with tempfile.TemporaryDirectory() as root:
        members = start_cluster(Path(root), 1)
        try:
            endpoint = members[0].client_url
            replica = open_replica([endpoint], u.ETCD_PREFIX, "home-a", site="home")
            assert replica.leadership.campaign()
            u.populate_federation(replica)
            log = EtcdAuditLog(replica.kv, replica.layout, replica.leadership,
                               clock=lambda: FIXED, replica="home-a")
            u.populate_audit(log)
            found = {"etcd_federation": u.readback_federation(replica),
                     "etcd_audit": u.readback_audit(log),
                     "etcd_keys": sorted(f.key for f in replica.kv.range(u.ETCD_PREFIX + "/")
                                         if not f.key.endswith("/leader"))}
            replica.leadership.resign()
            replica.close()
            snapshot = out / "etcd.snapshot.db"
            snapshot.unlink(missing_ok=True)
            subprocess.run(["etcdctl", "--endpoints", endpoint, "snapshot", "save",
                            str(snapshot)], check=True, capture_output=True,
                           env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"})
        finally:
            stop_cluster(members)
    return found


def _commit() -> str:
    return subprocess.run(["git", "-C", str(Path(slurm_geo.__file__).parent), "rev-parse",
                           "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--etcd" in sys.argv[2:])
