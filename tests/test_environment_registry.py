"""A deployment registers its own environments in ``TEMPER_ENVIRONMENTS`` ("name=module:Class,…"): they join
the built-in ones by name, a malformed entry is refused with an error naming it, and an entry naming what
cannot be imported is an environment error naming it when a domain asks for it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT
from workers.environments.base import BUILTIN_ENVIRONMENTS, parse_environments


def test_entries_are_parsed_by_name():
    assert parse_environments("") == {}
    assert parse_environments(" bench_slow_tool = bench.envs:SlowTool , other=pkg.mod:Other,") == {
        "bench_slow_tool": "bench.envs:SlowTool", "other": "pkg.mod:Other"}


@pytest.mark.parametrize("text, why", [
    ("bench.envs:SlowTool", "malformed entry 'bench.envs:SlowTool'"),
    ("slow=bench.envs", "malformed entry 'slow=bench.envs'"),
    ("Slow Tool=bench.envs:SlowTool", "malformed entry 'Slow Tool=bench.envs:SlowTool'"),
    ("ok=a.b:C,slow=bench/envs.py:SlowTool", "malformed entry 'slow=bench/envs.py:SlowTool'"),
    ("python_tool=bench.envs:SlowTool", "would replace the built-in environment 'python_tool'"),
    ("a=x:A,a=y:B", "entry 'a=y:B' names 'a' a second time"),
])
def test_a_malformed_entry_is_refused_with_its_text(text, why):
    with pytest.raises(ValueError, match="TEMPER_ENVIRONMENTS") as caught:
        parse_environments(text)
    assert why in str(caught.value)


def run_python(code: str, value: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TEMPER_ENVIRONMENTS": value})


def test_the_variable_adds_environments_a_domain_can_name():
    code = ("from workers.environments.base import ENVIRONMENTS, validate_params, make_environment\n"
            "print(sorted(ENVIRONMENTS))\n"
            "print(validate_params('bench_slow_tool', {'tool_turns': 3}).tool_turns)\n"
            "print(type(make_environment('bench_slow_tool', {}, judge=None)).__name__)\n")
    out = run_python(code, "bench_slow_tool=bench.envs:SlowTool")
    assert out.returncode == 0, out.stderr
    names, turns, cls = out.stdout.split("\n")[:3]
    assert names == str(sorted([*BUILTIN_ENVIRONMENTS, "bench_slow_tool"]))
    assert (turns, cls) == ("3", "SlowTool")


def test_a_malformed_variable_stops_the_process_naming_the_entry():
    out = run_python("import workers.environments.base", "bench_slow_tool=bench.envs.SlowTool")
    assert out.returncode != 0
    assert "TEMPER_ENVIRONMENTS: malformed entry 'bench_slow_tool=bench.envs.SlowTool'" in out.stderr


def test_an_entry_that_cannot_be_imported_is_an_environment_error_naming_it():
    code = ("from workers.environments.base import EnvironmentError_, validate_params\n"
            "try:\n    validate_params('gone', {})\nexcept EnvironmentError_ as exc:\n    print(exc.problems[0])\n")
    out = run_python(code, "gone=bench.no_such_module:Gone")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("environment: 'gone' is registered as 'bench.no_such_module:Gone', which cannot "
                                 "be imported: ModuleNotFoundError"), out.stdout
