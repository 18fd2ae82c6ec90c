"""The tool demo's base model: the demo model's architecture with a longer context, pre-trained so that RL
has something to reinforce in the ``python_tool`` environment.

Its held-out domain is ``product`` (two-digit times two-digit, ``"37*48="`` -> ``"1776"``), which a model of
this size cannot compute in its head. It is never shown a product in pre-training. What it is shown:

- direct answers to the demo's easy items (``"37+48="`` -> ``"85"``, ``"37*6="`` -> ``"222"``), most of the time;
- *format-priming episodes*: the same easy items, and longer sums and one-digit products, solved with the
  tool, as the ``python_tool`` environment would run them — the model's call ``<py>print(37+48)</py>``, the
  environment's ``<out>85</out>`` (not trained on: the loss mask is 0 there, as in RL), then the answer copied
  from it.

On a product the base model mostly answers directly (and wrongly: greedy accuracy is near 0) and calls the
tool now and then (about as often as it saw the tool used on easy items); each such call that is copied
right is rewarded, so GRPO raises the tool-call rate until greedy decoding calls it too. The episodes are
tokenized exactly as the episode runner does (byte-level, the stop string ``</py>`` kept in the model's
turn, the observation appended as it is).

Build from the command line (progress bar on stderr)::

    python -m workers.policy.tool_demo_model assets/base-models/demo-tool
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from workers.policy.demo_model import (
    build_progress,
    build_tokenizer,
    masked_lm_step,
    model_config,
    pad_batch,
    save_model,
)
from workers.policy.demo_tasks import _split_pool, demo_tasks

CONTEXT = 128


def tool_episode(prompt: str, expr: str, result: str) -> list[tuple[str, bool]]:
    """An episode as (text, trained) pieces: the prompt, the call, the tool's output, the copied answer."""
    return [(prompt, False), (f"<py>print({expr})</py>", True), (f"<out>{result}</out>\n", False), (result, True)]


def direct_answer(prompt: str, answer: str) -> list[tuple[str, bool]]:
    return [(prompt, False), (answer, True)]


def _easy_item(rng: random.Random, pools: dict[str, list[tuple[str, str]]]) -> tuple[str, str, str]:
    """(prompt, expression, answer) of an item the model is shown: a demo item, or a longer sum or
    one-digit product (so the answers it learns to copy run to five digits). Never two digits by two."""
    r = rng.random()
    if r < 0.35:
        p, a = rng.choice(pools["addition"])
    elif r < 0.6:
        p, a = rng.choice(pools["multiplication"])
    elif r < 0.75:
        x, y = rng.randint(1, 9999), rng.randint(1, 9999)
        p, a = f"{x}+{y}=", str(x + y)
    else:  # any lengths but two digits by two: the model learns to copy both factors, whatever their length
        while True:
            x, y = _number(rng), _number(rng)
            if not (9 < x < 100 and 9 < y < 100):
                break
        p, a = f"{x}*{y}=", str(x * y)
    return p, p[:-1], a


def _number(rng: random.Random) -> int:
    digits = rng.choice((1, 2, 3, 3))
    return rng.randint(10 ** (digits - 1) if digits > 1 else 2, 10**digits - 1)


def _encode(tokenizer: Any, pieces_list: list[list[tuple[str, bool]]]) -> tuple[torch.Tensor, torch.Tensor]:
    eos = tokenizer.eos_token_id
    seqs, masks = [], []
    for pieces in pieces_list:
        ids: list[int] = []
        mask: list[int] = []
        for text, trained in pieces:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            mask += [int(trained)] * len(piece)
        ids.append(eos)
        mask.append(1)
        seqs.append(ids)
        masks.append(mask)
    return pad_batch(tokenizer, seqs, masks)


@torch.no_grad()
def _generate(model: Any, tokenizer: Any, texts: list[str], max_new: int, stop: str | None,
              sample: bool) -> list[str]:
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=max_new, do_sample=sample, temperature=1.0 if sample else None,
                         top_p=None, top_k=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, stop_strings=[stop] if stop else None,
                         tokenizer=tokenizer if stop else None)
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def _tool(code: str) -> str:
    """The tool as the pre-training evaluation runs it: ``print(<arithmetic>)`` only (no sandbox here)."""
    import re

    m = re.fullmatch(r"print\((\d{1,5})([+*])(\d{1,5})\)", code.strip())
    if not m:
        return "error: bad call"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a * b)


def episode_accuracy(model: Any, tokenizer: Any, rows: list[dict[str, str]], *, sample: bool,
                     force_tool: bool = False) -> dict[str, float]:
    """Play the ``python_tool`` episode (at most one call) on ``rows``: accuracy and the tool-call rate."""
    model.eval()
    starts = [r["prompt"] + ("<py>" if force_tool else "") for r in rows]
    first = _generate(model, tokenizer, starts, 24, "</py>", sample)
    contexts, calls = [], 0
    finals: list[str | None] = [None] * len(rows)
    for i, (start, text) in enumerate(zip(starts, first, strict=True)):
        turn = ("<py>" if force_tool else "") + text
        if "<py>" in turn and "</py>" in turn:
            calls += 1
            code = turn.split("<py>", 1)[1].split("</py>", 1)[0]
            contexts.append((i, start + text.split("</py>", 1)[0] + "</py>" + f"<out>{_tool(code)}</out>\n"))
        elif "<py>" in turn:
            finals[i] = ""
        else:
            finals[i] = turn
    if contexts:
        answers = _generate(model, tokenizer, [c for _, c in contexts], 8, None, sample)
        for (i, _), a in zip(contexts, answers, strict=True):
            finals[i] = a
    right = sum((f or "").split("\n", 1)[0].strip() == r["answer"] for f, r in zip(finals, rows, strict=True))
    return {"accuracy": right / len(rows), "tool_rate": calls / len(rows)}


def good_base(info: dict[str, float]) -> bool:
    """A base RL can raise by far: it seldom solves a product alone (greedy), calls the tool now and then
    when sampling, and copies right when it calls it. Greedy accuracy swings from one evaluation to the
    next while the tool-call rate settles, so the checkpoint is chosen by these figures, not a step count."""
    return info["greedy"] <= 0.1 and 0.05 <= info["tool_rate"] <= 0.4 and info["forced"] >= 0.9


def train_without_the_tool(model: Any, tokenizer: Any, steps: int = 40, batch_size: int = 32, lr: float = 1e-4,
                           seed: int = 0) -> dict[str, float]:
    """A planted end-to-end regression (``tests/test_tool_demo.py``): supervised steps on products answered
    directly, the right answer and no tool call. A model of this size cannot compute a product in its head,
    so a policy that had learnt the tool unlearns it and its episodes fail; nothing else is trained on.
    Returns the greedy tool-call rate and accuracy on held-out products afterwards."""
    rng = random.Random(seed)
    rows = _split_pool("product", "train")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    for _ in range(steps):
        ids, mask = _encode(tokenizer, [direct_answer(p, a) for p, a in rng.sample(rows, batch_size)])
        masked_lm_step(model, opt, ids, mask)
    after = episode_accuracy(model, tokenizer, demo_tasks("product", 200, seed=seed, split="heldout"), sample=False)
    model.eval()
    return {"tool_rate": after["tool_rate"], "accuracy": after["accuracy"]}


def build_tool_demo_model(
    out_dir: str | Path,
    seed: int = 0,
    progress: Callable[[int, int, dict[str, float]], None] | None = None,
    steps: int = 1500,
    batch_size: int = 64,
    lr: float = 1e-3,
    tool_share: float = 0.08,
    long_tool_share: float = 1.0,
    eval_every: int = 250,
) -> dict[str, Any]:
    """Build, pre-train and save the tool demo's base model; return a report.

    ``tool_share`` of the demo's easy items are shown as tool episodes, ``long_tool_share`` of the longer
    ones (the rest as direct answers). The
    report holds, on held-out products: greedy accuracy as the base model plays the episode, the sampled
    tool-call rate (what RL starts from), and the accuracy when the tool is called (what RL can reach).
    Training stops at the first evaluation that finds a ``good_base``, or after ``steps``.
    """
    from transformers import Qwen2ForCausalLM

    started = time.monotonic()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = CONTEXT
    config = model_config()
    config.max_position_embeddings = CONTEXT
    model = Qwen2ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    pools = {d: _split_pool(d, "train") for d in ("addition", "multiplication")}
    products = demo_tasks("product", 200, seed=seed, split="heldout")
    history: list[dict[str, Any]] = []
    warmup = 50
    for step in range(1, steps + 1):
        model.train()
        batch = []
        for _ in range(batch_size):
            p, expr, a = _easy_item(rng, pools)
            share = tool_share if len(expr) <= 5 else long_tool_share
            batch.append(tool_episode(p, expr, a) if share >= 1.0 or rng.random() < share else direct_answer(p, a))
        ids, mask = _encode(tokenizer, batch)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, step / warmup) * (0.1 + 0.9 * (1 - step / steps))
        info: dict[str, float] = {"loss": masked_lm_step(model, opt, ids, mask)}
        if step % eval_every == 0 or step == steps:
            greedy = episode_accuracy(model, tokenizer, products, sample=False)
            sampled = episode_accuracy(model, tokenizer, products, sample=True)
            forced = episode_accuracy(model, tokenizer, products, sample=False, force_tool=True)
            info.update(greedy=greedy["accuracy"], tool_rate=sampled["tool_rate"], forced=forced["accuracy"])
            history.append({"step": step, **info})
            if good_base(info):
                if progress is not None:
                    progress(step, steps, info)
                break
        if progress is not None:
            progress(step, steps, info)
    out = save_model(model, tokenizer, out_dir)
    report: dict[str, Any] = {
        "seed": seed, "steps": steps, "tool_share": tool_share, "long_tool_share": long_tool_share,
        "parameters": sum(p.numel() for p in model.parameters()),
        "product_heldout": history[-1], "history": history,
        "seconds": round(time.monotonic() - started, 1),
    }
    (out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build and pre-train the tool demo's base model.")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--tool-share", type=float, default=0.08)
    parser.add_argument("--long-tool-share", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    bar, progress = build_progress(args.steps, "pre-training the tool demo model")

    report = build_tool_demo_model(args.out_dir, seed=args.seed, progress=progress, steps=args.steps,
                                   tool_share=args.tool_share, long_tool_share=args.long_tool_share)
    bar.close()
    h = report["product_heldout"]
    print(f"saved {args.out_dir}: {report['parameters']:,} parameters; held-out products: greedy {h['greedy']:.0%}, "
          f"sampled tool-call rate {h['tool_rate']:.0%}, with the tool {h['forced']:.0%}; {report['seconds']} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
