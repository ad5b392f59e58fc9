"""Errors a user or a script can act on.

Each class has a stable exit code from the one table, `slurm_geo.exitcodes`, so that
prolog/epilog callers and scripts can branch on it; the CLI prints the message (one line,
naming the thing and the fix) and exits with it.
"""

from slurm_geo.exitcodes import ExitCode


class SlurmGeoError(Exception):
    """Base of every error slurm-geo reports to a user instead of a traceback."""

    exit_code: int = ExitCode.FAILURE

    def __reduce__(self):  # type: ignore[override]
        # Subclasses take their own arguments, which pickle's default would not pass back;
        # torch.distributed pickles a rank's exception to report it on the coordinator.
        return _rebuild, (type(self), str(self), self.__dict__)


def _rebuild(cls: type[SlurmGeoError], message: str, state: dict) -> SlurmGeoError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class ConfigError(SlurmGeoError):
    """The slurm-geo config file is missing, malformed or names something unknown."""

    exit_code = ExitCode.CONFIG


class SandboxError(SlurmGeoError):
    """The local sandbox cannot be brought up, inspected or torn down."""

    exit_code = ExitCode.SANDBOX
