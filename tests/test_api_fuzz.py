"""Fuzz every operation of the OpenAPI schema against a live server: no input may cause a server error."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import factories
from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_schema_fuzzing_finds_no_server_error(live_server_proc, user, tmp_path: Path):
    from rest_framework.authtoken.models import Token

    token = Token.objects.create(user=user)
    run = factories.run(user)  # real ids for path parameters to hit
    del run
    st = Path(sys.executable).with_name("st")
    result = subprocess.run(
        [str(st), "run", f"{live_server_proc.url}/api/v1/schema/", "-H", f"Authorization: Token {token.key}",
         "--checks", "not_a_server_error", "--max-examples", "12", "--seed", "7", "--no-shrink",
         "--generation-database", "none", "--phases", "examples,coverage,fuzzing", "--max-failures", "5",
         "--request-timeout", "20", "--workers", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:] + "\n--- server log ---\n" + live_server_proc.log_path.read_text()[-4000:]
    assert re.search(r"\d+ passed", output), output[-2000:]  # it really generated and ran cases
