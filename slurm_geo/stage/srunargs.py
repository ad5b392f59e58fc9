"""Where the command starts in an `srun` command line, and that command line with every
component's command wrapped (docs/training.md "A moved job's world", every node). Pure.

srun parses its options with getopt_long in "stop at the first non-option" mode: options
come first, the first word that is not an option (or follows `--`) is the command, and
everything after it is the command's. A lone `:` separates the components of a
heterogeneous step, each with its own options and command. So the command is found only
by knowing which options take a value in the next word: `-n 4`, `--ntasks 4` (`-n4`,
`--ntasks=4` carry it in the same word; an option whose value is optional never takes
the next word). The tables below are srun's options in Slurm 22.05, 24.11 and 26.05
(src/common/slurm_opt.c, every option of `common_options` that srun sets), their union:
the rented clusters slurm-geo meets run one of these. A long option may be abbreviated to
any unambiguous prefix, as getopt_long allows; an option srun does not know is refused
in one line (srun would refuse it too), since guessing could wrap the wrong word.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode

# Long options that take a value (required_argument): `--opt VALUE` or `--opt=VALUE`.
LONG_WITH_VALUE = frozenset("""
accel-bind account acctg-freq autocomplete bb bbf bcast-exclude begin chdir cluster
cluster-constraint clusters comment constraint container container-id container-type context
core-spec cores-per-socket cpu-bind cpu-freq cpu_bind cpus-per-gpu cpus-per-task deadline
delay-boot dependency distribution epilog error exclude export extra extra-node-info gid
gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task gres gres-flags
het-group hint ignore-signals input job-name jobid licenses mail-type mail-user mcs-label
mem mem-bind mem-per-cpu mem-per-gpu mem-update mincpus mpi msg-timeout network nodefile
nodelist nodes ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket
ntasks-per-tres open-mode output pack-group partition power prefer priority profile
prolog qos relative reservation resources runtime segment signal slurmd-debug
sockets-per-node switches task-epilog task-prolog tasks-per-node thread-spec threads
threads-per-core time time-min tmp treewidth tres-bind tres-per-task uid wait wckey
""".split())
# Long options whose value is optional (`--opt=VALUE` only) and flags: never the next word.
LONG_OPTIONAL = frozenset("""
bcast compress exclusive external-launcher immediate kill-on-bad-exit nice no-kill
oom-kill-step overlap propagate pty resv-ports send-libs x11
""".split())
LONG_FLAGS = frozenset("""
async consolidate-segments contiguous debugger-test disable-status exact help hold
interactive label multi-prog no-allocate overcommit oversubscribe parsable preserve-env
quiet quit-on-interrupt reboot spread-job spread-segments stepmgr test-only unbuffered
usage use-min-nodes verbose version wait-for-children whole
""".split())
LONG_OPTIONS = LONG_WITH_VALUE | LONG_OPTIONAL | LONG_FLAGS
SHORT_WITH_VALUE = frozenset("AbBcCdDeFGiJLmnNoprqStTwWx")
SHORT_OPTIONAL = frozenset("IKk")
SHORT_FLAGS = frozenset("EhHlOQsuvVXZ")
HET_SEPARATOR = ":"


class SrunArgsError(SlurmGeoError):
    exit_code = ExitCode.USAGE


@dataclass(frozen=True)
class Component:
    """One component of an srun command line: its options (as written) and its command
    with the command's own arguments (empty where it gave none)."""

    options: tuple[str, ...]
    command: tuple[str, ...]
    values: tuple[tuple[str, str], ...] = ()  # (long name, value) of each valued option

    def value(self, name: str) -> str | None:
        """The last value given for the long option `name`, else None."""
        found = [value for option, value in self.values if option == name]
        return found[-1] if found else None


SHORT_NAMES = {"D": "chdir", "w": "nodelist", "N": "nodes", "n": "ntasks"}


def long_name(given: str) -> str:
    """The full name of the long option `given` (without `--`), prefixes resolved as
    getopt_long resolves them."""
    if given in LONG_OPTIONS:
        return given
    matches = sorted(name for name in LONG_OPTIONS if name.startswith(given))
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise SrunArgsError(f"srun option '--{given}' is not one srun knows (Slurm 22.05 "
                            "to 26.05); check its spelling")
    raise SrunArgsError(f"srun option '--{given}' is ambiguous ({', '.join(matches[:4])}"
                        f"{' ...' if len(matches) > 4 else ''}); spell it out")


def component(words: list[str]) -> Component:
    """Split one component's words into options and command."""
    index = 0
    values: list[tuple[str, str]] = []
    while index < len(words):
        word = words[index]
        if word == "--":
            return Component(tuple(words[:index + 1]), tuple(words[index + 1:]),
                             tuple(values))
        if word.startswith("--"):
            name, equals, value = word[2:].partition("=")
            name = long_name(name)
            if name in LONG_WITH_VALUE and not equals:
                if index + 1 >= len(words):
                    raise SrunArgsError(f"srun option '--{name}' needs a value")
                value = words[index + 1]
                index += 1
            elif name in LONG_FLAGS and equals:
                raise SrunArgsError(f"srun option '--{name}' takes no value")
            values.append((name, value))
        elif word.startswith("-") and word != "-":
            index, short = _short(words, index)
            if short is not None:
                values.append(short)
        else:
            break
        index += 1
    return Component(tuple(words[:index]), tuple(words[index:]), tuple(values))


def _short(words: list[str], index: int) -> tuple[int, tuple[str, str] | None]:
    """A cluster of short options (`-lN2`, `-n 4`): the index of its last word and the
    (name, value) of a valued one."""
    word = words[index]
    for position in range(1, len(word)):
        letter = word[position]
        rest = word[position + 1:]
        if letter in SHORT_FLAGS:
            continue
        if letter in SHORT_OPTIONAL:
            return index, None
        if letter in SHORT_WITH_VALUE:
            if rest:
                return index, (SHORT_NAMES.get(letter, letter), rest)
            if index + 1 >= len(words):
                raise SrunArgsError(f"srun option '-{letter}' needs a value")
            return index + 1, (SHORT_NAMES.get(letter, letter), words[index + 1])
        raise SrunArgsError(f"srun option '-{letter}' (in '{word}') is not one srun knows "
                            "(Slurm 22.05 to 26.05)")
    return index, None


def parse(argv: list[str]) -> list[Component]:
    """The components of an srun command line (`argv` without `srun` itself)."""
    parts: list[list[str]] = [[]]
    for word in argv:
        if word == HET_SEPARATOR:
            parts.append([])
        else:
            parts[-1].append(word)
    return [component(part) for part in parts]


def wrapped(argv: list[str], wrapper: list[str]) -> list[str]:
    """`argv` with `wrapper` put before each component's command (a component with no
    command keeps none: srun gives it the next one's). A `--multi-prog` component's
    command is its configuration file, which `multi_prog` rewrites: unchanged here."""
    words: list[str] = []
    for index, part in enumerate(parse(argv)):
        if index:
            words.append(HET_SEPARATOR)
        words += part.options
        if part.command and not is_multi_prog(part):
            words += wrapper
        words += part.command
    return words


def is_multi_prog(part: Component) -> bool:
    return any(name == "multi-prog" for name, _ in part.values)


def multi_prog(text: str, wrapper: list[str]) -> str:
    """An srun `--multi-prog` configuration with `wrapper` put before each line's program
    (`RANKS PROGRAM ARGS...`); comments, blank lines and continued lines kept as is."""
    lines, continued = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if continued or not stripped or stripped.startswith("#"):
            lines.append(line)
        else:
            ranks, *rest = stripped.split(None, 1)
            program = rest[0] if rest else ""
            if program:
                line = " ".join([ranks, *(_quoted(w) for w in wrapper), program])
            lines.append(line)
        continued = line.rstrip().endswith("\\")
    return "\n".join(lines) + "\n"


def _quoted(word: str) -> str:
    """A word of the wrapper in a multi-prog line (srun splits them on blanks, keeping
    single or double quoted strings whole)."""
    if word and not any(c.isspace() or c in "'\"\\%" for c in word):
        return word
    if "'" in word or "%" in word:
        raise SrunArgsError(f"the path '{word}' cannot stand in an srun --multi-prog line")
    return f"'{word}'"
