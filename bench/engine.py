"""Benchmark: torch engine sampling vs plain ``model.generate`` on the same prompts, and trainer throughput.

    python bench/engine.py [--base assets/base-models/demo] [--prompts 16] [--n 8] [--max-tokens 16]

Both generators sample the same prompts (n samples each, temperature 1, stop at end-of-text, KV cache);
tokens/s counts generated tokens up to and including end-of-text, median of ``--repeats`` timed runs after
one warm-up. The engine additionally records behaviour log-probs, which ``generate`` does not. Trained
tokens/s is one GRPO train step (LoRA, two minibatch updates) over those samples. The last line is
``result: key=value ...`` for scripts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=str(REPO / "assets" / "base-models" / "demo"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from workers.policy.demo_model import demo_tasks, exact_match
    from workers.policy.engines import SamplingParams
    from workers.policy.torch_engine import TorchEngine
    from workers.policy.trainer import Group, Trainer, TrainerConfig

    torch.set_num_threads(args.threads)
    rows = demo_tasks("addition", args.prompts, seed=0, split="heldout")
    prompts = [r["prompt"] for r in rows]
    engine = TorchEngine(args.base, seed=0)
    model, tok = engine.model, engine.tokenizer
    spec = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens)

    def run_engine() -> int:
        return sum(len(s.completion_token_ids) for s in engine.generate(prompts, spec))

    tok.padding_side = "left"
    enc = tok(
        [p for p in prompts for _ in range(args.n)],
        return_tensors="pt",
        padding=True,
        add_special_tokens=True,
    )
    width = enc["input_ids"].shape[1]

    @torch.no_grad()
    def run_generate() -> int:
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=args.max_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        new = out[:, width:]
        count = 0
        for row in new.tolist():
            for t in row:
                count += 1
                if t == tok.eos_token_id:
                    break
        return count

    def rate(fn: Callable[[], int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        tokens = fn()
        return tokens / (time.perf_counter() - t0), tokens

    # Interleave the two so that load from other processes on a shared machine hits both alike.
    run_engine(), run_generate()
    eng_rates, gen_rates = [], []
    eng_tokens = gen_tokens = 0
    for _ in range(args.repeats):
        r, eng_tokens = rate(run_engine)
        eng_rates.append(r)
        r, gen_tokens = rate(run_generate)
        gen_rates.append(r)
    eng_rate, gen_rate = statistics.median(eng_rates), statistics.median(gen_rates)

    samples = engine.generate(prompts, spec)
    groups = []
    for i, row in enumerate(rows):
        chunk = samples[i * args.n : (i + 1) * args.n]
        rewards: list[float | None] = [exact_match(s.text, row["answer"]) for s in chunk]
        if len(set(rewards)) == 1:  # guarantee a learning signal so every sample trains
            rewards = [float(j % 2) for j in range(len(chunk))]
        groups.append(Group(samples=chunk, rewards=rewards))
    trainer = Trainer(args.base, TrainerConfig(num_minibatches=2))
    trainer.train_step(groups)  # warm-up
    train_rates = []
    for _ in range(args.repeats):
        m = trainer.train_step(groups)
        train_rates.append(m.tokens_trained / m.seconds)
    train_rate = statistics.median(train_rates)

    ratio = eng_rate / gen_rate
    batch = f"{args.prompts}x{args.n}"
    lines = [
        ("torch engine (sample + log-probs)", f"{eng_rate:,.0f}", f"{eng_tokens}", f"{ratio:.2f}"),
        ("model.generate (sample only)", f"{gen_rate:,.0f}", f"{gen_tokens}", "1.00"),
        ("trainer (LoRA, 2 updates/step)", f"{train_rate:,.0f}", f"{m.tokens_trained}", "-"),
    ]
    print(
        f"demo model {args.base}, batch {batch}, max {args.max_tokens} tokens, {args.threads} thread(s), "
        f"median of {args.repeats}"
    )
    print(f"{'what':<36} {'tokens/s':>10} {'tokens/run':>11} {'vs generate':>12}")
    for what, speed, tokens, rel in lines:
        print(f"{what:<36} {speed:>10} {tokens:>11} {rel:>12}")
    print(
        f"result: engine_tok_s={eng_rate:.0f} generate_tok_s={gen_rate:.0f} ratio={ratio:.2f} "
        f"train_tok_s={train_rate:.0f} batch={batch}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
