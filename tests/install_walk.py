"""docs/install.md walked on a machine that has only Slurm: the pieces of the walk.

The shell blocks the walk runs are marked in install.md with `<!-- walk: NAME -->` on the
line before their fence; `blocks` finds them, so the page stays the source of what is run.
The walk (tests/test_install_walk.py) runs them in a throwaway root: an overlay over the
Debian 13 image of sandbox.rootfs.HOME_2411 (Slurm 24.11 and nothing of slurm-geo), in a
mount and UTS namespace of its own, entered with chroot. The image itself is only the
overlay's lower layer and never changes.

Pure but for `root_script`'s and `walk_script`'s text, which the test runs.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

MARKER = re.compile(r"^<!-- walk: ([a-z0-9-]+) -->\n```sh\n(.*?)^```$", re.M | re.S)
# What the walk runs, in order: install.md's order but for the service account, which
# section 1 says to create (section 4) before `site install`, and `conf`, what the admin
# does with the lines `site install` prints (follow_up), which section 1 says to do once
# the site config (section 2) is in place; the rest are install.md's blocks.
ORDER = ("packages", "account", "site-install", "config", "conf", "key", "csr", "ca")
# A compute node: what install.md asks of every host, none of what it asks of the
# daemons' hosts (the service account, the master key, the daemon's certificate, the units
# enabled), and the site CA's certificate copied to where the config names it (section 6:
# "at the same path on every host that runs home jobs").
COMPUTE_ORDER = ("packages", "site-install", "config", "conf")
CLUSTER = "onprem"  # docs/examples/site.toml's home cluster
# Lines of a walked block the walk leaves out, and why (a substring of the line).
NOT_WALKED = {"'torch==": "training nodes only: this host is no training node, and torch "
                         "is no dependency of the CLI"}
HOSTNAME = "walkhost"
# What the machine has before the walk: Debian 13 with Slurm 24.11 installed and a
# slurm.conf of its own (the site's, with none of slurm-geo's lines).
SLURM_CONF = f"""ClusterName={CLUSTER}
SlurmctldHost={HOSTNAME}
AuthType=auth/slurm
CredType=cred/slurm
SlurmUser=slurm
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
NodeName={HOSTNAME} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={HOSTNAME} Default=YES State=UP
"""


def blocks(markdown: str) -> dict[str, str]:
    """The marked shell blocks of a page, by name, in the page's order."""
    found: dict[str, str] = {}
    for match in MARKER.finditer(markdown):
        name, body = match.group(1), match.group(2)
        assert name not in found, f"two blocks marked walk: {name}"
        found[name] = body
    return found


def walked(body: str) -> str:
    """A block as the walk runs it: less the lines NOT_WALKED names (a line continued with
    \\ is one line), then where it left the shell (cd), for the next block."""
    kept = []
    for line in body.replace("\\\n", "\0").splitlines():
        if not any(part in line for part in NOT_WALKED):
            kept.append(line)
    return "\n".join(kept).replace("\0", "\\\n") + "\npwd > /walk/cwd\n"


def printed(output: str) -> dict[str, list[str]]:
    """What `site install` prints for the admin, by heading: "slurm.conf", "plugstack.conf"
    and "then" (the commands, with their comments), each line stripped of its indent."""
    sections: dict[str, list[str]] = {"slurm.conf": [], "plugstack.conf": [], "then": []}
    current: str | None = None
    for line in output.splitlines():
        if line.startswith("Add to slurm.conf"):
            current = "slurm.conf"
        elif line.startswith("Add to plugstack.conf"):
            current = "plugstack.conf"
        elif line.startswith("Then:"):
            current = "then"
        elif current and line.startswith("  ") and line.strip():
            sections[current].append(line.strip())
        elif not line.strip():
            continue
        else:
            current = None
    return sections


def follow_up(lines: dict[str, list[str]],
              daemon_host: bool = True) -> tuple[str, list[str]]:
    """The admin's part after `site install`, as shell: the printed lines added to
    slurm.conf and plugstack.conf (CLUSTER: this cluster's name), then the printed commands,
    but for what cannot run on a machine whose daemons systemd does not run (here: a chroot):
    `scontrol reconfigure` (no slurmctld runs) and `systemctl ... --now` (the units are
    enabled instead, which is what starts them at boot). Returns the shell and the commands
    it left out or changed."""
    script = ["cat >> /etc/slurm/slurm.conf <<'EOF'", *lines["slurm.conf"], "EOF",
              "cat >> /etc/slurm/plugstack.conf <<'EOF'",
              *(line.replace("CLUSTER", CLUSTER) for line in lines["plugstack.conf"]), "EOF"]
    changed = []
    for line in lines["then"]:
        line = line.replace("CLUSTER", CLUSTER)
        command, _, comment = line.partition("   #")
        if not daemon_host and "on the daemons' hosts" in comment:
            continue
        if command.startswith("scontrol reconfigure"):
            changed.append(line)
            continue
        if "systemctl" in command and "--now" in command:
            changed.append(line)
            command = "systemctl enable " + command.split("--now", 1)[1].strip()
        script.append(command.strip())
    return "\n".join(script) + "\n", changed


def root_script(image: Path, top: Path, walk_dir: Path) -> str:
    """The host's part, run under `unshare --mount --uts --propagation private`: the image
    as the lower layer of an overlay at `top`/mnt, /proc, /dev, /sys, a /run and /tmp of its
    own, the host's resolv.conf (apt reaches Debian's registry), `walk_dir` at /walk; then
    chroot into it and run /walk/walk.sh."""
    q = shlex.quote
    m = top / "mnt"
    return "\n".join([
        "set -eu",
        f"mkdir -p {q(str(top / 'upper'))} {q(str(top / 'work'))} {q(str(m))}",
        f"mount -t overlay overlay -o lowerdir={image},upperdir={top / 'upper'},"
        f"workdir={top / 'work'} {q(str(m))}",
        f"mount -t proc proc {q(str(m / 'proc'))}",
        f"mount --rbind /dev {q(str(m / 'dev'))}",
        f"mount --rbind /sys {q(str(m / 'sys'))}",
        f"mount -t tmpfs -o mode=0755 run {q(str(m / 'run'))}",
        f"mount -t tmpfs -o mode=1777 tmp {q(str(m / 'tmp'))}",
        f"mount --bind /etc/resolv.conf {q(str(m / 'etc/resolv.conf'))}",
        f"mkdir -p {q(str(m / 'walk'))}",
        f"mount --bind {q(str(walk_dir))} {q(str(m / 'walk'))}",
        f"hostname {HOSTNAME}",
        f"exec chroot {q(str(m))} /bin/bash /walk/walk.sh",
    ]) + "\n"


# Inside the root. Each step is /walk/steps/NAME.sh, run with bash -e from /walk (where the
# wheel and site.toml lie, as copied there by the admin), its output in /walk/out/NAME.out
# and its status in NAME.rc; the walk stops at the first step that fails. munged: the
# walk starts it as munge.service would at boot (no systemd runs here), and stops it.
WALK = """set -u
export DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 HOME=/root
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
echo "127.0.0.1 localhost {hostname}" > /etc/hosts
stop_munged() {{ [ -s /run/munge/munged.pid ] && kill "$(cat /run/munge/munged.pid)"; }}
trap stop_munged EXIT
cd /walk
pwd > cwd
if ! apt-get update -qq > out/apt-update.out 2>&1; then echo 75 > out/apt-update.rc; exit 0; fi
# an admin's machine has man (Debian's minimal image not): what `man slurm-geo` needs
apt-get install -y -qq man-db > out/man-db.out 2>&1 || exit 0
# the admin answers apt-get's question (install.md's commands have no -y)
echo 'APT::Get::Assume-Yes "true";' > /etc/apt/apt.conf.d/90walk
mkdir -p /var/spool/slurmctld /var/spool/slurmd
cat > /etc/slurm/slurm.conf <<'EOF'
{slurm_conf}EOF
export PIP_NO_INDEX=1 PIP_FIND_LINKS=/walk/wheelhouse PIP_DISABLE_PIP_VERSION_CHECK=1
for step in {steps}; do
  if [ "$step" = conf ]; then
    /opt/slurm-geo/bin/python /walk/follow_up.py out/site-install.out {role} > steps/conf.sh
  fi
  # one admin's shell: each step starts where the one before left off (cd)
  (cd "$(cat /walk/cwd)" && bash -ex /walk/steps/$step.sh) > out/$step.out 2>&1
  rc=$?
  echo $rc > out/$step.rc
  [ $rc = 0 ] || exit 0
  if [ "$step" = packages ] && [ -x /usr/sbin/munged ]; then
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged
  fi
done
bash /walk/probes.sh > out/probes.out 2>&1
echo $? > out/probes.rc
"""

# What the test reads after the walk: each one's output in /walk/out/probe-NAME.out.
PROBES = {
    "python": "/opt/slurm-geo/bin/python -c 'import sys, slurm_geo; "
              "print(sys.version_info[:2], slurm_geo.__file__)'",
    "help": "slurm-geo --help",
    "man": "MANPAGER=cat MANWIDTH=100 man slurm-geo",
    "completion": "source /usr/local/share/bash-completion/completions/slurm-geo; "
                  "COMP_WORDS=(slurm-geo si); COMP_CWORD=1; _slurm_geo_completion slurm-geo; "
                  "printf '%s\\n' \"${COMPREPLY[@]}\"",
    "key": "stat -c '%U:%G %a' /etc/slurm-geo/master.key",
    "submit-as": "stat -c '%U:%G %a' /usr/local/libexec/slurm-geo/submit-as",
    "wants": "ls /etc/systemd/system/multi-user.target.wants/ "
             "/etc/systemd/system/timers.target.wants/",
    "slurm": "scontrol -V",
    "doctor": "slurm-geo doctor --json",
}


def walk_script(steps: tuple[str, ...] = ORDER) -> str:
    role = "daemon" if "key" in steps else "compute"
    return WALK.format(hostname=HOSTNAME, slurm_conf=SLURM_CONF, steps=" ".join(steps),
                       role=role)


def probes_script() -> str:
    return "".join(f"( {command} ) > out/probe-{name}.out 2> out/probe-{name}.err; "
                   f"echo $? > out/probe-{name}.rc\n" for name, command in PROBES.items())


# Run inside with the installed slurm-geo's Python: the admin's part after `site install`.
FOLLOW_UP = """import sys
sys.path.insert(0, "/walk")
from install_walk import follow_up, printed
script, _changed = follow_up(printed(open(sys.argv[1]).read()), sys.argv[2] == "daemon")
print("set -e")
print(script, end="")
"""
