"""The run page's live charts in Chromium: points the websocket never brought are caught up from the
database, pausing live updates holds points back without losing them, and new points keep the zoom."""

from __future__ import annotations

from typing import Any

import pytest

from tests import factories
from tests.browser.conftest import log_in
from webapp.runs.metrics import Point, record_points

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def points_of(page: Any, chart: str) -> int:
    return int(page.evaluate(f"document.getElementById('chart-{chart}').dataset.points"))


def test_catch_up_pause_and_zoom(browser: Any, live_server_proc: Any, django_user_model: Any) -> None:
    user = django_user_model.objects.create_user("erin", password="pw-erin-erin")
    run = factories.run(user, name="live")
    page = browser.new_page()
    page.set_default_timeout(20_000)
    log_in(page, live_server_proc.url, "erin", "pw-erin-erin")
    page.goto(f"{live_server_proc.url}/runs/{run.pk}/")
    page.wait_for_function("window.temperLoaded === true && document.getElementById('live-indicator')"
                           ".textContent.includes('live')")

    # written to the database only, never broadcast (as when the channel layer is down): the page's
    # safety net notices the run's metric_seq ahead of what it has and fetches the points
    record_points(run.pk, [Point("loss", s, 1.0 / s) for s in range(1, 11)])
    page.wait_for_function("document.getElementById('chart-trainer').dataset.points === '10'")

    # zoom in; later points keep the zoom
    page.evaluate("Plotly.relayout('chart-trainer', {'xaxis.range': [2, 5]})")
    page.wait_for_timeout(500)
    record_points(run.pk, [Point("loss", s, 1.0 / s) for s in range(11, 16)])
    page.wait_for_function("window.temperCharts.find(c => c.def.id === 'trainer').points() >= 15")
    page.wait_for_timeout(600)
    assert page.evaluate("document.getElementById('chart-trainer').layout.xaxis.range") == [2, 5]

    # pause: points arrive but are not drawn; resume: they are
    page.check("#pause-live")
    drawn = points_of(page, "trainer")
    record_points(run.pk, [Point("loss", s, 1.0 / s) for s in range(16, 21)])
    page.wait_for_function("window.temperCharts.find(c => c.def.id === 'trainer').points() >= 20")
    page.wait_for_timeout(600)
    assert points_of(page, "trainer") == drawn
    page.uncheck("#pause-live")
    page.wait_for_function("Number(document.getElementById('chart-trainer').dataset.points) >= 20")
