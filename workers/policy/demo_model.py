"""The demo base model and the demo task domains.

Temper ships its own tiny base model so a laptop can run the whole loop with no hub download:
a Qwen2-architecture transformer (~1.08M parameters, hidden 128, 4 layers, 2 heads of dim 64, tied
embeddings) with a byte-level tokenizer of 258 tokens, pre-trained for a couple of minutes on the demo
domains until it is *mediocre* (~30-50 % held-out exact match on addition), so RL has visible headroom.

Demo domains (plain generators of ``{"prompt", "answer"}`` rows, split into disjoint train/held-out pools):
    ``addition``        two-digit addition, ``"37+48="`` -> ``"85"``
    ``multiplication``  two-digit times one-digit, ``"37*6="`` -> ``"222"`` (stays harder than addition;
                        string reversal was learnt in ~250 steps and left no headroom, so it is not used)

Build from the command line (progress bar on stderr)::

    python -m workers.policy.demo_model assets/base-models/demo
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

from workers.policy.demo_tasks import DOMAINS, _split_pool, demo_tasks

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

def extract_answer(completion: str) -> str:
    """The answer part of a completion: everything before the first newline or end-of-text, stripped."""
    return completion.split(EOS_TOKEN, 1)[0].split("\n", 1)[0].strip()


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion's answer equals the reference exactly, else 0.0."""
    return 1.0 if extract_answer(completion) == answer.strip() else 0.0


# --------------------------------------------------------------------------- tokenizer and model


def build_tokenizer() -> Any:
    """A byte-level tokenizer: 256 byte tokens (GPT-2 byte-to-unicode alphabet), end-of-text and pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Order byte tokens by byte value so ids are easy to read: id == byte for printable ASCII.
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    vocab[EOS_TOKEN] = 256
    vocab[PAD_TOKEN] = 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, model_max_length=64
    )


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable unicode map (the alphabet of tokenizers' ByteLevel).
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def model_config() -> Any:
    from transformers import Qwen2Config

    settings: dict[str, Any] = dict(
        vocab_size=258,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=64,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=256,
        pad_token_id=257,
        bos_token_id=256,
        use_sliding_window=False,
        torch_dtype="float32",
    )
    return Qwen2Config(**settings)


def fix_up_hf_files(model_dir: str | Path) -> None:
    """Rewrite what transformers 5 writes so older loaders and vLLM read the directory.

    transformers 5 stores ``tokenizer_class: "TokenizersBackend"`` and ``rope_parameters`` without a
    top-level ``rope_theta``; vLLM and transformers 4 expect ``PreTrainedTokenizerFast`` and ``rope_theta``.
    """
    d = Path(model_dir)
    cfg_path = d / "config.json"
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        rope = cfg.get("rope_parameters") or {}
        cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
        if "rope_parameters" in cfg and "rope_theta" not in cfg["rope_parameters"]:
            cfg["rope_parameters"]["rope_theta"] = cfg["rope_theta"]
        cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_cfg_path = d / "tokenizer_config.json"
    if tok_cfg_path.exists():
        tok_cfg = json.loads(tok_cfg_path.read_text())
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- pre-training


def _encode_rows(tokenizer: Any, rows: list[dict[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids [B, L] and a loss mask [B, L] covering answer tokens and end-of-text."""
    eos = tokenizer.eos_token_id
    seqs, masks = [], []
    for row in rows:
        p = tokenizer.encode(row["prompt"], add_special_tokens=False)
        a = [*tokenizer.encode(row["answer"], add_special_tokens=False), eos]
        seqs.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    return pad_batch(tokenizer, seqs, masks)


def pad_batch(tokenizer: Any, seqs: list[list[int]], masks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids [B, L] and their loss mask [B, L] (0 on padding)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m)
    return ids, mask


def masked_lm_step(model: Any, opt: Any, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """One optimiser step of next-token cross-entropy on the tokens where ``mask`` is 1; returns the loss."""
    logits = model(input_ids=ids).logits[:, :-1]
    targets = ids[:, 1:]
    tmask = mask[:, 1:].float()
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    loss = (nll * tmask.reshape(-1)).sum() / tmask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def build_progress(total: int, desc: str) -> tuple[Any, Callable[[int, int, dict[str, float]], None]]:
    """A builder's progress bar and its ``progress(step, total, info)`` callback: the bar follows the step and
    shows the latest figures; an evaluation's figures (more than the loss) are also written out as a line."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="step")

    def progress(step: int, total: int, info: dict[str, float]) -> None:
        bar.n = step
        bar.set_postfix({k: round(v, 3) for k, v in info.items()}, refresh=False)
        bar.refresh()
        if len(info) > 1:
            tqdm.write(json.dumps({"step": step, **{k: round(v, 3) for k, v in info.items()}}), file=sys.stderr)

    return bar, progress


def save_model(model: Any, tokenizer: Any, out_dir: str | Path) -> Path:
    """Write a Hugging Face model directory every loader here reads (vLLM and transformers 4 included)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.config.architectures = ["Qwen2ForCausalLM"]
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    fix_up_hf_files(out)
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; the artifact store is shared between users
    return out


@torch.no_grad()
def greedy_accuracy(model: Any, tokenizer: Any, rows: list[dict[str, str]], max_new_tokens: int = 5) -> float:
    """Held-out exact match of greedy decoding (batched, left-padded, KV cache via model.generate)."""
    model.eval()
    tokenizer.padding_side = "left"
    enc = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=False)
    return sum(exact_match(t, r["answer"]) for t, r in zip(texts, rows, strict=True)) / len(rows)


def build_demo_model(
    out_dir: str | Path,
    seed: int = 0,
    progress: Callable[[int, int, dict[str, float]], None] | None = None,
    max_steps: int = 1500,
    batch_size: int = 64,
    lr: float = 1e-3,
    target: tuple[float, float] = (0.30, 0.50),
    eval_every: int = 10,
    addition_share: float = 0.8,
) -> dict[str, Any]:
    """Build, pre-train and save the demo base model; return a report.

    Trains on a mix of both demo domains, evaluates held-out greedy exact match on addition every
    ``eval_every`` steps, and keeps the checkpoint whose accuracy first lands inside ``target`` (accuracy
    jumps sharply over a few dozen steps, so the choice is made by accuracy, never by step count). If no
    evaluation lands inside, the checkpoint closest to the middle of the range is kept.
    ``progress(step, max_steps, info)`` is called after every step.
    """
    from transformers import Qwen2ForCausalLM

    started = time.monotonic()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = build_tokenizer()
    model = Qwen2ForCausalLM(model_config())
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    heldout = demo_tasks("addition", 300, seed=seed, split="heldout")
    train_pools = {d: _split_pool(d, "train") for d in DOMAINS}
    warmup = 50
    lo, hi = target
    mid = (lo + hi) / 2
    best: tuple[float, int, dict[str, torch.Tensor]] | None = None  # (distance to mid, step, state)
    chosen_acc, chosen_step = 0.0, 0
    history: list[tuple[int, float]] = []
    for step in range(1, max_steps + 1):
        model.train()
        rows = []
        for _ in range(batch_size):
            # Mostly addition (the headline domain); enough multiplication to give the second domain a start.
            domain = "addition" if rng.random() < addition_share else "multiplication"
            p, a = rng.choice(train_pools[domain])
            rows.append({"prompt": p, "answer": a})
        ids, mask = _encode_rows(tokenizer, rows)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, step / warmup)
        info = {"loss": masked_lm_step(model, opt, ids, mask)}
        if step % eval_every == 0 and step >= 100:
            acc = greedy_accuracy(model, tokenizer, heldout)
            history.append((step, acc))
            info["heldout"] = acc
            dist = 0.0 if lo <= acc <= hi else abs(acc - mid)
            if best is None or dist < best[0]:
                best = (dist, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
                chosen_acc, chosen_step = acc, step
            if lo <= acc <= hi:
                if progress is not None:
                    progress(step, max_steps, info)
                break
        if progress is not None:
            progress(step, max_steps, info)
    if best is None:
        raise RuntimeError("demo model pre-training ended before any held-out evaluation; raise max_steps")
    model.load_state_dict(best[2])
    out = save_model(model, tokenizer, out_dir)
    mult_heldout = demo_tasks("multiplication", 300, seed=seed, split="heldout")
    report: dict[str, Any] = {
        "seed": seed,
        "parameters": n_params,
        "chosen_step": chosen_step,
        "heldout_exact_match": {
            "addition": chosen_acc,
            "multiplication": greedy_accuracy(model, tokenizer, mult_heldout),
        },
        "history": history,
        "seconds": round(time.monotonic() - started, 1),
        "bytes": sum(f.stat().st_size for f in out.iterdir() if f.is_file()),
    }
    (out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse

    from tqdm import tqdm

    parser = argparse.ArgumentParser(description="Build and pre-train Temper's tiny demo base model.")
    parser.add_argument("out_dir", help="directory to write the Hugging Face model into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=1500)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 is fastest for the tiny model)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    bar = tqdm(total=args.max_steps, desc="pre-training demo model", unit="step")

    def progress(step: int, total: int, info: dict[str, float]) -> None:
        bar.n = step
        bar.set_postfix({k: round(v, 3) for k, v in info.items()}, refresh=False)
        bar.refresh()

    report = build_demo_model(args.out_dir, seed=args.seed, progress=progress, max_steps=args.max_steps)
    bar.close()
    em = report["heldout_exact_match"]
    print(
        f"saved {args.out_dir}: {report['parameters']:,} parameters, step {report['chosen_step']}, "
        f"held-out exact match addition {em['addition']:.0%}, multiplication {em['multiplication']:.0%}, "
        f"{report['seconds']} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
