"""The weaker tiers still work and say what they are (forced here; a machine without cgroups or without
namespaces would pick them by itself)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from sandboxes import Limits, SandboxPool, SandboxSpec, probe_tier

from .conftest import watch


@pytest.fixture(scope="module", params=["namespaces+rlimits", "rlimits-only"])
def weak_pool(request: pytest.FixtureRequest) -> Iterator[SandboxPool]:
    if probe_tier() == "rlimits-only" and request.param != "rlimits-only":
        pytest.skip("this machine has no namespaces")
    with SandboxPool(size=1, _force_tier=request.param) as pool:
        yield watch(pool)


def test_weaker_tier_is_declared_and_works(weak_pool: SandboxPool) -> None:
    result = weak_pool.run(SandboxSpec(code="def f():\n    return 1\n", epilogue="assert f() == 1",
                                       files={"in.txt": "x"}, artifacts=("*.txt",)))
    assert result.tier == weak_pool.tier
    assert result.passed
    assert [a.path for a in result.artifacts] == ["in.txt"]


def test_weaker_tier_enforces_time_and_memory(weak_pool: SandboxPool) -> None:
    assert weak_pool.run(SandboxSpec(code="import time\ntime.sleep(30)",
                                     limits=Limits(wall_seconds=0.5))).status == "timeout"
    result = weak_pool.run(SandboxSpec(code="x = bytearray(400 << 20)", limits=Limits(memory_bytes=128 << 20)))
    assert result.status == "memory_limit"


def test_weaker_tier_scrubs_the_environment(weak_pool: SandboxPool) -> None:
    os.environ["TEMPER_TIER_SECRET"] = "x"
    try:
        result = weak_pool.run(SandboxSpec(code="import os\nprint('TEMPER_TIER_SECRET' in os.environ)"))
    finally:
        del os.environ["TEMPER_TIER_SECRET"]
    assert result.stdout == b"False\n"
