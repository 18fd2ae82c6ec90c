"""Forms of the pages. The new-run form is built from ``RunSpec`` itself, so every algorithm and pipeline
setting appears with its description as help text and its default, and pydantic's errors land next to
the field they concern.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from django import forms
from pydantic import BaseModel as PydanticModel
from pydantic.fields import FieldInfo

from webapp.catalog.models import BaseModel, DomainKind, TaskDomain, Verifier, VerifierKind
from webapp.runs.models import Engine
from workers.environments.base import ENVIRONMENTS
from workers.pipeline.spec import RunSpec
from workers.verifiers.python_reward import EXAMPLE as REWARD_EXAMPLE

SPEC_PREFIX = "spec__"


@dataclass(frozen=True)
class SpecField:
    """One leaf of RunSpec: ``algorithm.learning_rate`` becomes the form field ``spec__algorithm__learning_rate``."""

    path: str
    section: str
    info: FieldInfo

    @property
    def form_name(self) -> str:
        return SPEC_PREFIX + self.path.replace(".", "__")


def spec_fields(model: type[PydanticModel] = RunSpec, prefix: str = "") -> Iterator[SpecField]:
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, PydanticModel):
            yield from spec_fields(annotation, f"{prefix}{name}.")
        else:
            yield SpecField(f"{prefix}{name}", prefix.rstrip(".") or "run", info)


def _form_field(field: SpecField) -> forms.Field:
    info, annotation = field.info, field.info.annotation
    default = info.get_default(call_default_factory=True)
    common: dict[str, Any] = {"label": field.path.split(".")[-1].replace("_", " "), "help_text": info.description or "",
                              "required": False}
    optional = get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in get_args(annotation)
    if optional:
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) is Literal:
        choices = [(c, c) for c in get_args(annotation)]
        return forms.ChoiceField(choices=choices, initial=default, **common)
    if annotation is bool:
        return forms.BooleanField(initial=default, **common)
    if annotation is int:
        return forms.IntegerField(initial=default, **common)
    if annotation is float:
        return forms.FloatField(initial=default, **common)
    if get_origin(annotation) is tuple:
        common["help_text"] += " (one per line)"
        return forms.CharField(widget=forms.Textarea(attrs={"rows": 2}), initial="\n".join(default or ()), **common)
    return forms.CharField(initial=default, **common)


class NamedChoiceField(forms.ModelChoiceField):
    def label_from_instance(self, obj: Any) -> str:
        return str(obj.name)


class VerifierChoiceField(forms.ModelChoiceField):
    def label_from_instance(self, obj: Any) -> str:
        return f"{obj.name} ({obj.kind}, calibration {obj.calibration_status})"


class RunForm(forms.Form):
    """Name, base model, engine and every RunSpec setting; the domains come from their own rows."""

    name = forms.CharField(max_length=200)
    description = forms.CharField(widget=forms.Textarea(attrs={"rows": 2}), required=False)
    base_model = NamedChoiceField(queryset=BaseModel.objects.none())
    engine = forms.ChoiceField(choices=Engine.choices, initial=Engine.TORCH,
                               help_text="torch runs anywhere; vLLM needs a GPU worker with vllm installed")
    start_now = forms.BooleanField(required=False, initial=True, label="start the run now")
    force = forms.BooleanField(required=False, label="start even if a verifier is not calibrated",
                               help_text="recorded on the run")

    def __init__(self, *args: Any, user: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields["base_model"]
        assert isinstance(field, forms.ModelChoiceField)
        field.queryset = BaseModel.objects.visible_to(user)
        self.spec_layout: dict[str, list[str]] = {}
        for item in spec_fields():
            self.fields[item.form_name] = _form_field(item)
            self.spec_layout.setdefault(item.section, []).append(item.form_name)

    def spec_sections(self) -> list[tuple[str, list[forms.BoundField]]]:
        return [(section, [self[name] for name in names]) for section, names in self.spec_layout.items()]

    def spec(self) -> dict[str, Any]:
        """The nested spec dict from the cleaned fields (blank optional fields fall back to their defaults)."""
        out: dict[str, Any] = {}
        for item in spec_fields():
            value = self.cleaned_data.get(item.form_name)
            if value is None or value == "":
                if isinstance(self.fields[item.form_name], forms.BooleanField):
                    value = False
                else:
                    continue
            if get_origin(item.info.annotation) is tuple:
                value = [line for line in str(value).splitlines() if line]
            node = out
            *parents, leaf = item.path.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return out

    def add_spec_errors(self, details: dict[str, list[str]]) -> None:
        """Attach pydantic's ``{"algorithm.clip_high": [...]}`` messages to their fields."""
        for path, messages in details.items():
            name = SPEC_PREFIX + path.replace(".", "__")
            for message in messages:
                self.add_error(name if name in self.fields else None, f"{path}: {message}" if name not in self.fields
                               else message)


class DomainForm(forms.Form):
    """Create a domain, or (``instance=``) change its settings; checked by ``catalog.services.check_domain``."""

    name = forms.CharField(max_length=200)
    kind = forms.ChoiceField(choices=DomainKind.choices, help_text="decides the shape of a task row")
    description = forms.CharField(widget=forms.Textarea(attrs={"rows": 2}), required=False)
    verifier = VerifierChoiceField(queryset=Verifier.objects.none(), required=False,
                                      help_text="judges this domain's completions; it must judge this kind")
    prompt_template = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "class": "mono"}), required=False,
        help_text="what the model sees: {prompt}, the kind's visible fields ({context}, {files}, …) and "
                  "{metadata.<key>}; empty: the kind's default")
    system_prompt = forms.CharField(widget=forms.Textarea(attrs={"rows": 2}), required=False,
                                    help_text="put before every prompt of the domain")
    environment = forms.ChoiceField(choices=[(name, name) for name in ENVIRONMENTS], initial="single_turn",
                                    required=False,
                                    help_text="single_turn: one completion, judged; python_tool: the model may run "
                                              "Python in a sandbox session before it answers")
    environment_params = forms.CharField(widget=forms.Textarea(attrs={"rows": 2, "class": "mono"}), required=False,
                                         initial="{}", help_text="the environment's parameters as JSON")
    heldout_fraction = forms.FloatField(initial=0.1, min_value=0.0, max_value=0.9,
                                        help_text="share of imported tasks kept out of training for evaluation")

    def __init__(self, *args: Any, user: Any, instance: TaskDomain | None = None, **kwargs: Any) -> None:
        # (an unbound settings form is DomainForm(None, instance=…): it must show the domain's values)
        if instance is not None and (not args or args[0] is None) and "initial" not in kwargs:
            kwargs["initial"] = {f: getattr(instance, f) for f in self.base_fields}
            kwargs["initial"]["environment_params"] = json.dumps(instance.environment_params)
        super().__init__(*args, **kwargs)
        self.user, self.instance = user, instance
        field = self.fields["verifier"]
        assert isinstance(field, forms.ModelChoiceField)
        field.queryset = Verifier.objects.visible_to(user)

    def clean_name(self) -> str:
        name = self.cleaned_data["name"].strip()
        clash = TaskDomain.objects.filter(owner=self.instance.owner if self.instance else self.user, name=name)
        if self.instance is not None:
            clash = clash.exclude(pk=self.instance.pk)
        if clash.exists():
            raise forms.ValidationError(f"you already have a domain named {name!r}")
        return name

    def clean_environment_params(self) -> dict[str, Any]:
        text = self.cleaned_data.get("environment_params") or "{}"
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"not JSON: {exc.msg} at column {exc.colno}") from None
        if not isinstance(value, dict):
            raise forms.ValidationError("the parameters must be a JSON object")
        return value

    def clean(self) -> dict[str, Any]:
        from webapp.catalog.services import check_domain

        data = super().clean() or {}
        data["environment"] = data.get("environment") or "single_turn"
        if "kind" in data:
            for name, messages in check_domain(kind=data["kind"], verifier=data.get("verifier"),
                                               prompt_template=data.get("prompt_template", ""),
                                               environment=data.get("environment", "single_turn"),
                                               environment_params=data.get("environment_params"),
                                               domain=self.instance).items():
                for message in messages:
                    self.add_error(name if name in self.fields else None, message)
        return data


class UploadForm(forms.Form):
    file = forms.FileField(help_text="JSONL: one task per line; the whole file is refused if any row is bad")


class VerifierForm(forms.Form):
    name = forms.CharField(max_length=200)
    kind = forms.ChoiceField(choices=VerifierKind.choices)
    code = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 8, "class": "mono", "placeholder": REWARD_EXAMPLE, "spellcheck": "false"}),
        required=False, strip=False, label="reward code (python_reward)",
        help_text="python_reward only: define score(prompt, completion, reference) -> float | None, as in the "
                  "example shown. reference is the task's stored reference (an answer task: {\"answer\": \"5\"}); "
                  "None means invalid (left out of training); a number outside [min_score, max_score] (default "
                  "[0, 1], set in the configuration) is refused. It runs in the sandbox, once per group, and is "
                  "dry-run on the calibration cases when saved.")
    config = forms.CharField(widget=forms.Textarea(attrs={"rows": 4}), required=False, initial="{}",
                             help_text="the kind's configuration as JSON")
    description = forms.CharField(widget=forms.Textarea(attrs={"rows": 2}), required=False)
    calibration_cases = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 6, "class": "mono"}), required=False, label="calibration cases",
        help_text='JSONL, one case per line: {"completion": "5", "reference": {"answer": "5"}, "expected": "pass", '
                  '"label": "good"}; labels good, bad or hack. Include known-bad answers and hacks (an empty answer, '
                  'a lone ":"): calibration measures false positives on them.')

    def clean_calibration_cases(self) -> list[dict[str, Any]]:
        cases, problems = [], []
        for number, line in enumerate((self.cleaned_data.get("calibration_cases") or "").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                case = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.append(f"line {number}: not JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(case, dict):
                problems.append(f"line {number}: expected a JSON object")
                continue
            unknown = set(case) - {"prompt", "completion", "reference", "expected", "label", "note"}
            if unknown:
                problems.append(f"line {number}: unknown field(s) {', '.join(sorted(unknown))}")
            if case.get("expected") not in ("pass", "fail"):
                problems.append(f"line {number}: expected must be \"pass\" or \"fail\"")
            if case.get("label", "good") not in ("good", "bad", "hack"):
                problems.append(f"line {number}: label must be good, bad or hack")
            if not isinstance(case.get("reference", {}), dict):
                problems.append(f"line {number}: reference must be a JSON object")
            cases.append({"prompt": str(case.get("prompt", "")), "completion": str(case.get("completion", "")),
                          "reference": case.get("reference", {}), "expected": case.get("expected"),
                          "label": case.get("label", "good"), "note": str(case.get("note", ""))[:300]})
        if problems:
            raise forms.ValidationError(problems)
        return cases

    def clean(self) -> dict[str, Any]:
        from webapp.catalog.services import check_verifier
        from workers.verifiers.base import VerifierConfigError, build_verifier

        data = super().clean() or {}
        reward = data.get("kind") == VerifierKind.PYTHON_REWARD
        if reward and "config" in data:
            if data.get("code", "").strip():  # (a browser sends the textarea's lines ended by \r\n)
                data["config"] = {**data["config"], "code": data["code"].replace("\r\n", "\n")}
            try:
                build_verifier(data["kind"], data["config"])
            except VerifierConfigError as exc:
                self.add_error("code" if any(p.startswith("code") for p in exc.problems) else "config",
                               [p.removeprefix("code: ") for p in exc.problems])
                return data
        elif data.get("code", "").strip() and "kind" in data:
            self.add_error("code", f"only a python_reward verifier takes reward code (this one is {data['kind']})")
        if "kind" in data and "calibration_cases" in data:
            problems = check_verifier(data["kind"], data["calibration_cases"],
                                      config=data.get("config") if reward else None)
            for message in problems.get("calibration_cases", []):
                self.add_error("calibration_cases", message)
            for message in problems.get("config", []):
                self.add_error("code", message)
        return data

    def clean_config(self) -> dict[str, Any]:
        text = self.cleaned_data.get("config") or "{}"
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
        if not isinstance(value, dict):
            raise forms.ValidationError("the configuration must be a JSON object")
        return value
