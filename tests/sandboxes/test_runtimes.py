"""Runtimes as images: definitions, the content-addressed image cache (built once, under a lock), a failed
build naming its package, the warm per-runtime interpreters with their modules preloaded, the standard-library
default, a broken image rebuilt on retry, and garbage collection.

The numpy image is built once per machine into the project's image root (``var/runtimes``: ~7 s the first
time, a cache hit after); the other images here are package-free (a virtualenv: ~0.1 s) in a root of their own.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes import SandboxPool, SandboxSpec, runtimes
from sandboxes.runtimes import BuildError, Runtime, RuntimeDefinitionError

from .conftest import watch


@pytest.fixture(scope="session")
def numpy_image() -> runtimes.Image:
    image, _ = runtimes.ensure_image(runtimes.get("numpy"))
    return image


@pytest.fixture
def own_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An image root of the test's own (outside /tmp, which every sandbox covers with its work directory)."""
    root = runtimes.images_root().parent / "test-runtimes" / uuid.uuid4().hex[:8]
    monkeypatch.setenv("TEMPER_RUNTIMES_ROOT", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def registered() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        runtimes._registered.pop(name, None)


def register(names: list[str], runtime: Runtime) -> Runtime:
    names.append(runtime.name)
    return runtimes.register(runtime)


# ---------------------------------------------------------------- definitions


def test_definitions_are_validated_with_the_field_and_the_reason(tmp_path: Path) -> None:
    with pytest.raises(RuntimeDefinitionError, match=r"packages: 'numpy' must be an exact pin"):
        Runtime(name="loose", packages=("numpy",))
    with pytest.raises(RuntimeDefinitionError, match=r"python: '3' must be a major\.minor"):
        Runtime(name="odd", python="3")
    bad = tmp_path / "typo.toml"
    bad.write_text('packages = ["numpy==2.4.6"]\npreloads = ["numpy"]\n')
    with pytest.raises(RuntimeDefinitionError, match=r"unknown field\(s\) \['preloads'\]"):
        runtimes.load_definition(bad)
    with pytest.raises(RuntimeDefinitionError, match=r"unknown sandbox runtime 'nope'; defined: .*numpy.*python"):
        runtimes.get("nope")


def test_the_image_key_is_the_content_not_the_name() -> None:
    numpy = runtimes.get("numpy")
    twin = Runtime(name="arrays", packages=("NumPy==2.4.6",), preload=())
    assert twin.key() == numpy.key()  # same pins (canonical names), same interpreter: one image
    assert Runtime(name="newer", packages=("numpy==2.4.5",)).key() != numpy.key()


# ---------------------------------------------------------------- images and warm interpreters


def test_the_default_runtime_is_the_standard_library_only(pool: SandboxPool) -> None:
    result = pool.run(SandboxSpec(code="import json, sqlite3\nimport numpy\n"))
    assert result.report is not None and result.report.code_error == "ModuleNotFoundError: No module named 'numpy'"
    for module in ("django", "pydantic", "torch"):  # the worker's own packages stay outside
        assert pool.run(SandboxSpec(code=f"import {module}")).report.code_error.startswith(  # type: ignore[union-attr]
            "ModuleNotFoundError")


def test_a_numpy_runtime_runs_numpy_preloaded_from_its_image(pool: SandboxPool, numpy_image: runtimes.Image
                                                             ) -> None:
    code = ("import sys, numpy as np\n"
            "print('numpy' in sys.modules, np.__version__, int(np.arange(10).sum()), sys.prefix)\n")
    first = pool.run(SandboxSpec(code=code, runtime="numpy"))
    assert first.passed, first.to_dict()
    assert first.stdout.decode().split() == ["True", "2.4.6", "45", str(numpy_image.path)]
    second = pool.run(SandboxSpec(code="import numpy as np\nassert np.ones(3).sum() == 3", runtime="numpy"))
    assert second.passed and second.warm and second.runtime == "numpy"
    stats = pool.stats()["runtimes_stats"]["numpy"]
    assert stats["warm_hits"] >= 1 and stats["cold_starts"] >= 1 and stats["image_builds"] + stats["image_cache_hits"] >= 1
    # the image's lock is what pip resolved
    assert "numpy==2.4.6" in numpy_image.lock and len(numpy_image.lock_sha256) == 64
    assert numpy_image.size_bytes > 10 << 20


def test_two_pools_share_one_image_a_build_is_made_once(own_root: Path, registered: list[str]) -> None:
    runtime = register(registered, Runtime(name="shared-empty", preload=("json",)))
    results: list[tuple[runtimes.Image, bool]] = []
    threads = [threading.Thread(target=lambda: results.append(runtimes.ensure_image(runtime))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(built for _, built in results) == [False, False, True]  # the lock: one build, two waits
    assert len({image.path for image, _ in results}) == 1
    with SandboxPool(size=1) as first, SandboxPool(size=1) as second:
        watch(first), watch(second)
        for p in (first, second):
            for _ in range(3):
                assert p.run(SandboxSpec(code="print(1)", runtime="shared-empty")).passed
        a, b = first.stats()["runtimes_stats"]["shared-empty"], second.stats()["runtimes_stats"]["shared-empty"]
    assert a["image_builds"] == b["image_builds"] == 0 and a["image_cache_hits"] == b["image_cache_hits"] == 1
    assert a["reuse_rate"] == 3.0 and a["cold_starts"] == 1 and a["warm_hits"] == 2


def test_a_failed_build_names_the_package_and_why(own_root: Path, registered: list[str]) -> None:
    runtime = register(registered, Runtime(name="broken-pin", packages=("numpy==9.9.9",)))
    with pytest.raises(BuildError) as caught:
        runtimes.ensure_image(runtime)
    assert caught.value.package == "numpy==9.9.9"
    assert "No matching distribution found for numpy==9.9.9" in caught.value.reason
    assert runtimes.report(runtime).status == "failed"
    with SandboxPool(size=1) as p:
        watch(p)
        started = time.monotonic()
        result = p.run(SandboxSpec(code="print(1)", runtime="broken-pin"))
        assert time.monotonic() - started < 2  # the recent failure is reported, not built again
    assert result.status == "sandbox_error" and result.runtime == "broken-pin"
    assert "package numpy==9.9.9" in (result.error or "") and "No matching distribution" in (result.error or "")


def test_a_broken_image_is_moved_aside_and_rebuilt_on_retry(own_root: Path, registered: list[str]) -> None:
    runtime = register(registered, Runtime(name="fragile", preload=("json",)))
    image, _ = runtimes.ensure_image(runtime)
    os.unlink(image.python)  # the image's interpreter is gone: no zygote can start from it
    with SandboxPool(size=1) as p:
        watch(p)
        result = p.run(SandboxSpec(code="print('rebuilt')", runtime="fragile"))
        stats = p.stats()["runtimes_stats"]["fragile"]
    assert result.passed and result.attempts == 2, result.to_dict()
    assert stats["retries"] == 1 and stats["image_builds"] == 1
    assert any(e.name.startswith(".broken-") for e in own_root.iterdir())


def test_an_unknown_runtime_is_a_sandbox_error_saying_so(pool: SandboxPool) -> None:
    result = pool.run(SandboxSpec(code="print(1)", runtime="no-such-runtime"))
    assert result.status == "sandbox_error" and "unknown sandbox runtime 'no-such-runtime'" in (result.error or "")


def test_garbage_collection_keeps_named_images_and_removes_unused_ones(own_root: Path, registered: list[str]
                                                                       ) -> None:
    kept = register(registered, Runtime(name="kept"))
    gone = Runtime(name="gone", packages=())  # never registered: no definition names its image
    kept_image, _ = runtimes.ensure_image(kept)
    orphan = own_root / "0123456789abcdef01234567"
    shutil.copytree(kept_image.path, orphan, symlinks=True)
    (own_root / ".build-abc-999999999").mkdir()  # an interrupted build whose process is gone
    assert runtimes.collect_garbage(min_age_seconds=3600) == [own_root / ".build-abc-999999999"]  # orphan too young
    removed = runtimes.collect_garbage(min_age_seconds=3600, now=time.time() + 7200)
    assert removed == [orphan] and kept_image.path.is_dir() and not orphan.exists()
    assert gone.key() == kept.key()  # (an empty runtime of any name is the same image: still named by "kept")


def test_a_session_runs_in_its_runtime(numpy_image: runtimes.Image) -> None:
    from sandboxes.session import SessionPool, SessionSpec

    with SessionPool() as sessions:
        with sessions.session(SessionSpec(runtime="numpy", setup="import numpy as np")) as session:
            assert session.run("a = np.arange(4)").status == "ok"
            assert session.run("print(int(a.sum()))").stdout == "6\n"
        with sessions.session(SessionSpec()) as plain:
            assert "ModuleNotFoundError" in (plain.run("import numpy").error or "")
        assert set(sessions.zygotes) == {"python", "numpy"}
    from workers.environments.python_tool import PythonTool

    with pytest.raises(ValueError, match="unknown sandbox runtime 'numpi'"):
        PythonTool.Params(runtime="numpi")
