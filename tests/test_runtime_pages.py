"""Sandbox runtimes for people: the domain page names the runtime its verifier (or environment) runs in, with
its build status, image size, packages and lock, or why its build failed; a train step's report has the
sandbox points per domain (cold-start share, retries, image builds) for the run page's sandbox chart."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from sandboxes import runtimes
from tests import factories
from webapp.catalog.models import Verifier
from webapp.runs.loop.reporting import sandbox_points
from webapp.runs.models import Trajectory
from webapp.ui.charts import CHARTS

pytestmark = pytest.mark.django_db


@pytest.fixture
def client_in(user: Any) -> Client:
    c = Client()
    c.force_login(user)
    return c


@pytest.fixture
def own_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = runtimes.images_root().parent / "test-runtimes" / uuid.uuid4().hex[:8]
    monkeypatch.setenv("TEMPER_RUNTIMES_ROOT", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def code_domain(user: Any, config: dict[str, Any], name: str = "arrays") -> Any:
    verifier = Verifier.objects.create(owner=user, name=f"v-{name}", kind="python_tests", config=config)
    return factories.domain(user, name=name, kind="code", verifier_row=verifier)


def test_the_domain_page_shows_its_runtime_status_size_and_packages(client_in: Client, user: Any) -> None:
    image, _ = runtimes.ensure_image(runtimes.get("numpy"))
    domain = code_domain(user, {"runtime": "numpy", "strict_values": False})
    html = client_in.get(reverse("domain", args=[domain.pk])).content.decode()
    assert 'id="domain-runtime-numpy"' in html and "named by the verifier" in html
    assert ">built<" in html and f"{round(image.size_bytes / 1e6, 1)} MB" in html
    assert "<code>numpy==2.4.6</code>" in html and "preloaded: numpy" in html

    plain = code_domain(user, {}, name="plain")
    html = client_in.get(reverse("domain", args=[plain.pk])).content.decode()
    assert 'id="domain-runtime-python"' in html and "the standard library only" in html


def test_a_runtime_not_built_or_failed_says_so(client_in: Client, user: Any, own_root: Path) -> None:
    domain = code_domain(user, {"runtime": "numpy"})
    html = client_in.get(reverse("domain", args=[domain.pk])).content.decode()
    assert ">not built<" in html and "python -m sandboxes.runtimes build numpy" in html
    runtimes.register(runtimes.Runtime(name="broken-pin", packages=("numpy==9.9.9",)))
    try:
        with pytest.raises(runtimes.BuildError):
            runtimes.ensure_image(runtimes.get("broken-pin"))
        broken = code_domain(user, {"runtime": "broken-pin"}, name="broken")
        html = client_in.get(reverse("domain", args=[broken.pk])).content.decode()
    finally:
        runtimes._registered.pop("broken-pin", None)
    assert ">failed<" in html and "numpy==9.9.9: " in html and "No matching distribution" in html


def test_a_steps_report_has_the_sandbox_points_per_domain(user: Any) -> None:
    run = factories.run(user, name="sb")
    domain = run.run_domains.get().domain
    facts = [("cold", 1, 4.2), ("warm", 1, 0.0), ("warm", 3, 0.0), ("warm", 1, 0.0)]
    for i, (start, attempts, build_s) in enumerate(facts):
        Trajectory.objects.create(run=run, domain=domain, group_key="g", sample_index=i, version=0, prompt="p",
                                  completion="c", verdict="pass", reward=1.0, trained_step=1, verifier_details={
                                      "runtime": "numpy", "sandbox_start": start, "sandbox_attempts": attempts,
                                      "image_build_s": build_s})
    Trajectory.objects.create(run=run, domain=domain, group_key="g", sample_index=9, version=0, prompt="p",
                              completion="c", verdict="pass", reward=1.0, trained_step=1, verifier_details={})
    points = {p.name: p.value for p in sandbox_points(run, 1)}
    assert points == {"sandbox_cold_share": 0.25, "sandbox_retries": 2.0, "sandbox_image_builds": 1.0,
                      "sandbox_build_s": 4.2}
    chart = next(c for c in CHARTS if c["id"] == "sandbox")
    assert set(points) == set(chart["names"])
