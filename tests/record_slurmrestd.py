"""Record slurmrestd 26.05's replies per API version into tests/data/slurmrestd-26.05.

Run as root from the checkout: `PYTHONPATH=. python tests/record_slurmrestd.py [DIR]`.
Brings up a provider site (sandbox.provider) in DIR (default /var/tmp/slurm-geo-record),
records its /openapi/v3 and, for v0.0.42-v0.0.45, what a ping, a held submission, release, reads,
requeue (v0.0.45), cancel, an unknown job and a refused token get, then takes it down.
tests/test_rest_recorded.py reads them; job ids and times are the recording's.
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path
from typing import Any

import requests

from slurm_geo.sandbox import provider

OUT = Path(__file__).parent / "data" / "slurmrestd-26.05"
VERSIONS = ("0.0.42", "0.0.43", "0.0.44", "0.0.45")


def save(version: str, name: str, response: requests.Response) -> dict[str, Any]:
    body = response.json()
    body.get("meta", {}).get("client", {}).pop("source", None)  # a port of the recording
    (OUT / version).mkdir(parents=True, exist_ok=True)
    doc = {"status": response.status_code, "body": body}
    (OUT / version / f"{name}.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return dict(body)


def record(url: str, token: str) -> None:
    headers = {"X-SLURM-USER-NAME": "geo-alice", "X-SLURM-USER-TOKEN": token}
    bad = {**headers, "X-SLURM-USER-TOKEN": token[:-4] + "AAAA"}
    with gzip.open(OUT / "openapi-v3.json.gz", "wt") as handle:
        json.dump(requests.get(f"{url}/openapi/v3", headers=headers).json(), handle,
                  sort_keys=True)
    for v in VERSIONS:
        base = f"{url}/slurm/v{v}"

        def get(path: str, use: dict[str, str] = headers, base: str = base) -> requests.Response:
            return requests.get(f"{base}/{path}", headers=use, timeout=30)

        save(v, "ping", get("ping"))
        job: dict[str, Any] = {"name": f"rec-{v}", "current_working_directory": "/home/geo-alice",
               "environment": ["PATH=/usr/bin:/bin"], "nodes": "1", "cpus_per_task": 1,
               "time_limit": {"set": True, "infinite": False, "number": 5}, "requeue": True,
               "kill_warning_signal": "USR1", "kill_warning_flags": ["BATCH_JOB"],
               "kill_warning_delay": {"set": True, "infinite": False, "number": 60},
               "standard_output": f"/home/geo-alice/rec-{v}.out", "hold": True,
               "comment": "c1"}
        job_id = save(v, "submit", requests.post(
            f"{base}/job/submit", headers=headers,
            json={"script": "#!/bin/bash\nsleep 300\n", "job": job}))["job_id"]
        save(v, "job-held", get(f"job/{job_id}"))
        save(v, "release", requests.post(f"{base}/job/{job_id}", headers=headers,
                                         json={"hold": False}))
        for _ in range(40):
            if "RUNNING" in get(f"job/{job_id}").json()["jobs"][0]["job_state"]:
                break
            time.sleep(0.5)
        save(v, "job-running", get(f"job/{job_id}"))
        save(v, "jobs", get("jobs"))
        save(v, "nodes", get("nodes"))
        save(v, "job-unknown", get("job/999999"))
        save(v, "cancel-unknown", requests.delete(f"{base}/job/999999", headers=headers))
        if v == "0.0.45":
            save(v, "requeue", get(f"job/{job_id}/requeue"))
            time.sleep(1)
            save(v, "job-requeued", get(f"job/{job_id}"))
            save(v, "requeue-unknown", get("job/999999/requeue"))
        save(v, "cancel", requests.delete(f"{base}/job/{job_id}", headers=headers))
        time.sleep(1)
        save(v, "job-cancelled", get(f"job/{job_id}"))
        # 22.05's field `signal`: what the newer versions say of it.
        save(v, "submit-unknown-field", requests.post(f"{base}/job/submit", headers=headers, json={
            "script": "#!/bin/bash\ntrue\n",
            "job": {**job, "hold": False, "signal": "B:USR1@60", "name": f"unknown-{v}"}}))
        save(v, "ping-bad-token", get("ping", bad))
        save(v, "partitions-bad-token", get("partitions", bad))
        print(v, "recorded, job", job_id)


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/var/tmp/slurm-geo-record")
    site = provider.ProviderSite(root, 24570)
    provider.up(site)
    try:
        record(site.rest_url, site.token_file("geo-alice").read_text().strip())
    finally:
        provider.down(site)


if __name__ == "__main__":
    main()
