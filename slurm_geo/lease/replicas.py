"""Which replica of the federation daemon a job asks next. Pure.

A job knows every replica's URL (SLURM_GEO_FEDERATION_URLS; at home, the site config's
[[federation.replicas]]) and asks the one that led last. A replica that does not lead
answers with the way to the leader (docs/federation.md, "Replicas"): `307` with the
leader's URL in Location, followed only to a URL of the list, so a credential is never
sent anywhere else; or `503` with `"leader": null` while nobody leads, asked again after
Retry-After. A replica that does not answer at all is passed over for the next one.
Neither a redirect nor a wait for an election is a refusal: the job is not fenced, and
its lease is not lost for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class Answer:
    """What one replica answered: `status` None when no reply came (and `body["reason"]`
    says why)."""

    status: int | None
    body: dict[str, Any] = field(default_factory=dict)
    location: str = ""
    retry_after_s: float = 1.0


class Move(Enum):
    DONE = "done"        # the leader's answer (or a daemon alone's): take it
    FOLLOW = "follow"    # redirected to a replica of the list: ask that one
    NEXT = "next"        # no answer: ask the next replica
    WAIT = "wait"        # nobody leads yet: ask again after Retry-After
    REFUSE = "refuse"    # redirected outside the list: send nothing there


@dataclass(frozen=True)
class Hop:
    move: Move
    index: int  # the replica to ask next
    reason: str = ""


def next_hop(urls: Sequence[str], asked: int, path: str, answer: Answer) -> Hop:
    """What to do after replica `asked` of `urls` answered `answer` to a request at `path`."""
    if answer.status is None:
        return Hop(Move.NEXT, (asked + 1) % len(urls), str(answer.body.get("reason", "")))
    if answer.status in REDIRECTS:
        target = next((i for i, url in enumerate(urls)
                       if answer.location == url.rstrip("/") + path), None)
        if target is None:
            return Hop(Move.REFUSE, asked, f"{urls[asked]} redirected to "
                       f"{answer.location or 'nowhere'}, which is not {path} of a replica "
                       "this job knows (SLURM_GEO_FEDERATION_URLS): not followed")
        return Hop(Move.FOLLOW, target)
    if answer.status == 503 and "leader" in answer.body and answer.body["leader"] is None:
        return Hop(Move.WAIT, asked, str(answer.body.get("reason", "")))
    return Hop(Move.DONE, asked)


def parse_urls(text: str) -> tuple[str, ...]:
    """SLURM_GEO_FEDERATION_URLS: comma-separated http(s) URLs, in order, each once."""
    urls = [part.strip() for part in text.split(",") if part.strip()]
    for url in urls:
        if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
            raise ValueError(f"{url!r} is not an http:// or https:// URL")
    return tuple(dict.fromkeys(urls))


def retry_after(value: str | None) -> float:
    """A Retry-After of whole seconds (1 to 60); 1 when absent or not a number."""
    try:
        return float(min(60, max(1, int(value or "1"))))
    except ValueError:
        return 1.0
