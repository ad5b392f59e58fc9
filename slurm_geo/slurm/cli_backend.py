"""A cluster reached through its command-line tools (sbatch, squeue, scontrol, sacct).

Submissions (checked in Slurm's source, tags slurm-22-05-8-1 and slurm-24-11-4-1):

- A job runs as its owner: a submission that names an owner goes to the privileged helper
  slurm-geo-submit-as (slurm_geo.slurm.submit_as) as data; it drops to the owner's uid,
  gid and groups and then runs sbatch, so sbatch, the SPANK plugin's validator and every
  file the script's `#SBATCH` lines name run and open with the owner's rights, never
  root's. `sbatch --uid/--gid` (root only; deprecated in 26.05) is never used: the
  daemons run as an unprivileged service account.
- The job's environment is exactly JobSpec.environment. `--export=NONE` cannot carry an
  explicit environment: sbatch then keeps only the SLURM_* variables of its own
  environment (in 22.05 it even drops what --export-file read) and makes slurmd load the
  owner's login environment (--get-user-env); NAME=value in --export would put secrets
  on the command line, which every local user can read. So sbatch is started with the
  job's environment as its own - none of the calling process's variables - plus the
  cluster's SLURM_CONF, and `--export=ALL` passes that on whatever SBATCH_EXPORT says.
  Found by the caller's PATH, sbatch is named by its absolute path.

Where Slurm's commands run: by default on this machine. `command_prefix` runs each of them
(the helper included) behind a prefix instead, e.g. `nsenter ...` into a machine image
whose Slurm is another version than this host's (tests: a Debian 13 root with 24.11,
sandbox.home24); `sbatch` then names the sbatch there (the helper has its own, built in).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from slurm_geo.slurm import parse, submit_as
from slurm_geo.slurm.client import WINDOW_SLACK, SlurmClient, job_from_records, overlaps
from slurm_geo.slurm.errors import (
    ControllerUnreachable,
    JobNotFound,
    SlurmCommandError,
    SlurmdbdUnreachable,
    SlurmRejected,
)
from slurm_geo.slurm.models import (
    DEFAULT_JOB_PATH,
    AccountingRecord,
    JobInfo,
    JobSpec,
    MalformedAccountingRow,
    NodeInfo,
)
from slurm_geo.slurm.submit_as import SUBMIT_AS_PATH
from slurm_geo.slurm.windows import (
    STATE_FILTER,
    IncarnationKey,
    incarnation_key,
    one_per_incarnation,
)

# What Slurm's commands print when the controller (or slurmdbd) does not answer.
UNREACHABLE_MARKERS = (
    "Unable to contact slurm controller",
    "Slurm controller not responding",
    "Socket timed out",
    "Connection refused",
    "Unable to establish connection",
    "Problem talking to the database",
    "is DOWN",  # scontrol ping
)


# Between the fields of `sacct --parsable2` (ASCII unit separator): no job name holds it.
PARSABLE_DELIMITER = "\x1f"


def sbatch_arguments(spec: JobSpec) -> list[str]:
    """sbatch flags for `spec`; the script itself goes to sbatch's stdin, its environment
    is sbatch's own (`sbatch_environment`)."""
    nodes = f"{spec.nodes}-{spec.max_nodes}" if spec.max_nodes else str(spec.nodes)
    args = [f"--job-name={spec.name}", f"--chdir={spec.working_dir}",
            f"--nodes={nodes}", f"--cpus-per-task={spec.cpus_per_task}", "--export=ALL"]
    if spec.tasks_per_node is not None:
        args.append(f"--ntasks-per-node={spec.tasks_per_node}")
    if spec.partition:
        args.append(f"--partition={spec.partition}")
    if spec.time_limit_minutes is not None:
        args.append(f"--time={spec.time_limit_minutes}")
    if spec.requeue is not None:
        args.append("--requeue" if spec.requeue else "--no-requeue")
    if spec.signal:
        args.append(f"--signal={spec.signal}")
    if spec.output:
        args.append(f"--output={spec.output}")
    if spec.hold:
        args.append("--hold")
    if spec.comment:
        args.append(f"--comment={spec.comment}")
    return args


def sbatch_environment(spec: JobSpec, slurm_conf: Path) -> dict[str, str]:
    """sbatch's whole environment for `spec`, which it exports to the job."""
    return {"PATH": DEFAULT_JOB_PATH, **spec.environment, "SLURM_CONF": str(slurm_conf)}


SACCT_JSON = ("sacct", "--json", "--duplicates", "--allusers", "--allocations")


class CliSlurmClient(SlurmClient):
    def __init__(self, cluster: str, slurm_conf: Path, timeout_s: float,
                 submit_as: Path = SUBMIT_AS_PATH, command_prefix: Sequence[str] = (),
                 sbatch: str | None = None):
        self.cluster = cluster
        self.slurm_conf = slurm_conf  # as the commands see it (behind the prefix)
        self.timeout_s = timeout_s
        self.submit_as = submit_as
        self.command_prefix = tuple(command_prefix)
        self.sbatch = sbatch

    def submit(self, spec: JobSpec) -> int:
        return parse.submitted_job_id(self._sbatch_for(spec, ["--parsable"], "submit"))

    def _sbatch_for(self, spec: JobSpec, extra: list[str], action: str,
                    merge_stderr: bool = False) -> str:
        """sbatch for `spec`: as its owner through the helper, else as this process."""
        options = [*extra, *sbatch_arguments(spec)]
        if spec.owner is None:
            return self._run([self.sbatch or self._sbatch(), *options], action, stdin=spec.script,
                             env=sbatch_environment(spec, self.slurm_conf),
                             merge_stderr=merge_stderr)
        environment = {"PATH": DEFAULT_JOB_PATH, **spec.environment}
        environment.pop("SLURM_CONF", None)
        data = submit_as.request(spec.owner, self.slurm_conf, options, environment,
                                 spec.script)
        return self._run([str(self.submit_as)], action, stdin_bytes=data,
                         env={"PATH": DEFAULT_JOB_PATH}, merge_stderr=merge_stderr)

    def job(self, job_id: int) -> JobInfo:
        for info in self.jobs(all_states=True):
            if info.job_id == job_id:
                return info
        records = self.accounting([job_id])
        if not records:
            raise JobNotFound(self.cluster, job_id)
        return job_from_records(records)

    def jobs(self, all_states: bool = False) -> list[JobInfo]:
        # squeue --json ignores --jobs on 22.05, so callers filter.
        argv = ["squeue", "--json"] + (["--states=all"] if all_states else [])
        return parse.jobs_from_ctld(self._json(argv, "list jobs"), self.cluster)

    def cancel(self, job_id: int) -> None:
        # Only --verbose makes scancel mention an unknown job id (it exits 0 either way).
        self._run(["scancel", "--verbose", str(job_id)], "cancel", job_id=job_id)

    def requeue(self, job_id: int) -> None:
        self._run(["scontrol", "requeue", str(job_id)], "requeue", job_id=job_id)

    def batch_script(self, job_id: int) -> str:
        return self._run(["scontrol", "write", "batch_script", str(job_id), "-"],
                         "read the batch script", job_id=job_id)

    def batch_environment(self, job_id: int) -> dict[str, str]:
        out = self._run(["sacct", "--env-vars", "--noheader", f"--jobs={job_id}"],
                        "read the batch environment", job_id=job_id)
        found = parse.batch_environment(out)
        if found is None:
            raise SlurmRejected(self.cluster, "read the batch environment",
                                f"slurmdbd keeps no environment for job {job_id} (it needs "
                                "AccountingStoreFlags=job_env in slurm.conf, and the job's "
                                "record, which reaches slurmdbd seconds after submission)")
        return found

    def hold(self, job_id: int, comment: str | None = None) -> None:
        self._run(["scontrol", "hold", str(job_id)], "hold", job_id=job_id)
        if comment is not None:
            self._run(["scontrol", "update", f"JobId={job_id}", f"Comment={comment}"],
                      "set the comment", job_id=job_id)

    def release(self, job_id: int) -> None:
        self._run(["scontrol", "release", str(job_id)], "release", job_id=job_id)

    def ping(self) -> float:
        began = time.monotonic()
        out = self._run(["scontrol", "ping"], "ping")
        if not parse.ping_is_up_text(out):
            raise ControllerUnreachable(self.cluster, out.strip(), self.timeout_s)
        return time.monotonic() - began

    def nodes(self) -> list[NodeInfo]:
        return parse.nodes(self._json(["sinfo", "--json"], "list nodes"))

    def expected_start(self, spec: JobSpec) -> datetime | None:
        out = self._sbatch_for(spec, ["--test-only"], "test-only submit", merge_stderr=True)
        return parse.expected_start_from_test_only(out)

    def accounting_of(self, job_ids: list[int]) -> list[AccountingRecord]:
        argv = [*SACCT_JSON, f"--jobs={','.join(str(i) for i in job_ids)}"]
        return parse.accounting(self._json(argv, "accounting"), self.cluster)

    def accounting_between(self, start: datetime, end: datetime) -> list[AccountingRecord]:
        found: list[AccountingRecord] = []
        for query in window_queries(list(SACCT_JSON), start, end):
            found += parse.accounting(self._json(query, "accounting"), self.cluster)
        return [r for r in one_per_incarnation(found) if overlaps(r, start, end)]

    def accounting_rows(self, start: datetime, end: datetime
                        ) -> Iterator[AccountingRecord | MalformedAccountingRow]:
        """`accounting(start=, end=)` read from `sacct --parsable2` instead of JSON: a
        fraction of the memory for large windows (billing ingest). A line that cannot be
        read comes out as a MalformedAccountingRow instead of failing the whole window."""
        seen: set[IncarnationKey] = set()
        malformed: set[str] = set()
        for argv in window_queries(parse.sacct_parsable_argv(PARSABLE_DELIMITER), start, end):
            out = self._run(argv, "accounting")
            for item in parse.parsable_accounting(out.splitlines(), self.cluster,
                                                  delimiter=PARSABLE_DELIMITER):
                if isinstance(item, MalformedAccountingRow):
                    if item.text not in malformed:
                        malformed.add(item.text)
                        yield item
                elif incarnation_key(item) not in seen and overlaps(item, start, end):
                    seen.add(incarnation_key(item))
                    yield item

    # --- running commands ----------------------------------------------------------------

    @staticmethod
    def _sbatch() -> str:
        """sbatch, found by this process's PATH: the job's own PATH may name another."""
        found = shutil.which("sbatch")
        if found is None:
            raise SlurmCommandError("sbatch", "not found; install Slurm's client tools")
        return found

    def _json(self, argv: list[str], action: str) -> dict[str, Any]:
        out = self._run(argv, action)
        try:
            return json.loads(out)
        except json.JSONDecodeError:
            raise SlurmCommandError(argv[0], f"printed no JSON: {out[:200]!r}") from None

    def _run(
        self,
        argv: list[str],
        action: str,
        job_id: int | None = None,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
        merge_stderr: bool = False,
        stdin_bytes: bytes | None = None,
    ) -> str:
        """`argv` with `env` as its whole environment; by default this process's own."""
        if env is None:
            env = {**os.environ, "SLURM_CONF": str(self.slurm_conf)}
        # sacct asks slurmdbd, never slurmctld: its silence is an accounting outage.
        unreachable = SlurmdbdUnreachable if argv[0] == "sacct" else ControllerUnreachable
        data = stdin_bytes if stdin_bytes is not None else \
            (None if stdin is None else stdin.encode())
        try:
            raw = subprocess.run([*self.command_prefix, *argv], input=data,
                                 capture_output=True, env=env, timeout=self.timeout_s,
                                 check=False)
        except PermissionError:
            raise SlurmCommandError(argv[0], "may not be run by this account (the service "
                                    "account's group runs it; docs/install.md)") from None
        except subprocess.TimeoutExpired:
            raise unreachable(self.cluster, f"{argv[0]} got no answer", self.timeout_s) from None
        except FileNotFoundError:
            raise SlurmCommandError(argv[0], "not found; install Slurm's client tools (and "
                                    "`slurm-geo site install` for slurm-geo-submit-as)") from None
        proc = subprocess.CompletedProcess(
            argv, raw.returncode, raw.stdout.decode(errors="replace"),
            raw.stderr.decode(errors="replace"))
        message = (proc.stderr or proc.stdout).strip()
        silent = [line for line in message.splitlines()
                  if any(marker in line for marker in UNREACHABLE_MARKERS)]
        if silent:
            raise unreachable(self.cluster, silent[0].strip(), self.timeout_s)
        if job_id is not None and "Invalid job id" in proc.stderr:
            raise JobNotFound(self.cluster, job_id)
        if proc.returncode != 0:
            raise SlurmRejected(self.cluster, action, message or f"exit {proc.returncode}")
        return proc.stdout + proc.stderr if merge_stderr else proc.stdout


def window_queries(argv: list[str], start: datetime, end: datetime) -> list[list[str]]:
    """The sacct runs that together return every incarnation overlapping [start, end):
    the plain window, and the incarnations that ended in it whatever their eligible time
    says (`slurm_geo.slurm.windows`). Their records overlap: keep one per incarnation."""
    window = [f"--starttime={_local(start - WINDOW_SLACK)}",
              f"--endtime={_local(end + WINDOW_SLACK)}"]
    return [[*argv, *window], [*argv, f"--state={STATE_FILTER}", *window]]


def _local(moment: datetime) -> str:
    """sacct reads times in the host's local zone, without an offset."""
    return moment.astimezone().replace(tzinfo=None).isoformat(timespec="seconds")
