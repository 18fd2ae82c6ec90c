"""Verifier throughput: judgments per second per kind, the sandboxed ``python_tests`` verifier against
a naive one-subprocess-per-answer harness on the same HumanEval answers, and ``python_reward`` (the user's
``score()`` judging a whole group in one sandbox execution) against a naive one-interpreter-per-sample one.

    python bench/verifiers.py                 # ~1 minute on a quiet 2-core machine
    python bench/verifiers.py --problems 164  # every HumanEval problem (canonical + corrupted answer)

The naive harness is what many RL stacks do: ``subprocess.run([sys.executable, "-c", code + tests])`` per
answer, pass = exit code 0. It has no isolation and is fooled by ``sys.exit(0)`` (see
tests/verifiers/test_python_tests.py); it is measured here only for speed. Both harnesses run the same
answers one at a time ("at once" 1 in the table) after a short warm-up (a sandbox worker keeps its pool
warm, and the naive harness gets a warm page cache), in slices taken in turn so that a change in machine
load hits both alike; with ``--threads N`` both are also run N at a time.
``python_reward`` is measured on groups of ``--group-size`` answers to addition prompts (a third of them
wrong), with the same ``score()`` in all three harnesses: one execution per group (the loop's path), one
per sample (``judge``, calibration's path), and a fresh ``python -c`` per sample printing the score.
The last line is machine-readable: ``result: key=value …``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.verifiers.base import JudgeInput, build_verifier
from workers.verifiers.calibration import percentile


@dataclass
class Measurement:
    name: str
    n: int
    seconds: float
    latencies_ms: list[float]
    correct: int | None = None
    concurrency: int = 1  # judgments in flight at once

    @property
    def per_second(self) -> float:
        return self.n / self.seconds if self.seconds > 0 else float("inf")


def timed(name: str, fn: Callable[[Any], bool], items: Sequence[Any], warmup: int = 3,
          expected: Sequence[bool] | None = None, threads: int = 1) -> Measurement:
    for item in items[:warmup]:
        fn(item)
    latencies: list[float] = []

    def one(item: Any) -> bool:
        t = time.perf_counter()
        ok = fn(item)
        latencies.append((time.perf_counter() - t) * 1000)
        return ok

    start = time.perf_counter()
    if threads == 1:
        results = [one(item) for item in items]
    else:
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(one, items))
    seconds = time.perf_counter() - start
    correct = None if expected is None else sum(r == e for r, e in zip(results, expected, strict=True))
    return Measurement(name, len(items), seconds, latencies, correct, threads)


def interleaved(harnesses: Sequence[tuple[str, Callable[[Any], bool], Sequence[bool] | None]],
                items: Sequence[Any], blocks: int = 6, threads: int = 1) -> list[Measurement]:
    """Each harness over the same items, in `blocks` slices taken in turn (the order alternating), so that a
    change in machine load hits all of them alike."""
    for _, fn, _ in harnesses:
        for item in items[:3]:  # warm-up, as in timed()
            fn(item)
    merged = [Measurement(name, 0, 0.0, [], None if expected is None else 0, threads)
              for name, _, expected in harnesses]
    bounds = [round(len(items) * b / blocks) for b in range(blocks + 1)]
    for b in range(blocks):
        lo, hi = bounds[b], bounds[b + 1]
        order = list(range(len(harnesses)))
        for k in order if b % 2 == 0 else order[::-1]:
            name, fn, expected = harnesses[k]
            part = timed(name, fn, items[lo:hi], warmup=0, expected=None if expected is None else expected[lo:hi],
                         threads=threads)
            m = merged[k]
            m.n += part.n
            m.seconds += part.seconds
            m.latencies_ms += part.latencies_ms
            if m.correct is not None and part.correct is not None:
                m.correct += part.correct
    return merged


def judge_fn(kind: str, config: dict[str, Any], **kw: Any) -> Callable[[JudgeInput], bool]:
    verifier = build_verifier(kind, config, **kw)

    def run(inp: JudgeInput) -> bool:
        v = verifier.judge(inp)
        if v.status == "invalid":
            raise RuntimeError(f"{kind}: unexpected invalid verdict: {v.reason}")
        return v.status == "pass"

    return run


def simple_kinds(n: int) -> list[Measurement]:
    out = []
    gsm = [JudgeInput("q", f"{i} + {i} = {2 * i}\nAnswer: {2 * i + (i % 2)}", str(2 * i)) for i in range(n)]
    out.append(timed("exact_match", judge_fn("exact_match", {"extract": "marker"}), gsm))
    out.append(timed("regex", judge_fn("regex", {"pattern": r"-?\d+", "extract": "marker"}), gsm))
    qa = [JudgeInput("q", f"The answer is the city of Paris {i}", {"answers": ["Paris", "city of Paris"]})
          for i in range(n)]
    out.append(timed("f1", judge_fn("f1", {}), qa))
    js = [JudgeInput("q", f'```json\n{{"id": {i}, "tags": ["a", "b"], "ok": true}}\n```', {"expected": {"id": i, "ok": True}})
          for i in range(n)]
    out.append(timed("json_match", judge_fn("json_match", {"mode": "subset"}), js))
    maths = [JudgeInput("q", rf"so the result is $\boxed{{\frac{{{i}}}{{2}}}}$", f"{i / 2}") for i in range(1, n // 4 + 2)]
    out.append(timed("math", judge_fn("math", {}), maths))
    judge = judge_fn("llm_judge", {"rubric": "correct capital", "use_engine": True},
                     generate=lambda prompt: "Names the capital.\nSCORE: 9")
    out.append(timed("llm_judge (stub engine: overhead only)", judge,
                     [JudgeInput("Capital of France?", "Paris", "Paris")] * n))
    shell = [JudgeInput("count", f"echo {i} > out.txt", {"script": f"grep -qx {i} out.txt",
                                                         "expected_files": {"out.txt": str(i)}})
             for i in range(max(10, n // 25))]
    out.append(timed("command (sandbox)", judge_fn("command", {}), shell))
    return out


def humaneval_answers(problems: int) -> list[dict[str, Any]]:
    from workers.verifiers.humaneval import humaneval_rows

    return list(humaneval_rows(problems, variants=("canonical", "corrupt")))


_NAIVE_CWD = tempfile.mkdtemp(prefix="temper-naive-bench-")


def naive_harness(row: dict[str, Any]) -> bool:
    """The baseline: one fresh interpreter per answer, pass = exit code 0.

    It isolates NOTHING: only ever give it the honest HumanEval answers (canonical / corrupted), never hack
    cases — a hack run this way acts on the real file system with this process's rights.
    """
    ref = row["reference"]
    code = row["completion"] + "\n" + ref["tests"] + f"\ncheck({ref['entry_point']})\n"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=10, cwd=_NAIVE_CWD)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


def python_tests_comparison(problems: int, threads: int) -> list[Measurement]:
    rows = humaneval_answers(problems)
    expected = [r["expected"] == "pass" for r in rows]
    verify = judge_fn("python_tests", {})

    def sandboxed(row: dict[str, Any]) -> bool:
        return verify(JudgeInput(row["prompt"], row["completion"], row["reference"]))

    from sandboxes import SandboxSpec, run

    def empty_sandbox(row: dict[str, Any]) -> bool:
        return run(SandboxSpec(code="pass")).status == "ok"

    out = interleaved([
        ("python_tests: Temper sandboxed verifier", sandboxed, expected),
        ("python_tests: naive subprocess per answer", naive_harness, expected),
        ("(floor: empty sandbox run, `pass`)", empty_sandbox, None),
    ], rows)
    if threads > 1:
        out += interleaved([
            (f"python_tests: Temper sandboxed, {threads} threads", sandboxed, expected),
            (f"python_tests: naive, {threads} threads", naive_harness, expected),
        ], rows, threads=threads)
    return out


REWARD_CODE = """def score(prompt, completion, reference):
    answers = reference["answer"]
    answers = [answers] if isinstance(answers, str) else answers
    return 1.0 if completion.strip() in answers else 0.0
"""


def reward_groups(groups: int, size: int) -> list[list[JudgeInput]]:
    return [[JudgeInput(f"{g}+{i}=", str(g + i + (1 if (g + i) % 3 == 0 else 0)), {"answer": str(g + i)})
             for i in range(size)] for g in range(groups)]


def naive_reward(group: list[JudgeInput]) -> bool:
    """The baseline: one fresh interpreter per sample running the user's code, the score read from stdout.
    It isolates NOTHING (and a score() printing a number forges its result): only ever give it this
    benchmark's own score()."""
    ok = True
    for inp in group:
        code = REWARD_CODE + f"\nprint(score({inp.prompt!r}, {inp.completion!r}, {inp.reference!r}))\n"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10, cwd=_NAIVE_CWD)
        ok = ok and proc.returncode == 0 and proc.stdout.strip() in ("0.0", "1.0")
    return ok


def python_reward_comparison(groups: int, size: int) -> list[Measurement]:
    verifier = build_verifier("python_reward", {"code": REWARD_CODE})

    def per_group(group: list[JudgeInput]) -> bool:
        verdicts = verifier.judge_group(group)
        if any(v.status == "invalid" for v in verdicts):
            raise RuntimeError(f"python_reward: unexpected invalid verdict: {verdicts}")
        return True

    def per_sample(group: list[JudgeInput]) -> bool:
        return all(verifier.judge(inp).status != "invalid" for inp in group)

    expected = [True] * groups
    out = interleaved([
        (f"python_reward: 1 execution per group of {size}", per_group, expected),
        ("python_reward: 1 execution per sample", per_sample, expected),
        ("python_reward: naive python -c per sample", naive_reward, expected),
    ], reward_groups(groups, size))
    for m in out:  # counted in samples judged, not groups
        m.n, m.correct = m.n * size, None if m.correct is None else m.correct * size
    return out


def table(measurements: Sequence[Measurement]) -> str:
    head = (f"{'verifier':<46} {'at once':>7} {'n':>5} {'seconds':>8} {'judg/s':>9} {'p50 ms':>8} {'p95 ms':>8} "
            f"{'correct':>8}")
    lines = [head, "-" * len(head)]
    for m in measurements:
        correct = "" if m.correct is None else f"{m.correct}/{m.n}"
        lines.append(f"{m.name:<46} {m.concurrency:>7} {m.n:>5} {m.seconds:>8.2f} {m.per_second:>9.1f} "
                     f"{percentile(m.latencies_ms, 50):>8.2f} {percentile(m.latencies_ms, 95):>8.2f} {correct:>8}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=400, help="judgments per in-process kind")
    parser.add_argument("--problems", type=int, default=60, help="HumanEval problems (2 answers each)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("TEMPER_SANDBOX_POOL_SIZE", "1")),
                        help="also run both python_tests harnesses from this many threads "
                             "(set TEMPER_SANDBOX_POOL_SIZE to the same number)")
    parser.add_argument("--reward-groups", type=int, default=30, help="python_reward: groups judged per harness")
    parser.add_argument("--group-size", type=int, default=8, help="python_reward: samples per group (G)")
    parser.add_argument("--only", choices=["python_reward"], help="measure only this comparison")
    args = parser.parse_args(argv)

    from sandboxes import probe_tier

    print(f"sandbox tier: {probe_tier()}   cpus: {os.cpu_count()}   load: {os.getloadavg()[0]:.2f}")
    reward = python_reward_comparison(args.reward_groups, args.group_size)
    grouped, sampled, naive_reward_m = reward
    reward_fields = {
        "python_reward_per_s": f"{grouped.per_second:.1f}",
        "python_reward_per_sample_per_s": f"{sampled.per_second:.1f}",
        "python_reward_naive_per_s": f"{naive_reward_m.per_second:.1f}",
        "python_reward_speedup": f"{grouped.per_second / naive_reward_m.per_second:.2f}",
        "group_size": str(args.group_size),
    }
    if args.only == "python_reward":
        print(table(reward))
        print("result: " + " ".join(f"{k}={v}" for k, v in reward_fields.items()))
        return 0
    kinds = simple_kinds(args.n)
    comparison = python_tests_comparison(args.problems, args.threads)
    print(table([*kinds, *comparison, *reward]))
    ours, naive, floor = comparison[0], comparison[1], comparison[2]
    speedup = ours.per_second / naive.per_second
    print(f"\npython_tests: sandboxed {ours.per_second:.1f}/s vs naive {naive.per_second:.1f}/s "
          f"→ {speedup:.2f}x ({'meets' if speedup >= 3 else 'BELOW'} the 3x goal); "
          f"correct verdicts {ours.correct}/{ours.n} vs {naive.correct}/{naive.n}")
    fields = {f"{m.name.split(' ')[0].rstrip(':')}_per_s": f"{m.per_second:.1f}" for m in kinds}
    fields.update({
        "python_tests_per_s": f"{ours.per_second:.1f}",
        "naive_per_s": f"{naive.per_second:.1f}",
        "speedup": f"{speedup:.2f}",
        "python_tests_correct": f"{ours.correct}/{ours.n}",
        "naive_correct": f"{naive.correct}/{naive.n}",
        "empty_sandbox_per_s": f"{floor.per_second:.1f}",
    })
    fields.update(reward_fields)
    if len(comparison) == 5:
        fields["speedup_threads"] = f"{comparison[3].per_second / comparison[4].per_second:.2f}"
    print("result: " + " ".join(f"{k}={v}" for k, v in fields.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
