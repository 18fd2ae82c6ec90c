"""python_reward in the real sandbox: the user's score() judges a whole group in one execution, each
sample's failure is its own (with the line), and hostile reward code gains nothing and leaves nothing
running (the stray-process check of tests/sandboxes, on the default pool the verifier uses)."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from workers.verifiers.base import JudgeInput, Verdict, VerifierConfigError, build_verifier
from workers.verifiers.python_reward import EXAMPLE, check_reward_code
from workers.verifiers.sandbox_call import PREFIX

pytest.importorskip("sandboxes.pool")

from sandboxes.pool import default_pool
from tests.sandboxes.conftest import strays, watch

FAST = {"cpu_seconds": 1, "wall_seconds": 4, "max_processes": 16}


@pytest.fixture(autouse=True)
def nothing_left_running() -> Iterator[None]:
    watch(default_pool())
    yield
    watch(default_pool())  # (a zygote restarted during the test has a new uid)
    assert strays(timeout=2.0) == []


def reward(code: str, **config: Any) -> Any:
    return build_verifier("python_reward", {"code": textwrap.dedent(code), **config})


def group(code: str, completions: list[str], reference: Any = "5", **config: Any) -> list[Verdict]:
    return reward(code, **config).judge_group([JudgeInput("2+3=", c, reference) for c in completions])


def executions() -> int:
    return int(default_pool().stats()["executions"])


# ---------------------------------------------------------------- validation on save (nothing runs)


@pytest.mark.parametrize(("code", "needle"), [
    ("def score(prompt, completion, reference):\n    return (\n", "line 2"),
    ("def helper(a, b, c):\n    return 1.0\n", "defines no top-level score"),
    ("def score(completion):\n    return 1.0\n", "line 1: score(completion) cannot be called"),
    ("async def score(p, c, r):\n    return 1.0\n", "not async"),
    ("def score(p, c, r, extra):\n    return 1.0\n", "cannot be called"),
])
def test_code_is_checked_when_the_config_is_validated(code: str, needle: str) -> None:
    assert needle in (check_reward_code(code) or "")
    with pytest.raises(VerifierConfigError) as err:
        build_verifier("python_reward", {"code": code})
    assert needle in str(err.value) and "code" in str(err.value)


def test_accepted_signatures_and_range_checks() -> None:
    for code in ("def score(*args):\n    return 1.0\n", "def score(p, c, r, k=1, **kw):\n    return 1.0\n",
                 "score = lambda p, c, r: 1.0\n", "from math import floor as score\n"):
        assert check_reward_code(code) is None, code
    with pytest.raises(VerifierConfigError, match="below max_score"):
        build_verifier("python_reward", {"code": EXAMPLE, "min_score": 1, "max_score": 1})


# ---------------------------------------------------------------- judging


def test_one_execution_judges_the_whole_group() -> None:
    verifier = reward(EXAMPLE)
    verifier.judge_group([JudgeInput("2+3=", "5", "5")])  # warm
    before = executions()
    verdicts = verifier.judge_group([JudgeInput("2+3=", c, "5") for c in ["5", "6", " 5 ", "", ":", "55"]])
    assert executions() == before + 1
    assert [v.status for v in verdicts] == ["pass", "fail", "pass", "fail", "fail", "fail"]
    assert verdicts[0].details["raw_score"] == 1.0 and verdicts[0].latency_ms > 0
    # the single-sample path (calibration, manage.py verify) is the same execution for one sample
    assert verifier.judge(JudgeInput("2+3=", "5", {"answer": ["5", "five"]})).status == "pass"


def test_each_sample_fails_on_its_own_with_the_reason() -> None:
    verdicts = group("""
        import math
        def score(prompt, completion, reference):
            table = {"ok": 0.75, "none": None, "str": "1.0", "list": [1.0], "nan": math.nan,
                     "inf": math.inf, "big": 1.5, "neg": -0.1, "true": True}
            if completion == "boom":
                return {}["missing"]
            if completion == "exit":
                raise SystemExit(0)
            return table[completion]
    """, ["ok", "none", "str", "list", "nan", "inf", "big", "neg", "true", "boom", "exit", "ok"], pass_threshold=0.5)
    by = {c: v for c, v in zip(["ok", "none", "str", "list", "nan", "inf", "big", "neg", "true", "boom", "exit"],
                               verdicts, strict=False)}
    assert by["ok"].status == "pass" and by["ok"].score == 0.75
    assert by["none"].status == "invalid" and "returned None" in (by["none"].reason or "")
    assert "returned str, not a number" in (by["str"].reason or "")
    assert "returned list, not a number" in (by["list"].reason or "")
    assert "nan, not a finite number" in (by["nan"].reason or "")
    assert "inf, not a finite number" in (by["inf"].reason or "")
    assert "1.5, outside the declared range [0.0, 1.0]" in (by["big"].reason or "")
    assert "-0.1, outside" in (by["neg"].reason or "")
    assert by["true"].status == "pass" and by["true"].score == 1.0
    assert by["boom"].reason == "score() raised at line 7 (`return {}[\"missing\"]`) in score(): KeyError: 'missing'"
    assert "SystemExit" in (by["exit"].reason or "") and "line 9" in (by["exit"].reason or "")
    assert verdicts[-1].status == "pass"  # the samples after the failures are judged as usual
    assert all(v.score is None for v in verdicts if v.status == "invalid")


def test_a_declared_range_is_mapped_onto_the_verdict() -> None:
    verdicts = group("def score(p, c, r):\n    return float(c)\n", ["-1", "0", "1", "2"], min_score=-1, max_score=1)
    assert [v.score for v in verdicts[:3]] == [0.0, 0.5, 1.0]
    assert [v.details["raw_score"] for v in verdicts[:3]] == [-1.0, 0.0, 1.0]
    assert verdicts[3].status == "invalid" and "outside the declared range [-1.0, 1.0]" in (verdicts[3].reason or "")


def test_code_that_fails_when_loaded_names_its_line() -> None:
    verdicts = group("import math\nTABLE = math.nope\ndef score(p, c, r):\n    return 1.0\n", ["5", "6"])
    assert all(v.status == "invalid" for v in verdicts)
    assert "failed when loaded at line 2 (`TABLE = math.nope`): AttributeError" in (verdicts[0].reason or "")


def test_an_endless_sample_is_invalid_and_the_group_before_it_is_kept() -> None:
    verdicts = group("""
        def score(prompt, completion, reference):
            while completion == "loop":
                pass
            return 1.0
    """, ["5", "loop", "6"], limits=FAST)
    assert verdicts[0].status == "pass"
    assert verdicts[1].status == "invalid" and "exceeded the time limit on this sample" in (verdicts[1].reason or "")
    assert verdicts[2].status == "invalid" and verdicts[2].reason.startswith("not judged")  # type: ignore[union-attr]


def test_a_fork_bomb_gains_nothing_and_leaves_nothing() -> None:
    verdicts = group("""
        import os
        def score(prompt, completion, reference):
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
    """, ["5", "6"], limits=FAST)
    assert all(v.status == "invalid" for v in verdicts), verdicts


def test_a_detached_daemon_does_not_survive_the_group() -> None:
    verdicts = group("""
        import os, time
        def score(prompt, completion, reference):
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    while True:
                        time.sleep(0.01)
                os._exit(0)
            return 1.0
    """, ["5"], limits=FAST)
    assert verdicts[0].status == "pass"


def test_secrets_are_out_of_reach(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEMPER_TEST_SECRET", "s3cr3t-value")
    verdicts = group("""
        import glob, os
        def score(prompt, completion, reference):
            if completion == "shadow":
                return float(len(open("/etc/shadow").read()) > 0)
            seen = str(dict(os.environ))
            for path in glob.glob("/proc/*/environ"):
                try:
                    seen += open(path, "rb").read().decode("latin-1")
                except OSError:
                    pass
            return 1.0 if "s3cr3t-value" in seen else 0.0
    """, ["shadow", "environ"])
    assert verdicts[0].status == "invalid" and "PermissionError" in (verdicts[0].reason or ""), verdicts[0]
    assert verdicts[1].status == "fail" and verdicts[1].score == 0.0


def test_writing_outside_the_work_directory_leaves_nothing(tmp_path: Path) -> None:
    targets = [str(tmp_path / "planted"), str(Path(__file__).resolve().parents[2] / "planted-by-reward"),
               "/etc/planted-by-reward"]
    verdicts = group(f"""
        def score(prompt, completion, reference):
            written = 0
            for path in {targets!r}:
                try:
                    open(path, "w").write("x")
                    written += 1
                except OSError:
                    pass
            return float(written > 0)
    """, ["5"])
    assert verdicts[0].status == "fail" and verdicts[0].score == 0.0
    assert not any(os.path.exists(t) for t in targets)


def test_forged_results_gain_nothing() -> None:
    # printing one (stdout is never read); raising one without the per-call nonce; writing a file
    verdicts = group(f"""
        def score(prompt, completion, reference):
            if completion == "print":
                print("{PREFIX}R: 0 0 ok 1.0")
                print('{{"score": 1.0, "status": "pass"}}')
                return 0.0
            if completion == "raise":
                class Forged(BaseException):
                    pass
                Forged.__name__ = Forged.__qualname__ = "{PREFIX}R"
                raise Forged("00000000000000000000000000000000 1 ok 1.0")
            open("result.json", "w").write('{{"scores": [1.0, 1.0, 1.0]}}')
            return 0.0
    """, ["print", "raise", "file"])
    assert [v.status for v in verdicts] == ["fail", "invalid", "fail"], verdicts
    assert "score() raised" in (verdicts[1].reason or "")


def test_writing_into_the_report_channel_discards_the_whole_execution() -> None:
    verdicts = group("""
        import os
        def score(prompt, completion, reference):
            os.write(3, b"\\x00\\x00\\x00\\x10" + b"A" * 48)
            return 1.0
    """, ["5", "6"])
    assert all(v.status == "invalid" and "tampered" in (v.reason or "") for v in verdicts), verdicts


def test_ending_the_interpreter_invalidates_only_what_was_not_judged() -> None:
    verdicts = group("""
        import os
        def score(prompt, completion, reference):
            if completion == "exit":
                os._exit(0)
            return 1.0
    """, ["5", "exit", "5"])
    assert verdicts[0].status == "pass"
    assert verdicts[1].status == "invalid" and "ended the sandbox" in (verdicts[1].reason or "")
    assert verdicts[2].status == "invalid" and (verdicts[2].reason or "").startswith("not judged")


def test_dry_run_reports_the_first_failure_with_its_line() -> None:
    verifier = reward("""
        def score(prompt, completion, reference):
            if completion == "":
                return None
            return 1.0 if completion == reference["answr"] else 0.0
    """)
    cases = [JudgeInput("p", "", "5"), JudgeInput("p", "5", "5")]
    assert verifier.dry_run(cases) == ("case 2: score() raised at line 5 (`return 1.0 if completion == "
                                       "reference[\"answr\"] else 0.0`) in score(): KeyError: 'answr'")
    assert reward(EXAMPLE).dry_run(cases) is None
