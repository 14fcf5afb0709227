"""Every phase extension that exists compiles (no GPU needed; skipped only without a toolkit)."""

import pytest

from utils.build import build_all, extension_packages, package_exists
from utils.testing import requires_toolkit


@requires_toolkit
@pytest.mark.compile
def test_every_extension_builds():
    present = [p for p in extension_packages() if package_exists(p)]
    assert present, "no extension packages found"
    assert build_all(present), "some extensions failed to build (their logs are printed above)"
