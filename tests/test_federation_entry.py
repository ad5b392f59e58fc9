"""The federation daemon's main loop in-process, signals queued by hand: SIGTERM and SIGINT
stop it, SIGHUP reloads the config (what may change live takes effect, what may not is
named and kept, a config that does not validate keeps the old one), sd_notify sees READY,
WATCHDOG every round and STOPPING, and every log line is `event=NAME key=value`."""

from __future__ import annotations

import logging
import re
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from systemd_units import settings

from slurm_geo.config.model import SiteConfig, load_config, parse_config
from slurm_geo.daemon.process import Wakeup
from slurm_geo.errors import ConfigError
from slurm_geo.federation.daemon.entry import live_site, run_loop
from slurm_geo.federation.daemon.service import Metrics
from slurm_geo.site import UNITS
from tests.kit.federation import TTL, Site, lose_home

UNIT = UNITS / "slurm-geo-federation.service"

LOGFMT = re.compile(r'event=[a-z_]+( [a-z_]+=("([^"\\]|\\.)*"|[^ "]+))*')


class FakeNotifier:
    """What sd_notify would have sent, in order; `on_watchdog(n)` runs at the n-th."""

    watchdog_interval_s = None

    def __init__(self, on_watchdog: Callable[[int], None] = lambda n: None):
        self.sent: list[str] = []
        self._on_watchdog = on_watchdog

    def ready(self, status: str) -> bool:
        self.sent.append("READY")
        return True

    def reloading(self) -> bool:
        self.sent.append("RELOADING")
        return True

    def stopping(self) -> bool:
        self.sent.append("STOPPING")
        return True

    def status(self, text: str) -> bool:
        return True

    def watchdog(self) -> bool:
        self.sent.append("WATCHDOG")
        self._on_watchdog(self.sent.count("WATCHDOG"))
        return True


class Racing:
    """A monotonic clock that moves on `step` seconds at every reading: each turn of the
    loop finds the next round due, and never waits."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 1000.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path)


@pytest.fixture
def signals():
    wakeup = Wakeup()
    yield wakeup
    wakeup.close()


def federation_changed(config: SiteConfig, **settings: object) -> SiteConfig:
    assert config.federation is not None
    return replace(config, federation=replace(config.federation, **settings))


def run(site: Site, signals: Wakeup, queued: list[int],
        load_site: Callable[[], SiteConfig] | None = None,
        notifier: FakeNotifier | None = None, **kwargs: object) -> FakeNotifier:
    notifier = notifier or FakeNotifier()
    signals.signals.extend(queued)
    assert run_loop(site.federation, signals, notifier,  # type: ignore[arg-type]
                    load_site or (lambda: site.config), **kwargs) == 0
    return notifier


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_queued_term_stops_the_loop_before_a_round(site, signals, signum, caplog):
    caplog.set_level(logging.INFO, "slurm_geo.federation")
    metrics = Metrics()
    notifier = run(site, signals, [signum], metrics=metrics)
    assert notifier.sent == ["READY", "STOPPING"]
    assert metrics.ticks._value.get() == 0
    assert f"event=stopping signal={signal.Signals(signum).name}" in caplog.messages


def test_ready_then_a_watchdog_every_round_then_stopping(site, signals):
    metrics = Metrics()

    def term_at_the_third(n: int) -> None:
        if n == 3:
            signals.signals.append(signal.SIGTERM)

    notifier = run(site, signals, [], notifier=FakeNotifier(term_at_the_third),
                   metrics=metrics, monotonic=Racing(site.federation.config.probe_interval_s))
    assert notifier.sent == ["READY", "WATCHDOG", "WATCHDOG", "WATCHDOG", "STOPPING"]
    assert metrics.ticks._value.get() == 3


def test_sighup_takes_a_longer_lease_ttl_and_a_failover_waits_for_it(site, signals,
                                                                      caplog):
    caplog.set_level(logging.INFO, "slurm_geo.federation")
    job_id = site.home_job_training()
    longer = federation_changed(site.config, lease_ttl_s=3 * TTL)
    longer = replace(longer, policy=replace(longer.policy, max_restarts=5))

    notifier = run(site, signals, [signal.SIGHUP, signal.SIGTERM], lambda: longer)

    assert notifier.sent == ["READY", "RELOADING", "READY", "STOPPING"]
    assert site.federation.config.lease_ttl_s == 3 * TTL
    [reloaded] = [m for m in caplog.messages if m.startswith("event=reloaded")]
    assert f"lease_ttl_s={3 * TTL}" in reloaded and "max_restarts=5" in reloaded
    assert site.federation.site.policy.max_restarts == 5
    assert site.lease("onprem", job_id)["ttl_s"] == 3 * TTL  # jobs learn it at renewal
    lose_home(site)  # onprem declared out, then the old TTL runs out
    site.tick()
    assert site.job().cluster == "onprem"  # the new TTL is what the failover waits for
    assert site.kinds()[-1] == "decision: waiting to move until the lease runs out"
    assert not any(kind.startswith("decision: move") for kind in site.kinds())
    site.clock.advance(2 * TTL)
    site.tick()
    assert site.job().cluster == "rented"


@pytest.mark.parametrize("broken, error", [
    ("[federation]\nlease_ttl_s = -1\n", "lease_ttl_s must be a number of seconds > 0"),
    ("[federation\n", "is not valid TOML"),
    ("[site]\n", "has no [federation] table"),
])
def test_an_invalid_config_keeps_the_old_one_and_is_one_warning(site, signals, caplog,
                                                                 tmp_path, broken, error):
    caplog.set_level(logging.INFO, "slurm_geo.federation")
    path = tmp_path / "config.toml"
    path.write_text(broken)
    before = (site.federation.config, site.federation.site)

    notifier = run(site, signals, [signal.SIGHUP, signal.SIGTERM], lambda: load_config(path))

    assert (site.federation.config, site.federation.site) == before
    assert notifier.sent == ["READY", "RELOADING", "READY", "STOPPING"]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].getMessage().startswith("event=reload_failed error=")
    assert error in warnings[0].getMessage()


def test_what_cannot_change_live_is_named_and_kept(site, signals, caplog, tmp_path):
    caplog.set_level(logging.INFO, "slurm_geo.federation")
    old = site.federation.config
    new = federation_changed(site.config, listen_port=old.listen_port + 1,
                             state=tmp_path / "elsewhere.db", margin_s=5.0)

    run(site, signals, [signal.SIGHUP, signal.SIGTERM], lambda: new)

    config = site.federation.config
    assert (config.listen_port, config.state, config.margin_s) == (
        old.listen_port, old.state, 5.0)
    assert [m for m in caplog.messages if m.startswith("event=restart_needed")] == [
        'event=restart_needed setting=federation.listen_port '
        'reason="takes effect at the next start"',
        'event=restart_needed setting=federation.state '
        'reason="takes effect at the next start"']


def test_every_log_line_is_one_event_in_logfmt(site, signals, caplog):
    caplog.set_level(logging.DEBUG, "slurm_geo.federation")
    configs = [federation_changed(site.config, lease_ttl_s=2 * TTL, listen_port=1)]

    def load() -> SiteConfig:
        if configs:
            return configs.pop()
        raise ConfigError('config.toml [federation]: lease_ttl_s must be a number of '
                          'seconds > 0, got "soon"')

    run(site, signals, [signal.SIGHUP, signal.SIGHUP, signal.SIGTERM], load)
    assert {m.split()[0] for m in caplog.messages} >= {
        "event=started", "event=restart_needed", "event=reloaded", "event=reload_failed",
        "event=stopping"}
    for message in caplog.messages:
        assert LOGFMT.fullmatch(message), message


def test_systemctl_reload_sends_sighup():
    assert settings(UNIT)["ExecReload"] == ["/bin/kill -HUP $MAINPID"]


# --- live_site: which parts of a re-read config a running daemon takes ----------------------


def s3_site(**offsite: str) -> SiteConfig:
    return parse_config({
        "site": {"home_cluster": "onprem"},
        "clusters": {"onprem": {"region": "home", "access": "cli", "slurm_conf": "/x",
                                "store": "offsite"}},
        "stores": {"offsite": {"url": "s3://ckpt/p", "region": "eu", **offsite}},
        "federation": {},
    })


def test_a_store_takes_new_job_credentials_live_but_not_a_new_url():
    old = s3_site(job_credentials="/etc/slurm-geo/old.env")
    site, restart = live_site(old, s3_site(job_credentials="/etc/slurm-geo/new.env"))
    assert restart == [] and site.stores["offsite"].job_credentials == Path(
        "/etc/slurm-geo/new.env")

    site, restart = live_site(old, s3_site(url="s3://other/p"))
    assert restart == ["stores.offsite"]
    assert site.stores["offsite"].url == "s3://ckpt/p"
    assert site.stores["offsite"].job_credentials is None


def test_changed_clusters_need_a_restart_and_the_old_ones_stay():
    old = s3_site()
    new = replace(old, clusters={name: replace(c, slurm_conf=Path("/elsewhere"))
                                 for name, c in old.clusters.items()})
    site, restart = live_site(old, new)
    assert restart == ["clusters"] and site.clusters == old.clusters
