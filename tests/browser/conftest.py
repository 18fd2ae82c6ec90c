"""Playwright driving Debian's Chromium (``/usr/bin/chromium``, installed by ``make system-deps``).

No browser download: Playwright's own Chromium cannot be fetched here, and Debian's is the one CI has.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("TEMPER_CHROMIUM", "/usr/bin/chromium")
# Without the background-networking flags Chromium keeps dialling Google's hosts, which this machine refuses.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update", "--disable-dev-shm-usage"]


def launch_chromium(playwright: Any, tmp_path: Path) -> Any:
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    # Playwright's sync API runs an event loop in this thread; the test's own ORM calls are still
    # synchronous and sequential, which is what Django's guard exists to protect.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "1")
    if not (shutil.which(CHROMIUM) or Path(CHROMIUM).exists()):
        pytest.fail(f"{CHROMIUM} is missing: run `make system-deps` (apt-get install chromium) as root")
    from django.db import connections
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = launch_chromium(p, tmp_path)
        yield chromium
        chromium.close()
        # The test's ORM calls ran in the context Playwright's sync API set up, so on connections of their own
        # (Django keeps one per context), which pytest-django does not close: left open, one outlived the
        # session and PostgreSQL refused to drop the test database ("being accessed by other users").
        connections.close_all()


def log_in(page: Any, base_url: str, username: str, password: str) -> None:
    page.goto(f"{base_url}/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base_url}/")
