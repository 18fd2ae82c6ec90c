"""A person's path through Temper in a real Chromium, against daphne and real Celery workers:
log in, create a domain and upload its tasks, create and start a run, watch its chart receive live
points over the websocket, pause, resume, and open a trajectory."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests import factories
from tests.browser.conftest import log_in
from webapp.catalog.models import BaseModel
from webapp.runs.models import Run

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PASSWORD = "correct horse battery staple"


def test_define_a_domain_start_a_run_and_watch_it_live(
    browser: Any, live_server_proc: Any, start_worker: Any, django_user_model: Any, tmp_path: Path,
) -> None:
    from workers.policy.demo_tasks import _split_pool

    user = django_user_model.objects.create_user("carol", password=PASSWORD)
    factories.verifier(user, name="exact-answer")  # calibrated: the gate lets its domains train
    BaseModel.objects.create(owner=user, name="demo", path="assets/base-models/demo")
    tasks = tmp_path / "addition.jsonl"
    tasks.write_text("\n".join(json.dumps({"prompt": p, "answer": a, "split": s})
                               for s in ("train", "heldout") for p, a in _split_pool("addition", s)[:40]))
    start_worker("control")
    start_worker("rollout,train")
    start_worker("verify")
    base = live_server_proc.url
    page = browser.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    log_in(page, base, "carol", PASSWORD)

    # a domain, from the form, and its tasks, uploaded as JSONL (a bad file first: every bad row is named)
    page.click("text=Domains")
    page.click("text=New domain")
    page.fill("#id_name", "addition")
    page.select_option("#id_kind", "answer")
    page.select_option("#id_verifier", label="exact-answer (exact_match, calibration passed)")
    page.click("button:has-text('Create domain')")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2="}\nnot json\n')
    page.set_input_files("#upload-form input[type=file]", str(bad))
    page.click("#upload-form button")
    table = page.locator("#import-errors")
    assert "nothing was imported" in table.inner_text()
    assert table.locator("tbody tr").count() == 2
    page.set_input_files("#upload-form input[type=file]", str(tasks))
    page.click("#upload-form button")
    assert page.locator("#task-count").inner_text() == "80"

    # a run, from the new-run form: a field error first, shown next to its field
    page.click("text=New run")
    page.fill("#id_name", "browser run")
    page.select_option("#id_base_model", label="demo")
    page.fill("#domain-search", "addi")
    page.check("input[name^=domain_]")
    page.fill("#id_spec__pipeline__group_size", "1")
    page.click("#create-run")
    assert "greater than or equal to 2" in page.locator("#field-spec__pipeline__group_size .field-error").inner_text()
    for name, value in {"pipeline__group_size": "4", "pipeline__batch_prompts": "4",
                        "pipeline__rollout_batch_prompts": "4", "sampling__max_tokens": "5",
                        "sampling__stop": "\n", "algorithm__lora_rank": "8", "algorithm__learning_rate": "0.001",
                        "algorithm__updates_per_batch": "1", "max_steps": "200", "eval_every": "2",
                        "eval_tasks": "20"}.items():
        page.fill(f"#id_spec__{name}", value)
    page.click("#create-run")
    page.wait_for_url(re.compile(r"/runs/\d+/$"))
    run = Run.objects.get(name="browser run")
    assert run.spec["pipeline"]["group_size"] == 4

    # the charts fill from the websocket as the workers train
    page.wait_for_function("document.getElementById('live-indicator').textContent.includes('live')")
    page.wait_for_function("Number(document.getElementById('chart-reward').dataset.points) > 0", timeout=180_000)
    page.wait_for_function("Number(document.getElementById('chart-trainer').dataset.points) >= 10", timeout=180_000)
    drawn = page.evaluate("window.temperDrawn.length")
    assert drawn > 0
    assert page.locator("#chart-reward .main-svg").count() > 0  # plotly drew it

    # pause: the in-between state, then paused; resume
    page.click("#btn-pause")
    page.wait_for_function("['pausing', 'paused'].includes(document.getElementById('run-status').dataset.status)")
    page.wait_for_function("document.getElementById('run-status').dataset.status === 'paused'", timeout=120_000)
    assert page.locator("#btn-resume").is_enabled() and page.locator("#btn-pause").is_disabled()
    steps_at_pause = Run.objects.get(pk=run.pk).step
    page.click("#btn-resume")
    page.wait_for_function("['queued', 'running'].includes(document.getElementById('run-status').dataset.status)")
    page.wait_for_function(f"/step (\\d+)/.exec(document.getElementById('run-step').textContent)[1] > {steps_at_pause}",
                           timeout=120_000)
    assert "status.paused" in page.locator("#events").inner_text()

    # a trajectory, from the browser of the run's samples
    page.click("text=Trajectories")
    page.locator("#trajectory-table tbody tr td a").first.click()
    page.wait_for_url(re.compile(r"/trajectories/\d+/$"))
    assert page.locator("#prompt").inner_text().strip() != ""
    assert page.locator("#verdict").inner_text() in {"pass", "fail", "invalid", "pending"}

    # every train step so far reported its trainer metrics (what the trainer chart draws)
    from webapp.runs.models import MetricPoint

    steps = Run.objects.get(pk=run.pk).step
    reported = set(MetricPoint.objects.filter(run=run, name="loss").values_list("step", flat=True))
    assert len(reported) >= steps - 2, (steps, sorted(reported))

    # cancel (after a confirmation) so the workers stop promptly
    page.go_back()
    page.go_back()
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#btn-cancel")
    page.wait_for_function("document.getElementById('run-status').dataset.status === 'cancelled'")
    assert not errors, errors
    if os.environ.get("TEMPER_SCREENSHOTS"):
        page.screenshot(path=os.environ["TEMPER_SCREENSHOTS"] + "/run.png", full_page=True)


def test_api_docs_load_with_no_network_and_list_the_operations(browser, live_server_proc, user):
    """The docs page's assets come from the project (drf-spectacular-sidecar), not a CDN: with every other
    host unreachable it still renders Swagger UI with Temper's operations."""
    context = browser.new_context()
    outside: list[str] = []

    def only_localhost(route):
        from urllib.parse import urlparse

        if urlparse(route.request.url).hostname in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort("internetdisconnected")

    context.route("**/*", only_localhost)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, live_server_proc.url, "alice", "alice-password-1")
    page.goto(f"{live_server_proc.url}/api/v1/docs/")
    page.wait_for_selector(".opblock", timeout=20_000)
    paths = page.locator(".opblock-summary-path").all_inner_texts()
    assert "/api/v1/runs/" in paths and "/api/v1/domains/{id}/import/" in paths, paths[:20]
    assert not errors, errors  # e.g. "SwaggerUIBundle is not defined" when the bundle came from a CDN
    assert not outside, outside
    context.close()
