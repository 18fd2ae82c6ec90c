"""``manage.py verify`` as a person runs it: HumanEval's canonical solutions pass, broken ones fail."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_humaneval_canonical_pass_and_broken_fail_through_the_cli(tmp_path):
    from workers.verifiers.humaneval import humaneval_rows

    rows = list(humaneval_rows())
    assert len({r["task_id"] for r in rows}) == 164
    source = tmp_path / "humaneval.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "verdicts.jsonl"
    result = subprocess.run([sys.executable, "manage.py", "verify", "--kind", "python_tests", "--input", str(source),
                             "--output", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    judged = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(judged) == len(rows)
    wrong = [(r["task_id"], r["variant"], r["verdict"], r["reason"]) for r in judged
             if r["verdict"] != r["expected"]]
    assert wrong == []
    assert "pass rate" in result.stderr  # the summary table


def test_bad_rows_are_named_and_good_rows_still_judged(tmp_path):
    source = tmp_path / "mixed.jsonl"
    source.write_text('{"prompt": "p", "completion": "5", "reference": {"answer": "5"}}\n{broken\n'
                      '{"prompt": "p", "completion": "4"}\n')
    result = subprocess.run([sys.executable, "manage.py", "verify", "--kind", "exact_match", "--input", str(source)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["verdict"] for line in result.stdout.splitlines()] == ["pass"]
    assert f"{source}: line 2: not valid JSON" in result.stderr
    assert f"{source}: line 3: missing field(s): reference" in result.stderr


def test_unknown_kind_or_bad_config_is_a_clear_error(tmp_path):
    source = tmp_path / "x.jsonl"
    source.write_text("")
    result = subprocess.run([sys.executable, "manage.py", "verify", "--kind", "regex", "--config", '{"pattern": "("}',
                             "--input", str(source)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "pattern" in result.stderr
