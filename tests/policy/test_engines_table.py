"""The engine table: lazy imports, clear errors, and no Django/Celery anywhere in workers.policy."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.policy.conftest import REPO
from workers.policy.engines import ENGINES, Engine, load_engine


def _modules_after(code: str) -> set[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_engine_table_is_lazy() -> None:
    mods = _modules_after("import workers.policy.engines")
    assert not {"torch", "vllm", "transformers"} & mods


def test_policy_package_imports_no_django_celery_or_vllm() -> None:
    mods = _modules_after(
        "import workers.policy.torch_engine, workers.policy.trainer, workers.policy.versions, "
        "workers.policy.losses, workers.policy.demo_model, workers.policy.demo_loop, workers.policy.vllm_engine"
    )
    assert not {m for m in mods if m.split(".")[0] in {"django", "celery", "vllm"}}


def test_table_names_and_errors(demo_dir: object) -> None:
    assert ENGINES == {
        "torch": "workers.policy.torch_engine.TorchEngine",
        "vllm": "workers.policy.vllm_engine.VLLMEngine",
    }
    with pytest.raises(ValueError, match="unknown engine 'tpu'"):
        load_engine("tpu", "nowhere")
    engine = load_engine("torch", demo_dir)  # type: ignore[arg-type]
    assert isinstance(engine, Engine) and engine.version == 0


def test_chat_template_is_applied_when_the_tokenizer_has_one(demo_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from workers.policy.engines import SamplingParams, encode_prompts
    from workers.policy.torch_engine import TorchEngine

    chat_dir = tmp_path / "chat"
    shutil.copytree(demo_dir, chat_dir)
    cfg_path = chat_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}Q:{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    cfg_path.write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(chat_dir)
    assert encode_prompts(tok, ["1+2="]) == [tok.encode("Q:1+2=A:", add_special_tokens=False)]
    sample = TorchEngine(chat_dir).generate(["1+2="], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert sample.prompt == "1+2=" and sample.prompt_token_ids == tok.encode(
        "Q:1+2=A:", add_special_tokens=False
    )
    plain = AutoTokenizer.from_pretrained(demo_dir)
    assert encode_prompts(plain, ["1+2="]) == [plain.encode("1+2=")]
