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
    queues = {name: " ".join(services[name]["command"]) for name in ("worker-control", "worker-sandbox", "worker-gpu")}
    assert "-Q control" in queues["worker-control"]
    assert "-Q verify" in queues["worker-sandbox"]
    assert "-Q rollout,train" in queues["worker-gpu"]
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
