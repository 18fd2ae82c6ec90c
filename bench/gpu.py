"""The first thing to run on a machine with a GPU: does Temper's policy stack work there, and how fast.

    python bench/gpu.py [--steps 20] [--skip-vllm]

Where CUDA exists it (1) loads the demo base model on the GPU (``TEMPER_DEVICE``, bf16 where supported),
(2) runs GRPO steps with the torch engine there and the same steps on the CPU as the baseline, (3) with
vLLM importable, runs the same GRPO steps through the vLLM engine, (4) hot-loads a trained LoRA version
into vLLM and checks that its greedy outputs agree with the torch engine's under the same version. Every
stage is timed and reported even when a later one fails (its error is printed; the exit code is 1).
On a machine without CUDA it says so and exits 0.

The last line is ``result: key=value ...``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _grpo(base: Path, work: Path, engine: Any, device: str, autocast: str, steps: int) -> dict[str, float]:
    from workers.policy.demo_loop import run_grpo
    from workers.policy.trainer import TrainerConfig

    cfg = TrainerConfig(lr=5e-4, lora_rank=16, seed=0, device=device, autocast=autocast)
    started = time.monotonic()
    report = run_grpo(base, work, engine=engine, config=cfg, max_steps=steps, time_budget_s=3600, seed=0,
                      eval_every=steps, heldout_size=100)
    seconds = time.monotonic() - started
    return {"steps": report.steps, "seconds": seconds, "steps_per_s": report.steps / seconds,
            "before": report.before, "after": report.after}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=str(REPO / "assets" / "base-models" / "demo"))
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per engine (16 prompts x 8 samples)")
    parser.add_argument("--cpu-steps", type=int, default=5, help="baseline steps on the CPU")
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from workers.policy.device import resolve, torch_dtype
    from workers.policy.engines import SamplingParams, load_engine

    if not torch.cuda.is_available():
        print(f"no CUDA: torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}) sees no GPU here; "
              "nothing to check. Run this on a GPU machine with requirements-gpu.txt installed.")
        print("result: cuda=false")
        return 0
    base = Path(args.base)
    where = resolve()
    rows: list[tuple[str, str, str]] = []
    result: dict[str, Any] = {"cuda": "true", "device": where.device, "dtype": where.dtype}
    failed = False
    print(f"device: {where.describe()}; torch {torch.__version__}, CUDA {torch.version.cuda}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # 1-2: the torch engine on the GPU, against the same loop on the CPU
        try:
            started = time.monotonic()
            gpu_engine = load_engine("torch", base, device=where.device, seed=0, dtype=torch_dtype(where))
            load_s = time.monotonic() - started
            gpu = _grpo(base, work / "torch-gpu", gpu_engine, where.device, where.dtype, args.steps)
            cpu_engine = load_engine("torch", base, device="cpu", seed=0)
            torch.set_num_threads(1)
            cpu = _grpo(base, work / "torch-cpu", cpu_engine, "cpu", "float32", args.cpu_steps)
            rows += [("torch engine: load on GPU", f"{load_s:.2f} s", ""),
                     ("torch GRPO steps/s (GPU vs CPU)", f"{gpu['steps_per_s']:.2f}", f"{cpu['steps_per_s']:.2f}"),
                     ("torch held-out before → after", f"{gpu['before']:.2f} → {gpu['after']:.2f}", "")]
            result.update(torch_load_s=round(load_s, 2), torch_gpu_steps_per_s=round(gpu["steps_per_s"], 3),
                          torch_cpu_steps_per_s=round(cpu["steps_per_s"], 3),
                          torch_gpu_vs_cpu=round(gpu["steps_per_s"] / cpu["steps_per_s"], 2))
        except Exception:
            failed = True
            traceback.print_exc()
            rows.append(("torch engine on the GPU", "FAILED", "see the traceback above"))
        # 3-4: vLLM, its LoRA hot-load, and agreement with the torch engine under the same version
        if not args.skip_vllm:
            try:
                import vllm  # noqa: F401

                started = time.monotonic()
                engine = load_engine("vllm", base, device=where.device, seed=0, dtype=where.dtype)
                load_s = time.monotonic() - started
                out = _grpo(base, work / "vllm", engine, where.device, where.dtype, args.steps)
                version = sorted((work / "vllm").glob("v*"))[-1]
                prompts = [f"{a}+{b}=" for a in range(10, 40) for b in (11, 57)]
                greedy = SamplingParams(temperature=0.0, max_tokens=6)
                started = time.monotonic()
                engine.set_version(version)
                via_vllm = [s.text for s in engine.generate(prompts, greedy)]
                hotload_ms = (time.monotonic() - started) * 1000
                reference = load_engine("torch", base, device=where.device, seed=0, dtype=torch_dtype(where))
                reference.set_version(version)
                via_torch = [s.text for s in reference.generate(prompts, greedy)]
                agreement = sum(a == b for a, b in zip(via_vllm, via_torch, strict=True)) / len(prompts)
                rows += [("vllm engine: load", f"{load_s:.2f} s", ""),
                         ("vllm GRPO steps/s (vs torch on the GPU)", f"{out['steps_per_s']:.2f}",
                          f"{result.get('torch_gpu_steps_per_s', float('nan')):.2f}"),
                         ("vllm LoRA hot-load + first greedy batch", f"{hotload_ms:.0f} ms", ""),
                         ("greedy agreement vllm vs torch, same version", f"{agreement:.1%}", "")]
                result.update(vllm_load_s=round(load_s, 2), vllm_steps_per_s=round(out["steps_per_s"], 3),
                              lora_hotload_ms=round(hotload_ms, 1), greedy_agreement=round(agreement, 3))
                close = getattr(engine, "close", None)
                if callable(close):
                    close()
            except ImportError as exc:
                rows.append(("vllm", "not installed", str(exc)[:60]))
                result["vllm"] = "missing"
            except Exception:
                failed = True
                traceback.print_exc()
                rows.append(("vllm engine on the GPU", "FAILED", "see the traceback above"))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'check':<{width}}  {'ours (GPU)':>16}  {'baseline':>12}")
    for name, ours, baseline in rows:
        print(f"{name:<{width}}  {ours:>16}  {baseline:>12}")
    print("result: " + " ".join(f"{k}={v}" for k, v in result.items()) + f" ok={'false' if failed else 'true'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
