"""The guess-the-number demo's base model: the demo model's architecture with a 128-token context, pre-trained
on transcripts of simulated players so that it is *mediocre but feedback-aware* in ``guess_number`` (1-15,
four guesses), leaving RL the headroom between that and binary search.

The players (each plays the environment itself, so the transcripts are what an episode holds):

- ``uninformed``: distinct random guesses, ignoring the feedback — solves 4/15 = 27 %;
- ``consistent``: a random guess inside the interval the feedback leaves — solves ~61 %;
- ``binary_search``: the middle of that interval — solves every secret; never shown in pre-training.

Pre-training has two phases, the loss on the players' guesses only (observations masked, as in RL):

1. ``consistent_steps`` (600) batches of consistent players: the model learns to read the feedback — the
   share of its sampled later guesses inside the feedback's interval (``consistency``) goes 0.65 -> 0.86
   (an uninformed player's is 0.56), its sampled solve rate to ~51 %;
2. the mixture, ``consistent_share`` (30 %) consistent and the rest uninformed, at a lower learning rate,
   until the checkpoint is what RL needs (``good_base``). Within 25-50 steps the model leans back toward
   ignoring the feedback (consistency ~0.6, sampled ~33 %): mediocre, but with the reading of the feedback
   still in its weights for RL to bring back.

Why two phases: the mixture alone teaches the interval too slowly (64 x 1,200 steps, 14 minutes here:
consistency 0.55 -> 0.61), since only its consistent third rewards reading the feedback.

The checkpoint is chosen by what RL needs (``good_base``), not by a step count: guesses well formed (at most
2 % parse errors), a sampled solve rate of 25-35 % — near the uninformed 27 %, so everything RL gains shows
against it, and still enough solved episodes in a group of 8 for a gradient — and greedy solving at most
80 % (not at the ceiling). The base this builds (seed 0, ~2.5 minutes here) stops 25 steps into the mixture:
sampled 34 %, greedy 27 %, consistency 0.60, parse errors 0.2 %.

Why this base, measured with a bare synchronous GRPO loop (full fine-tuning, lr 5e-4, 16 prompts x 8, 40
steps, seed 0) from candidate bases: this one (34 %) rose to a sampled solve rate of ~60 % and greedy
27 % -> 67 %; two from a variant of phase 2 (a fresh optimizer) about as much — after 25 mixture steps
(39 %, consistency 0.73) to ~65 %, after 50 (30 %, 0.58) to ~55 %; the consistent-only model (51 %) only to
~60 %. A model pre-trained on uninformed
players alone (sampled 25 %) did not learn at all: 0.23 -> 0.05-0.13 in 40 steps, greedy 7 % -> 0 %. So the
reading of the feedback learnt in phase 1 is what RL brings back; RL does not discover it from scratch at
this size. Through the real loop (``demo: guess the number``, lr 3e-4) the sampled solve rate goes from
~0.29 over the first five steps to ~0.48 over steps 16-20 (``tests/test_guess_demo.py``).

The episodes are tokenized exactly as the episode runner feeds them to a plain (template-free) model: the
prompt's bytes, each guess as sampled up to and including its ``"\\n"`` (the stop string stays in the turn), each
observation's bytes appended as they are; no end-of-text (the environment ends the episode).

Build from the command line (progress bar on stderr)::

    python -m workers.policy.guess_demo_model assets/base-models/demo-guess
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers.environments.base import EnvTask, Transcript, Turn
from workers.environments.guess_number import GuessNumber, prompt
from workers.policy.demo_model import (
    build_progress,
    build_tokenizer,
    masked_lm_step,
    model_config,
    pad_batch,
    save_model,
)
from workers.verifiers.base import Verdict

CONTEXT = 128
MAX_TOKENS_PER_TURN = 4
"""A guess is at most ``"15\\n"`` (three byte tokens); one spare token before a run-on turn is cut."""
PARAMS = GuessNumber.Params.model_validate({})

History = list[tuple[int, str]]
"""(guess, feedback) so far: feedback is ``higher`` or ``lower``."""
Player = Callable[[History, GuessNumber.Params, random.Random], int]


def interval(history: History, params: GuessNumber.Params) -> list[int]:
    """The numbers the feedback still allows, less those already guessed."""
    lo, hi = params.low, params.high
    for guess, feedback in history:
        if feedback == "higher":
            lo = max(lo, guess + 1)
        elif feedback == "lower":
            hi = min(hi, guess - 1)
    guessed = {g for g, _ in history}
    return [n for n in range(lo, hi + 1) if n not in guessed]


def uninformed(history: History, params: GuessNumber.Params, rng: random.Random) -> int:
    guessed = {g for g, _ in history}
    return rng.choice([n for n in range(params.low, params.high + 1) if n not in guessed])


def consistent(history: History, params: GuessNumber.Params, rng: random.Random) -> int:
    return rng.choice(interval(history, params) or [params.low])


def binary_search(history: History, params: GuessNumber.Params, rng: random.Random) -> int:
    allowed = interval(history, params) or [params.low]
    return allowed[(len(allowed) - 1) // 2]


PLAYERS: dict[str, Player] = {"uninformed": uninformed, "consistent": consistent, "binary_search": binary_search}


@dataclass
class Played:
    """One simulated episode: (text, trained) pieces as the runner would tokenize them, and its verdict."""

    pieces: list[tuple[str, bool]]
    solved: bool
    guesses: int


def _no_judge(task: EnvTask, text: str) -> Verdict:
    raise AssertionError("guess_number scores by its own rule")


def task_for(secret: int, params: GuessNumber.Params = PARAMS) -> EnvTask:
    return EnvTask(prompt=prompt(params), reference={"answer": str(secret)}, kind="answer")


def play(player: Player, secret: int, rng: random.Random, params: GuessNumber.Params = PARAMS) -> Played:
    """Play one episode of ``guess_number`` with a simulated player, through the environment itself."""
    env = GuessNumber(params, _no_judge)
    task = task_for(secret, params)
    first = env.start(task, 0, None)
    pieces: list[tuple[str, bool]] = [(first.text, False)]
    turns: list[Turn] = []
    history: History = []
    while True:
        guess = player(history, params, rng)
        text = f"{guess}\n"
        obs = env.step(text)
        pieces += [(text, True), (obs.text, False)]
        turns += [Turn("model", text, 0, 0), Turn("env", obs.text, 0, 0, status=obs.status)]
        history.append((guess, obs.text.strip()))
        if obs.done:
            break
    env.close()
    verdict = env.score(Transcript(task, turns, "done"))
    return Played(pieces, verdict.score == 1.0, len(history))


def solve_rate(player: Player, episodes_per_secret: int, seed: int = 0, params: GuessNumber.Params = PARAMS) -> float:
    """A simulated player's solve rate over every secret (``episodes_per_secret`` episodes each)."""
    rng = random.Random(seed)
    results = [play(player, s, rng, params).solved for s in range(params.low, params.high + 1)
               for _ in range(episodes_per_secret)]
    return sum(results) / len(results)


# --------------------------------------------------------------------------- the model plays the game


@torch.no_grad()
def _turns(model: Any, tokenizer: Any, contexts: Sequence[list[int]], sample: bool,
           gen: torch.Generator) -> list[list[int]]:
    """One turn per context as the engine samples it: up to ``MAX_TOKENS_PER_TURN`` tokens, ending after a
    ``"\\n"`` or at end-of-text (both kept in the turn). Left-padded, positions counting real tokens only, a KV
    cache across the turn's tokens (as ``workers.policy.torch_engine`` generates)."""
    stops = {tokenizer.encode("\n", add_special_tokens=False)[0], tokenizer.eos_token_id}
    b, width = len(contexts), max(len(c) for c in contexts)
    ids = torch.full((b, width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):] = torch.tensor(c)
        attn[i, width - len(c):] = 1
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True)
    next_pos = positions[:, -1:] + 1  # [B, 1]
    turns: list[list[int]] = [[] for _ in contexts]
    done = [False] * b
    for step in range(MAX_TOKENS_PER_TURN):
        logits = out.logits[:, -1].float()  # [B, V]
        if sample:
            token = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(-1)
        else:
            token = logits.argmax(-1)
        for i, t in enumerate(token.tolist()):
            if not done[i]:
                turns[i].append(t)
                done[i] = t in stops
        if all(done) or step == MAX_TOKENS_PER_TURN - 1:
            break
        attn = torch.cat([attn, torch.ones((b, 1), dtype=attn.dtype)], dim=1)
        out = model(input_ids=token[:, None], attention_mask=attn, position_ids=next_pos,
                    past_key_values=out.past_key_values, use_cache=True)
        next_pos = next_pos + 1
    return turns


def model_games(model: Any, tokenizer: Any, secrets: Sequence[int], *, sample: bool, seed: int = 0,
                params: GuessNumber.Params = PARAMS) -> dict[str, float]:
    """The model plays one episode per secret (sampled or greedy turns), each observation appended as the
    runner appends it: its solve rate, parse errors per guess, the share of its later guesses inside the
    feedback's interval (``consistency``), and guesses per episode."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    envs = [GuessNumber(params, _no_judge) for _ in secrets]
    tasks = [task_for(s, params) for s in secrets]
    contexts = [tokenizer.encode(env.start(task, 0, None).text, add_special_tokens=True)
                for env, task in zip(envs, tasks, strict=True)]
    turns: list[list[Turn]] = [[] for _ in secrets]
    history: list[History] = [[] for _ in secrets]
    active = list(range(len(secrets)))
    guesses = parse_errors = later = inside = 0
    while active:
        outs = _turns(model, tokenizer, [contexts[i] for i in active], sample, gen)
        still = []
        for i, ids in zip(active, outs, strict=True):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            guess = envs[i].parse(text)
            guesses += 1
            if guess is None:
                parse_errors += 1
            elif history[i]:
                later += 1
                inside += guess in interval(history[i], params)
            obs = envs[i].step(text)
            contexts[i] += ids + tokenizer.encode(obs.text, add_special_tokens=False)
            turns[i] += [Turn("model", text, 0, 0), Turn("env", obs.text, 0, 0, status=obs.status)]
            if guess is not None:
                history[i].append((guess, obs.text.strip()))
            if not obs.done:
                still.append(i)
        active = still
    solved = [env.score(Transcript(task, t, "done")).score == 1.0 for env, task, t in zip(envs, tasks, turns, strict=True)]
    return {"solved": sum(solved) / len(secrets), "parse_errors": parse_errors / max(1, guesses),
            "consistency": inside / max(1, later), "guesses": guesses / len(secrets)}


def evaluate(model: Any, tokenizer: Any, seed: int = 0, samples_per_secret: int = 16,
             params: GuessNumber.Params = PARAMS) -> dict[str, float]:
    """Sampled play over every secret (``samples_per_secret`` each), and greedy play (once each)."""
    secrets = list(range(params.low, params.high + 1))
    sampled = model_games(model, tokenizer, secrets * samples_per_secret, sample=True, seed=seed, params=params)
    greedy = model_games(model, tokenizer, secrets, sample=False, params=params)
    return {"sampled": sampled["solved"], "greedy": greedy["solved"], "consistency": sampled["consistency"],
            "parse_errors": sampled["parse_errors"], "guesses": sampled["guesses"]}


def good_base(info: dict[str, float]) -> bool:
    """What RL needs of the base (see the module docstring)."""
    return info["parse_errors"] <= 0.02 and 0.25 <= info["sampled"] <= 0.35 and info["greedy"] <= 0.8


# --------------------------------------------------------------------------- pre-training


def _encode(tokenizer: Any, episodes: list[Played]) -> tuple[torch.Tensor, torch.Tensor]:
    seqs, masks = [], []
    for ep in episodes:
        ids: list[int] = []
        mask: list[int] = []
        for text, trained in ep.pieces:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            mask += [int(trained)] * len(piece)
        seqs.append(ids)
        masks.append(mask)
    return pad_batch(tokenizer, seqs, masks)


def build_guess_demo_model(
    out_dir: str | Path,
    seed: int = 0,
    progress: Callable[[int, int, dict[str, float]], None] | None = None,
    consistent_steps: int = 600,
    max_mixture_steps: int = 300,
    batch_size: int = 32,
    lr: float = 1e-3,
    mixture_lr: float = 2e-4,
    consistent_share: float = 0.3,
    eval_every: int = 100,
    mixture_eval_every: int = 25,
) -> dict[str, Any]:
    """Build, pre-train and save the guess demo's base model; return a report.

    ``consistent_steps`` on consistent players (the feedback's interval is learnt from them), then up to
    ``max_mixture_steps`` on the mixture (``consistent_share`` consistent, the rest uninformed) at
    ``mixture_lr``, until an evaluation finds a ``good_base`` (else the last checkpoint is kept, and the
    report says it is not a good base).
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
    history: list[dict[str, Any]] = []
    good = False
    warmup = 50
    total = consistent_steps + max_mixture_steps
    for step in range(1, total + 1):
        mixing = step > consistent_steps
        model.train()
        share = consistent_share if mixing else 1.0
        batch = [play(consistent if rng.random() < share else uninformed, rng.randint(PARAMS.low, PARAMS.high), rng)
                 for _ in range(batch_size)]
        ids, mask = _encode(tokenizer, batch)
        for group in opt.param_groups:
            group["lr"] = mixture_lr if mixing else lr * min(1.0, step / warmup)
        info: dict[str, float] = {"loss": masked_lm_step(model, opt, ids, mask)}
        if step % (mixture_eval_every if mixing else eval_every) == 0 or step == total:
            info.update(evaluate(model, tokenizer, seed=seed))
            history.append({"step": step, "phase": "mixture" if mixing else "consistent", **info})
            good = mixing and good_base(info)
            if good:
                if progress is not None:
                    progress(step, total, info)
                break
        if progress is not None:
            progress(step, total, info)
    out = save_model(model, tokenizer, out_dir)
    report: dict[str, Any] = {
        "seed": seed, "consistent_steps": consistent_steps, "consistent_share": consistent_share,
        "batch_size": batch_size, "lr": lr, "mixture_lr": mixture_lr,
        "parameters": sum(p.numel() for p in model.parameters()), "good_base": good,
        "chosen": history[-1], "history": history,
        "players": {name: round(solve_rate(player, 200, seed=seed), 3) for name, player in PLAYERS.items()},
        "seconds": round(time.monotonic() - started, 1),
    }
    (out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build and pre-train the guess-the-number demo's base model.")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--consistent-steps", type=int, default=600)
    parser.add_argument("--consistent-share", type=float, default=0.3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    bar, progress = build_progress(args.consistent_steps + 300, "pre-training the guess demo model")

    report = build_guess_demo_model(args.out_dir, seed=args.seed, progress=progress,
                                    consistent_steps=args.consistent_steps, consistent_share=args.consistent_share)
    bar.close()
    c = report["chosen"]
    print(f"saved {args.out_dir}: {report['parameters']:,} parameters, step {c['step']} "
          f"({'a good base' if report['good_base'] else 'NOT a good base: no evaluation met good_base'}); "
          f"solved sampled {c['sampled']:.0%}, greedy {c['greedy']:.0%}, consistency {c['consistency']:.0%}, "
          f"parse errors {c['parse_errors']:.1%}; {report['seconds']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
