"""Verifiers: turn (prompt, completion, reference) into a Verdict — a score in [0, 1], or invalid with a
reason — and calibrate them against known good, bad and hack cases before a run trusts them.

Pure code: no Django, no Celery. Kinds are imported lazily by ``build_verifier``; code-running kinds call
``sandboxes``. Entry points::

    from workers.verifiers import JudgeInput, build_verifier
    verdict = build_verifier("python_tests", {"scoring": "fraction"}).judge(JudgeInput(prompt, completion, ref))
    verdict.to_dict()  # JSON for the database

    from workers.verifiers.calibration import CalibrationCase, builtin_cases, calibrate
    from workers.verifiers.batch import judge_rows, read_jsonl, summary, format_summary_table
"""

from workers.verifiers.base import (
    KINDS,
    JudgeInput,
    Verdict,
    Verifier,
    VerifierConfigError,
    build_verifier,
    config_schema,
    get_verifier,
    normalized_config,
)

__all__ = [
    "KINDS",
    "JudgeInput",
    "Verdict",
    "Verifier",
    "VerifierConfigError",
    "build_verifier",
    "config_schema",
    "get_verifier",
    "normalized_config",
]
