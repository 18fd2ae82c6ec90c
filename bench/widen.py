"""A wider copy of the demo base model that computes the same function: the same answers, more device work.

    .venv/bin/python bench/widen.py [--factor 4] [--out var/bench-models/demo-x4]

``bench/pipeline.py --base-model DIR`` then runs its comparison on it. *Why:* the demo model spends ~1.7 ms
of device time on a trajectory, less than the machinery spends on it in CPU (writes, messages, the judge's
HTTP), so on this 2-core machine its GPU-busy fraction measures how the staleness window holds the judge's
tail (docs/ARCHITECTURE.md, "What the machinery costs per step"); a model whose trajectories cost the
device more, as any real model's do on a real accelerator, shows what the pipeline does where the device
is the expensive part. A random model would not do: every verdict would fail, every group would have zero
variance and nothing would train.

The widening pads with zeros (Net2Net's function-preserving growth): the hidden size, the MLP and the
attention heads grow by ``--factor``; the new embedding columns, the new heads' query, key and value rows
and biases, and the new MLP units' rows are zero, and so are the columns of ``o_proj``, ``down_proj`` and
the projections that read them. The hidden state's new dimensions therefore stay zero, every new head
attends to zero values and every new unit outputs zero; RMSNorm's mean over the wider hidden state is
restored by scaling its weights by sqrt(old/new) and its epsilon by old/new. The new units' gradients are
zero too (each is multiplied by a zero), so a run on the wide model learns what a run on the demo model
does, step for step, up to float rounding, while each matrix product costs ~factor² more.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SOURCE = REPO / "assets" / "base-models" / "demo"


def pad(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` in the top-left corner of a zero tensor of ``shape``."""
    import torch

    out = torch.zeros(shape, dtype=t.dtype)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def widen(source: Path, out: Path, factor: int) -> dict[str, int]:
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    if config.get("model_type") != "qwen2":
        raise SystemExit(f"{source}: widen knows Qwen2 models, not {config.get('model_type')!r}")
    h, i, heads, kv = (config["hidden_size"], config["intermediate_size"], config["num_attention_heads"],
                       config["num_key_value_heads"])
    hd = config.get("head_dim") or h // heads
    if kv != heads:
        raise SystemExit(f"{source}: widen keeps one key/value head per query head ({heads} vs {kv})")
    H, M, N = h * factor, i * factor, heads * factor  # wide hidden, MLP and head counts
    norm_scale = math.sqrt(h / H)
    sd = load_file(str(source / "model.safetensors"))
    wide: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name == "model.embed_tokens.weight" or name == "lm_head.weight":
            wide[name] = pad(t, (t.shape[0], H))
        elif name.endswith("layernorm.weight") or name == "model.norm.weight":
            wide[name] = pad(t * norm_scale, (H,))
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            wide[name] = pad(t, (N * hd, H))
        elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            wide[name] = pad(t, (N * hd,))
        elif name.endswith("o_proj.weight"):
            wide[name] = pad(t, (H, N * hd))
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            wide[name] = pad(t, (M, H))
        elif name.endswith("down_proj.weight"):
            wide[name] = pad(t, (H, M))
        else:
            raise SystemExit(f"{source}: widen does not know the parameter {name} {tuple(t.shape)}")
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in wide.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.update({"hidden_size": H, "intermediate_size": M, "num_attention_heads": N, "num_key_value_heads": N,
                   "head_dim": hd, "rms_norm_eps": config["rms_norm_eps"] * h / H})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (source / name).exists():
            shutil.copyfile(source / name, out / name)
    return {"hidden": H, "intermediate": M, "heads": N,
            "parameters": sum(t.numel() for t in wide.values()), "source_parameters": sum(t.numel() for t in sd.values())}


def check(source: Path, out: Path) -> float:
    """The largest difference between the two models' log-probabilities on a few prompts (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source))
    ids = tok(["12+34=", "7+8=", "99+1="], return_tensors="pt", padding=True)
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(str(source)).eval()(**ids).logits.log_softmax(-1)
        b = AutoModelForCausalLM.from_pretrained(str(out)).eval()(**ids).logits.log_softmax(-1)
    mask = ids["attention_mask"].bool()
    return float((a - b).abs()[mask].max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factor", type=int, default=4, help="how many times wider (hidden, MLP, heads)")
    parser.add_argument("--source", type=Path, default=SOURCE)
    parser.add_argument("--out", type=Path, default=None, help="default var/bench-models/demo-x<factor>")
    args = parser.parse_args()
    if args.factor < 1:
        raise SystemExit("--factor must be at least 1")
    out = args.out or REPO / "var" / "bench-models" / f"demo-x{args.factor}"
    sizes = widen(args.source, out, args.factor)
    diff = check(args.source, out)
    print(f"{out}: hidden {sizes['hidden']}, MLP {sizes['intermediate']}, {sizes['heads']} heads; "
          f"{sizes['parameters']:,} parameters (the demo's {sizes['source_parameters']:,})")
    print(f"largest log-prob difference from {args.source.name}: {diff:.2e}")
    if diff > 1e-3:
        raise SystemExit("the wide model does not compute the demo model's function")
    print(f"result: factor={args.factor} parameters={sizes['parameters']} max_logprob_diff={diff:.2e}")


if __name__ == "__main__":
    main()
