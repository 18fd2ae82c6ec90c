"""A tiny chat model for tests: the demo base model with a chat template of its own.

The template frames each message as ``<|role|>content<|endoftext|>`` (the demo tokenizer's end-of-text
token closes a turn, as ``<|im_end|>`` does for ChatML models) and the generation prompt is ``<|assistant|>``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "assets" / "base-models" / "demo"

CHATML_LIKE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|>{% endif %}")

NO_TOOL_ROLE = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}"
                "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")

RE_RENDERS = ("{{ messages | length }} messages:{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
              "<|endoftext|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""Writes the message count first, so earlier messages render differently once one is appended."""


def make_chat_model(out: Path, template: str = CHATML_LIKE, source: Path = DEMO) -> Path:
    """A copy of ``source`` whose tokenizer carries ``template``; returns its directory."""
    shutil.copytree(source, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return out
