"""Judging files of samples: the pure core of ``manage.py verify``.

``read_jsonl(path)`` yields ``(line_number, row | InputRowError)``; ``judge_rows(verifier, rows)`` yields one
output row per input row — the input fields plus ``verdict`` (pass|fail|invalid), ``score``, ``reason``,
``latency_ms`` and ``details`` — or, for a bad input row (not JSON, not an object, a missing or mistyped
field), ``{"line": n, "verdict": None, "error": "line n: …"}``. A bad row never stops the good ones.
``summary(rows)`` and ``format_summary_table(summary)`` report the outcome for people.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.verifiers.base import JudgeInput, Verifier
from workers.verifiers.calibration import percentile

REQUIRED_FIELDS = ("prompt", "completion", "reference")


@dataclass(frozen=True)
class InputRowError:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | InputRowError]]:
    """``(line_number, row)`` for each non-blank line (1-based), or ``(line_number, InputRowError)``."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as exc:
                yield n, InputRowError(n, f"not valid JSON ({exc})"[:300])
                continue
            if not isinstance(row, dict):
                yield n, InputRowError(n, f"expected a JSON object, got {type(row).__name__}")
                continue
            yield n, row


def check_row(line: int, row: dict[str, Any]) -> JudgeInput | InputRowError:
    missing = [f for f in REQUIRED_FIELDS if f not in row]
    if missing:
        return InputRowError(line, f"missing field(s): {', '.join(missing)}")
    for f in ("prompt", "completion"):
        if not isinstance(row[f], str):
            return InputRowError(line, f"field {f!r} must be a string, got {type(row[f]).__name__}")
    kind = row.get("kind")
    if kind is not None and not isinstance(kind, str):
        return InputRowError(line, f"field 'kind' must be a domain kind name, got {type(kind).__name__}")
    return JudgeInput(row["prompt"], row["completion"], row["reference"], kind=kind)


def judge_rows(
    verifier: Verifier,
    rows: Iterable[dict[str, Any] | tuple[int, dict[str, Any] | InputRowError]],
    progress: Callable[[int, dict[str, Any]], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Judge each row lazily. ``rows`` are dicts (numbered from 1) or ``read_jsonl`` pairs.

    ``progress(n_done, output_row)`` is called after each row.
    """
    for i, item in enumerate(rows, start=1):
        if isinstance(item, tuple):
            line, payload = item
        else:
            line, payload = i, item
        out: dict[str, Any]
        if isinstance(payload, InputRowError):
            out = {"line": line, "verdict": None, "error": str(payload)}
        elif not isinstance(payload, dict):
            out = {"line": line, "verdict": None,
                   "error": str(InputRowError(line, f"expected an object, got {type(payload).__name__}"))}
        else:
            checked = check_row(line, payload)
            if isinstance(checked, InputRowError):
                out = {"line": line, "verdict": None, "error": str(checked)}
            else:
                v = verifier.judge(checked).to_dict()
                out = {**payload, "line": line, "verdict": v["status"], "score": v["score"],
                       "reason": v["reason"], "latency_ms": v["latency_ms"], "details": v["details"]}
        if progress is not None:
            progress(i, out)
        yield out


def summary(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    errors: list[str] = []
    scores: list[float] = []
    latencies: list[float] = []
    for r in rows:
        verdict = r.get("verdict")
        if verdict is None:
            counts["input_errors"] += 1
            errors.append(str(r.get("error")))
            continue
        counts[verdict] += 1
        latencies.append(float(r.get("latency_ms") or 0.0))
        if verdict == "invalid":
            reasons[str(r.get("reason"))[:80]] += 1
        elif r.get("score") is not None:
            scores.append(float(r["score"]))
    judged = counts["pass"] + counts["fail"] + counts["invalid"]
    valid = counts["pass"] + counts["fail"]
    return {
        "rows": judged + counts["input_errors"],
        "judged": judged,
        "pass": counts["pass"],
        "fail": counts["fail"],
        "invalid": counts["invalid"],
        "input_errors": counts["input_errors"],
        "pass_rate": counts["pass"] / valid if valid else None,
        "invalid_rate": counts["invalid"] / judged if judged else None,
        "mean_score": statistics.fmean(scores) if scores else None,
        "latency_ms": {"p50": percentile(latencies, 50), "p95": percentile(latencies, 95),
                       "mean": statistics.fmean(latencies) if latencies else 0.0},
        "invalid_reasons": dict(reasons.most_common(5)),
        "errors": errors[:20],
    }


def format_summary_table(s: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    rows = [
        ("rows", str(s["rows"])),
        ("pass", str(s["pass"])),
        ("fail", str(s["fail"])),
        ("invalid", f"{s['invalid']} ({pct(s['invalid_rate'])} of judged; excluded from training)"),
        ("input errors", str(s["input_errors"])),
        ("pass rate", f"{pct(s['pass_rate'])} of valid verdicts"),
        ("mean score", "-" if s["mean_score"] is None else f"{s['mean_score']:.4f}"),
        ("latency p50 / p95", f"{s['latency_ms']['p50']:.1f} / {s['latency_ms']['p95']:.1f} ms"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    for reason, n in s["invalid_reasons"].items():
        lines.append(f"{'  invalid:'.ljust(width)}  {n} x {reason}")
    for err in s["errors"]:
        lines.append(f"{'  error:'.ljust(width)}  {err}")
    return "\n".join(lines)
