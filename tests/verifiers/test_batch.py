"""judge_rows / read_jsonl / summary: the pure core of `manage.py verify`."""

from __future__ import annotations

import json
from pathlib import Path

from workers.verifiers.base import build_verifier
from workers.verifiers.batch import format_summary_table, judge_rows, read_jsonl, summary


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_bad_rows_are_reported_by_line_and_good_rows_survive(tmp_path: Path) -> None:
    f = write_lines(tmp_path / "in.jsonl", [
        json.dumps({"prompt": "2+2", "completion": "Answer: 4", "reference": "4", "id": "a"}),
        "{not json",
        "",
        json.dumps({"prompt": "3+3", "completion": "Answer: 7", "reference": "6"}),
        json.dumps(["a", "list"]),
        json.dumps({"prompt": "x", "reference": "1"}),
        json.dumps({"prompt": "x", "completion": 5, "reference": "1"}),
        json.dumps({"prompt": "1+1", "completion": "Answer: 2", "reference": None}),
    ])
    progress: list[int] = []
    out = list(judge_rows(build_verifier("exact_match", {"extract": "marker"}), read_jsonl(f),
                          progress=lambda n, row: progress.append(n)))
    assert [r["line"] for r in out] == [1, 2, 4, 5, 6, 7, 8]
    assert progress == [1, 2, 3, 4, 5, 6, 7]
    assert out[0]["verdict"] == "pass" and out[0]["id"] == "a" and out[0]["score"] == 1.0
    assert out[1]["verdict"] is None and out[1]["error"].startswith("line 2: not valid JSON")
    assert out[2]["verdict"] == "fail" and out[2]["reason"] == "answer differs from the reference"
    assert out[3]["error"] == "line 5: expected a JSON object, got list"
    assert out[4]["error"] == "line 6: missing field(s): completion"
    assert out[5]["error"] == "line 7: field 'completion' must be a string, got int"
    assert out[6]["verdict"] == "invalid" and out[6]["score"] is None
    json.dumps(out)  # every output row is JSON

    s = summary(out)
    assert (s["rows"], s["pass"], s["fail"], s["invalid"], s["input_errors"]) == (7, 1, 1, 1, 4)
    assert s["pass_rate"] == 0.5 and s["invalid_rate"] == 1 / 3
    table = format_summary_table(s)
    assert "invalid" in table and "line 2: not valid JSON" in table and "50.0% of valid verdicts" in table


def test_plain_dict_rows_are_numbered_from_one() -> None:
    rows = [{"prompt": "p", "completion": "a", "reference": "a"}, {"prompt": "p"}]
    out = list(judge_rows(build_verifier("exact_match", {}), rows))
    assert out[0]["line"] == 1 and out[0]["verdict"] == "pass"
    assert out[1]["error"] == "line 2: missing field(s): completion, reference"


def test_summary_of_nothing() -> None:
    s = summary([])
    assert s["rows"] == 0 and s["pass_rate"] is None
    assert "rows" in format_summary_table(s)


def test_non_utf8_input_is_replaced_not_fatal(tmp_path: Path) -> None:
    f = tmp_path / "in.jsonl"
    f.write_bytes(b'{"prompt": "p", "completion": "\xff", "reference": "x"}\n')
    (row,) = list(judge_rows(build_verifier("exact_match", {}), read_jsonl(f)))
    assert row["verdict"] == "fail"
