"""Chat models: a task as messages, rendered by the base model's chat template one message at a time.

A task is a conversation: the domain's system prompt (when it has one) and the user's turn (the rendered
prompt); an episode then appends the model's turns and the environment's observations (a tool's result, or
the user's reply). With a tokenizer that has a chat template:

- the prompt is the template applied to the first messages, with the generation prompt;
- each later observation is rendered **alone**: the ids the template writes for that one message after an
  assistant turn (the assistant turn's closing, when the model's own end-of-turn token did not already close
  it, the message, the next generation prompt), appended to the ids the episode holds. History is never
  re-rendered: what the model sampled stays exactly as sampled (re-tokenizing decoded text can merge or split
  tokens: the log-probs would no longer be those of the tokens trained on), and a turn costs the same however
  long the episode is. The delta is taken against a fixed probe conversation, as SkyRL's generator does;
  a template whose rendering of earlier messages changes when one is appended (so that no delta exists) is
  refused with that reason.

Without a template the messages' contents are joined by blank lines (what a plain prompt always was:
``system\\n\\nprompt``) and observations are appended as they are. ``BaseModel.chat_template`` replaces the
tokenizer's own template when set (``apply_override``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, str]
"""``{"role": "system" | "user" | "assistant" | "tool", "content": text}``"""

Prompt = str | Sequence[Message]
"""What an engine is asked to continue: plain text (one user message) or a conversation."""

_PROBE: list[dict[str, str]] = [{"role": "user", "content": "\x00user\x00"},
                                {"role": "assistant", "content": "\x00assistant\x00"}]


class ChatTemplateError(ValueError):
    """A chat template that cannot render a conversation one message at a time."""


def as_messages(prompt: Prompt) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]


def prompt_text(prompt: Prompt) -> str:
    """The prompt as one text: what a model without a template is given, and what a trajectory shows."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(str(m["content"]) for m in prompt if m["content"])


def task_messages(system: str, prompt: str) -> list[dict[str, str]]:
    """A task's first messages: the domain's system prompt, when it has one, and the user's turn."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def apply_override(tokenizer: Any, template: str | None) -> None:
    """Use ``template`` (a base model's registered chat template) instead of the tokenizer's own."""
    if template:
        tokenizer.chat_template = template


class ChatFormat:
    """How one tokenizer turns prompts and observations into the ids an episode appends."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self._closing: str | None = None
        self._roles: dict[str, str] = {}

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if not self.templated:
            return list(self.tokenizer.encode(prompt_text(prompt), add_special_tokens=True))
        return _ids(self.tokenizer.apply_chat_template(as_messages(prompt), add_generation_prompt=True,
                                                        tokenize=True))

    def observation_ids(self, role: str, text: str, after: Sequence[int] = ()) -> list[int]:
        """The ids to append for one observation, after the model turn whose ids end with ``after``."""
        if not self.templated:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        closing = self.closing()
        eos = self.tokenizer.eos_token
        if after and eos and after[-1] == self.tokenizer.eos_token_id and closing.startswith(eos):
            closing = closing[len(eos):]  # the model closed its turn itself
        return list(self.tokenizer.encode(closing + self._delta(role, text), add_special_tokens=False))

    def closing(self) -> str:
        """The text the template puts after an assistant message's content (its end-of-turn)."""
        if self._closing is None:
            rendered = self._render(_PROBE, generation=False)
            content = _PROBE[1]["content"]
            if content not in rendered:
                raise ChatTemplateError("the chat template does not render an assistant message's content")
            self._closing = rendered[rendered.rindex(content) + len(content):]
        return self._closing

    def _delta(self, role: str, text: str) -> str:
        prefix = self._render(_PROBE, generation=False)
        used = self._roles.get(role)
        for candidate in ([used] if used else [role, "user"] if role != "user" else ["user"]):
            try:
                full = self._render([*_PROBE, {"role": candidate, "content": text}], generation=True)
            except Exception:  # a template that rejects the role (jinja's raise_exception): try the user role
                continue
            if not full.startswith(prefix):
                raise ChatTemplateError("the chat template renders earlier messages differently once another "
                                        "is appended, so a turn cannot be rendered on its own")
            delta = full[len(prefix):]
            if text and text not in delta:
                continue  # the template dropped a message of this role
            self._roles[role] = candidate
            return delta
        raise ChatTemplateError(f"the chat template renders neither a {role!r} nor a 'user' message after an "
                                f"assistant turn")

    def _render(self, messages: list[dict[str, str]], generation: bool) -> str:
        return str(self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False))


def _ids(out: Any) -> list[int]:
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]
