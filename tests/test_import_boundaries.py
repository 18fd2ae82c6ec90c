"""The import rules of ARCHITECTURE.md §3, checked in fresh interpreters by looking at sys.modules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def modules_after(code: str, env: dict[str, str] | None = None) -> set[str]:
    script = code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True, env=env)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def roots(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


@pytest.mark.parametrize("package", ["sandboxes", "workers.domains", "workers.environments", "workers.pipeline", "workers.policy",
                                     "workers.verifiers"])
def test_pure_packages_import_no_django_or_celery(package):
    code = f"import importlib, pkgutil, {package} as p\n" \
           "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n" \
           "    importlib.import_module(m.name)"
    loaded = roots(modules_after(code))
    assert "django" not in loaded and "celery" not in loaded and "rest_framework" not in loaded


@pytest.mark.parametrize("package", ["sandboxes", "workers.domains", "workers.environments", "workers.pipeline",
                                     "workers.verifiers"])
def test_light_packages_import_no_torch(package):
    code = f"import importlib, pkgutil, {package} as p\n" \
           "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n" \
           "    importlib.import_module(m.name)"
    assert "torch" not in roots(modules_after(code))


def test_web_process_imports_no_torch_or_vllm():
    code = (
        "import os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'webapp.settings')\n"
        "import webapp.asgi\n"
        "from django.urls import get_resolver; get_resolver().url_patterns\n"
        "import webapp.catalog.api, webapp.runs.api, webapp.catalog.admin, webapp.runs.admin"
    )
    loaded = roots(modules_after(code))
    assert "django" in loaded
    assert "torch" not in loaded and "vllm" not in loaded and "transformers" not in loaded


def test_engines_are_imported_lazily():
    loaded = modules_after("import workers.policy")
    assert "vllm" not in roots(loaded)


def test_the_import_layers_hold_and_webapp_never_imports_the_tasks():
    """The layers contract of pyproject.toml (also run by `make lint`): workers.tasks above webapp above
    workers.messages above the pure data plane above sandboxes; no cycle among the three packages."""
    out = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0 and "1 kept, 0 broken" in out.stdout, out.stdout[-3000:]


def test_a_gpu_worker_imports_neither_torch_nor_transformers_for_its_loop():
    """The GPU worker's tasks and the loop's modules: its device process does the device work
    (``workers.policy.device_process``), so the worker itself needs neither (an episode's tokenizer is
    loaded on first use)."""
    code = ("import os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'webapp.settings'); import django; "
            "django.setup(); import workers.celery, workers.gpu_worker, workers.tasks.rollout, workers.tasks.train; "
            "import webapp.runs.loop.generation, webapp.runs.loop.training, webapp.runs.loop.heldout")
    loaded = roots(modules_after(code))
    assert "torch" not in loaded and "transformers" not in loaded and "vllm" not in loaded
