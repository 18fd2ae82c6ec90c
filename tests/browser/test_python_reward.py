"""Bring your own reward, in a real Chromium against daphne and real Celery workers: write a
``python_reward`` verifier on the page (a typo first: the dry run on save names the case and the line),
calibrate it on the verify worker, attach it to a domain, and train two steps whose verdicts come from it."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest

from tests import factories
from tests.browser.conftest import log_in
from webapp.catalog.models import BaseModel, Verifier
from webapp.catalog.task_import import import_tasks
from webapp.runs.models import Run, Trajectory
from workers.verifiers.python_reward import EXAMPLE

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PASSWORD = "correct horse battery staple"
CASES = "\n".join(json.dumps(c) for c in [
    {"completion": "5", "reference": {"answer": "5"}, "expected": "pass", "label": "good"},
    {"completion": " 8 ", "reference": {"answer": "8"}, "expected": "pass", "label": "good"},
    {"completion": "6", "reference": {"answer": "5"}, "expected": "fail", "label": "bad"},
    {"completion": "12", "reference": {"answer": "21"}, "expected": "fail", "label": "bad"},
    {"completion": "", "reference": {"answer": "5"}, "expected": "fail", "label": "hack"},
    {"completion": ":", "reference": {"answer": "5"}, "expected": "fail", "label": "hack"},
])


def wait_for(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
    return value


def test_write_calibrate_attach_and_train_with_your_own_reward(
    browser: Any, live_server_proc: Any, start_worker: Any, django_user_model: Any,
) -> None:
    from workers.policy.demo_tasks import _split_pool

    user = django_user_model.objects.create_user("dana", password=PASSWORD)
    BaseModel.objects.create(owner=user, name="demo", path="assets/base-models/demo")
    domain = factories.domain(user, name="sums")
    import_tasks(domain, [json.dumps({"prompt": p, "answer": a, "split": s}) + "\n"
                          for s in ("train", "heldout") for p, a in _split_pool("addition", s)[:16]])
    start_worker("verify")
    base = live_server_proc.url
    page = browser.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, base, "dana", PASSWORD)

    # the reward, written on the page: a typo first, which the dry run on the cases catches with its line
    page.goto(f"{base}/verifiers/new/")
    page.fill("#id_name", "my-reward")
    page.select_option("#id_kind", "python_reward")
    assert "def score(prompt, completion, reference)" in (page.get_attribute("#id_code", "placeholder") or "")
    page.fill("#id_code", EXAMPLE.replace('reference["answer"]', 'reference["answr"]'))
    page.fill("#id_calibration_cases", CASES)
    page.click("button:has-text('Create verifier')")
    error = page.locator("#field-code .field-error").inner_text()
    assert "case 1: score() raised at line 3" in error and "KeyError: 'answr'" in error, error
    assert not Verifier.objects.filter(name="my-reward").exists()
    page.fill("#id_code", EXAMPLE)
    page.click("button:has-text('Create verifier')")
    page.wait_for_url(re.compile(r"/verifiers/\d+/$"))
    verifier = Verifier.objects.get(owner=user, name="my-reward")
    assert verifier.kind == "python_reward" and verifier.config["code"] == EXAMPLE
    assert "def score(prompt, completion, reference)" in page.locator("[data-testid=reward-code]").inner_text()

    # calibrated on the verify worker, through the same gate as every kind
    wait_for(lambda: Verifier.objects.get(pk=verifier.pk).calibration_status in ("passed", "failed", "error"),
             90, "calibration")
    page.reload()
    assert "calibration: passed" in page.locator("#calibration-status").inner_text(), \
        verifier.calibration_reports.first().summary  # type: ignore[union-attr]

    # attached to the domain from its settings
    page.goto(f"{base}/domains/{domain.pk}/")
    page.click("#domain-settings summary")
    assert page.input_value("#domain-settings-form input[name=name]") == "sums"  # the form shows the domain
    page.select_option("#domain-settings-form select[name=verifier]",
                       label="my-reward (python_reward, calibration passed)")
    with page.expect_navigation():
        page.click("#domain-settings-form button[name=settings]")
    domain.refresh_from_db()
    assert domain.verifier_id == verifier.pk, page.locator("#domain-settings-form").inner_text()

    # a run of two steps, from the new-run form; its verdicts come from score()
    start_worker("control")
    start_worker("rollout,train")
    page.goto(f"{base}/runs/new/")
    page.fill("#id_name", "own reward")
    page.select_option("#id_base_model", label="demo")
    page.fill("#domain-search", "sums")
    page.check("input[name^=domain_]")
    for name, value in {"pipeline__group_size": "4", "pipeline__batch_prompts": "2",
                        "pipeline__rollout_batch_prompts": "2", "sampling__max_tokens": "5", "sampling__stop": "\n",
                        "algorithm__lora_rank": "8", "max_steps": "2", "eval_every": "100", "eval_tasks": "4"}.items():
        page.fill(f"#id_spec__{name}", value)
    page.click("#create-run")
    page.wait_for_url(re.compile(r"/runs/\d+/$"))
    run = Run.objects.get(name="own reward")
    assert not run.forced_start  # the gate let it start: its verifier passed calibration
    wait_for(lambda: Run.objects.get(pk=run.pk).step >= 2, 240, "two train steps")
    judged = Trajectory.objects.filter(run=run, is_eval=False).exclude(verdict="pending")
    assert judged.count() >= 8
    for t in judged:
        assert t.verifier_details.get("reward_status") == "ok", (t.verdict, t.verdict_reason, t.verifier_details)
        assert t.reward == t.verifier_details["raw_score"]
        assert t.reward == (1.0 if t.completion.strip() == t.task.reference["answer"] else 0.0)  # type: ignore[union-attr]
    # the run ends by itself at max_steps (clicking Cancel raced it: the page could disable the button between
    # the status read here and the click, which then waited 30 s for a button that stays disabled)
    wait_for(lambda: Run.objects.get(pk=run.pk).status in ("completed", "failed", "cancelled"), 240, "the run to end")
    assert not errors, errors
