"""Which provider image a sandbox uses: the shared one, or one a benchmark names."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_geo.errors import SandboxError
from slurm_geo.sandbox.rootfs import IMAGE_DIR, IMAGE_DIR_ENV, provider_image_dir


@pytest.mark.parametrize("environ, expected", [
    ({}, IMAGE_DIR),
    ({IMAGE_DIR_ENV: ""}, IMAGE_DIR),
    ({IMAGE_DIR_ENV: "/var/tmp/bench-image"}, Path("/var/tmp/bench-image")),
])
def test_the_shared_image_unless_one_is_named(environ, expected):
    assert provider_image_dir(environ) == expected


def test_a_relative_image_path_is_one_clear_error():
    with pytest.raises(SandboxError, match="absolute path"):
        provider_image_dir({IMAGE_DIR_ENV: "image"})
