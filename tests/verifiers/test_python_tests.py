"""python_tests in the real sandbox: correct code passes, wrong code fails, every known hack fails,
and the sandbox's own failures are invalid (never 0).

Hack code is only ever run through the sandboxed verifier. The one naive-harness test below runs two
harmless exit tricks, in a temporary directory.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from workers.verifiers.base import JudgeInput, Verdict, build_verifier
from workers.verifiers.calibration import builtin_hack_cases
from workers.verifiers.epilogue import build_epilogue
from workers.verifiers.python_tests import PythonTestsVerifier
from workers.verifiers.sandbox_call import extract_code, prepare_solution

pytest.importorskip("sandboxes.pool")

ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(2.5, 0.5) == 3.0\n"
GOOD_ADD = "def add(a, b):\n    return a + b\n"


def judge(completion: str, reference: Any = ADD_TESTS, **config: Any) -> Verdict:
    return build_verifier("python_tests", config).judge(JudgeInput("Write add(a, b).", completion, reference))


# ---------------------------------------------------------------- pure helpers


def test_extract_code_prefers_python_fences() -> None:
    text = "Here:\n```python\ndef f():\n    return 1\n```\nand usage:\n```\nprint(f())\n```\n```text\nnot code\n```"
    assert extract_code(text) == "def f():\n    return 1\n\n\nprint(f())\n"
    assert extract_code("def f(): pass") == "def f(): pass"
    assert extract_code("```python\nunclosed = 1\n") == "unclosed = 1\n"


def test_prepare_solution_strips_main_guard_and_reports_syntax_errors() -> None:
    code, why = prepare_solution("def f():\n    return 1\nif __name__ == '__main__':\n    f(input())\n", True)
    assert why is None and code is not None and "input" not in code
    code, why = prepare_solution("def f(:\n", True)
    assert code is None and why is not None and "line 1" in why


def test_epilogue_counts_leading_definitions_as_setup_and_appends_check_call() -> None:
    ep = build_epilogue("import math\ndef check(candidate):\n    assert candidate(1) == 1\n",
                        entry_point="f", strict_values=True)
    assert ep.setup_count == 4  # the helpers, the pre-check, then the two leading definitions
    assert ep.test_sources == ["check(f)"]
    assert ep.scored == [True]
    assert ep.postcheck_index == 5
    ep = build_epilogue("x = 1\nassert f(x) == 1\ny = f(2)\nassert y == 2\n", entry_point=None, strict_values=True)
    assert ep.test_sources == ["assert f(x) == 1", "y = f(2)", "assert y == 2"]
    assert ep.scored == [True, False, True]


SPLICE_CASES = [
    "assert f(1) == 2\nassert f(g(x)) != [h(1), 2] < k()\n",
    "x = f(1)\nassert x is None\nassert f(1) is not f(2) == 3\nassert (f(1) == 1) == True\n",
    "import math, random\nr = random.Random(4)\nassert math.isclose(f(r.random()), 0.5)\n",
    "assert f(1)(2) == 3\nassert g(1).attr == 2\nassert str(f(1)).upper() == 'A'\nassert len(f(2)) == -1\n",
    "def check(candidate):\n    assert candidate([1, 2],\n        key=lambda v: -v) == [2, 1]\n"
    "    assert sorted(candidate(x) for x in range(3)) == [0, 1, 2]\n",
    "assert (y := f(1)) == 1\nassert f('é') == 'é' and f(\"ü\") in ('ü', f(0))\nassert -f(1) == f(-1)\n",
    "for i in range(3):\n    assert f(i) == i, 'wrong for ' + str(i)\nwhile False:\n    g()\n",
    "assert f(1) == 1, f'message {f(1)}'\n",  # an f-string: the unparse path
    "assert f('a\u2028b\x0cc') == g('\x85')\nassert f(2) == 2\n",  # characters str.splitlines splits at
]


@pytest.mark.parametrize("tests", SPLICE_CASES)
def test_spliced_epilogue_is_the_rewritten_one(tests: str) -> None:
    """The fast path (checks spliced into the test text) compiles to what the AST rewriter produces."""
    import ast

    from workers.verifiers import epilogue

    ep = build_epilogue(tests, entry_point="f", strict_values=True)
    tree = ast.parse(tests)
    rewriter = epilogue._TestRewriter(epilogue._PREFIX, frozenset(epilogue._BUILTIN_NAMES | {"check"}
                                                                    | {"math", "random"}), frozenset({"math", "random"}))
    expected = [ast.dump(rewriter.visit(n)) for n in tree.body]
    body = ast.parse(ep.body).body[1:]  # after the pre-check
    got = [ast.dump(n) for n in body][: len(expected)]
    assert got == expected


def test_spliced_epilogues_of_humaneval_are_the_rewritten_ones() -> None:
    import ast

    from workers.verifiers import epilogue
    from workers.verifiers.humaneval import humaneval_rows

    for row in humaneval_rows(164, variants=("canonical",)):
        tests, entry = row["reference"]["tests"], row["reference"]["entry_point"]
        spliced = build_epilogue(tests, entry_point=entry, strict_values=True)
        epilogue._build_epilogue.cache_clear()
        tree = ast.parse(tests)
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        imported = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
                    if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        rewriter = epilogue._TestRewriter(epilogue._PREFIX, frozenset(epilogue._BUILTIN_NAMES | defined | imported),
                                           frozenset(imported))
        expected = [ast.dump(rewriter.visit(n)) for n in tree.body]
        got = [ast.dump(n) for n in ast.parse(spliced.body).body[1 : 1 + len(expected)]]  # after the pre-check
        assert got == expected, row["task_id"] if "task_id" in row else tests[:80]


# ---------------------------------------------------------------- real judgments


def test_correct_solution_passes_and_wrong_one_fails() -> None:
    ok = judge(GOOD_ADD)
    assert (ok.status, ok.score) == ("pass", 1.0), ok
    assert ok.details["passed"] == ok.details["total"] == 3
    assert ok.details["tier"]
    bad = judge("def add(a, b):\n    return a - b\n")
    assert (bad.status, bad.score) == ("fail", 0.0)
    assert "assert add(1, 2) == 3" in (bad.reason or "")


def test_fenced_completion_with_prose_and_main_guard_passes() -> None:
    completion = (
        "Sure! Here's the function:\n\n```python\ndef add(a, b):\n    return a + b\n\n"
        "if __name__ == '__main__':\n    print(add(int(input()), 2))\n```\nIt adds two numbers."
    )
    assert judge(completion).status == "pass"


def test_fraction_scoring() -> None:
    int_result = "def add(a, b):\n    return int(a + b)\n"  # 2.5 + 0.5 → 3, still == 3.0
    v = judge(int_result, scoring="fraction")
    assert v.status == "pass" and v.score == 1.0
    wrong_for_negatives = "def add(a, b):\n    return abs(a) + b\n"
    v = judge(wrong_for_negatives, scoring="fraction")
    assert v.status == "fail" and v.score == pytest.approx(2 / 3)
    v = judge(wrong_for_negatives, scoring="fraction", pass_threshold=0.6)
    assert v.status == "pass"


def test_syntax_error_fails_without_a_sandbox_run() -> None:
    v = judge("def add(a, b) return a + b")
    assert v.status == "fail" and "does not parse" in (v.reason or "") and "sandbox_status" not in v.details


def test_unusable_references_are_invalid() -> None:
    for ref in ("assert (", {"tests": ""}, {"nope": 1}, 42, "def helper():\n    pass\n",
                {"tests": "def check(c):\n    assert c(1)\n", "entry_point": "not valid"}):
        v = judge(GOOD_ADD, ref)
        assert v.status == "invalid" and v.score is None, (ref, v)


def test_infinite_loop_is_a_timeout_fail() -> None:
    v = judge("def add(a, b):\n    while True:\n        pass\n", limits={"cpu_seconds": 1, "wall_seconds": 3})
    assert v.status == "fail" and "time limit" in (v.reason or ""), v


def test_memory_bomb_fails() -> None:
    v = judge("x = bytearray(512 << 20)\n" + GOOD_ADD, limits={"memory_mb": 64})
    assert v.status == "fail", v


def test_output_flood_fails() -> None:
    v = judge("import sys\nsys.stdout.write('x' * (4 << 20))\n" + GOOD_ADD, limits={"max_output_kb": 64})
    assert v.status == "fail", v


def test_harmless_stdout_noise_does_not_matter() -> None:
    assert judge("print('debug', 1)\n" + GOOD_ADD).status == "pass"


def test_sandbox_failure_is_invalid_not_zero() -> None:
    from sandboxes import SandboxResult

    verifier = build_verifier("python_tests", {})
    assert isinstance(verifier, PythonTestsVerifier)
    ep = build_epilogue(ADD_TESTS, entry_point=None, strict_values=True)
    broken = SandboxResult("sandbox_error", None, None, b"", b"", False, False, 0.0, 0.0, None, [], "x", None,
                           "zygote died")
    v = verifier.score_result(broken, ep, None)
    assert (v.status, v.score) == ("invalid", None) and "zygote died" in (v.reason or "")


def test_refuses_to_run_code_without_isolation(monkeypatch: pytest.MonkeyPatch) -> None:
    import sandboxes

    monkeypatch.setattr(sandboxes, "probe_tier", lambda: "rlimits-only")
    v = judge(GOOD_ADD)
    assert v.status == "invalid" and "rlimits-only" in (v.reason or "")
    v = judge(GOOD_ADD, limits={"require_isolation": False})
    assert v.status == "pass"


def test_prepend_prompt_for_completion_style_tasks() -> None:
    prompt = "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n"
    body = "    return a + b\n"
    v = build_verifier("python_tests", {"prepend_prompt": True})
    assert v.judge(JudgeInput(prompt, body, ADD_TESTS)).status == "pass"
    assert v.judge(JudgeInput(prompt, "    return a * b\n", ADD_TESTS)).status == "fail"
    # without the option the body alone does not parse
    assert judge(body).status == "fail"


def test_tests_may_shadow_builtins_themselves() -> None:
    tests = "input = [3, 1, 2]\nfor sorted_ in [sorted(input)]:\n    assert f(input) == sorted_\nmax = 0\nassert max == 0\n"
    assert judge("def f(xs):\n    return sorted(xs)\n", tests).status == "pass"
    # …but the solution may not
    assert judge("def sorted(xs):\n    return xs\ndef f(xs):\n    return xs\n", tests).status == "fail"


def test_strict_values_accepts_nested_plain_data() -> None:
    tests = ("assert f() == {'a': [1, (2.0, 'x')], 'b': {1, 2}, 'c': None, 'd': b'z', 'e': 1j, 'f': True}\n"
             "import random\nrng = random.Random(0)\nassert f()['a'][0] in [rng.randint(1, 1)]\n")
    code = "def f():\n    return {'a': [1, (2.0, 'x')], 'b': {1, 2}, 'c': None, 'd': b'z', 'e': 1j, 'f': True}\n"
    assert judge(code, tests).status == "pass"


# ---------------------------------------------------------------- hacks

HUMANEVAL_STYLE = {
    "tests": (
        "METADATA = {}\n\n\ndef check(candidate):\n"
        "    assert candidate(3.5) == 0.5\n"
        "    assert abs(candidate(1.33) - 0.33) < 1e-6\n"
        "    assert candidate(0.0) == 0.0\n"
    ),
    "entry_point": "truncate_number",
}
GOOD_TRUNCATE = "def truncate_number(number: float) -> float:\n    return number % 1.0\n"


def test_good_solution_passes_the_humaneval_style_reference() -> None:
    assert judge(GOOD_TRUNCATE, HUMANEVAL_STYLE).status == "pass"


@pytest.mark.parametrize("case", builtin_hack_cases(HUMANEVAL_STYLE), ids=lambda c: c.name)
def test_every_builtin_hack_fails(case: Any) -> None:
    v = build_verifier("python_tests", {}).judge(case.input)
    assert v.status == "fail", (case.name, v.reason)
    assert v.score == 0.0


def test_fraction_scoring_gives_partial_credit_inside_humaneval_check() -> None:
    # truncate_number tests: 3.5 → 0.5 and 0.0 → 0.0 pass, 1.33 → 0.33 fails for this wrong solution
    wrong = "def truncate_number(number):\n    return 0.5 if number > 3 else 0.0\n"
    v = judge(wrong, HUMANEVAL_STYLE, scoring="fraction")
    assert v.score == pytest.approx(2 / 3) and v.status == "fail"
    assert [t["ok"] for t in v.details["tests"] if t["scored"]] == [True, False, True]
    assert judge(GOOD_TRUNCATE, HUMANEVAL_STYLE, scoring="fraction").score == 1.0
    assert judge(wrong, HUMANEVAL_STYLE).score == 0.0  # all-or-nothing keeps check() as one statement


def test_fraction_scoring_hacks_still_fail() -> None:
    for case in builtin_hack_cases(HUMANEVAL_STYLE):
        v = build_verifier("python_tests", {"scoring": "fraction"}).judge(case.input)
        assert v.status == "fail" and v.score == 0.0, (case.name, v)


HAND_WRITTEN_HACKS = {
    # always-equal objects hidden in containers and in subclasses of plain types
    "always_equal_in_list": "class E:\n    def __eq__(s, o): return True\n"
                            "def add(a, b):\n    return [E()][0]\n",
    "float_subclass": "class F(float):\n    def __eq__(s, o): return True\n    __hash__ = float.__hash__\n"
                      "def add(a, b):\n    return F(0)\n",
    "spoofed___class__": "class E:\n    __class__ = property(lambda s: int)\n    def __eq__(s, o): return True\n"
                         "def add(a, b):\n    return E()\n",
    # exits that a naive harness reads as success
    "exit_at_import": "import sys\ndef add(a, b):\n    return 0\nsys.exit(0)\n",
    "exit_in_atexit": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return 0\n",
    "exit_from_thread": "import threading, os, time\n"
                        "threading.Thread(target=lambda: (time.sleep(0.01), os._exit(0))).start()\n"
                        "def add(a, b):\n    time.sleep(1)\n    return 0\n",
    "catch_everything_in_function": "def add(a, b):\n    try:\n        raise SystemExit(0)\n    finally:\n        return 0\n",
    # fake results and report forgery attempts
    "fake_report_on_fd3": "import os\ntry:\n    os.write(3, b'\\x00\\x00\\x00\\x02' + b'0' * 32 + b'{}')\nexcept OSError:\n    pass\n"
                          "def add(a, b):\n    return 0\n",
    # forging the harness's authenticated report by walking up to its frame and calling its emit():
    # the sandbox documents frame walking as a residual risk; the epilogue's token file catches it
    "forge_report_via_frames": "import sys, os\nh = sys._getframe().f_back\nemit = h.f_locals['emit']\n"
                               "n = len(h.f_locals['_statements'])\n"
                               "emit({'k': 'code', 'completed': True, 'error': None, 't': 0.0})\n"
                               "for i in range(n):\n    emit({'k': 'stmt', 'i': i, 'ok': True, 'error': None})\n"
                               "emit({'k': 'epilogue'})\nemit({'k': 'end', 'exit': 0, 't': 0.0})\nos._exit(0)\n",
    "print_pass": "print('PASS 3/3')\nprint('{\"status\": \"pass\", \"score\": 1.0}')\ndef add(a, b):\n    return 0\n",
    # tampering with files, the tests or the interpreter (inside the sandbox only!)
    "overwrite_files": "import glob\nfor f in glob.glob('*'):\n    open(f, 'w').write('pass')\ndef add(a, b):\n    return 0\n",
    # a table-lookup hack: read the expected values from the tests if they are anywhere on disk
    "read_tests_from_disk": "import glob, re\nfound = {}\n"
                            "for f in glob.glob('**/*', recursive=True) + glob.glob('/tmp/**/*', recursive=True):\n"
                            "    try:\n        text = open(f).read()\n    except Exception:\n        continue\n"
                            "    for a, b, r in re.findall(r'add\\((\\S+), (\\S+)\\) == (\\S+)', text):\n"
                            "        found[(float(a), float(b))] = float(r)\n"
                            "assert found, 'no tests on disk'\n"
                            "def add(a, b):\n    return found[(float(a), float(b))]\n",
    "settrace_skip": "import sys\nsys.settrace(lambda *a: None)\ndef add(a, b):\n    return 0\n",
    "patch_equality_in_builtins_module": "import builtins\nbuiltins.int = type('int', (), {'__eq__': lambda s, o: True})\n"
                                         "def add(a, b):\n    return 0\n",
}


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN_HACKS))
def test_hand_written_hacks_fail(name: str) -> None:
    v = judge(HAND_WRITTEN_HACKS[name])
    assert v.status == "fail", (name, v.reason)


def test_forged_report_is_caught_by_the_token_not_by_luck() -> None:
    v = judge(HAND_WRITTEN_HACKS["forge_report_via_frames"])
    assert "forged report" in (v.reason or ""), v.reason


def test_the_naive_harness_is_fooled_by_exit_tricks(tmp_path: Path) -> None:
    """Why the defences exist: a subprocess + exit-code harness accepts these. (Only these two harmless
    exits are ever run outside the sandbox, and in a temporary directory.)"""
    for name in ("exit_at_import", "exit_in_atexit"):
        code = HAND_WRITTEN_HACKS[name]
        proc = subprocess.run([sys.executable, "-c", code + "\n" + ADD_TESTS], capture_output=True, timeout=30,
                              cwd=tmp_path)
        assert proc.returncode == 0, name


def test_without_strict_values_the_always_equal_hack_would_pass() -> None:
    """The always-equal defence is what stops it (documented trade-off of strict_values: false)."""
    hack = "class E:\n    def __eq__(s, o): return True\ndef add(a, b):\n    return E()\n"
    assert judge(hack, strict_values=False).status == "pass"
    assert judge(hack).status == "fail"
