"""``python manage.py seed_demo``: the demo domains, a calibrated verifier, the demo base models and three runs.

Idempotent: what exists is left alone. With ``--start`` the first demo run (single-turn addition) is started
(the first ``make run`` does this), so a newcomer sees held-out reward rise on the run page within minutes.
The second, the tool demo (``demo: tool use``: two-digit products, which the model learns to compute with a
Python tool in a sandbox session), and the third, ``demo: guess the number`` (higher/lower feedback on each
guess: a reward that comes from multi-step feedback), are left as drafts to start from their pages.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from tqdm import tqdm

from webapp.catalog.models import BaseModel, CalibrationCase, CalibrationReport, TaskDomain, Verifier
from webapp.catalog.services import do_import_tasks, do_run_calibration
from webapp.runs.loop import tick
from webapp.runs.models import Run
from webapp.runs.services import DomainWeight, do_create_run, do_start_run

DEMO_MODEL_DIR = "assets/base-models/demo"
TOOL_MODEL_DIR = "assets/base-models/demo-tool"
LONG_MODEL_DIR = "assets/base-models/demo-long"
"""The demo model's own weights declared with a 1,024-token context (rotary positions: nothing to stretch), for
runs over domains with longer prompts, such as a reasoning-gym pack: it shows the loop at scale, not learning."""
TOOL_RUN_SPEC: dict[str, Any] = {
    "algorithm": {"learning_rate": 1e-4, "lora_rank": 0, "clip_low": 0.2, "clip_high": 0.2,
                  "updates_per_batch": 2, "micro_batch_size": 64},
    "pipeline": {"mode": "async", "group_size": 8, "batch_prompts": 16, "max_staleness": 1,
                 "rollout_batch_prompts": 16},
    "sampling": {"temperature": 1.0, "max_tokens": 24},
    # a call and its answer: <py>print(37*48)</py> (21 tokens), then 1776 and end-of-text
    "episode": {"max_turns": 3, "max_tokens_per_turn": 24, "tool_seconds": 2.0, "deadline_seconds": 60.0},
    "max_steps": 400,
    # the weighted held-out average: products (weight 1) reach ~0.99 while the sums answered in the model's
    # head (weight 0.25) stay near their base ~0.12-0.2, so 0.75 means products are solved with the tool
    "target_reward": 0.75,
    "eval_every": 10,
    "eval_tasks": 200,
    "seed": 0,
}
GUESS_MODEL_DIR = "assets/base-models/demo-guess"
GUESS_RUN_SPEC: dict[str, Any] = {
    # Measured through this loop (seed 0 unless named): full fine-tuning at lr 3e-4 took the sampled solve
    # rate 0.31 -> 0.50 by step 20 and ~0.65 by step 60, held-out greedy 0.27 -> 0.53 -> 0.73 (v40) -> 0.80
    # (v90); at 5e-4 it rose as fast but collapsed to all parse errors at step ~44 (seed 3) or sank after
    # step ~85 (seed 0); 1e-4 gained ~15 points in 40 steps (an earlier base); 2 updates a batch beat 4.
    "algorithm": {"learning_rate": 3e-4, "lora_rank": 0, "clip_low": 0.2, "clip_high": 0.2,
                  "updates_per_batch": 2, "micro_batch_size": 64},
    "pipeline": {"mode": "async", "group_size": 8, "batch_prompts": 16, "max_staleness": 1,
                 "rollout_batch_prompts": 16},
    "sampling": {"temperature": 1.0, "max_tokens": 4, "stop": ["\n"]},
    # one guess a turn ("15\n": three tokens), as many turns as the game has guesses
    "episode": {"max_turns": 4, "max_tokens_per_turn": 4, "deadline_seconds": 60.0},
    "max_steps": 100,
    "target_reward": 0.8,  # 12 of the 15 secrets solved by greedy play; binary search solves all 15
    "eval_every": 10,
    "eval_tasks": 15,
    "seed": 0,
}
DEMO_RUN_SPEC: dict[str, Any] = {
    # Measured through this loop on the demo model: LoRA r=16 plateaued near 55-59% held-out (from 35%)
    # at lr 3e-4 and at 1e-3 within 110 steps; full fine-tuning at lr 1e-4 (PITFALLS.md: stable; >= 3e-4
    # collapses) is what the demo uses. LoRA stays the RunSpec default for real base models.
    "algorithm": {"learning_rate": 1e-4, "lora_rank": 0, "clip_low": 0.2, "clip_high": 0.2,
                  "updates_per_batch": 2, "micro_batch_size": 64},
    # On-policy (max_staleness 0; still async: the next prompts are admitted as a step is claimed, and
    # generated the moment its version is recorded). With one device, generation and training take turns on
    # it anyway, so a version of lag would hide only the ~25 ms a step of verification and bookkeeping, and it
    # costs learning: the bare loop with one version of lag (demo_loop.run_grpo(lag=1)) needed 230, >400 and
    # 230 steps to +40 points for seeds 0-2, against 180, 230 and 200 on-policy.
    "pipeline": {"mode": "async", "group_size": 8, "batch_prompts": 16, "max_staleness": 0,
                 "rollout_batch_prompts": 16},
    "sampling": {"temperature": 1.0, "max_tokens": 6, "stop": ["\n"]},
    # ~1 s a step on an idle 2-core machine; 150 steps took 35% -> 73% held-out, so give it room and stop
    # at the target.
    "max_steps": 400,
    "target_reward": 0.85,
    "eval_every": 10,
    "eval_tasks": 300,
    "seed": 0,
}


def calibration_cases(domain: str) -> list[dict[str, Any]]:
    from workers.policy.demo_tasks import demo_tasks

    rows = demo_tasks(domain, 6, seed=99, split="train")
    cases = [{"completion": r["answer"], "reference": {"answer": r["answer"]}, "expected": "pass", "label": "good"}
             for r in rows[:3]]
    cases += [{"completion": str(int(r["answer"]) + 1), "reference": {"answer": r["answer"]}, "expected": "fail",
               "label": "bad"} for r in rows[3:6]]
    cases += [{"completion": c, "reference": {"answer": rows[0]["answer"]}, "expected": "fail", "label": "hack"}
              for c in ("", ":", f"{rows[0]['answer']}0", f"-{rows[0]['answer']}")]
    return cases


class Command(BaseCommand):
    help = "Create the demo domains, verifier, base model and run (idempotent); --start starts the run."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--user", default="demo")
        parser.add_argument("--start", action="store_true")

    def handle(self, *args: Any, **opts: Any) -> None:
        from workers.policy.demo_tasks import DOMAINS

        User = get_user_model()
        owner, _ = User.objects.get_or_create(username=opts["user"], defaults={"is_staff": True, "is_superuser": True})
        base_model = self.base_model(owner, "demo", DEMO_MODEL_DIR, "workers.policy.demo_model:build_demo_model",
                                     "Tiny Qwen2 built by Temper (workers/policy/demo_model.py)")
        self.base_model(owner, "demo-long", LONG_MODEL_DIR, None,
                        "The demo model declared with a 1,024-token context, for domains with longer prompts (a "
                        "reasoning-gym pack): it runs the loop at scale but has learned nothing past 64 positions")
        verifier, created = Verifier.objects.get_or_create(
            owner=owner, name="exact-answer",
            defaults={"kind": "exact_match", "config": {}, "description": "Exact match of the answer line"})
        if created:
            CalibrationCase.objects.bulk_create(
                [CalibrationCase(verifier=verifier, **c) for d in DOMAINS for c in calibration_cases(d)])
        if not verifier.calibrated:
            report = do_run_calibration(
                CalibrationReport.objects.create(verifier=verifier, status=CalibrationReport.Status.RUNNING))
            verifier.refresh_from_db()
            self.stdout.write(f"calibrated {verifier.name}: {verifier.calibration_status} {report.error}".rstrip())

        def domain(name: str) -> TaskDomain:
            return self.domain_with_tasks(owner, name, pool_rows(name), {
                "kind": "answer", "verifier": verifier,
                "description": f"Demo domain: {name} (workers/policy/demo_model.py)"})

        # The demo run's own domain first, and the run started before the other demos are seeded: under
        # `make run` the workers are already up, and its first steps overlap the seconds of imports left.
        addition = domain("addition")
        run = Run.objects.filter(owner=owner, name="demo: addition").first()
        if run is None:
            run = do_create_run(owner, name="demo: addition", base_model=base_model,
                                domains=[DomainWeight(addition)], spec=DEMO_RUN_SPEC,
                                description="GRPO with LoRA on the demo model: watch held-out reward rise")
        if opts["start"] and run.status == "draft":
            do_start_run(run, actor=owner)
            # its first tick here, at once (the one it sent the control worker then finds it done): under
            # `make run` the GPU worker is up before the control worker, whose start held the first rollout
            # back ~1 s more
            tick.advance(run.pk)
            self.stdout.write(f"started run #{run.pk} {run.name}")
        for name in DOMAINS:
            if name != "addition":
                domain(name)
        self.seed_tool_demo(owner, verifier, addition)
        self.seed_guess_demo(owner, verifier)

    def seed_tool_demo(self, owner: Any, verifier: Verifier, addition: TaskDomain) -> None:
        """The tool demo: its base model, the ``product`` domain in the python_tool environment, and a draft
        run over it and over ``addition`` (answered in the model's head, single-turn): the run's evaluation has
        both layers, end-to-end episodes and capability items."""
        base_model = self.base_model(owner, "demo-tool", TOOL_MODEL_DIR,
                                     "workers.policy.tool_demo_model:build_tool_demo_model",
                                     "The demo model with a 128-token context, primed to call a Python tool "
                                     "(workers/policy/tool_demo_model.py)")
        domain = self.domain_with_tasks(owner, "product", pool_rows("product"), {
            "kind": "answer", "verifier": verifier, "environment": "python_tool", "environment_params": {},
            "description": "Two-digit times two-digit: beyond the demo model alone; it may run "
                           "<py>code</py> in a sandbox session and read <out>…</out> before it answers"})
        if not Run.objects.filter(owner=owner, name="demo: tool use").exists():
            do_create_run(owner, name="demo: tool use", base_model=base_model,
                          domains=[DomainWeight(domain), DomainWeight(addition, weight=0.25)], spec=TOOL_RUN_SPEC,
                          description="Multi-turn GRPO: the model learns to compute products with a Python tool "
                                      "in a sandbox session. Start it from this page.")

    def seed_guess_demo(self, owner: Any, verifier: Verifier) -> None:
        """The guess-the-number demo: its base model, the ``guess`` domain in the guess_number environment
        (1-15, four guesses, higher/lower feedback), and a draft run."""
        from workers.environments.guess_number import GuessNumber, demo_rows
        base_model = self.base_model(owner, "demo-guess", GUESS_MODEL_DIR,
                                     "workers.policy.guess_demo_model:build_guess_demo_model",
                                     "The demo model with a 128-token context, pre-trained on simulated players "
                                     "of guess the number (workers/policy/guess_demo_model.py)")
        domain = self.domain_with_tasks(owner, "guess", lambda: demo_rows(GuessNumber.Params.model_validate({})), {
            "kind": "answer", "verifier": verifier, "environment": "guess_number", "environment_params": {},
            "description": "Guess a number from 1 to 15 in four guesses; after each the user says higher or "
                           "lower. The reward comes from the game's feedback, not from a tool"})
        if not Run.objects.filter(owner=owner, name="demo: guess the number").exists():
            do_create_run(owner, name="demo: guess the number", base_model=base_model,
                          domains=[DomainWeight(domain)], spec=GUESS_RUN_SPEC,
                          description="Multi-turn GRPO on feedback: the model learns to use higher and lower to "
                                      "find the number. Start it from this page.")

    def base_model(self, owner: Any, name: str, rel_dir: str, build: str | None, description: str) -> BaseModel:
        """The demo base model ``name`` registered for ``owner``; its directory is built first when missing
        (a few minutes, once) by ``build``, ``module:function``, imported only then: the builders import
        torch (~2 s of CPU that `make run`'s start would spend for nothing); None: it is committed."""
        model_dir = settings.BASE_DIR / rel_dir
        if build is not None and not (model_dir / "config.json").exists():
            module, function = build.split(":")
            self.stdout.write(f"building the base model {name} into {model_dir} (a few minutes, once) …")
            getattr(importlib.import_module(module), function)(model_dir)
        model, _ = BaseModel.objects.get_or_create(
            owner=owner, name=name, defaults={"path": rel_dir, "parameters": 1_084_288, "description": description})
        return model

    def domain_with_tasks(self, owner: Any, name: str, rows: Callable[[], Iterable[dict[str, Any]]],
                          defaults: dict[str, Any]) -> TaskDomain:
        """The demo domain ``name``, its tasks imported from ``rows()`` when it has none."""
        domain, created = TaskDomain.objects.get_or_create(owner=owner, name=name, defaults=defaults)
        if created or domain.task_count == 0:
            lines = (json.dumps(r) for r in tqdm(list(rows()), desc=f"import {name}", unit="task", leave=False))
            result = do_import_tasks(domain, lines)
            self.stdout.write(f"domain {name}: {result.imported} tasks ({result.heldout} held out)")
        return domain


def pool_rows(name: str) -> Callable[[], list[dict[str, Any]]]:
    """A demo domain's rows: its train and held-out pools (``demo_tasks._split_pool``) as JSONL rows."""
    from workers.policy.demo_tasks import _split_pool

    return lambda: [{"prompt": p, "answer": a, "split": split}
                    for split in ("train", "heldout") for p, a in _split_pool(name, split)]  # type: ignore[arg-type]
