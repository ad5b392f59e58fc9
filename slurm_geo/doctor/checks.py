"""The judgements of `slurm-geo doctor`: facts gathered from a host in, findings out.

Pure: every function takes facts (slurm_geo.doctor.facts) and the time, and returns
Findings, so each rule is tested table-driven without a file, a socket or a clock. A
finding at level "error" fails the doctor; each names what is wrong and the fix in one line.
A check that depends on another one's failure says nothing (a slurm.conf without a
PlugStackConfig line is one error, not also "no SPANK plugin"), so one broken piece is one
line.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from slurm_geo.doctor.facts import (
    CA_UNREADABLE,
    ClockFact,
    EtcdFact,
    JwtFact,
    LinkFact,
    MungeFact,
    OperatorFact,
    SecretFileFact,
    SlurmConfFact,
    SpankFact,
    StoreFact,
    TlsFact,
    UnitFact,
)

ERROR, WARN, OK = "error", "warn", "ok"
INFO = "info"  # a measurement, reported and never judged (the link rates)
DAY_S = 86400.0
# A certificate or a token that ends within this long is an error: it fails before anyone
# who reads the doctor's output after a weekend has acted.
CERT_ERROR_S = 7 * DAY_S
CERT_WARN_S = 30 * DAY_S
TOKEN_WARN_S = DAY_S / 2  # a token of a day (the sandbox's) is renewed daily
# The lease signatures allow +-60 s between a job's host and the daemon (docs/federation.md);
# half of that is the most a host may be off before it is an error.
CLOCK_ERROR_S = 30.0
CLOCK_WARN_S = 5.0
# Secret files: no group or other bit at all (the key, tokens, TLS keys, passwords).
OPEN_BITS = 0o077
# The slurm.conf lines of the --geo-* integration (sandbox.render.geo_slurm_conf_lines):
# setting -> what it is, for the fix.
GEO_SLURM_SETTINGS = {
    "PlugStackConfig": "the plugstack.conf that loads geo_directives.so",
    "JobSubmitPlugins": "lua (job_submit.lua next to slurm.conf)",
    "CliFilterPlugins": "cli_filter/lua (cli_filter.lua next to slurm.conf)",
    "Prolog": "the slurm-geo prolog hook",
    "Epilog": "the slurm-geo epilog hook",
    "PrologSlurmctld": "the slurm-geo prolog_slurmctld hook",
    "EpilogSlurmctld": "the slurm-geo epilog_slurmctld hook",
}
HOOK_SETTINGS = ("Prolog", "Epilog", "PrologSlurmctld", "EpilogSlurmctld")
SITE_INSTALL = "`slurm-geo site install` prints the exact lines"


@dataclass(frozen=True)
class Finding:
    level: str  # ERROR, WARN or OK
    check: str  # the piece: "slurm.conf", "spank", "munge", "master key", "tls", ...
    what: str  # what was found, naming the file, URL or member
    fix: str = ""  # what to do; empty for OK

    def line(self) -> str:
        """The one line a person reads: the piece, what is wrong, the fix."""
        text = f"{self.check}: {self.what}"
        return f"{text}; fix: {self.fix}" if self.fix else text


def failed(findings: Iterable[Finding]) -> bool:
    return any(f.level == ERROR for f in findings)


# --- Slurm ------------------------------------------------------------------------------

def check_slurm_conf(fact: SlurmConfFact, controller: bool) -> list[Finding]:
    """The --geo-* lines of a cluster's slurm.conf; the hook lines and the Lua plugins are
    the controller's (slurmctld reads them), PlugStackConfig every host's (sbatch, slurmd)."""
    name = f"slurm.conf ({fact.cluster})"
    if fact.error:
        return [Finding(ERROR, name, f"{fact.path} cannot be read: {fact.error}",
                        "give the config's slurm_conf = PATH of the cluster's slurm.conf")]
    wanted = list(GEO_SLURM_SETTINGS) if controller else ["PlugStackConfig"]
    findings = []
    for setting in wanted:
        value = fact.settings.get(setting.lower(), "")
        if not value:
            findings.append(Finding(
                ERROR, name, f"{fact.path} has no {setting}= line "
                f"({GEO_SLURM_SETTINGS[setting]})",
                f"add {setting}=... to {fact.path} ({SITE_INSTALL}), then "
                "`scontrol reconfigure`"))
        elif setting in ("JobSubmitPlugins", "CliFilterPlugins") and "lua" not in value:
            findings.append(Finding(
                ERROR, name, f"{fact.path}: {setting}={value} lacks lua",
                f"add lua to {setting} in {fact.path}, then `scontrol reconfigure`"))
        elif setting in HOOK_SETTINGS and not fact.hooks_runnable.get(value, False):
            findings.append(Finding(
                ERROR, name, f"{fact.path}: {setting}={value} is not an executable file",
                f"install the hooks ({SITE_INSTALL}) or correct {setting}="))
    return findings or [Finding(OK, name, f"{fact.path} has the slurm-geo lines")]


def check_spank(fact: SpankFact) -> list[Finding]:
    """The plugstack.conf line loading geo_directives.so, and the plugin built against the
    Slurm this host runs (Slurm refuses a plugin of another major.minor)."""
    name = f"spank plugin ({fact.cluster})"
    if fact.plugstack is None:
        return []  # no PlugStackConfig line: check_slurm_conf said so
    if fact.plugstack_error:
        return [Finding(ERROR, name, f"{fact.plugstack} cannot be read: {fact.plugstack_error}",
                        "create it with the line `slurm-geo site install` prints")]
    if fact.plugin is None:
        return [Finding(ERROR, name, f"{fact.plugstack} loads no geo_directives.so",
                        f"add `required /PATH/geo_directives.so ...` to {fact.plugstack} "
                        f"({SITE_INSTALL})")]
    if fact.plugin_error:
        return [Finding(ERROR, name, f"{fact.plugin}: {fact.plugin_error}",
                        "build and install the plugin: `slurm-geo site install`")]
    if fact.slurm_version is None:
        return [Finding(WARN, name, f"cannot tell which Slurm runs here ({fact.slurm_error}) "
                        f"to compare with {fact.plugin}", "install Slurm's commands")]
    built = version_text(fact.plugin_version)
    if fact.plugin_version is None or \
            (fact.plugin_version >> 8) != (fact.slurm_version[0] << 8 | fact.slurm_version[1]):
        running = f"{fact.slurm_version[0]}.{fact.slurm_version[1]:02d}"
        return [Finding(ERROR, name, f"{fact.plugin} was built against Slurm {built}, this "
                        f"host runs {running}: Slurm refuses to load it",
                        "rebuild it against the installed Slurm's headers: "
                        "`slurm-geo site install`")]
    return [Finding(OK, name, f"{fact.plugin} built for Slurm {built}")]


def version_text(number: int | None) -> str:
    """SLURM_VERSION_NUMBER (0x160508) as 22.05.8."""
    if number is None:
        return "an unknown version"
    return f"{number >> 16}.{(number >> 8) & 0xFF:02d}.{number & 0xFF}"


def check_munge(fact: MungeFact) -> list[Finding]:
    if fact.ok:
        return [Finding(OK, "munge", f"a credential made and decoded at {fact.socket}")]
    return [Finding(ERROR, "munge", f"{fact.socket}: {fact.detail}",
                    "start munged (`systemctl enable --now munge`), or name its socket "
                    "in [federation] munge_socket / slurm.conf AuthInfo=socket=")]


# --- files ------------------------------------------------------------------------------

def check_secret_file(fact: SecretFileFact) -> list[Finding]:
    """A secret (master key, token, TLS key, password) held where it must be, readable by
    its owner alone, owned by root or the service account."""
    name = fact.what
    if not fact.exists:
        if not fact.required:
            return []
        return [Finding(ERROR, name, f"{fact.path} does not exist", fact.create_fix
                        or f"create {fact.path} (docs/install.md)")]
    if fact.mode & OPEN_BITS:
        return [Finding(ERROR, name, f"{fact.path} is mode {fact.mode:04o}: others may read "
                        "it", f"chmod 600 {fact.path}")]
    if fact.owners and fact.owner not in fact.owners:
        return [Finding(ERROR, name, f"{fact.path} is owned by {fact.owner or fact.uid}",
                        f"chown {fact.owners[0]} {fact.path}")]
    return [Finding(OK, name, f"{fact.path} mode {fact.mode:04o}, owner {fact.owner}")]


def daemon_checks_skipped(roles_given: bool) -> Finding:
    """A user who is neither root nor the service account, on a daemon host: the daemon's
    checks read its secrets, which are not theirs to read."""
    return Finding(ERROR if roles_given else WARN, "daemon",
                   "the daemon host's checks (its key, secrets, tokens, units, etcd, stores) "
                   "need root or the slurm-geo account; only the others ran",
                   "run `sudo slurm-geo doctor`")


def check_not_held(fact: SecretFileFact, role: str) -> list[Finding]:
    """A secret this role of host must never hold (the master key on a compute or login
    node: docs/security.md, "Where each secret lives")."""
    if not fact.exists:
        return [Finding(OK, fact.what, f"not on this {role} host, as it should be")]
    return [Finding(ERROR, fact.what, f"{fact.path} is on this {role} host, which never "
                    "needs it (no hook or job reads it)", f"shred -u {fact.path}; jobs get "
                    "their run's key from the federation daemon")]


def check_jwt(fact: JwtFact, now: float) -> list[Finding]:
    name = f"token ({fact.what})"
    if fact.error:
        return [Finding(ERROR, name, f"{fact.path}: {fact.error}", fact.renew)]
    if fact.expires is None:
        return [Finding(OK, name, f"{fact.path} has no expiry")]
    left = fact.expires - now
    if left <= 0:
        return [Finding(ERROR, name, f"{fact.path} expired {_ago(-left)} ago", fact.renew)]
    if left < TOKEN_WARN_S:
        return [Finding(WARN, name, f"{fact.path} expires in {_ago(left)}", fact.renew)]
    return [Finding(OK, name, f"{fact.path} valid for {_ago(left)}")]


def check_tls(fact: TlsFact, now: float) -> list[Finding]:
    """A certificate: readable, signed by its CA, matching its key, and not ending soon."""
    name = f"tls ({fact.what})"
    renew = fact.renew or f"issue a new certificate and write it to {fact.path}"
    if fact.error:
        return [Finding(ERROR, name, f"{fact.path}: {fact.error}", renew)]
    assert fact.not_after is not None
    left = fact.not_after - now
    if left <= 0:
        return [Finding(ERROR, name, f"{fact.path} expired {_ago(-left)} ago", renew)]
    if fact.not_before is not None and fact.not_before > now:
        return [Finding(ERROR, name, f"{fact.path} is not valid for another "
                        f"{_ago(fact.not_before - now)}", "check this host's clock, or "
                        "reissue the certificate")]
    if fact.signed_by_ca is False:
        return [Finding(ERROR, name, f"{fact.path} is not signed by {fact.ca}", renew +
                        f" (signed by {fact.ca}), or name its CA")]
    if fact.key_matches is False:
        return [Finding(ERROR, name, f"{fact.path} and its key {fact.key} do not match",
                        "give the private key of that certificate")]
    if left < CERT_ERROR_S:
        return [Finding(ERROR, name, f"{fact.path} expires in {_ago(left)}", renew)]
    if left < CERT_WARN_S:
        return [Finding(WARN, name, f"{fact.path} expires in {_ago(left)}", renew)]
    return [Finding(OK, name, f"{fact.path} valid for {_ago(left)}")]


# --- services ---------------------------------------------------------------------------

def check_unit(fact: UnitFact) -> list[Finding]:
    name = f"unit {fact.unit}"
    if fact.path is None:
        return [Finding(ERROR, name, f"{fact.unit} is not installed under {fact.root}",
                        "`slurm-geo site install` puts it in /etc/systemd/system")]
    if not fact.enabled:
        return [Finding(ERROR, name, f"{fact.unit} is not enabled: it does not start at "
                        "boot", f"systemctl enable --now {fact.unit}")]
    if fact.user and not fact.user_exists:
        return [Finding(ERROR, name, f"{fact.unit} runs as {fact.user}, who does not exist",
                        f"create the account: useradd --system {fact.user} "
                        "(docs/install.md, section 4)")]
    return [Finding(OK, name, f"{fact.path}, enabled")]


def check_operator(fact: OperatorFact) -> list[Finding]:
    """The daemons' account is a Slurm operator of each CLI cluster (docs/install.md,
    section 4): it holds, requeues and cancels other users' jobs and reads their scripts."""
    name = f"account ({fact.cluster})"
    if fact.error:
        return [Finding(ERROR, name, f"cannot ask the cluster's accounting about {fact.user}: "
                        f"{fact.error}", "check slurmdbd and the cluster's slurm.conf")]
    if fact.level not in ("Operator", "Administrator"):
        said = "is not in" if not fact.level else f"has AdminLevel {fact.level} in"
        return [Finding(ERROR, name, f"{fact.user} {said} {fact.cluster}'s accounting: the "
                        "federation daemon cannot hold, requeue or read others' jobs",
                        f"sacctmgr -i add user {fact.user} account=ACCOUNT "
                        f"cluster={fact.cluster}; sacctmgr -i modify user {fact.user} set "
                        "adminlevel=Operator")]
    return [Finding(OK, name, f"{fact.user} is a Slurm {fact.level} of {fact.cluster}")]


def check_etcd(fact: EtcdFact) -> list[Finding]:
    """Each member named in etcd_endpoints answers with a raft leader; a quorum of the
    cluster's members does."""
    if fact.error:
        return [Finding(ERROR, "etcd", fact.error, "see [federation] etcd_* settings")]
    healthy = [m for m in fact.members if m.healthy]
    size = max(fact.cluster_size, len(fact.members))
    quorum = size // 2 + 1
    held = f"quorum held ({len(healthy)} of {size})" if len(healthy) >= quorum else \
        f"quorum LOST ({len(healthy)} of {size}, {quorum} needed)"
    findings = [Finding(ERROR, "etcd", f"member {m.endpoint} does not answer or has no "
                        f"leader ({m.error or 'unhealthy'}); {held}",
                        "start it (`systemctl start slurm-geo-etcd` on its host) or remove "
                        "it from [federation] etcd_endpoints")
                for m in fact.members if not m.healthy]
    if not healthy:
        return findings or [Finding(ERROR, "etcd", "no member answers",
                                    "start the members")]
    return findings or [Finding(OK, "etcd", f"the {len(healthy)} members of etcd_endpoints "
                                f"answer with a leader; {held}")]


def check_store(fact: StoreFact) -> list[Finding]:
    """write, read back, list, delete under doctor/: the first operation that fails."""
    name = f"store {fact.name}"
    for operation, error in fact.operations:
        if error:
            return [Finding(ERROR, name, f"{fact.url} refuses {operation}: {error}",
                            f"give these credentials {operation} access to {fact.url} "
                            "(file://: the directory writable by the daemons' account; "
                            "s3://: the bucket policy)")]
    done = ", ".join(op for op, _ in fact.operations)
    return [Finding(OK, name, f"{fact.url}: {done}")]


def check_link(fact: LinkFact) -> list[Finding]:
    """The rate of one timed transfer to a store: reported, never judged (a link's rate
    depends on the hour; `slurm-geo drill` measures what a move costs)."""
    if fact.error or not fact.size:
        return []  # check_store says why the store cannot be written
    mb = fact.size / 1e6
    return [Finding(INFO, f"link {fact.name}", f"{fact.url}: {mb:.0f} MB up at "
                    f"{_rate(mb, fact.up_s)}, read back at {_rate(mb, fact.down_s)}")]


def _rate(mb: float, seconds: float) -> str:
    if seconds <= 0:
        return "-"
    rate = mb / seconds
    return f"{rate:.0f} MB/s" if rate >= 100 else f"{rate:.3g} MB/s"


def check_clock(facts: Sequence[ClockFact], clock_offset_s: float = 0.0) -> list[Finding]:
    """This host's clock against each federation daemon's (its HTTP Date header): a daemon
    that does not answer is an error of its own; the clock is one verdict, on the daemon it
    is furthest from (the replicas' own clocks are their hosts' doctors' to judge)."""
    findings = [Finding(ERROR, "federation daemon", f"{f.url} cannot be asked: {f.error}",
                        "put the CA's certificate there (docs/install.md, section 6) or "
                        "correct [federation] ca_file")
                if f.error.startswith(CA_UNREADABLE) else
                Finding(ERROR, "federation daemon", f"{f.url} does not answer: {f.error}",
                        "start it (`systemctl start slurm-geo-federation`) or correct "
                        "[federation] public_url / [[federation.replicas]] url")
                for f in facts if f.error]
    skews = [(f.our_time + clock_offset_s - f.their_time, f.url) for f in facts
             if not f.error and f.our_time is not None and f.their_time is not None]
    if not skews:
        return findings
    skew, url = max(skews, key=lambda pair: abs(pair[0]))
    where = "ahead of" if skew > 0 else "behind"
    said = f"this host's clock is {abs(skew):.0f} s {where} the daemon at {url}"
    fix = "sync this host's clock with NTP (`chronyc tracking` shows the offset)"
    if abs(skew) > CLOCK_ERROR_S:
        return [*findings, Finding(ERROR, "clock", said + " (lease signatures allow +-60 s)",
                                   fix)]
    if abs(skew) > CLOCK_WARN_S:
        return [*findings, Finding(WARN, "clock", said, fix)]
    return [*findings, Finding(OK, "clock", said)]


def _ago(seconds: float) -> str:
    """A duration, rounded: 3 days, 5 hours, 12 minutes, 40 s."""
    if seconds >= 2 * DAY_S:
        return f"{seconds / DAY_S:.0f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.0f} hours"
    if seconds >= 120:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds:.0f} s"
