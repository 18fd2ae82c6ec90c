"""Exporting policy versions: a LoRA adapter or a merged model, zipped with a manifest, downloadable."""

from __future__ import annotations

import io
import json
import tempfile
import zipfile
from pathlib import Path

import pytest

from tests import factories
from tests.policy.conftest import make_lora_version
from webapp.catalog.models import BaseModel
from webapp.runs.loop import paths
from webapp.runs.models import PolicyVersion
from webapp.runs.services import DomainWeight, do_create_run

pytestmark = [pytest.mark.django_db, pytest.mark.slow]
DEMO = Path(__file__).resolve().parent.parent / "assets" / "base-models" / "demo"


@pytest.fixture
def lora_version(user, settings, tmp_path):
    settings.ARTIFACTS_ROOT = str(tmp_path / "artifacts")
    bm = BaseModel.objects.create(owner=user, name="demo", path=str(DEMO))
    domain = factories.domain(user, verifier_row=factories.verifier(user))
    run = do_create_run(user, name="r", base_model=bm, domains=[DomainWeight(domain)])
    v0 = PolicyVersion.objects.create(run=run, number=0)
    v1 = PolicyVersion.objects.create(run=run, number=1, step=1, parent=v0)
    target = paths.version_dir(run.pk, 1)
    assert target is not None
    make_lora_version(DEMO, target, version=1, seed=1)
    factories.evaluation(v1, domain, [1.0, 0.0, 1.0])
    return v1


def test_merged_export_loads_as_a_plain_model_and_carries_a_manifest(api, lora_version):
    from transformers import AutoModelForCausalLM

    from workers.tasks.export import export_version

    before = api.get(f"/api/v1/policy-versions/{lora_version.pk}/export/?kind=merged")
    assert before.status_code == 409 and "no finished merged export" in before.json()["detail"]
    assert api.post(f"/api/v1/policy-versions/{lora_version.pk}/export/", {"kind": "merged"},
                    format="json").status_code == 202
    export_version(lora_version.pk, "merged")  # what the train worker runs
    response = api.get(f"/api/v1/policy-versions/{lora_version.pk}/export/?kind=merged")
    assert response.status_code == 200 and response["Content-Type"] == "application/zip"
    archive = zipfile.ZipFile(io.BytesIO(b"".join(response.streaming_content)))
    root = f"run{lora_version.run_id}-v1-merged"
    manifest = json.loads(archive.read(f"{root}/temper_manifest.json"))
    assert manifest["version"] == 1 and manifest["parent"] == 0 and manifest["base_model"]["name"] == "demo"
    assert manifest["evaluations"][0]["score"] == pytest.approx(2 / 3)
    target = Path(tempfile.mkdtemp())
    archive.extractall(target)
    model = AutoModelForCausalLM.from_pretrained(target / root)
    assert sum(p.numel() for p in model.parameters()) == 1_084_288
    lora_version.refresh_from_db()
    status = lora_version.metadata["exports"]["merged"]
    assert status["status"] == "done" and len(status["sha256"]) == 64


def test_adapter_export_and_refusals(api, lora_version):
    from workers.tasks.export import export_version

    export_version(lora_version.pk, "adapter")
    response = api.get(f"/api/v1/policy-versions/{lora_version.pk}/export/?kind=adapter")
    names = zipfile.ZipFile(io.BytesIO(b"".join(response.streaming_content))).namelist()
    assert any(n.endswith("adapter_config.json") for n in names)
    assert any(n.endswith("adapter_model.safetensors") for n in names)
    v0 = PolicyVersion.objects.get(run=lora_version.run, number=0)
    refused = api.post(f"/api/v1/policy-versions/{v0.pk}/export/", {"kind": "adapter"}, format="json")
    assert refused.status_code == 409 and "no adapter" in refused.json()["detail"]
    bad = api.post(f"/api/v1/policy-versions/{v0.pk}/export/", {"kind": "gguf"}, format="json")
    assert bad.status_code == 400
