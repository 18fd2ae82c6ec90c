"""docker-compose.yml and the requirement files stay true to the code (no Docker engine runs here)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_has_every_process_with_health_checks():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"postgres", "redis", "web", "worker-control", "worker-gpu", "worker-sandbox", "beat"}
    for name, service in services.items():
        assert "healthcheck" in service, name
    assert services["worker-gpu"]["build"]["dockerfile"] == "Dockerfile.gpu"
    assert services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    for name in ("web", "worker-control", "worker-sandbox", "worker-gpu"):
        assert "/artifacts" in services[name]["volumes"][0]
        assert services[name]["environment"]["ARTIFACTS_ROOT"] == "/artifacts"


def pins(path: str) -> dict[str, str]:
    found = {}
    for line in (ROOT / path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if match := re.match(r"^([A-Za-z0-9_.\-\[\]]+)==(\S+)$", line):
            found[match.group(1).split("[")[0].lower()] = match.group(2)
    return found


def test_requirements_are_pinned_and_split_by_weight():
    cpu, gpu = pins("requirements.txt"), pins("requirements-gpu.txt")
    assert cpu["torch"] == "2.13.0" and "vllm" not in cpu
    assert gpu["vllm"].startswith("0.33") and gpu["torch"] == "2.14.0"
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        assert not line or "==" in line, f"unpinned requirement: {line}"


def test_compose_runs_the_roles_of_manage_py_up_and_nothing_else():
    """One deployment definition: every Temper service is `manage.py up --role NAME`, one per role."""
    from webapp.common.management.commands.up import ROLES

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    ours = {name: s for name, s in services.items() if name not in ("postgres", "redis")}
    assert set(ours) == {r.name for r in ROLES}
    for name, service in ours.items():
        command = service["command"]
        assert command[:5] == ["python", "manage.py", "up", "--role", name], (name, command)
        extra = command[5:]
        assert all(flag in ("--host", "--port") for flag in extra[::2]), (name, extra)
    # what `make run` starts: the same roles, their queues and pools from the one table
    argv = {r.name: " ".join(r.argv) for r in ROLES}
    assert "-Q control" in argv["worker-control"]
    assert "-Q verify" in argv["worker-sandbox"]
    assert "-Q rollout,train" in argv["worker-gpu"] and "--pool threads" in argv["worker-gpu"]
    assert services["worker-gpu"]["environment"]["TEMPER_DEVICE"] == "cuda"


def test_up_role_runs_exactly_the_roles_command(tmp_path):
    """`up --role` execs the role's process: shown here with the beat role's printed command line."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "manage.py", "up", "--role", "beat", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert "--role {worker-control,beat,worker-gpu,worker-sandbox,web}" in out.stdout
    from webapp.common.management.commands.up import ROLES, role_argv

    beat = next(r for r in ROLES if r.name == "beat")
    assert role_argv(beat, host="h", port=1, verify_concurrency=2, var=str(tmp_path))[1:] == [
        "-m", "celery", "-A", "workers.celery", "beat", "-l", "INFO", "-s", f"{tmp_path}/celerybeat-schedule"]
