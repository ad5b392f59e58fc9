"""Home on Slurm 24.11 without Slurm: the trixie image's recipe, the home24 site's shape, and
the parsers' readings of what 24.11 prints otherwise than 22.05 (table-driven)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_geo.sandbox import home24, rootfs
from slurm_geo.sandbox import provider_render as render
from slurm_geo.slurm import parse
from slurm_geo.slurm.models import JobState


def test_the_trixie_image_is_its_own_and_has_no_rest_or_munge() -> None:
    assert rootfs.HOME_2411_IMAGE_DIR != rootfs.IMAGE_DIR  # the provider's is left alone
    argv = rootfs.mmdebstrap_argv(rootfs.HOME_2411, Path("/x/.img.building"))
    assert argv[-3] == "trixie"
    included = next(a for a in argv if a.startswith("--include=")).split("=", 1)[1].split(",")
    assert {"slurmctld", "slurmd", "slurmdbd", "slurm-client", "mariadb-server"} <= set(included)
    assert not {"slurmrestd", "munge"} & set(included)
    assert not rootfs.stamp_fits({"suite": "sid", "layout": rootfs.LAYOUT,
                                  "packages": sorted(rootfs.PACKAGES),
                                  "slurm_version": "26.05.5"}, rootfs.HOME_2411)


def test_the_home24_site_has_homes_users_at_homes_uids() -> None:
    site = home24.site(Path("/var/tmp/h/home24"), 27000)
    assert (site.image, site.recipe, site.rest, site.accounting) == (
        rootfs.HOME_2411_IMAGE_DIR, rootfs.HOME_2411, False, True)
    assert {(a.name, a.uid) for a in site.accounts} == {("alice", 2001), ("bob", 2002)}
    assert site.daemon_names == ["mariadb", "slurmdbd", "slurmctld",
                                               "home24-n1", "home24-n2"]
    passwd = render.passwd("root:x:0:0::/root:/bin/bash\n", site.accounts)
    assert "alice:x:2001:2001::/home/alice:/bin/bash" in passwd.splitlines()


def test_the_client_runs_each_command_inside_as_the_service_account() -> None:
    site = home24.site(Path("/var/tmp/h/home24"), 27000)
    client = home24.client(site)
    prefix = list(client.command_prefix)
    assert prefix[0] == "/usr/bin/nsenter" and f"--mount={site.mount_ns}" in prefix
    assert prefix[-4:] == ["/usr/bin/setpriv", "--reuid=slurm-geo", "--regid=slurm-geo",
                           "--init-groups"]
    assert (client.sbatch, client.submit_as, client.slurm_conf) == (
        "/usr/bin/sbatch", home24.HELPER, Path("/etc/slurm/slurm.conf"))
    assert "setpriv" not in " ".join(home24.command_prefix(site, as_root=True))


@pytest.mark.parametrize(("value", "state"), [
    ("REQUEUED", JobState.REQUEUED),  # 22.05
    (["PENDING", "REQUEUED"], JobState.REQUEUED),  # 24.11's sacct --json
    (["PENDING", "REQUEUE_HOLD"], JobState.REQUEUE_HOLD),
    (["PENDING", "REQUEUED", "REQUEUE_HOLD"], JobState.REQUEUED),  # sacct's own order
    (["PENDING"], JobState.PENDING),
    (["CANCELLED"], JobState.CANCELLED),
    (["COMPLETED"], JobState.COMPLETED),
    ([], JobState.UNKNOWN),
])
def test_record_state(value: object, state: JobState) -> None:
    assert parse.record_state(value) is state


def test_a_job_slurmctld_reports_requeued_is_pending() -> None:
    assert parse.job_state(["PENDING", "REQUEUED"]) is JobState.PENDING


@pytest.mark.parametrize(("value", "none"), [
    (0, True), (4294967294, True), (4294967295, True),
    ({"set": True, "infinite": False, "number": 4294967294}, True),
    (1_700_000_000, False),
])
def test_no_val_times_are_none(value: object, none: bool) -> None:
    assert (parse.timestamp(value) is None) is none


def test_negative_tres_counts_are_dropped() -> None:
    entries = [{"type": "cpu", "name": "", "count": 2}, {"type": "energy", "name": "",
                                                         "count": -2},
               {"type": "gres", "name": "gpu", "count": 1}]
    assert parse.tres(entries) == {"cpu": 2, "gres/gpu": 1}
