"""Episodes for people, in a real Chromium: the tool demo run (seeded by ``seed_demo``) trains a few steps on
real workers with real sandbox sessions; its trajectory list filters by stop reason, tool errors and turn
count, and an episode's page shows its turns told apart (model and environment), each turn's status, the
policy version that sampled it, the loss mask over its tokens and the files its session kept; the group page
shows the group's episodes side by side, turn by turn; the run page draws the episode charts live."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import call_command

from tests.browser.conftest import log_in
from tests.test_pipeline import wait_status
from webapp.runs.models import Run, Trajectory

# The domain's setup makes every print of the model's code also go to calls.log, a file the episode keeps.
LOG_PRINTS = """import builtins
open("calls.log", "w").close()
def print(*args, **kwargs):
    with open("calls.log", "a") as log:
        log.write(" ".join(map(str, args)) + "\\n")
    builtins.print(*args, **kwargs)
"""

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
    domain = next(rd.domain for rd in run.run_domains.select_related("domain") if rd.domain.environment == "python_tool")
    type(domain).objects.filter(pk=domain.pk).update(
        environment_params={**domain.environment_params, "setup": LOG_PRINTS, "artifacts": ["calls.log"]})
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
    # the run page, open since before the first step, drew the episode charts from the points it was sent live
    for chart in ("ep_tools", "ep_turns", "ep_tokens", "ep_stops", "ep_latency"):
        page.wait_for_function(f"Number(document.querySelector('#chart-{chart}').dataset.points) > 0")
    latency = page.locator("#chart-ep_latency .legend").text_content() or ""
    assert "session_start_s_p50" in latency and "tool_latency_s_p95" in latency
    assert page.locator("#no-episodes").count() == 0
    episodes = Trajectory.objects.filter(run=run, domain=domain)  # the episodes (the run may have single-turn domains too)
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

    # an episode whose tool call printed: the file its session kept (calls.log) holds what the model saw
    printed = next(t for t in episodes.filter(turn_count__gte=2, is_eval=False).order_by("id")
                   if any(x["role"] == "env" and x["status"] == "ok" and x["text"] != "<out>(no output)</out>\n"
                          for x in t.turns))
    assert printed.sandbox["session_start_s"] > 0
    assert [a["path"] for a in printed.sandbox["artifacts"]] == ["calls.log"]
    page.goto(f"{base}/trajectories/{printed.pk}/")
    assert "calls.log" in page.locator("#artifacts").inner_text()
    seen = next(x["text"] for x in printed.turns if x["role"] == "env" and x["status"] == "ok")
    preview = page.locator('pre.artifact-preview[data-path="calls.log"]').inner_text()
    assert seen.removeprefix("<out>").removesuffix("</out>\n") in preview
    assert "session start" in page.locator("#sandbox-facts").inner_text()

    # its group: the G episodes side by side, each turn by turn, with why it stopped, its verdict and reward
    page.click("text=its group")
    page.wait_for_selector("#samples")
    group = list(Trajectory.objects.filter(run=run, group_key=printed.group_key).order_by("sample_index"))
    cards = page.locator("#samples article.sample")
    assert cards.count() == len(group) == run.spec["pipeline"]["group_size"]
    for i, t in enumerate(group):
        card = cards.nth(i)
        assert card.locator("li.turn-model").count() == sum(x["role"] == "model" for x in t.turns)
        assert card.locator("li.turn-env").count() == sum(x["role"] == "env" for x in t.turns)
        assert card.locator(".stop-reason").inner_text() == f"stopped: {t.stop_reason}"
        assert card.locator(".verdict").inner_text() == t.verdict
    assert page.locator("#samples li.turn-env .tool-tag").first.inner_text() == "python"

    assert not errors, errors
