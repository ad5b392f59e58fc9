"""Pure parsers for what Slurm prints and serves.

`squeue --json`/`sinfo --json`/`sacct --json` and slurmrestd share their schemas per
OpenAPI version, so one set of normalisers reads both backends. Two shapes exist:
v0.0.38/39 (Slurm 22.05, 23.02) uses plain numbers and strings; v0.0.40 and later
(23.11, 24.x) wraps numbers as {"set", "infinite", "number"} and states as lists.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from slurm_geo.slurm.models import (
    AccountingRecord,
    JobInfo,
    JobState,
    MalformedAccountingRow,
    NodeInfo,
)

Json = dict[str, Any]


def number(value: Any) -> int | None:
    """An integer from either shape; None when unset or infinite."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite", False):
            return None
        value = value.get("number")
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return int(value)
    return None


# Slurm's NO_VAL and INFINITE as 32-bit times: 24.11's `sacct --json` prints a start time of
# 4294967294 for an incarnation that never started (22.05 and slurmrestd print 0).
_NO_TIME = 0xFFFFFFFE


def timestamp(value: Any) -> datetime | None:
    seconds = number(value)
    if not seconds or seconds >= _NO_TIME:
        return None
    return datetime.fromtimestamp(seconds, UTC)


def words(value: Any) -> list[str]:
    """A state or flag set from either shape: "RUNNING" or ["RUNNING", "COMPLETING"]."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    return [str(item) for item in value]


def job_state(value: Any) -> JobState:
    states = words(value)
    return JobState.parse(states[0]) if states else JobState.UNKNOWN


# The state flags an accounting record's state is named by, before its base state, in the
# order `sacct` names them (slurm_protocol_defs.c: job_state_string).
_RECORD_FLAG_STATES = ("REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "SPECIAL_EXIT", "REVOKED")


def record_state(value: Any) -> JobState:
    """An accounting record's state as sacct names it: 24.11's `sacct --json` says
    ["PENDING", "REQUEUED"] of an incarnation that ended in a requeue, sacct's text and
    22.05's JSON "REQUEUED". (A job slurmctld reports is PENDING so: `job_state`.)"""
    flags = words(value)[1:]
    for flag in _RECORD_FLAG_STATES:
        if flag in flags:
            return JobState(flag)
    return job_state(value)


def errors(doc: Json) -> list[Json]:
    """The answer's errors, with each failed job of a per-job `status` list as one: v0.0.40+
    answer DELETE /job/{id} of an unknown job with HTTP 200, no `errors` and the error in
    status[].error ({"code": 2017, "message": ...})."""
    found = [e for e in doc.get("errors") or [] if isinstance(e, dict)]
    statuses = doc.get("status")
    for entry in statuses if isinstance(statuses, list) else []:
        failure = entry.get("error") if isinstance(entry, dict) else None
        if isinstance(failure, dict) and number(failure.get("code")):
            found.append({"error_number": number(failure.get("code")),
                          "error": failure.get("message") or failure.get("string") or "",
                          "description": f"job {entry.get('step_id') or '?'}"})
    return found


def error_text(doc: Json) -> str:
    parts = []
    for err in errors(doc):
        text = err.get("description") or err.get("error") or ""
        if err.get("error") and err.get("error") not in text:
            text = f"{text} ({err['error']})" if text else err["error"]
        parts.append(text)
    return "; ".join(p for p in parts if p)


def jobs_from_ctld(doc: Json, cluster: str) -> list[JobInfo]:
    """Jobs as slurmctld reports them: `squeue --json` or slurmrestd /slurm/vX/job(s)."""
    return [_job(raw, cluster) for raw in doc.get("jobs") or []]


def _job(raw: Json, cluster: str) -> JobInfo:
    limit = number(raw.get("time_limit"))
    return JobInfo(
        cluster=raw.get("cluster") or cluster,
        job_id=int(number(raw.get("job_id")) or 0),
        name=raw.get("name") or "",
        state=job_state(raw.get("job_state")),
        reason=raw.get("state_reason") or "",
        user=raw.get("user_name") or "",
        account=raw.get("account") or "",
        partition=raw.get("partition") or "",
        nodes=raw.get("nodes") or "",
        restart_count=number(raw.get("restart_cnt")) or 0,
        submit_time=timestamp(raw.get("submit_time")),
        start_time=timestamp(raw.get("start_time")),
        end_time=timestamp(raw.get("end_time")),
        time_limit_minutes=limit,
        exit_code=_exit_code(raw.get("exit_code")),
        # Plain numbers in every shape (22.05's v0.0.38 and 24.11's v0.0.42 alike); a
        # group_id of null (v0.0.38 prints NO_VAL so) is unknown.
        uid=number(raw.get("user_id")),
        gid=number(raw.get("group_id")),
        work_dir=raw.get("current_working_directory") or None,
    )


def _exit_code(value: Any) -> int | None:
    if isinstance(value, dict) and "return_code" in value:
        return number(value["return_code"])
    return number(value)


def nodes(doc: Json) -> list[NodeInfo]:
    """Nodes from `sinfo --json` or slurmrestd /slurm/vX/nodes."""
    if not doc.get("nodes") and isinstance(doc.get("sinfo"), list):
        return _sinfo_nodes(doc["sinfo"])
    found = []
    for raw in doc.get("nodes") or []:
        states = words(raw.get("state"))
        base = states[0].lower() if states else "unknown"
        flags = [s.upper() for s in states[1:]] + [f.upper() for f in words(raw.get("state_flags"))]
        found.append(NodeInfo(
            name=raw.get("name") or raw.get("hostname") or "",
            state=base,
            flags=tuple(flags),
            reason=raw.get("reason") or "",
            cpus=number(raw.get("cpus")) or 0,
            partitions=tuple(words(raw.get("partitions"))),
        ))
    return found


def _sinfo_nodes(entries: list[Any]) -> list[NodeInfo]:
    """Nodes from 23.02+'s `sinfo --json` (24.11: v0.0.42): not one entry per node as 22.05
    and slurmrestd print, but one per group of nodes alike (state, reason, partition), its
    node names in nodes.nodes; a node in several partitions is in several groups."""
    found: dict[str, NodeInfo] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        states = words((entry.get("node") or {}).get("state"))
        reason = entry.get("reason")
        partition = (entry.get("partition") or {}).get("name") or ""
        for name in words((entry.get("nodes") or {}).get("nodes")):
            known = found.get(name)
            if known is not None:
                if partition and partition not in known.partitions:
                    found[name] = replace(known, partitions=(*known.partitions, partition))
                continue
            found[name] = NodeInfo(
                name=name,
                state=states[0].lower() if states else "unknown",
                flags=tuple(s.upper() for s in states[1:]),
                reason=(reason.get("description") or "" if isinstance(reason, dict)
                        else reason or ""),
                cpus=number((entry.get("cpus") or {}).get("maximum")) or 0,
                partitions=(partition,) if partition else (),
            )
    return list(found.values())


def accounting(doc: Json, cluster: str) -> list[AccountingRecord]:
    """Job records from `sacct --json` or slurmrestd /slurmdb/vX/job(s)."""
    return [_record(raw, cluster) for raw in doc.get("jobs") or []]


def _record(raw: Json, cluster: str) -> AccountingRecord:
    times = raw.get("time") or {}
    state = raw.get("state") or {}
    current = record_state(state.get("current"))
    return AccountingRecord(
        cluster=raw.get("cluster") or cluster,
        job_id=int(number(raw.get("job_id")) or 0),
        name=raw.get("name") or "",
        user=raw.get("user") or "",
        account=raw.get("account") or "",
        partition=raw.get("partition") or "",
        state=current,
        submit_time=timestamp(times.get("submission")),
        start_time=timestamp(times.get("start")),
        end_time=timestamp(times.get("end")),
        elapsed_s=number(times.get("elapsed")) or 0,
        allocated_tres=tres((raw.get("tres") or {}).get("allocated")),
        exit_code=_exit_code(raw.get("exit_code")),
        nodes=raw.get("nodes") or "",
        comment=_comment(raw.get("comment")),
        admin_comment=_admin_comment(raw.get("comment"), raw.get("admin_comment")),
        # slurmdbd's name of the user who cancelled it (v0.0.38 and later); "" otherwise.
        cancelled_by=(raw.get("kill_request_user") or ""
                      if current is JobState.CANCELLED else ""),
    )


def tres(entries: Any) -> dict[str, int]:
    """{"cpu": 2, "node": 1, "gres/gpu": 1} from a TRES list; counts of None are dropped,
    and negative ones (24.11's `sacct --json` counts energy never measured as -2)."""
    found: dict[str, int] = {}
    for entry in entries or []:
        count = number(entry.get("count"))
        if count is None or count < 0:
            continue
        key = entry.get("type") or ""
        if entry.get("name"):
            key = f"{key}/{entry['name']}"
        found[key] = count
    return found


def _comment(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("job") or ""
    return value or ""


def _admin_comment(comment: Any, flat: Any) -> str:
    """v0.0.38+ keep it in comment.administrator; some shapes have a flat admin_comment."""
    if isinstance(comment, dict) and comment.get("administrator"):
        return str(comment["administrator"])
    return str(flat) if isinstance(flat, str) else ""


# --- sacct --parsable2: the fast path for large windows ------------------------------------

# The fields `parsable_accounting` reads, in order. JobName comes last: it is the one free-text
# field users choose, and the last field may contain the delimiter.
PARSABLE_FIELDS = ("JobIDRaw", "Cluster", "User", "Account", "Partition", "State", "Submit",
                   "Start", "End", "ElapsedRaw", "AllocTRES", "ExitCode", "NodeList",
                   "AdminComment", "Comment", "JobName")
_MEMORY_UNITS = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 ** 2, "P": 1024 ** 3}


def sacct_parsable_argv(delimiter: str = "|") -> list[str]:
    """The sacct arguments whose output `parsable_accounting` reads (add the window)."""
    return ["sacct", "--parsable2", "--noheader", f"--delimiter={delimiter}", "--duplicates",
            "--allusers", "--allocations", f"--format={','.join(PARSABLE_FIELDS)}"]


def tres_text(text: str) -> dict[str, int]:
    """{"cpu": 2, "gres/gpu": 2, "mem": 4096} from sacct's "cpu=2,gres/gpu=2,mem=4G".

    Memory counts are in MB as in the JSON shapes. Raises ValueError for what is not TRES.
    """
    found: dict[str, int] = {}
    for item in text.split(",") if text else ():
        key, sep, value = item.partition("=")
        if value.isdigit() and key:
            found[key] = int(value)
        elif not sep or not key:
            raise ValueError(f"TRES entry {item!r} is not NAME=COUNT")
        elif value[:-1].replace(".", "", 1).isdigit() and value[-1:] in _MEMORY_UNITS:
            found[key] = round(float(value[:-1]) * _MEMORY_UNITS[value[-1]])
        else:
            raise ValueError(f"TRES entry {item!r} has no count")
    return found


def parsable_accounting(lines: Iterable[str], cluster: str, tz: Any = None,
                        delimiter: str = "|"
                        ) -> Iterator[AccountingRecord | MalformedAccountingRow]:
    """Records from `sacct --parsable2` lines with PARSABLE_FIELDS, one at a time.

    `tz` is the zone sacct printed times in (default: this host's). A line that cannot be
    read comes out as a MalformedAccountingRow saying why; a header line is skipped.
    """
    header = delimiter.join(PARSABLE_FIELDS)
    for number_, raw_line in enumerate(lines, 1):
        line = raw_line.rstrip("\n")
        if not line or line == header:
            continue
        fields = line.split(delimiter, len(PARSABLE_FIELDS) - 1)
        try:
            yield _parsable_record(fields, cluster, tz)
        except ValueError as exc:
            yield MalformedAccountingRow(cluster, number_, line, str(exc))


def _parsable_record(fields: list[str], cluster: str, tz: Any) -> AccountingRecord:
    if len(fields) != len(PARSABLE_FIELDS):
        raise ValueError(f"{len(fields)} fields, expected {len(PARSABLE_FIELDS)}")
    (job_id, cluster_name, user, account, partition, state, submit, start, end, elapsed,
     alloc, exit_code, nodes_, admin_comment, comment, name) = fields
    if not job_id.isdigit():
        raise ValueError(f"JobIDRaw {job_id!r} is not a job id")
    if not elapsed.isdigit():
        raise ValueError(f"ElapsedRaw {elapsed!r} is not a number of seconds")
    return AccountingRecord(
        cluster=cluster_name or cluster, job_id=int(job_id), name=name, user=user,
        account=account, partition=partition, state=_sacct_state(state),
        submit_time=_sacct_time(submit, tz), start_time=_sacct_time(start, tz),
        end_time=_sacct_time(end, tz), elapsed_s=int(elapsed),
        allocated_tres=dict(_sacct_tres(alloc)),
        exit_code=_sacct_exit_code(exit_code), nodes=nodes_, comment=comment,
        admin_comment=admin_comment, cancelled_by=sacct_cancelled_by(state),
    )


def sacct_cancelled_by(state: str) -> str:
    """The requester in sacct's "CANCELLED by 2001" (a uid); "" for any other state."""
    words = state.split()
    if len(words) == 3 and words[0] == "CANCELLED" and words[1] == "by":
        return words[2]
    return ""


# A month of accounting repeats a few states and TRES sets many thousand times.
@lru_cache(maxsize=256)
def _sacct_state(text: str) -> JobState:
    return JobState.parse(text)


@lru_cache(maxsize=4096)
def _sacct_tres(text: str) -> tuple[tuple[str, int], ...]:
    return tuple(tres_text(text).items())


def _sacct_time(text: str, tz: Any) -> datetime | None:
    if text in ("", "Unknown", "None", "N/A"):
        return None
    try:
        naive = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"time {text!r} is not YYYY-MM-DDTHH:MM:SS") from None
    if tz is UTC:
        return naive.replace(tzinfo=UTC)
    return (naive.replace(tzinfo=tz) if tz else naive.astimezone()).astimezone(UTC)


def _sacct_exit_code(text: str) -> int | None:
    code = text.split(":")[0]
    return int(code) if code.isdigit() else None


_TEST_ONLY = re.compile(r"Job \d+ to start at (\S+)")


def expected_start_from_test_only(text: str, local_tz: Any = None) -> datetime:
    """The start time `sbatch --test-only` predicts, as an aware datetime.

    sbatch prints local time without a zone; `local_tz` says which (default: this host's).
    """
    match = _TEST_ONLY.search(text)
    if not match:
        raise ValueError(f"no start time in sbatch --test-only output: {text.strip()!r}")
    naive = datetime.fromisoformat(match.group(1))
    return naive.replace(tzinfo=local_tz) if local_tz else naive.astimezone()


def ping_is_up_text(text: str) -> bool:
    """`scontrol ping`: "Slurmctld(primary) at host is UP"."""
    return bool(re.search(r"\bis UP\b", text)) and "DOWN" not in text


def ping_is_up_json(doc: Json) -> bool:
    pings = doc.get("pings") or []
    if not pings:
        return False
    first = pings[0]
    if "responding" in first:
        return bool(first["responding"])
    return str(first.get("pinged") or first.get("ping") or "").upper() == "UP"


# --- sacct --env-vars: the environment a batch job was submitted with -----------------------

_ENV_HEADER = "Environment used for "
# A variable's name; bash exports functions as BASH_FUNC_name%%=() { ...
_ENV_LINE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*|BASH_FUNC_[^=\s]+%%)=(.*)")


def batch_environment(text: str) -> dict[str, str] | None:
    """The variables `sacct --env-vars --jobs=ID` printed; None when slurmdbd keeps none
    (it prints NONE without AccountingStoreFlags=job_env, or nothing for a job it has no
    record of yet).

    slurmdbd stores the environment as NAME=value lines (accounting_storage_slurmdbd.c:
    "%s\n" per variable), so a value holding a newline (an exported bash function) goes on
    over the following lines: a line that does not start NAME= continues the previous
    value. 22.05 always prints a two-line header first; 24.11 only without --noheader.
    """
    lines = text.split("\n")
    if lines and lines[0].startswith(_ENV_HEADER):
        lines = lines[2:] if len(lines) > 1 and set(lines[1]) == {"-"} else lines[1:]
    while lines and not lines[-1].strip():
        lines.pop()  # 22.05 ends with a blank line
    if not lines or lines == ["NONE"]:
        return None
    found: dict[str, str] = {}
    name = None
    for line in lines:
        match = _ENV_LINE.fullmatch(line)
        if match:
            name = match.group(1)
            found[name] = match.group(2)
        elif name is not None:
            found[name] += "\n" + line
    return found


def submitted_job_id(text: str) -> int:
    """`sbatch --parsable` prints "ID" or "ID;cluster"."""
    head = text.strip().split(";")[0]
    if not head.isdigit():
        raise ValueError(f"sbatch printed no job id: {text.strip()!r}")
    return int(head)
