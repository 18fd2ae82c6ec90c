"""The dashboard's pages through Django's test client: every page renders, forms show their errors next
to the field, other users' objects are 404, and actions go through the services."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from tests import factories
from webapp.catalog.models import CalibrationCase, TaskDomain
from webapp.catalog.services import do_import_tasks
from webapp.runs.metrics import Point, record_points, series_names
from webapp.runs.models import AliasEvent, PolicyVersion, Run, RunEvent, Trajectory

pytestmark = pytest.mark.django_db


@pytest.fixture
def client_in(user: Any) -> Client:
    c = Client()
    c.force_login(user)
    return c


@pytest.fixture
def busy_run(user: Any) -> Run:
    """A run with metrics, versions, trajectories and events, as a finished loop leaves it."""
    run = factories.run(user, name="busy")
    domain = run.run_domains.get().domain
    do_import_tasks(domain, [json.dumps({"id": i, "prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(5)])
    points = []
    for step in range(1, 31):
        points += [Point("reward", step, step / 30, domain_id=domain.pk), Point("reward_mean", step, step / 30),
                   Point("loss", step, 1 / step), Point("trajectories_per_s", step, 12.5),
                   Point("custom_metric", step, 3.0)]
    record_points(run.pk, points)
    v0 = PolicyVersion.objects.create(run=run, number=0, step=0)
    v1 = PolicyVersion.objects.create(run=run, number=1, step=1, parent=v0)
    v2 = PolicyVersion.objects.create(run=run, number=2, step=2, parent=v1)
    for n, v in enumerate((v0, v1, v2)):
        factories.evaluation(v, domain, [1.0] * (10 * n + 5) + [0.0] * (35 - 10 * n))
    for i in range(4):
        Trajectory.objects.create(run=run, domain=domain, group_key="g1", sample_index=i, version=1,
                                  prompt="2+3=", completion="5" if i % 2 else "6\n" * 40, verdict="pass" if i % 2 else "fail",
                                  reward=float(i % 2), advantage=0.5 if i % 2 else -0.5, clipped=i == 3,
                                  verifier_details={"expected": "5"}, sandbox={"tier": "namespaces+cgroup",
                                                                                 "stdout": "ok"})
    RunEvent.objects.create(run=run, kind="alert.stall", level="warning", message="generation stalled")
    return run


def test_every_page_renders(client_in: Client, busy_run: Run) -> None:
    t = Trajectory.objects.filter(run=busy_run).first()
    assert t is not None
    v = busy_run.run_domains.get().domain.verifier
    urls = [
        reverse("runs"), reverse("runs") + "?q=busy&status=draft&sort=step", reverse("run-new"),
        reverse("run", args=[busy_run.pk]), reverse("run-trajectories", args=[busy_run.pk]),
        reverse("run-trajectories", args=[busy_run.pk]) + "?verdict=pass&reward_min=0.5&version=1",
        reverse("group", args=[busy_run.pk, "g1"]), reverse("trajectory", args=[t.pk]),
        reverse("compare") + f"?run={busy_run.pk}&metric=loss", reverse("domains"),
        reverse("domain", args=[busy_run.run_domains.get().domain_id]), reverse("domain-new"), reverse("verifiers"),
        reverse("verifier", args=[v.pk]), reverse("verifier-new"), reverse("base-models"), reverse("versions"),
    ]
    for url in urls:
        response = client_in.get(url)
        assert response.status_code == 200, (url, response.status_code)


def test_runs_list_shows_reward_sparkline_and_throughput(client_in: Client, busy_run: Run) -> None:
    html = client_in.get(reverse("runs")).content.decode()
    assert '<svg class="spark"' in html
    assert "reward from 0.03 to 1.00" in html  # the last 40 points of reward_mean, oldest first
    assert "12.5" in html


def test_runs_list_filters_and_searches(client_in: Client, user: Any) -> None:
    factories.run(user, name="alpha-run")
    factories.run(user, name="beta-run")
    html = client_in.get(reverse("runs") + "?q=alpha").content.decode()
    assert "alpha-run" in html and "beta-run" not in html
    html = client_in.get(reverse("runs") + "?status=running").content.decode()
    assert "alpha-run" not in html


def test_run_page_carries_chart_config_and_metric_names(client_in: Client, busy_run: Run) -> None:
    response = client_in.get(reverse("run", args=[busy_run.pk]))
    config = response.context["page_config"]
    assert config["run"] == busy_run.pk
    assert set(config["names"]) == {"custom_metric", "loss", "reward", "reward_mean", "trajectories_per_s"}
    assert config["allowed"]["pause"] == ["queued", "running"]
    html = response.content.decode()
    assert "vendor/plotly/plotly-cartesian.min.js" in html and "generation stalled" in html
    assert 'id="btn-start"' in html and 'id="btn-pause" disabled' in html


def test_series_names_is_a_loose_index_scan_of_one_run(busy_run: Run, user: Any) -> None:
    other = factories.run(user, name="other")
    record_points(other.pk, [Point("zzz", 1, 1.0)])
    assert series_names(busy_run.pk) == ["custom_metric", "loss", "reward", "reward_mean", "trajectories_per_s"]
    assert series_names(other.pk) == ["zzz"]


def test_plotly_is_served_by_the_project(client_in: Client) -> None:
    from django.contrib.staticfiles import finders

    path = finders.find("vendor/plotly/plotly-cartesian.min.js")
    assert path
    with open(path, encoding="utf-8") as f:
        assert "plotly" in f.read(2000).lower()


def test_new_run_form_shows_errors_next_to_fields(client_in: Client, user: Any) -> None:
    domain = factories.domain(user, verifier_row=factories.verifier(user))
    bm = factories.base_model(user)
    response = client_in.post(reverse("run-new"), {
        "name": "x", "base_model": bm.pk, "engine": "torch",
        "spec__algorithm__clip_low": "0.3", "spec__algorithm__clip_high": "0.1",  # clip_high < clip_low
        "spec__pipeline__group_size": "1",  # below the minimum of 2
    })
    assert response.status_code == 200
    form = response.context["form"]
    assert "spec__pipeline__group_size" in form.errors
    assert "a run needs at least one domain" in response.context["domain_error"]
    assert not Run.objects.filter(name="x").exists()
    # with a domain and valid settings the run is created and started
    response = client_in.post(reverse("run-new"), {
        "name": "x", "base_model": bm.pk, "engine": "torch", f"domain_{domain.pk}": "1", f"weight_{domain.pk}": "2.5",
        "spec__pipeline__group_size": "4", "spec__max_steps": "7", "start_now": "on",
    })
    run = Run.objects.get(name="x")
    assert response.status_code == 302 and response["Location"] == reverse("run", args=[run.pk])
    assert run.status == "queued" and run.spec["pipeline"]["group_size"] == 4 and run.spec["max_steps"] == 7
    assert run.run_domains.get().weight == 2.5


def test_new_run_form_reports_cross_field_spec_errors(client_in: Client, user: Any) -> None:
    domain = factories.domain(user, verifier_row=factories.verifier(user))
    response = client_in.post(reverse("run-new"), {
        "name": "x", "base_model": factories.base_model(user).pk, "engine": "torch", f"domain_{domain.pk}": "1",
        f"weight_{domain.pk}": "1", "spec__algorithm__clip_low": "0.3", "spec__algorithm__clip_high": "0.1",
    })
    assert response.status_code == 200
    assert "clip_high must be" in response.content.decode()


def test_starting_an_uncalibrated_run_from_the_form_says_why(client_in: Client, user: Any) -> None:
    domain = factories.domain(user, verifier_row=factories.verifier(user, calibrated=False))
    response = client_in.post(reverse("run-new"), {
        "name": "u", "base_model": factories.base_model(user).pk, "engine": "torch", f"domain_{domain.pk}": "1",
        f"weight_{domain.pk}": "1", "start_now": "on",
    }, follow=True)
    assert Run.objects.get(name="u").status == "draft"
    assert "must pass calibration" in response.content.decode()


def test_run_controls_move_the_run_and_refusals_are_shown(client_in: Client, user: Any) -> None:
    run = factories.run(user)
    client_in.post(reverse("run-action", args=[run.pk, "start"]))
    run.refresh_from_db()
    assert run.status == "queued"
    response = client_in.post(reverse("run-action", args=[run.pk, "resume"]), follow=True)
    assert "cannot resume" in response.content.decode()
    client_in.post(reverse("run-action", args=[run.pk, "pause"]))
    run.refresh_from_db()
    assert run.status == "pausing"


def test_other_users_objects_are_404(client_in: Client, other_user: Any) -> None:
    theirs = factories.run(other_user, name="theirs")
    domain = theirs.run_domains.get().domain
    for url in (reverse("run", args=[theirs.pk]), reverse("run-trajectories", args=[theirs.pk]),
                reverse("domain", args=[domain.pk]), reverse("verifier", args=[domain.verifier_id])):
        assert client_in.get(url).status_code == 404, url
    assert client_in.post(reverse("run-action", args=[theirs.pk, "start"])).status_code == 404
    assert "theirs" not in client_in.get(reverse("runs")).content.decode()


def test_pages_need_a_login() -> None:
    response = Client().get(reverse("runs"))
    assert response.status_code == 302 and response["Location"].startswith(reverse("login"))


def test_domain_upload_lists_every_bad_row_and_imports_nothing(client_in: Client, user: Any) -> None:
    from django.core.files.uploadedfile import SimpleUploadedFile

    domain = factories.domain(user)
    bad = b'{"prompt": "1+1=", "answer": "2"}\nnot json\n{"prompt": "", "answer": "3"}\n'
    response = client_in.post(reverse("domain", args=[domain.pk]), {"file": SimpleUploadedFile("t.jsonl", bad)})
    html = response.content.decode()
    assert response.status_code == 200
    errors = response.context["import_errors"]
    assert [e["line"] for e in errors["errors"]] == [2, 3]
    assert "not valid JSON" in html and "nothing was imported" in html
    domain.refresh_from_db()
    assert domain.task_count == 0
    good = b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n'
    response = client_in.post(reverse("domain", args=[domain.pk]), {"file": SimpleUploadedFile("t.jsonl", good)},
                              follow=True)
    domain.refresh_from_db()
    assert domain.task_count == 2 and "Imported 2 tasks" in response.content.decode()


def test_domain_and_verifier_forms(client_in: Client, user: Any) -> None:
    response = client_in.post(reverse("verifier-new"), {"name": "v", "kind": "regex", "config": "{not json"})
    assert "not JSON" in response.content.decode()
    response = client_in.post(reverse("verifier-new"), {"name": "v", "kind": "exact_match", "config": "{}"})
    assert response.status_code == 302
    v = client_in.get(response["Location"]).context["verifier"]
    response = client_in.post(reverse("domain-new"), {"name": "adds", "kind": "answer", "verifier": v.pk,
                                                      "heldout_fraction": "0.2"})
    domain = TaskDomain.objects.get(name="adds")
    assert response["Location"] == reverse("domain", args=[domain.pk]) and domain.verifier == v
    response = client_in.post(reverse("domain-new"), {"name": "adds", "kind": "answer", "heldout_fraction": "0.2"})
    assert "already have a domain named" in response.content.decode()


def test_verifier_page_shows_calibration_report(client_in: Client, user: Any) -> None:
    from webapp.catalog.models import CalibrationReport

    v = factories.verifier(user, calibrated=False)
    CalibrationCase.objects.create(verifier=v, completion="5", reference={"answer": "5"}, expected="pass")
    response = client_in.post(reverse("verifier-calibrate", args=[v.pk]), follow=True)
    assert "Calibration queued" in response.content.decode()
    report = CalibrationReport.objects.get(verifier=v)
    report.summary = {"agreement": {"value": 1.0, "ci95": [0.8, 1.0]},
                      "false_positive_rate": {"value": 0.0, "count": 0, "trials": 5, "ci95": [0.0, 0.43]},
                      "false_negative_rate": {"value": 0.0, "count": 0, "trials": 5, "ci95": [0.0, 0.43]},
                      "invalid_rate": {"value": 0.0, "ci95": [0.0, 0.2]}, "flip_rate": 0.0, "flipped_cases": 0,
                      "latency_ms": {"p50": 0.1, "p95": 0.2}, "thresholds": {"max_false_positive_rate": 0.05,
                                                                            "max_flip_rate": 0.05},
                      "n_cases": 1, "repeats": 5}
    report.status, report.passed = "done", True
    report.save()
    html = client_in.get(reverse("verifier", args=[v.pk])).content.decode()
    assert "false-positive rate" in html and "0.0 \u2013 0.43" in html


def test_promote_and_roll_back_from_the_versions_page(client_in: Client, busy_run: Run) -> None:
    v0, v1, v2 = PolicyVersion.objects.filter(run=busy_run).order_by("number")
    client_in.post(reverse("version-promote", args=[v1.pk]), {"alias": "production"})
    client_in.post(reverse("version-promote", args=[v2.pk]), {"alias": "production"})
    html = client_in.get(reverse("versions")).content.decode()
    assert "production → busy v2" in html
    client_in.post(reverse("alias-rollback", args=[busy_run.base_model_id]), {"alias": "production",
                                                                             "next": "https://evil.example/"})
    last = AliasEvent.objects.filter(alias="production").order_by("-id").first()
    assert last is not None and last.action == "rollback" and last.version == v1
    # the gate refuses the base model over v1 (a drop beyond noise) and the page says why
    response = client_in.post(reverse("version-promote", args=[v0.pk]), {"alias": "production"}, follow=True)
    assert "promotion gate refuses v0" in response.content.decode()
    assert AliasEvent.objects.filter(alias="production").order_by("-id").first() == last


def test_trajectory_page_shows_verdict_sandbox_and_group(client_in: Client, busy_run: Run) -> None:
    t = Trajectory.objects.get(run=busy_run, sample_index=3)
    html = client_in.get(reverse("trajectory", args=[t.pk])).content.decode()
    assert "namespaces+cgroup" in html and "clipped" in html.lower() and "v1" in html
    group = client_in.get(reverse("group", args=[busy_run.pk, "g1"])).content.decode()
    assert group.count('class="sample ') == 4


def test_example_tasks_download_and_import(client_in: Client, user: Any) -> None:
    response = client_in.get(reverse("example-tasks", args=["addition"]))
    rows = [json.loads(line) for line in response.content.decode().splitlines()]
    assert len(rows) == 90 * 90 and {r["split"] for r in rows} == {"train", "heldout"}
    assert client_in.get(reverse("example-tasks", args=["poetry"])).status_code == 404
    domain = factories.domain(user)
    do_import_tasks(domain, response.content.decode().splitlines())
    domain.refresh_from_db()
    assert domain.task_count == 8100 and domain.heldout_count == 1620


def test_verifier_form_takes_calibration_cases_and_names_bad_lines(client_in: Client, user: Any) -> None:
    bad = '{"completion": "5", "reference": {"answer": "5"}, "expected": "pass"}\n{oops\n{"expected": "maybe"}'
    response = client_in.post(reverse("verifier-new"), {"name": "v", "kind": "exact_match", "config": "{}",
                                                        "calibration_cases": bad})
    html = response.content.decode()
    assert "line 2: not JSON" in html and "line 3: expected must be" in html
    good = "\n".join(json.dumps(c) for c in (
        {"completion": "5", "reference": {"answer": "5"}, "expected": "pass", "label": "good"},
        {"completion": "", "reference": {"answer": "5"}, "expected": "fail", "label": "hack"}))
    response = client_in.post(reverse("verifier-new"), {"name": "v", "kind": "exact_match", "config": "{}",
                                                        "calibration_cases": good})
    assert response.status_code == 302
    verifier = client_in.get(response["Location"]).context["verifier"]
    assert verifier.calibration_cases.count() == 2 and verifier.calibration_status == "running"


def test_version_page_compares_flags_and_gates(client_in: Client, user: Any) -> None:
    from webapp.runs.services import DomainWeight, do_create_run

    v = factories.verifier(user)
    add, mul = factories.domain(user, "addition", verifier_row=v), factories.domain(user, "multiplication", verifier_row=v)
    run = do_create_run(user, name="two", base_model=factories.base_model(user),
                        domains=[DomainWeight(add), DomainWeight(mul)])
    v0 = PolicyVersion.objects.create(run=run, number=0)
    v1 = PolicyVersion.objects.create(run=run, number=1, parent=v0)
    for version, a, m in ((v0, 20, 20), (v1, 12, 40)):  # v1 trained on multiplication only
        factories.evaluation(version, add, [1.0] * a + [0.0] * (50 - a))
        factories.evaluation(version, mul, [1.0] * m + [0.0] * (50 - m))
    response = client_in.get(reverse("version", args=[v1.pk]))
    html = response.content.decode()
    assert response.status_code == 200
    assert 'class="tag warn regression-flag"' in html and "production: gate refuses" in html
    assert "addition regressed against v0" in html
    rows = {d.domain: d for d in response.context["comparison"].domains}
    assert rows["addition"].regression and rows["multiplication"].improvement
    # the versions list and the run page link to it; v0 compares against nothing and says so
    assert reverse("version", args=[v1.pk]) in client_in.get(reverse("versions")).content.decode()
    assert client_in.get(reverse("version", args=[v0.pk]) + "?against=nonsense").status_code == 200


def test_the_run_page_pages_its_versions_and_shows_the_device(client_in: Client, user: Any) -> None:
    """A 400-step run does not list 400 versions inline: 20 a page, newest first, with a pager."""
    from webapp.runs.models import WorkerHeartbeat

    run = factories.run(user, name="long")
    PolicyVersion.objects.bulk_create([PolicyVersion(run=run, number=n, step=n, metrics={"device": "cpu",
                                                                                         "dtype": "float32"})
                                       for n in range(1, 401)])
    now = timezone.now()
    WorkerHeartbeat.objects.create(name="gpu@box", queues="rollout,train", pid=1, started_at=now, last_seen=now,
                                   device="cuda:0 (H200) bfloat16")
    page = client_in.get(reverse("run", args=[run.pk])).content.decode()
    shown = re.findall(r">v(\d+)</a></td>", page)
    assert shown == [str(n) for n in range(400, 380, -1)]
    assert "page 1 of 20 (400 versions)" in page and "versions_page=2" in page
    assert "trained on cpu float32" in page and "gpu@box: cuda:0 (H200) bfloat16" in page
    last = client_in.get(reverse("run", args=[run.pk]) + "?versions_page=20").content.decode()
    assert re.findall(r">v(\d+)</a></td>", last) == [str(n) for n in range(20, 0, -1)]
    # a page of 20 versions costs the queries of a page of one: none a version
    short = factories.run(user, name="short")
    PolicyVersion.objects.create(run=short, number=1, step=1, metrics={"device": "cpu"})
    with CaptureQueriesContext(connection) as long_page:
        client_in.get(reverse("run", args=[run.pk]))
    with CaptureQueriesContext(connection) as short_page:
        client_in.get(reverse("run", args=[short.pk]))
    assert short.versions.count() == 1 and len(long_page) == len(short_page), long_page.captured_queries


def test_the_compare_view_shows_both_evaluation_layers_per_run(client_in: Client, user: Any) -> None:
    """Each chosen run's newest evaluated version against its base model, capability items and end-to-end
    episodes apart, with each layer's average: one layer's gain does not hide the other's loss."""
    from webapp.runs.services import DomainWeight, do_create_run

    v = factories.verifier(user)
    items = factories.domain(user, "sums", verifier_row=v)
    tool = factories.domain(user, "sums-with-tool", verifier_row=v, environment="python_tool")
    run = do_create_run(user, name="layered", base_model=factories.base_model(user),
                        domains=[DomainWeight(items), DomainWeight(tool)])
    v0 = PolicyVersion.objects.create(run=run, number=0)
    v1 = PolicyVersion.objects.create(run=run, number=1, parent=v0)
    PolicyVersion.objects.create(run=run, number=2, parent=v1)  # not evaluated: v1 is the newest evaluated
    for version, a, e in ((v0, 30, 10), (v1, 18, 40)):  # v1 got better end to end and worse on the items
        factories.evaluation(version, items, [1.0] * a + [0.0] * (50 - a))
        factories.evaluation(version, tool, [1.0] * e + [0.0] * (50 - e))
    fresh = factories.run(user, name="fresh")
    html = client_in.get(reverse("compare") + f"?run={run.pk}&run={fresh.pk}").content.decode()
    rows = re.findall(r'<tr class="layer-row ([^"]*)" data-run="(\d+)" data-layer="(\w+)">\s*<td>(.*?)</td>\s*'
                      r'<td class="layer">([^<]+)</td><td>([^<]+)</td>', html)
    assert [(r[1], r[2], r[4], r[5]) for r in rows] == [
        (str(run.pk), "capability", "capability", "sums"), (str(run.pk), "end_to_end", "end-to-end", "sums-with-tool")]
    assert "row-regression" in rows[0][0] and "row-improvement" in rows[1][0]
    assert f"v{v1.number}" in rows[0][3] and reverse("version", args=[v1.pk]) in rows[0][3]
    totals = re.findall(r'<tr class="total layer-total" data-run="(\d+)" data-layer="(\w+)">.*?<td>layer average</td>'
                        r'<td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td>', html)
    assert totals == [(str(run.pk), "capability", "0.360", "0.600", "-0.240"),
                      (str(run.pk), "end_to_end", "0.800", "0.200", "0.600")]
    assert "regression: sums" in html
    assert re.search(rf'data-run="{fresh.pk}">.*?no version of this run has a finished held-out evaluation', html)


def test_a_single_turn_run_page_leaves_the_episode_charts_out(client_in: Client, user: Any) -> None:
    single = factories.run(user, name="plain")
    page = client_in.get(reverse("run", args=[single.pk]))
    ids = {c["id"] for c in page.context["page_config"]["charts"]}
    assert "reward" in ids and not ids & {"ep_tools", "ep_turns", "ep_tokens", "ep_stops", "ep_latency"}
    assert 'id="no-episodes"' in page.content.decode() and 'id="card-ep_turns"' not in page.content.decode()
    from webapp.runs.services import DomainWeight, do_create_run

    tool = factories.domain(user, "tool", verifier_row=factories.verifier(user, "v2"), environment="python_tool")
    episodic = do_create_run(user, name="tools", base_model=factories.base_model(user, "bm2"),
                             domains=[DomainWeight(tool)])
    html = client_in.get(reverse("run", args=[episodic.pk])).content.decode()
    assert all(f'id="card-{c}"' in html for c in ("ep_tools", "ep_turns", "ep_tokens", "ep_stops", "ep_latency"))
    assert 'id="no-episodes"' not in html


def test_the_group_page_shows_each_episode_of_a_group_turn_by_turn(client_in: Client, user: Any) -> None:
    run = factories.run(user, name="eps")
    domain = run.run_domains.get().domain
    for i, stop in enumerate(("done", "max_turns")):
        turns = [{"role": "model", "text": "<py>print(6*7)</py>", "start": 0, "end": 5, "status": "ok", "latency_s": 0},
                 {"role": "env", "text": "<out>42</out>\n", "start": 5, "end": 8, "status": "tool_error" if i else "ok",
                  "latency_s": 0.002, "tool": "python", "args": "print(6*7)"},
                 {"role": "model", "text": "Answer: 42\n" * (30 if i else 1), "start": 8, "end": 11, "status": "ok",
                  "latency_s": 0}]
        Trajectory.objects.create(run=run, domain=domain, group_key="ep", sample_index=i, prompt="6*7=",
                                  completion=turns[-1]["text"], turns=turns, stop_reason=stop, turn_count=2,
                                  tool_errors=i, verdict="pass" if i == 0 else "fail", reward=1.0 - i)
    html = client_in.get(reverse("group", args=[run.pk, "ep"])).content.decode()
    samples = html.split('<article class="sample')[1:]
    assert len(samples) == 2
    for i, sample in enumerate(samples):
        assert sample.count('class="turn turn-model"') == 2 and sample.count('class="turn turn-env"') == 1
        assert f"stopped: {('done', 'max_turns')[i]}" in sample and f"reward {1.0 - i}" in sample
        assert '<span class="tag tool-tag">python</span>' in sample
    assert 'data-status="tool_error"' in samples[1] and "1 tool error" in samples[1]
