"""A synchronous GRPO loop over the policy pieces alone (engine, exact-match scorer, trainer, versions).

No Celery, no database: sample G completions per prompt with an engine, score them, train one step, save a
policy version and switch the engine to it, evaluate held-out greedy exact match now and then. It is the
smallest end-to-end proof that the pieces improve the demo model, used by the slow test, the benchmark and
people trying the stack (``python -m workers.policy.demo_loop``).

Not covered: asynchronous pipelining, staleness control, invalid verdicts, multiple domains per batch —
the Celery pipeline does those.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.policy.demo_model import demo_tasks, exact_match
from workers.policy.engines import Engine, SamplingParams, load_engine
from workers.policy.trainer import Group, Trainer, TrainerConfig


@dataclass
class LoopReport:
    before: float
    after: float
    best: float
    steps: int
    seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)
    collapsed: bool = False
    collapse_step: int | None = None
    collapse_reason: str | None = None


def heldout_accuracy(engine: Engine, rows: list[dict[str, str]], max_tokens: int = 6,
                     stop: tuple[str, ...] = ()) -> float:
    out = engine.generate([r["prompt"] for r in rows],
                          SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop))
    return sum(exact_match(s.text, r["answer"]) for s, r in zip(out, rows, strict=True)) / len(rows)


def run_grpo(
    base_model_dir: str | Path,
    work_dir: str | Path,
    *,
    engine: Engine | None = None,
    engine_name: str = "torch",
    domain: str = "addition",
    config: TrainerConfig | None = None,
    prompts_per_step: int = 16,
    group_size: int = 8,
    max_steps: int = 400,
    time_budget_s: float = 240.0,
    target: float | None = None,
    early_stop_gain: float | None = None,
    stop_on_collapse: bool = False,
    eval_every: int = 10,
    heldout_size: int = 200,
    seed: int = 0,
    progress: Callable[[dict[str, Any]], None] | None = None,
    train_rows: list[dict[str, str]] | None = None,
    heldout_rows: list[dict[str, str]] | None = None,
    lag: int = 0,
    stop: tuple[str, ...] = (),
) -> LoopReport:
    """Run GRPO on one demo domain until ``max_steps``, ``time_budget_s``, held-out >= ``target`` or
    held-out >= the starting accuracy + ``early_stop_gain``.

    Evaluation time counts towards the budget. Returns held-out greedy exact match before and after.
    ``lag``: train each step on a batch sampled ``lag`` versions before the newest, as the asynchronous
    pipeline may (``max_staleness``); 0 is on-policy. ``stop``: the sampling's stop strings, as a run's
    ``sampling.stop`` (the demo run stops at a newline: bench/demo.py passes it, or a sample that emits one
    and then end-of-text trains on that token here and not in the full system).
    """
    started = time.monotonic()
    cfg = config or TrainerConfig(seed=seed)
    eng = engine or load_engine(engine_name, base_model_dir, seed=seed)
    eng.set_version(None)
    trainer = Trainer(base_model_dir, cfg)
    # ``train_rows``/``heldout_rows``: the tasks a caller wants (bench/demo.py passes the full system's own)
    heldout = heldout_rows or demo_tasks(domain, heldout_size, seed=seed, split="heldout")
    if train_rows is None:
        train_rows = demo_tasks(domain, prompts_per_step * max_steps, seed=seed, split="train")
    elif len(train_rows) < prompts_per_step * max_steps:  # the stream goes round, as the loop's admission does
        train_rows = (train_rows * (prompts_per_step * max_steps // len(train_rows) + 1))[:prompts_per_step * max_steps]
    before = best = after = heldout_accuracy(eng, heldout, stop=stop)
    report = LoopReport(before=before, after=before, best=before, steps=0, seconds=0.0)
    if early_stop_gain is not None:
        target = min(target if target is not None else 1.0, before + early_stop_gain)
    spec = SamplingParams(n=group_size, temperature=cfg.temperature, max_tokens=6, stop=stop)
    work = Path(work_dir)

    def sample_batch(step: int) -> list[Group]:
        rows = train_rows[(step - 1) * prompts_per_step : step * prompts_per_step]
        samples = eng.generate([r["prompt"] for r in rows], spec)
        groups = []
        for i, row in enumerate(rows):
            chunk = samples[i * group_size : (i + 1) * group_size]
            groups.append(Group(samples=chunk, rewards=[exact_match(s.text, row["answer"]) for s in chunk]))
        return groups

    sampled = [sample_batch(step) for step in range(1, lag + 1)]
    for step in range(1, max_steps + 1):
        sampled.append(sample_batch(step + lag) if (step + lag) * prompts_per_step <= len(train_rows) else [])
        groups = sampled.pop(0)
        metrics = trainer.train_step(groups)
        vdir = work / f"v{trainer.version + 1:05d}"
        trainer.save_version(vdir)
        eng.set_version(vdir)
        info: dict[str, Any] = {
            "step": step,
            "reward": sum(sum(r for r in g.rewards if r is not None) for g in groups)
            / (len(groups) * group_size),
            "loss": metrics.loss,
            "clip": metrics.clip_fraction,
            "elapsed": time.monotonic() - started,
        }
        if metrics.collapsed and not report.collapsed:
            report.collapsed, report.collapse_step = True, step
            report.collapse_reason = metrics.collapse_reason
            info["collapse"] = metrics.collapse_reason
        last = step == max_steps or time.monotonic() - started > time_budget_s
        if step % eval_every == 0 or last:
            evaluated = time.monotonic()
            after = heldout_accuracy(eng, heldout, stop=stop)
            best = max(best, after)
            info["heldout"] = after
            info["eval_s"] = time.monotonic() - evaluated
        report.history.append(info)
        if progress is not None:
            progress(info)
        report.steps = step
        if stop_on_collapse and report.collapsed:
            after = heldout_accuracy(eng, heldout, stop=stop)
            break
        if last or (target is not None and "heldout" in info and after >= target):
            break
    report.after, report.best = after, best
    report.seconds = time.monotonic() - started
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Run a short synchronous GRPO loop on the demo model.")
    parser.add_argument("--base", default="assets/base-models/demo")
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    parser.add_argument("--budget", type=float, default=240.0, help="seconds")
    parser.add_argument(
        "--full", action="store_true", help="full fine-tune (lr 1e-4) instead of LoRA (lr 5e-4)"
    )
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (ignored with --full)")
    parser.add_argument("--alpha", type=int, default=32, help="LoRA alpha")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 is fastest for the tiny model)"
    )
    parser.add_argument("--stop", default="\\n", help="stop string of every generation, with backslash escapes; "
                        "the demo run's sampling.stop is a newline (default); '' for none")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    lr = args.lr if args.lr is not None else (1e-4 if args.full else 5e-4)
    cfg = TrainerConfig(lr=lr, lora_rank=0 if args.full else args.rank, lora_alpha=args.alpha, seed=args.seed)

    def show(info: dict[str, Any]) -> None:
        print(
            " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items()),
            file=sys.stderr,
        )

    with tempfile.TemporaryDirectory() as tmp:
        rep = run_grpo(
            args.base,
            tmp,
            engine_name=args.engine,
            config=cfg,
            time_budget_s=args.budget,
            seed=args.seed,
            progress=show,
            stop=(args.stop.encode("latin-1", "backslashreplace").decode("unicode_escape"),) if args.stop else (),
        )
    print(
        f"held-out exact match {rep.before:.1%} -> {rep.after:.1%} (best {rep.best:.1%}) in {rep.steps} steps, "
        f"{rep.seconds:.0f} s{' — collapse reported' if rep.collapsed else ''}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
