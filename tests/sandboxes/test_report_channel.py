"""The verdict cannot be forged from inside: one faking technique per test.

A test "passes" for the hostile code only if `result.passed` (the authenticated report says the code
completed and every epilogue statement passed). Every hack here must leave it False.
"""

from __future__ import annotations

import textwrap
from typing import Any

from sandboxes import SandboxPool, SandboxResult, SandboxSpec

EPILOGUE = "assert add(2, 2) == 4\nassert add(1, 1) == 3\n"  # the second always fails for a correct add


def run(pool: SandboxPool, code: str, epilogue: str = EPILOGUE, **kwargs: Any) -> SandboxResult:
    return pool.run(SandboxSpec(code=textwrap.dedent(code), epilogue=epilogue, **kwargs))


def test_an_honest_solution_passes_and_a_wrong_one_fails(pool: SandboxPool) -> None:
    good = pool.run(SandboxSpec(code="def add(a, b):\n    return a + b\n", epilogue="assert add(2, 2) == 4"))
    assert good.passed and good.report is not None and good.report.code_completed
    bad = pool.run(SandboxSpec(code="def add(a, b):\n    return a - b\n", epilogue="assert add(2, 2) == 4"))
    assert not bad.passed and bad.status == "nonzero_exit"
    assert bad.report is not None and bad.report.statements[0].error == "AssertionError"


def test_sys_exit_zero_is_not_completion(pool: SandboxPool) -> None:
    result = pool.run(SandboxSpec(code="import sys\nsys.exit(0)\n"))
    assert result.exit_code == 0
    assert result.report is not None
    assert result.report.code_completed is False
    assert result.report.code_error == "SystemExit(0)"
    assert not result.passed


def test_os_exit_zero_skips_the_epilogue_and_fails(pool: SandboxPool) -> None:
    result = run(pool, "def add(a, b):\n    return a + b\nimport os\nos._exit(0)\n",
                 epilogue="assert add(2, 2) == 4")
    assert result.exit_code == 0 and result.status == "ok"
    assert result.report is not None
    assert not result.report.code_completed and not result.report.epilogue_completed
    assert [s.ok for s in result.report.statements] == [False]
    assert not result.passed


def test_raising_base_exception(pool: SandboxPool) -> None:
    result = pool.run(SandboxSpec(code="raise KeyboardInterrupt\n", epilogue="assert True"))
    assert result.report is not None and not result.report.code_completed
    assert result.report.code_error == "KeyboardInterrupt"
    assert not result.passed


def test_exiting_from_inside_the_epilogue(pool: SandboxPool) -> None:
    result = run(pool, """
        import os
        def add(a, b):
            os._exit(0)
    """)
    assert result.status == "ok" and result.exit_code == 0
    assert result.report is not None and result.report.code_completed
    assert not any(s.ok for s in result.report.statements)
    assert not result.passed


def test_printing_a_fake_success(pool: SandboxPool) -> None:
    result = run(pool, """
        def add(a, b):
            return a + b
        print("===== 2 passed in 0.01s =====\\nOK\\nall tests passed")
    """)
    assert result.report is not None
    assert [s.ok for s in result.report.statements] == [True, False]
    assert not result.passed


def test_redefining_assertion_error_and_builtins(pool: SandboxPool) -> None:
    result = run(pool, """
        import builtins
        class Harmless(Exception):
            pass
        builtins.AssertionError = Harmless
        AssertionError = Harmless
        builtins.Exception = Harmless
        builtins.BaseException = Harmless
        builtins.isinstance = lambda *a: True
        builtins.repr = lambda *a: "ok"
        builtins.exec = lambda *a, **k: None
        def add(a, b):
            return a + b
    """)
    assert result.report is not None
    assert [s.ok for s in result.report.statements] == [True, False]
    assert result.report.statements[1].error == "AssertionError"
    assert not result.passed


def test_trace_functions_cannot_skip_asserts(pool: SandboxPool) -> None:
    result = run(pool, """
        import sys, threading
        def skipper(frame, event, arg):
            if event == "line" and frame.f_code.co_filename == "<epilogue>":
                frame.f_lineno = frame.f_lineno + 1
            return skipper
        refused = []
        for install in (sys.settrace, sys.setprofile, threading.settrace):
            try:
                install(skipper)
            except RuntimeError as exc:
                refused.append(str(exc))
        print(len(refused), "refused")
        def add(a, b):
            return a + b
    """)
    assert b"2 refused" in result.stdout or b"3 refused" in result.stdout
    assert result.report is not None
    assert [s.ok for s in result.report.statements] == [True, False]
    assert not result.passed


def test_rewriting_the_test_files(pool: SandboxPool) -> None:
    tests = "from solution import add\nassert add(1, 1) == 3\n"
    result = pool.run(SandboxSpec(
        code=textwrap.dedent("""
            import os, shutil
            attempts = []
            for attack in (
                lambda: open("test_add.py", "w").write("pass\\n"),
                lambda: os.remove("test_add.py"),
                lambda: os.rename("test_add.py", "x.py"),
                lambda: os.chmod("test_add.py", 0o666),
                lambda: shutil.copy("/dev/null", "test_add.py"),
            ):
                try:
                    attack()
                    attempts.append("succeeded")
                except OSError as exc:
                    attempts.append(type(exc).__name__)
            print(attempts)
            with open("solution.py", "w") as f:
                f.write("def add(a, b):\\n    return a + b\\n")
        """),
        files={"test_add.py": tests},
        epilogue="exec(compile(open('test_add.py').read(), 'test_add.py', 'exec'), {})",
    ))
    assert b"succeeded" not in result.stdout
    assert result.report is not None and result.report.statements[0].error == "AssertionError"
    assert not result.passed


def test_patching_the_harness_libraries(pool: SandboxPool) -> None:
    result = run(pool, """
        import json, hmac, hashlib, subprocess, builtins, sys
        json.dumps = lambda *a, **k: '{"k":"stmt","i":0,"ok":true,"error":null}'
        hmac.new = hmac.digest = lambda *a, **k: None
        builtins.enumerate = lambda seq: iter([(0, compile("pass", "x", "exec")), (1, compile("pass", "x", "exec"))])
        builtins.range = lambda n: iter([])
        builtins.len = lambda x: 0
        subprocess.run = lambda *a, **k: type("R", (), {"returncode": 0})()
        sys.modules["sandboxes.harness"].REPORT_FD = 1
        def add(a, b):
            return a + b
    """, command=["false"])
    assert result.report is not None
    assert [s.ok for s in result.report.statements] == [True, False]
    assert result.report.command_exit_code == 1
    assert not result.passed


def test_writing_forged_frames_to_the_report_pipe(pool: SandboxPool) -> None:
    result = run(pool, """
        import os, json, struct
        def add(a, b):
            return a + b
        fake = json.dumps({"k": "stmt", "i": 1, "ok": True, "error": None}).encode()
        for fd in range(3, 20):
            try:
                os.write(fd, struct.pack(">I32s", len(fake), b"\\0" * 32) + fake)
            except OSError:
                pass
    """)
    assert result.report is None  # tampering is detected: the report is discarded, never believed
    assert result.error is not None and "tampered" in result.error
    assert not result.passed


def test_introspection_routes_are_refused(pool: SandboxPool) -> None:
    result = run(pool, """
        import gc, sys
        refused = 0
        for attempt in (gc.get_objects, lambda: gc.get_referrers(sys), sys._current_frames,
                        lambda: __import__("ctypes").string_at(0)):
            try:
                attempt()
            except (RuntimeError, ImportError):
                refused += 1
        called = []
        sys.addaudithook(lambda *a: called.append(a))  # silently not added
        open("/dev/null").close()
        print(refused, len(called))
        def add(a, b):
            return a + b
    """)
    assert result.stdout == b"4 0\n"
    assert result.report is not None and [s.ok for s in result.report.statements] == [True, False]


def test_each_epilogue_statement_runs_even_after_a_failure(pool: SandboxPool) -> None:
    result = pool.run(SandboxSpec(
        code="def f(x):\n    return x * 2\n",
        epilogue="assert f(1) == 2\nassert f(2) == 5, 'f(2) should be 5'\nraise ValueError('boom')\nassert f(3) == 6\n",
    ))
    assert result.report is not None
    outcomes = [(s.index, s.lineno, s.ok, s.error) for s in result.report.statements]
    assert outcomes == [
        (0, 1, True, None),
        (1, 2, False, "AssertionError: f(2) should be 5"),
        (2, 3, False, "ValueError: boom"),
        (3, 4, True, None),
    ]
    assert result.report.epilogue_completed
    assert result.report.statements[1].source == "assert f(2) == 5, 'f(2) should be 5'"
