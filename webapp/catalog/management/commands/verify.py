"""``python manage.py verify``: judge a JSONL file of completions with a stored verifier or a kind.

    python manage.py verify --verifier exact-answer --input samples.jsonl --output verdicts.jsonl
    python manage.py verify --kind python_tests --config '{"scoring": "fraction"}' --input he.jsonl

Input rows: ``{"prompt", "completion", "reference"}``. Output rows add ``verdict`` (pass|fail|invalid),
``score``, ``reason``, ``latency_ms``. A bad input row is reported with its line number and skipped; the
good rows are still judged. A summary table ends the run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from webapp.catalog.models import Verifier


class Command(BaseCommand):
    help = "Judge a JSONL file of {prompt, completion, reference} rows; writes verdict rows and a summary."

    def add_arguments(self, parser: Any) -> None:
        which = parser.add_mutually_exclusive_group(required=True)
        which.add_argument("--verifier", help="name (or id) of a stored verifier")
        which.add_argument("--kind", help="a verifier kind, configured with --config")
        parser.add_argument("--config", default="{}", help="JSON configuration for --kind")
        parser.add_argument("--input", required=True, type=Path)
        parser.add_argument("--output", type=Path, help="JSONL of verdict rows (default: standard output)")
        parser.add_argument("--owner", help="username, when several users have a verifier of that name")

    def handle(self, *args: Any, **opts: Any) -> None:
        from workers.verifiers.base import VerifierConfigError, build_verifier
        from workers.verifiers.batch import format_summary_table, judge_rows, read_jsonl, summary

        if opts["verifier"]:
            ref: str = opts["verifier"]
            rows = Verifier.objects.all()
            if opts["owner"]:
                rows = rows.filter(owner__username=opts["owner"])
            matches = list(rows.filter(pk=int(ref)) if ref.isdigit() else rows.filter(name=ref))
            if len(matches) != 1:
                raise CommandError(f"{len(matches)} verifiers match {ref!r}" + (": give --owner or the id" if matches else ""))
            kind, config = matches[0].kind, matches[0].config
        else:
            kind = opts["kind"]
            try:
                config = json.loads(opts["config"])
            except json.JSONDecodeError as exc:
                raise CommandError(f"--config is not JSON: {exc}") from None
        try:
            verifier = build_verifier(kind, config)
        except VerifierConfigError as exc:
            raise CommandError(str(exc)) from None
        path: Path = opts["input"]
        if not path.is_file():
            raise CommandError(f"{path}: no such file")
        total = sum(1 for line in path.open("rb") if line.strip())
        out = opts["output"].open("w") if opts["output"] else sys.stdout
        results = []
        try:
            with tqdm(total=total, desc=f"verify ({kind})", unit="row", file=sys.stderr) as bar:
                for row in judge_rows(verifier, read_jsonl(path), progress=lambda n, _row: bar.update(1)):
                    if row.get("error"):
                        self.stderr.write(f"{path}: {row['error']}")
                    else:
                        out.write(json.dumps(row) + "\n")
                    results.append(row)
        finally:
            if opts["output"]:
                out.close()
        self.stderr.write(format_summary_table(summary(results)))
