"""Policy versions on disk: save, load, apply in place, export merged.

A version directory holds either
  - a LoRA adapter in peft's format (``adapter_config.json`` + ``adapter_model.safetensors``), which vLLM
    also loads directly as a ``LoRARequest``; or
  - full weights (``model.safetensors`` + ``config.json``, a Hugging Face model directory),
plus ``metadata.json``: format, kind, version number, parent version, train step, base model, run-spec
hash, creation time and a sha256 of every weight file.

Not covered: sharded checkpoints, optimizer state (a resumed trainer starts a fresh AdamW), remote stores
(the artifact store is a directory that may be shared between machines).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from workers.policy.engines import read_version_number

__all__ = [
    "ResidentPolicy",
    "VersionMetadata",
    "export_merged",
    "load_version",
    "read_metadata",
    "read_version_number",
    "save_version",
]

FORMAT = "temper-policy-version/1"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class VersionMetadata:
    kind: Literal["lora", "full"]
    version: int
    parent: int | None
    step: int
    base_model: str
    spec_hash: str | None = None
    created_at: float = 0.0
    format: str = FORMAT
    files: dict[str, str] | None = None


def _is_peft(model: Any) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:  # read in small buffers: a large model's weights are not read into memory whole
        return hashlib.file_digest(f, "sha256").hexdigest()


def save_version(
    model: Any,
    out_dir: str | Path,
    *,
    base_model_dir: str | Path,
    version: int,
    parent: int | None,
    step: int,
    spec_hash: str | None = None,
) -> VersionMetadata:
    """Write ``model`` (a peft model -> its adapter; a plain model -> full weights) as a version directory.

    The directory is written under a temporary name and renamed into place, so a reader never sees a
    half-written version.
    """
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    kind: Literal["lora", "full"] = "lora" if _is_peft(model) else "full"
    model.save_pretrained(tmp, safe_serialization=True)
    if kind == "lora":
        # peft records the base path it was built from; point it at the base this version belongs to.
        cfg_path = tmp / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["base_model_name_or_path"] = str(base_model_dir)
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    else:
        from workers.policy.demo_model import fix_up_hf_files

        fix_up_hf_files(tmp)
    (tmp / "README.md").unlink(missing_ok=True)  # peft's model-card stub says nothing about this version
    for f in tmp.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; engines on other machines or users read the artifact store
    files = {p.name: _sha256(p) for p in sorted(tmp.glob("*.safetensors"))}
    meta = VersionMetadata(
        kind=kind,
        version=version,
        parent=parent,
        step=step,
        base_model=str(base_model_dir),
        spec_hash=spec_hash,
        created_at=time.time(),
        files=files,
    )
    (tmp / "metadata.json").write_text(json.dumps(asdict(meta), indent=2, sort_keys=True) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return meta


def read_metadata(version_dir: str | Path) -> VersionMetadata:
    path = Path(version_dir) / "metadata.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: {version_dir} is not a policy version directory")
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown format {data.get('format')!r}, expected {FORMAT!r}")
    return VersionMetadata(**data)


def _adapter_state(version_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(version_dir / "adapter_model.safetensors"))


def _full_state(version_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(version_dir / "model.safetensors"))


def load_version(
    base_model_dir: str | Path,
    version_dir: str | Path,
    device: str = "cpu",
    trainable: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A fresh model for a version: a PeftModel over the base for LoRA, the full model otherwise."""
    from transformers import AutoModelForCausalLM

    meta = read_metadata(version_dir)
    model: Any
    if meta.kind == "full":
        model = AutoModelForCausalLM.from_pretrained(version_dir, dtype=dtype)
    else:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=dtype)
        model = PeftModel.from_pretrained(base, str(version_dir), is_trainable=trainable)
    model = model.to(device)
    return model.train() if trainable else model.eval()


class ResidentPolicy:
    """A base model kept in memory, with policy versions applied to it in place.

    LoRA versions: the base is wrapped once in a peft model whose adapter tensors are overwritten by each
    new version (re-wrapped only when the adapter's configuration changes). Full versions: one pristine
    copy of the base state is kept so the engine can go back to the base or to a LoRA version.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._lora_config: dict[str, Any] | None = None
        self._pristine: dict[str, torch.Tensor] | None = None
        self._full_loaded = False

    def _base(self) -> Any:
        if _is_peft(self.model):
            return self.model.get_base_model()
        return self.model

    def _restore_base_weights(self) -> None:
        if self._full_loaded and self._pristine is not None:
            self._base().load_state_dict(self._pristine, strict=True)
            self._full_loaded = False

    def _drop_adapter(self) -> None:
        if _is_peft(self.model):
            self.model = self.model.unload()  # removes the LoRA layers; the base is untouched (never merged)
            self._lora_config = None

    def apply(self, version_dir: str | Path | None) -> None:
        if version_dir is None:
            self._drop_adapter()
            self._restore_base_weights()
            return
        vdir = Path(version_dir)
        meta = read_metadata(vdir)
        if meta.kind == "full":
            self._drop_adapter()
            if self._pristine is None:
                self._pristine = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            state = _full_state(vdir)
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            # Tied embeddings are saved once; anything else missing means the version does not fit the base.
            missing = [k for k in missing if k != "lm_head.weight"]
            if missing or unexpected:
                raise ValueError(
                    f"{vdir}: weights do not fit the base model (missing {missing}, unexpected {unexpected})"
                )
            self._full_loaded = True
            return
        self._restore_base_weights()
        config = json.loads((vdir / "adapter_config.json").read_text())
        comparable = {k: v for k, v in config.items() if k not in ("base_model_name_or_path", "revision")}
        if self._lora_config != comparable:
            from peft import LoraConfig, get_peft_model

            self._drop_adapter()
            peft_config = LoraConfig.from_pretrained(str(vdir))
            peft_config.inference_mode = True
            self.model = get_peft_model(self.model, peft_config).eval()
            self._lora_config = comparable
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, _adapter_state(vdir))
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise ValueError(f"{vdir}: adapter tensors do not fit the model: {unexpected[:5]}")
        self.model.eval()


def export_merged(
    version_dir: str | Path, out_dir: str | Path, base_model_dir: str | Path | None = None
) -> Path:
    """Write a plain Hugging Face model directory (weights merged, tokenizer copied) for a version.

    Loads with ``AutoModelForCausalLM.from_pretrained(out_dir)``; serve it anywhere a normal model goes.
    """
    vdir = Path(version_dir)
    meta = read_metadata(vdir)
    base_dir = Path(base_model_dir or meta.base_model)
    model = load_version(base_dir, vdir)
    if meta.kind == "lora":
        model = model.merge_and_unload()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (base_dir / name).exists():
            shutil.copy2(base_dir / name, out / name)
    from workers.policy.demo_model import fix_up_hf_files

    fix_up_hf_files(out)
    (out / "temper_version.json").write_text(json.dumps(asdict(meta), indent=2, sort_keys=True) + "\n")
    return out
