"""A hundred domains in Chromium: the run page draws them as one domains x steps heatmap (sortable, the most
improved and most regressed named, redrawn live), its line charts keep to run-wide series, the new-run
form picks domains by pack, tag and search, and a version's per-domain tables sort and page."""

from __future__ import annotations

from typing import Any

import pytest

from tests import factories
from tests.browser.conftest import log_in
from webapp.catalog.models import TaskDomain
from webapp.runs.metrics import Point, record_points
from webapp.runs.models import PolicyVersion
from webapp.runs.services import DomainWeight, do_create_run

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PASSWORD = "correct horse battery staple"
N = 100


def hundred_domain_run(user: Any) -> tuple[Any, list[TaskDomain], list[Point]]:
    v = factories.verifier(user)
    domains = TaskDomain.objects.bulk_create([
        TaskDomain(owner=user, name=f"pack/d{i:03d}", kind="answer", verifier=v, pack="pack" if i < 60 else "other",
                   tags=["odd" if i % 2 else "even"]) for i in range(N)])
    run = do_create_run(user, name="hundred", base_model=factories.base_model(user),
                        domains=[DomainWeight(d) for d in domains])
    # 200 steps, 16 domains a step (as a run admits them by weight); d007 climbs, d042 falls, the rest stay
    points = []
    for step in range(1, 201):
        for k in range(16):
            d = domains[(step * 16 + k) % N]
            trend = {7: step / 200, 42: 1 - step / 200}.get(int(d.name[-3:]), 0.5)
            points.append(Point("reward", step, trend, domain_id=d.pk))
        points.append(Point("reward_mean", step, 0.5))
    for d in domains:
        points.append(Point("heldout_reward", 0, 0.4, domain_id=d.pk))
    record_points(run.pk, points)
    v0 = PolicyVersion.objects.create(run=run, number=0)
    v1 = PolicyVersion.objects.create(run=run, number=1, parent=v0, step=10)
    for i, d in enumerate(domains[:60]):
        factories.evaluation(v0, d, [0.5] * 10)
        factories.evaluation(v1, d, [1.0] * (i % 10) + [0.0] * (10 - i % 10))
    return run, domains, points


def test_a_hundred_domains_read_as_one_heatmap(browser: Any, live_server_proc: Any, django_user_model: Any) -> None:
    user = django_user_model.objects.create_user("hana", password=PASSWORD)
    run, domains, points = hundred_domain_run(user)
    v1 = PolicyVersion.objects.get(run=run, number=1)
    base = live_server_proc.url
    page = browser.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, base, "hana", PASSWORD)
    page.goto(f"{base}/runs/{run.pk}/")
    page.wait_for_function("document.getElementById('heatmap').dataset.rows === '100'")
    first_chart_ms = page.evaluate("Math.min(...window.temperDrawn.map(d => d.t)) - performance.timeOrigin")
    print(f"first chart drawn {first_chart_ms:.0f} ms after navigation ({N} domains, {len(points)} points)")
    named = page.inner_text("#heatmap-named")
    assert "most improved: pack/d007" in named and "most regressed: pack/d042" in named
    page.select_option("#heatmap-sort", "gain")
    order = page.evaluate("document.getElementById('heatmap').dataset.order").split("|")
    assert order[0] == "pack/d007" and order[-1] == "pack/d042" and len(order) == N
    page.select_option("#heatmap-sort", "name")
    assert page.evaluate("document.getElementById('heatmap').dataset.order").split("|")[:2] == ["pack/d000", "pack/d001"]
    # the per-domain line charts are left to the heatmap: the reward chart has the run-wide series only
    page.wait_for_function("window.temperLoaded === true")
    page.wait_for_function("document.getElementById('chart-reward').dataset.points === '200'")
    assert page.is_visible("#many-domains")
    # live: new points of the shown metric redraw the heatmap
    loads = int(page.evaluate("document.getElementById('heatmap').dataset.loads"))
    record_points(run.pk, [Point("reward", 201, 0.0, domain_id=domains[7].pk)])
    page.wait_for_function(f"Number(document.getElementById('heatmap').dataset.loads) > {loads}")
    page.select_option("#heatmap-metric", "heldout_reward")
    page.wait_for_function("document.getElementById('heatmap').dataset.loads > '0' && "
                           "document.getElementById('heatmap').dataset.order.startsWith('pack/d000')")

    # the new-run form: by pack, by tag, by search; tick what is shown
    page.goto(f"{base}/runs/new/")
    page.select_option("#domain-pack", "pack")
    page.select_option("#domain-tag", "odd")
    page.click("#domain-tick-shown")
    assert page.inner_text("#domain-chosen-count") == "30 chosen"
    page.fill("#domain-search", "d01")
    assert page.locator(".domain-row:visible").count() == 5  # d011, d013, ..., d019

    # a version's per-domain tables sort and page
    page.goto(f"{base}/versions/{v1.pk}/?against=base&sort=-delta")
    rows = page.locator("#comparison tbody tr:not(.total)")
    assert rows.count() == 50
    assert rows.first.inner_text().split("\t")[1].startswith("pack/d0")  # the worst change first
    page.click("#domains-next")
    assert page.locator("#evaluations tbody tr").count() == 10
    assert errors == []


# when each chart was first drawn as a preview (SVG, canvas) and by plotly, in ms after navigation
SEEN = """
window.__seen = {};
new MutationObserver(() => {
  const mark = (key, sel) => { if (!window.__seen[key] && document.querySelector(sel)) window.__seen[key] = performance.now(); };
  mark("heatPreview", "#heatmap canvas.chart-preview"); mark("heatPlotly", "#heatmap .main-svg");
}).observe(document, {childList: true, subtree: true});
"""


def test_the_charts_are_drawn_before_plotly_has_run(browser: Any, live_server_proc: Any, django_user_model: Any) -> None:
    """plotly.js (1.5 MB, one long parse) runs only after the first chart and the heatmap have their data:
    until then the line charts are SVG and the heatmap a canvas of the same data, then plotly's charts
    replace them. Without plotly at all, the previews stay and say why."""
    user = django_user_model.objects.create_user("iris", password=PASSWORD)
    run, _, _ = hundred_domain_run(user)
    base = live_server_proc.url

    page = browser.new_page()
    page.set_default_timeout(30_000)
    log_in(page, base, "iris", PASSWORD)
    page.route("**/plotly-cartesian.min.js", lambda route: route.abort())
    page.goto(f"{base}/runs/{run.pk}/")
    page.wait_for_function("window.temperLoaded === true")
    page.wait_for_function("document.getElementById('heatmap').dataset.preview === '1'")
    # the run-wide reward_mean series: 200 steps, one line of 200 vertices, its range on the axis
    path = page.get_attribute("#chart-reward .chart-preview path[stroke-width]", "d")
    assert path.count("M") == 1 and path.count("L") == 199, path[:200]
    labels = page.locator("#chart-reward .chart-preview text").all_text_contents()
    assert {"1", "200", "step"} <= set(labels), labels
    canvas = page.evaluate("(() => { const c = document.querySelector('#heatmap canvas.chart-preview');"
                           " return [c.style.height, document.getElementById('chart-reward').dataset.points]; })()")
    assert canvas == [f"{60 + 14 * N}px", "0"]  # a row per domain; data-points stays plotly's
    page.wait_for_function("document.getElementById('heatmap-named').textContent.includes('plotly.js did not load')")
    page.close()

    page = browser.new_page()
    page.set_default_timeout(30_000)
    page.add_init_script(SEEN)
    log_in(page, base, "iris", PASSWORD)
    page.goto(f"{base}/runs/{run.pk}/")
    page.wait_for_function("document.getElementById('heatmap').dataset.rows === '100' && "
                           "document.getElementById('chart-reward').dataset.points === '200'")
    seen = page.evaluate("window.__seen")
    assert seen["heatPreview"] < seen["heatPlotly"], seen  # plotly runs after the heatmap's data is drawn
    assert page.locator(".chart-preview").count() == 0  # every preview was replaced by plotly's chart
    assert page.locator("#chart-reward .main-svg").count() > 0 and page.locator("#heatmap .main-svg").count() > 0
    print("first drawn (ms after navigation):", {k: round(v) for k, v in seen.items()})
