"""command: terminal-style tasks judged by a test script and expected files, in the real sandbox."""

from __future__ import annotations

from typing import Any

import pytest

from workers.verifiers.base import JudgeInput, Verdict, build_verifier

pytest.importorskip("sandboxes.pool")

COUNT_LINES = {
    "script": "set -e\ntest -f out/result.txt\ngrep -qx 'lines: 3' out/result.txt\n",
    "expected_files": {"out/result.txt": "lines: 3\n"},
    "files": {"input.txt": "a\nb\nc\n"},
}


def judge(completion: str, reference: Any = COUNT_LINES, **config: Any) -> Verdict:
    return build_verifier("command", config).judge(JudgeInput("Count the lines of input.txt", completion, reference))


def test_shell_completion_passes() -> None:
    v = judge("```bash\nmkdir -p out\necho \"lines: $(wc -l < input.txt)\" > out/result.txt\n```")
    assert v.status == "pass", v
    assert v.details["script_exit_code"] == 0 and v.details["expected_files"] == {"out/result.txt": "ok"}


@pytest.mark.parametrize(
    ("completion", "problem"),
    [
        ("mkdir out; echo 'lines: 4' > out/result.txt", "differs"),
        ("echo 'lines: 3'", "missing"),
        ("exit 0", "missing"),
        ("echo 'lines: 3' > input.txt; mkdir out; cp input.txt out/result.txt", "differs"),  # input is read-only
    ],
)
def test_wrong_shell_completions_fail(completion: str, problem: str) -> None:
    v = judge(completion)
    assert v.status == "fail", v
    assert v.details["expected_files"]["out/result.txt"] == problem


def test_expected_files_are_checked_outside_even_when_the_script_passes() -> None:
    ref = {"script": "exit 0", "expected_files": {"answer.txt": "42"}}
    assert judge("echo 42 > answer.txt", ref).status == "pass"
    v = judge("echo 41 > answer.txt", ref)
    assert v.status == "fail" and "answer.txt: differs" in (v.reason or "")


def test_python_completion_and_python_script() -> None:
    ref = {"script": "import json\nassert json.load(open('data.json')) == {'n': 3}\n", "interpreter": "python"}
    cfg = {"completion_format": "python"}
    assert judge("import json\njson.dump({'n': 3}, open('data.json', 'w'))", ref, **cfg).status == "pass"
    v = judge("import json\njson.dump({'n': 4}, open('data.json', 'w'))", ref, **cfg)
    assert v.status == "fail" and v.details["script_exit_code"] == 1


def test_files_json_completion() -> None:
    cfg = {"completion_format": "files_json"}
    assert judge('{"out/result.txt": "lines: 3\\n"}', **cfg).status == "pass"
    v = judge('{"../../etc/x": "lines: 3\\n"}', **cfg)
    assert v.status == "fail" and "outside the work dir" in (v.reason or "")
    assert judge("not json", **cfg).status == "fail"


def test_hacks_against_the_script_fail() -> None:
    # exiting early, faking output, trying to replace the inputs, reading for the checks, killing the harness
    for hack in (
        "exit 0",
        "echo 'PASS'; echo 'lines: 3'",
        "for f in *; do echo 'exit 0' > \"$f\"; done; mkdir out; echo 'lines: 9' > out/result.txt",
        "ls -la > out.txt; cat * > /dev/null; mkdir out; grep -rh lines . > out/result.txt",
        "kill -9 $PPID",
    ):
        assert judge(hack).status == "fail", hack


def test_the_completion_cannot_see_the_checks() -> None:
    """Neither the script nor the expected files are in the work dir while the completion runs."""
    ref = {"script": "test \"$(cat seen.txt)\" = 'input.txt'", "files": {"input.txt": "x"}}
    assert judge("x=$(ls -A); echo \"$x\" > seen.txt", ref).status == "pass"


def test_forged_report_fails() -> None:
    """A python completion that forges the harness report (frame walking) still fails: no token file."""
    forge = (
        "import sys, os\nh = sys._getframe().f_back\nemit = h.f_locals['emit']\n"
        "emit({'k': 'code', 'completed': True, 'error': None, 't': 0.0})\nemit({'k': 'epilogue'})\n"
        "emit({'k': 'command', 'exit': 0})\nemit({'k': 'end', 'exit': 0, 't': 0.0})\nos._exit(0)\n"
    )
    v = judge(forge, {"script": "exit 1"}, completion_format="python")
    assert v.status == "fail", v


def test_runaway_completion_is_a_fail() -> None:
    v = judge("while true; do :; done", limits={"cpu_seconds": 1, "wall_seconds": 2})
    assert v.status == "fail", v


@pytest.mark.parametrize(
    "reference",
    [None, 42, {"files": {"a": "b"}}, {"script": 3}, {"script": "true", "expected_files": {"/etc/passwd": "x"}},
     {"script": "true", "interpreter": "ruby"}],
)
def test_unusable_references_are_invalid(reference: Any) -> None:
    v = judge("true", reference)
    assert v.status == "invalid" and v.score is None, v
