"""A logical job's output across its incarnations and clusters, in generation order
(`slurm-geo logs JOB [--follow]`).

Each incarnation writes where its `--output` option says (`slurm-%j.out` in its working
directory when it has none), expanded as Slurm does for %j, %x, %u and %%. Where that is
comes from the job's own options (`output_file`, pure); the files are read here, so an
incarnation that wrote to another site's filesystem is named, not shown.
"""

from __future__ import annotations

import codecs
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from slurm_geo.federation.act.resubmit import ScriptOptions, resubmitted_name, working_dir
from slurm_geo.federation.model import Incarnation, LogicalJob
from slurm_geo.federation.state.interface import State

SLURM_DEFAULT_OUTPUT = "slurm-%j.out"
READ_CHUNK = 1 << 16
_PATTERN = re.compile(r"%%|%(\d*)([jxu])")


@dataclass(frozen=True)
class OutputFile:
    """Where an incarnation's output is: `path` is absolute when `known`; otherwise it is
    relative to a directory the state does not record (the home job's submit directory, for
    a job registered before Slurm's record of it was kept)."""

    path: str
    known: bool


def expand(pattern: str, job_id: int | None, name: str | None, user: str | None) -> str:
    """Slurm's filename pattern with what is known filled in: %j (a number between % and
    j zero-pads it), %x the job name, %u the user, %% a percent sign. What is not known,
    and every other %-letter, stays as written."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "%%":
            return "%"
        pad, letter = match.group(1), match.group(2)
        if letter == "j":
            return match.group(0) if job_id is None else str(job_id).zfill(int(pad or 0))
        value = name if letter == "x" else user
        return match.group(0) if value is None else value

    return _PATTERN.sub(one, pattern)


def output_file(job: LogicalJob, incarnation: Incarnation,
                user: str | None = None) -> OutputFile:
    """Where `incarnation` of `job` writes its output. The home job (generation 0) has the
    user's options only; a resubmission also the daemon's defaults (federation.resubmit:
    its job name is the logical job id, its working directory /tmp)."""
    options = ScriptOptions.from_json(job.spec)
    resubmitted = incarnation.generation > 0
    name = resubmitted_name(options, job.logical_job) if resubmitted else options.name
    expanded = expand(options.output or SLURM_DEFAULT_OUTPUT, incarnation.job_id, name, user)
    if PurePosixPath(expanded).is_absolute():
        return OutputFile(expanded, True)
    workdir = (working_dir(options, incarnation.cluster == job.home) if resubmitted
               else options.working_dir or options.submit_dir)
    if workdir is None or not PurePosixPath(workdir).is_absolute():
        return OutputFile(expanded if workdir is None else f"{workdir}/{expanded}", False)
    return OutputFile(str(PurePosixPath(workdir) / expanded), True)


def header(incarnation: Incarnation, where: OutputFile) -> str:
    job_id = "-" if incarnation.job_id is None else incarnation.job_id
    return (f"==> {incarnation.cluster}:{job_id} generation {incarnation.generation}: "
            f"{where.path} <==\n")


@dataclass
class _Tail:
    """One incarnation's file, read from where the last read stopped."""

    incarnation: Incarnation
    where: OutputFile
    offset: int = 0
    said_unreadable: bool = False
    ends_line: bool = True
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))

    def read_shipped(self, shipped: Callable[[Incarnation], bytes | None]) -> str | None:
        """What was appended to the log the incarnation shipped home (docs/format.md
        §11.9) since the last read; None when it shipped none."""
        data = shipped(self.incarnation)
        if data is None:
            return None
        new, self.offset = data[self.offset:], max(self.offset, len(data))
        text = self.decoder.decode(new)
        if text:
            self.ends_line = text.endswith("\n")
        return text

    def read_new(self) -> str | None:
        """What was appended since the last read; None when the file cannot be read."""
        if not self.where.known or self.incarnation.job_id is None:
            return None
        try:
            with open(self.where.path, "rb") as file:
                file.seek(self.offset)
                data = file.read()
        except OSError:
            return None
        self.offset += len(data)
        text = self.decoder.decode(data)
        if text:
            self.ends_line = text.endswith("\n")
        return text


class JobOutput:
    """Prints a logical job's output to `write`, incarnation by incarnation, each under a
    header line. `users`: the user each cluster's resubmissions run as, where known
    (%u); the home job's user is not recorded."""

    def __init__(self, state: State, logical_job: str, write: Callable[[str], None],
                 users: Mapping[str, str] | None = None,
                 shipped: Callable[[Incarnation], bytes | None] | None = None):
        self.state, self.logical_job, self.write = state, logical_job, write
        self.users = dict(users or {})
        self.shipped = shipped  # a moved incarnation's log as it shipped it home

    def print_all(self) -> None:
        """Every incarnation's output as it stands now."""
        job = self.state.job(self.logical_job)
        for incarnation in self.state.incarnations(self.logical_job):
            tail = self._start(job, incarnation)
            self._drain(tail, finished=True)

    def follow(self, poll_s: float = 1.0, sleep: Callable[[float], None] = time.sleep) -> None:
        """The older incarnations' output, then the current one's as it grows; when the
        daemon moves the job, the next incarnation's; until the job is final."""
        job = self.state.job(self.logical_job)
        *older, newest = self.state.incarnations(self.logical_job)
        for incarnation in older:
            self._drain(self._start(job, incarnation), finished=True)
        tail = self._start(job, newest)
        while True:
            job = self.state.job(self.logical_job)
            final = job.status.is_final()
            tail = self._catch_up(job, tail, final)
            if final:
                return
            sleep(poll_s)

    def _catch_up(self, job: LogicalJob, tail: _Tail, final: bool) -> _Tail:
        incarnations = {i.generation: i for i in self.state.incarnations(self.logical_job)}
        newer = sorted(g for g in incarnations if g > tail.incarnation.generation)
        self._refresh(job, tail, incarnations[tail.incarnation.generation])
        if not newer:
            self._drain(tail, finished=final)
            return tail
        self._drain(tail, finished=True)
        for generation in newer[:-1]:
            self._drain(self._start(job, incarnations[generation]), finished=True)
        tail = self._start(job, incarnations[newer[-1]])
        self._drain(tail, finished=final)
        return tail

    def _refresh(self, job: LogicalJob, tail: _Tail, incarnation: Incarnation) -> None:
        """A moving incarnation gets its job id (and so its file name) once submitted."""
        if incarnation != tail.incarnation:
            submitted = tail.incarnation.job_id is None and incarnation.job_id is not None
            tail.incarnation = incarnation
            tail.where = self._where(job, incarnation)
            if submitted:  # its header said "not submitted yet": name the file now
                self.write(header(incarnation, tail.where))

    def _start(self, job: LogicalJob, incarnation: Incarnation) -> _Tail:
        tail = _Tail(incarnation, self._where(job, incarnation))
        self.write(header(incarnation, tail.where))
        return tail

    def _where(self, job: LogicalJob, incarnation: Incarnation) -> OutputFile:
        return output_file(job, incarnation, self.users.get(incarnation.cluster)
                           if incarnation.generation > 0 else None)

    def _drain(self, tail: _Tail, finished: bool) -> None:
        """Write what is new; `finished`: nothing more is awaited, so end the text with a
        newline and say once if the file could not be read at all."""
        text = tail.read_new()
        if text is None and self.shipped is not None:
            text = tail.read_shipped(self.shipped)
        if text:
            self.write(text)
        if text is None and not tail.said_unreadable and (finished or tail.offset == 0):
            tail.said_unreadable = True
            self.write(_unreadable(tail) + "\n")
        if finished and not tail.ends_line:
            self.write("\n")
            tail.ends_line = True


def _unreadable(tail: _Tail) -> str:
    incarnation, where = tail.incarnation, tail.where
    if incarnation.job_id is None:
        return "(not submitted yet)"
    if not where.known:
        return (f"(cannot be read here: {where.path} is relative to the directory "
                f"{incarnation.cluster}:{incarnation.job_id} was submitted from, which the "
                "federation state does not record)")
    if incarnation.ended_at is not None:
        return (f"(cannot be read here: it would be at {where.path}, on "
                f"{incarnation.cluster}'s filesystem)")
    return (f"(cannot be read here yet: {where.path} is not written yet, or on "
            f"{incarnation.cluster}'s filesystem)")
