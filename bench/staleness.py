"""What a version of staleness costs the demo job's learning: the bare loop on-policy and with one version of lag.

    .venv/bin/python bench/staleness.py [--seeds 0,1,2] [--lags 0,1] [--max-steps 400]

The demo job of ``bench/demo.py`` (``DEMO_RUN_SPEC``'s trainer settings, the full system's own train and
held-out tasks) through ``workers.policy.demo_loop.run_grpo``, once per seed and lag: ``lag`` n trains each
step on a batch sampled n versions before the newest, what the asynchronous pipeline allows with
``max_staleness`` n. For each: the steps to +40 points of held-out accuracy (evaluated every 10 steps; none
when ``--max-steps`` passes first). One torch thread, as the bare side of ``bench/demo.py``.

Why it matters: with one device, generation and training take turns on it, so lag hides only the
bookkeeping between them (verification, database writes: ~25 ms a step on the demo) while it changes what
is learnt per step. The last line is ``result: steps_lag0=… steps_lag1=… ratio=…`` (the mean steps, a run
that never got there counted at ``--max-steps``; ``ratio`` = lag 1 over lag 0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GAIN = 0.40


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--lags", default="0,1")
    parser.add_argument("--max-steps", type=int, default=400)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    lags = [int(n) for n in args.lags.split(",")]

    import torch
    import transformers
    from tqdm import tqdm

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()
    from webapp.common.management.commands.seed_demo import DEMO_RUN_SPEC as spec
    from workers.policy.demo_loop import run_grpo
    from workers.policy.demo_tasks import _split_pool
    from workers.policy.trainer import TrainerConfig

    a, p = spec["algorithm"], spec["pipeline"]
    train = [{"prompt": q, "answer": x} for q, x in _split_pool("addition", "train")]
    heldout = [{"prompt": q, "answer": x} for q, x in _split_pool("addition", "heldout")[: spec["eval_tasks"]]]
    steps: dict[tuple[int, int], int | None] = {}
    seconds: dict[tuple[int, int], float] = {}
    with tqdm(total=len(seeds) * len(lags), unit="run", desc="bare loop") as bar:
        for seed in seeds:
            for lag in lags:
                config = TrainerConfig(lr=a["learning_rate"], lora_rank=a["lora_rank"], clip_low=a["clip_low"],
                                       clip_high=a["clip_high"], num_minibatches=a["updates_per_batch"],
                                       micro_batch_size=a["micro_batch_size"], seed=seed)
                started = time.monotonic()
                with tempfile.TemporaryDirectory() as tmp:
                    report = run_grpo(REPO / "assets/base-models/demo", tmp, config=config, max_steps=args.max_steps,
                                      time_budget_s=1e9, prompts_per_step=p["batch_prompts"],
                                      group_size=p["group_size"], eval_every=spec["eval_every"], seed=seed,
                                      early_stop_gain=GAIN, train_rows=train, heldout_rows=heldout, lag=lag,
                                      stop=tuple(spec["sampling"].get("stop", ())))
                seconds[seed, lag] = time.monotonic() - started
                steps[seed, lag] = report.steps if report.after >= report.before + GAIN - 1e-9 else None
                bar.update()

    print(f"\nsteps to +{GAIN:.0%} held-out (the demo job, bare loop; '-' = not within {args.max_steps})")
    print(f"{'seed':>6}" + "".join(f"{f'lag {n}':>10}" for n in lags))
    for seed in seeds:
        print(f"{seed:>6}" + "".join(f"{steps[seed, n] if steps[seed, n] else '-':>10}" for n in lags))
    means = {n: statistics.mean(steps[s, n] or args.max_steps for s in seeds) for n in lags}
    print(f"{'mean':>6}" + "".join(f"{means[n]:>10.0f}" for n in lags))
    print(f"{'s/run':>6}" + "".join(f"{statistics.mean(seconds[s, n] for s in seeds):>10.1f}" for n in lags))
    figures = " ".join(f"steps_lag{n}={means[n]:.0f}" for n in lags)
    ratio = f" ratio={means[1] / means[0]:.2f}" if 0 in means and 1 in means else ""
    print(f"result: {figures}{ratio} seeds={len(seeds)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
