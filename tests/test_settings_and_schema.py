"""Production settings pass ``check --deploy``; the OpenAPI schema is valid OpenAPI 3."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def manage(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_check_deploy_is_clean_with_production_values(tmp_path):
    env = {"DEBUG": "0", "SECRET_KEY": "x" * 64 + "-production-secret-key-with-entropy-9f8e7d",
           "ALLOWED_HOSTS": "temper.example.org", "TEMPER_VAR_DIR": str(tmp_path)}
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_check_deploy_complains_in_debug(tmp_path):
    result = manage("check", "--deploy", "--fail-level", "WARNING", env={"DEBUG": "1", "TEMPER_VAR_DIR": str(tmp_path)})
    assert result.returncode != 0 and "DEBUG" in result.stdout + result.stderr


def test_secret_key_is_generated_once(tmp_path):
    env = {"TEMPER_VAR_DIR": str(tmp_path)}
    env_no_key = {k: v for k, v in os.environ.items() if k != "SECRET_KEY"} | env
    subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env_no_key, check=True, capture_output=True)
    key = (tmp_path / "secret_key").read_text()
    subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env_no_key, check=True, capture_output=True)
    assert (tmp_path / "secret_key").read_text() == key and len(key) > 40


def test_openapi_schema_is_valid(tmp_path):
    out = tmp_path / "schema.yaml"
    result = manage("spectacular", "--validate", "--fail-on-warn", "--file", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    schema = yaml.safe_load(out.read_text())
    assert schema["openapi"].startswith("3.")
    for path in ("/api/v1/runs/{id}/start/", "/api/v1/domains/{id}/import/", "/api/v1/metrics/",
                 "/api/v1/trajectories/", "/api/v1/policy-versions/{id}/promote/", "/api/v1/verifiers/{id}/calibrate/"):
        assert path in schema["paths"], path


@pytest.mark.django_db
def test_schema_and_docs_are_served_to_logged_in_users(api, client):
    assert api.get("/api/v1/schema/").status_code == 200
    assert client.get("/api/v1/docs/").status_code == 302  # login required
