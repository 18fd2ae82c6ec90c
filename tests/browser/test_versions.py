"""Policy versions in Chromium: a planted regression (a version trained only on the other domain) is
flagged on its page and its promotion refused with the reason, although its average is higher; the
good version is promoted to production after a confirmation and rolled back."""

from __future__ import annotations

from typing import Any

import pytest

from tests import factories
from tests.browser.conftest import log_in
from webapp.runs.models import AliasEvent, PolicyVersion
from webapp.runs.services import DomainWeight, do_create_run

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PASSWORD = "correct horse battery staple"


def test_regression_blocks_promotion_then_promote_and_roll_back(
    browser: Any, live_server_proc: Any, django_user_model: Any,
) -> None:
    user = django_user_model.objects.create_user("dana", password=PASSWORD)
    v = factories.verifier(user)
    add, mul = factories.domain(user, "addition", verifier_row=v), factories.domain(user, "multiplication", verifier_row=v)
    run = do_create_run(user, name="two domains", base_model=factories.base_model(user),
                        domains=[DomainWeight(add), DomainWeight(mul)])
    v0 = PolicyVersion.objects.create(run=run, number=0)
    v1 = PolicyVersion.objects.create(run=run, number=1, parent=v0)
    v2 = PolicyVersion.objects.create(run=run, number=2, parent=v1)
    # v1: trained on multiplication only (+40 there, -16 on addition); v2: better on both
    for version, a, m in ((v0, 20, 20), (v1, 12, 40), (v2, 30, 35)):
        factories.evaluation(version, add, [1.0] * a + [0.0] * (50 - a))
        factories.evaluation(version, mul, [1.0] * m + [0.0] * (50 - m))
    base = live_server_proc.url
    page = browser.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, base, "dana", PASSWORD)

    page.goto(f"{base}/versions/{v1.pk}/?against=base")
    row = page.locator("#comparison tr.row-regression")
    assert row.count() == 1 and "addition" in row.inner_text()
    assert page.locator("#chart-delta .main-svg").count() > 0
    page.once("dialog", lambda d: d.accept())
    page.select_option("#promote-form select[name=alias]", "production")
    page.click("#btn-promote")
    assert "promotion gate refuses v1" in page.locator(".messages").inner_text()
    assert not AliasEvent.objects.filter(alias="production").exists()

    def promote(version: PolicyVersion, alias: str) -> str:
        page.goto(f"{base}/versions/{version.pk}/?against={alias}")
        page.once("dialog", lambda d: d.accept())
        page.select_option("#promote-form select[name=alias]", alias)
        page.click("#btn-promote")
        return str(page.locator(".messages").inner_text())

    assert "production → " in promote(v0, "production")  # the base model serves first
    page.goto(f"{base}/versions/{v2.pk}/?against=production")
    assert page.locator("#comparison tr.row-regression").count() == 0
    assert page.locator(".gate[data-alias=production]").inner_text().strip() == "production: gate passes"
    assert "production → " in promote(v2, "production")
    page.goto(f"{base}/versions/")
    assert "production → two domains v2" in page.locator(".version-section").inner_text()
    page.once("dialog", lambda d: d.accept())
    page.select_option(".version-section form select[name=alias]", "production")
    page.click(".version-section button.rollback")
    assert "production rolled back to" in page.locator(".messages").inner_text()
    assert "production → two domains v0" in page.locator(".version-section").inner_text()
    history = page.locator(".version-section details")
    history.locator("summary").click()
    assert history.locator("tbody tr").count() >= 3  # promote v0, promote v2 (+ previous), rollback
    assert not errors, errors
