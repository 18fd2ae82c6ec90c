"""Episodes for people, in a real Chromium: the tool demo run (seeded by ``seed_demo``) trains a few steps on
real workers with real sandbox sessions; its trajectory list filters by stop reason, tool errors and turn
count, and an episode's page shows its turns told apart (model and environment), each turn's status, the
policy version that sampled it and the loss mask over its tokens."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import call_command

from tests.browser.conftest import log_in
from tests.test_pipeline import wait_status
from webapp.runs.models import Run, Trajectory

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PASSWORD = "correct horse battery staple"


def test_an_episode_of_the_tool_demo_and_the_stop_reason_filter(
    browser: Any, live_server_proc: Any, start_worker: Any, django_user_model: Any,
) -> None:
    user = django_user_model.objects.create_user("dora", password=PASSWORD, is_staff=True)
    call_command("seed_demo", user="dora")
    run = Run.objects.get(owner=user, name="demo: tool use")
    # max_turns 2: an episode that calls the tool twice stops on max_turns, so two stop reasons show up
    Run.objects.filter(pk=run.pk).update(spec={**run.spec, "max_steps": 3, "eval_every": 0,
                                               "episode": {**run.spec["episode"], "max_turns": 2}})
    start_worker("control")
    start_worker("rollout,train")
    start_worker("verify")
    base = live_server_proc.url
    page = browser.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, base, "dora", PASSWORD)

    page.goto(f"{base}/runs/{run.pk}/")
    page.click("#btn-start")
    wait_status(run.pk, {"completed"}, timeout=300)
    episodes = Trajectory.objects.filter(run=run)
    reasons = set(episodes.values_list("stop_reason", flat=True))
    assert "done" in reasons, reasons

    # the list: filter by stop reason; every row shown stopped that way, and the count matches the database
    page.goto(f"{base}/runs/{run.pk}/trajectories/")
    page.select_option("select[name=stop]", "done")
    page.click("#trajectory-filters button[type=submit]")
    page.wait_for_url("**stop=done**")
    shown = page.locator("#trajectory-table tbody td.stop-reason").all_inner_texts()
    assert shown and set(shown) == {"done"}
    for other in reasons - {"done"}:
        page.select_option("select[name=stop]", other)
        page.click("#trajectory-filters button[type=submit]")
        page.wait_for_url(f"**stop={other}**")
        assert set(page.locator("#trajectory-table tbody td.stop-reason").all_inner_texts()) == {other}

    # an episode that called the tool: its turns, their statuses, the versions and the mask
    page.goto(f"{base}/runs/{run.pk}/trajectories/?turns_min=2")
    page.locator("#trajectory-table tbody tr td a").first.click()
    page.wait_for_selector("#transcript")
    model_turns = page.locator("#transcript li.turn-model")
    env_turns = page.locator("#transcript li.turn-env")
    assert model_turns.count() >= 2 and env_turns.count() >= 1
    assert "(trained on)" in model_turns.first.inner_text() and "(not trained on)" in env_turns.first.inner_text()
    assert "<py>" in model_turns.first.inner_text() and "<out>" in env_turns.first.inner_text()
    statuses = page.locator("#transcript li.turn").evaluate_all("els => els.map(e => e.dataset.status)")
    assert statuses and all(s in ("ok", "done", "tool_error", "parse_error", "timeout", "env_error") for s in statuses)
    mask = page.locator("#mask code").inner_text()
    trajectory = Trajectory.objects.get(pk=int(page.url.rstrip("/").split("/")[-1]))
    expected = "".join(("█" if t["role"] == "model" else "·") * (t["end"] - t["start"]) for t in trajectory.turns)
    assert mask == expected and "█" in mask and "·" in mask
    assert len(mask) == len(trajectory.completion_token_ids)
    assert "sampled by v" in page.locator("h2", has_text="Episode").inner_text()
    assert not errors, errors
