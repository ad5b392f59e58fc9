"""One `with` for what slurm-geo opens and must close (a database, an audit log, a
checkpointer): a class that defines `close()` takes `__enter__` and `__exit__` from
`Closing`, and `with Thing(...) as thing:` closes it however the block ends."""

from __future__ import annotations

from typing import Self


class Closing:
    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
