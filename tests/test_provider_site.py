"""The rented provider's image and site (sandbox.rootfs, provider_render): pure, table-driven."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_geo.sandbox import provider_render as render
from slurm_geo.sandbox import rootfs
from slurm_geo.sandbox.provider import ProviderSite


@pytest.mark.parametrize(("output", "version"), [
    ("slurm-wlm 26.05.5\n", "26.05.5"),
    ("slurm 24.11.5", "24.11.5"),
    ("slurm-wlm 22.05.8", "22.05.8"),
    ("", ""),
    ("slurmctld: error: something", ""),
])
def test_slurm_version(output: str, version: str) -> None:
    assert rootfs.slurm_version(output) == version


def _stamp(**changes: object) -> dict[str, object]:
    recipe = rootfs.Recipe()
    stamp: dict[str, object] = {"suite": recipe.suite, "packages": sorted(recipe.packages),
                                "layout": recipe.layout, "slurm_version": "26.05.5"}
    return {**stamp, **changes}


@pytest.mark.parametrize(("stamp", "fits"), [
    (None, False),
    ({}, False),
    (_stamp(), True),
    (_stamp(packages=list(reversed(rootfs.PACKAGES))), True),  # order is not the recipe
    (_stamp(suite="trixie"), False),
    (_stamp(layout=rootfs.LAYOUT - 1), False),
    (_stamp(packages=["slurmctld"]), False),
    (_stamp(slurm_version=""), False),  # a build that never said what it gave
])
def test_stamp_fits(stamp: dict[str, object] | None, fits: bool) -> None:
    assert rootfs.stamp_fits(stamp, rootfs.Recipe()) is fits


def test_mmdebstrap_argv_is_the_checked_recipe() -> None:
    argv = rootfs.mmdebstrap_argv(rootfs.Recipe(), Path("/x/.img.building"))
    assert argv[:2] == ["mmdebstrap", "--variant=apt"]
    assert '--aptopt=Acquire::Check-Valid-Until "false"' in argv
    assert argv[-3:] == ["sid", "/x/.img.building", rootfs.MIRROR]
    included = next(a for a in argv if a.startswith("--include="))
    for package in ("slurmctld", "slurmd", "slurmdbd", "slurmrestd", "slurm-wlm-jwt-plugin"):
        assert package in included.removeprefix("--include=").split(",")
    hook = next(a for a in argv if a.startswith("--customize-hook="))
    for point in (*rootfs.MOUNT_POINTS, *rootfs.FILE_MOUNT_POINTS):
        assert f'"$1/{point}"' in hook


def test_every_python_bind_has_its_mount_point_in_the_image() -> None:
    points = {f"/{p}" for p in (*rootfs.MOUNT_POINTS, *rootfs.FILE_MOUNT_POINTS)}
    assert {str(p) for p in render.PYTHON_BINDS} <= points


def test_slurm_conf_is_stock() -> None:
    """Nothing of slurm-geo's: no plugin stack, Lua, hook or script; JWT for slurmrestd."""
    conf = render.slurm_conf("provider", "10.77.0.2", render.Ports.from_base(24070),
                             (("p-n1", 24071),), accounting=True)
    for setting in ("PlugStackConfig", "JobSubmitPlugins", "CliFilterPlugins", "Prolog",
                    "Epilog", "slurm-geo", "slurm_geo", "geo-"):
        assert setting not in conf
    assert "AuthType=auth/slurm\n" in conf
    assert "AuthAltTypes=auth/jwt\n" in conf
    assert "SlurmctldHost=provider(10.77.0.2)\n" in conf
    assert "SlurmctldPort=24070\n" in conf and "Port=24071 " in conf


IMAGE_PASSWD = ("root:x:0:0:root:/root:/bin/bash\n"
                "slurm:x:64030:64030::/nonexistent:/usr/sbin/nologin\n"
                "geo-alice:x:1:1::/:/bin/sh\n")


def test_accounts_are_the_providers_own() -> None:
    text = render.passwd(IMAGE_PASSWD)
    names = [line.split(":")[0] for line in text.splitlines()]
    assert names == ["root", "slurm", "slurmrestd", "slurm-geo", "geo-alice", "geo-bob"]
    assert "geo-alice:x:3101:3101::/home/geo-alice:/bin/bash" in text
    assert "alice:" not in text.replace("geo-alice:", "")
    group = render.group("root:x:0:\nslurm:x:64030:\n")
    assert group.splitlines()[-4:] == ["slurmrestd:x:64031:", "slurm-geo:x:3100:",
                                       "geo-alice:x:3101:", "geo-bob:x:3102:"]


@pytest.mark.parametrize(("address", "expected"), [
    ("127.0.0.1", "127.0.0.1 localhost provider\n"),
    ("10.77.0.2", "127.0.0.1 localhost\n10.77.0.2 provider\n"),
])
def test_hosts(address: str, expected: str) -> None:
    assert render.hosts(address) == expected


def test_setup_script_hides_the_host_disk() -> None:
    site = ProviderSite(Path("/var/tmp/sgX/provider"), 24070)
    script = render.setup_script(site.dirs)
    lines = script.splitlines()
    assert lines[1] == f"mount --bind {rootfs.IMAGE_DIR} /var/tmp/sgX/provider/mnt"
    assert lines[2] == "mount -o remount,bind,ro /var/tmp/sgX/provider/mnt"
    for source, target in [("home", "/home"), ("tmp", "/tmp"), ("scratch", "/scratch"),
                           ("etc", "/etc/slurm")]:
        assert f"mount --bind /var/tmp/sgX/provider/{source} " \
               f"/var/tmp/sgX/provider/mnt{target}" in lines
    for python in render.PYTHON_BINDS:
        assert f"mount -o remount,bind,ro /var/tmp/sgX/provider/mnt{python}" in lines
    # The host's root is left behind and detached last; nothing is bound from / itself.
    assert lines[-3:] == ["pivot_root . .oldroot", "cd /", "umount -l /.oldroot"]
    assert not any(line.startswith("mount --rbind / ") for line in lines)
