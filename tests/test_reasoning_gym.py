"""The reasoning-gym extra (skipped where it is not installed): one generator domain per dataset, seeded and
disjoint, scored with the dataset's own score_answer, and a pack of its datasets that names what it cannot
calibrate."""

from __future__ import annotations

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from webapp.catalog.models import CalibrationStatus, TaskDomain  # noqa: E402
from webapp.catalog.packs import PackItem, do_create_pack  # noqa: E402
from workers.domains import generators as gen  # noqa: E402
from workers.domains import reasoning_gym as rg  # noqa: E402
from workers.verifiers.base import JudgeInput, build_verifier  # noqa: E402


def test_a_dataset_stream_is_seeded_disjoint_and_scored_by_the_dataset() -> None:
    params = gen.check_params("rg.basic_arithmetic", {})
    a = [gen.generate("rg.basic_arithmetic", params, 3, "train", i) for i in (0, 1, 300)]
    assert a == [gen.generate("rg.basic_arithmetic", params, 3, "train", i) for i in (0, 1, 300)]
    held = {gen.content_hash(t.prompt) for _, t in gen.heldout_set("rg.basic_arithmetic", params, 3, 50)}
    train, _ = gen.train_batch("rg.basic_arithmetic", params, 3, 0, 200, held)
    assert not held & {gen.content_hash(t.prompt) for _, t in train}
    task = train[0][1]
    verifier = build_verifier("generator", {})
    ref = {"generator": "rg.basic_arithmetic", "answer": task.answer, "entry": task.entry}
    assert verifier.judge(JudgeInput(task.prompt, f"<answer>{task.answer}</answer>", ref, "generated")).status == "pass"
    assert verifier.judge(JudgeInput(task.prompt, "no idea", ref, "generated")).status == "fail"


def test_difficulty_and_config_are_checked_by_reasoning_gym() -> None:
    assert gen.check_params("rg.basic_arithmetic", {"difficulty": 3}).difficulty == 3
    with pytest.raises(gen.GeneratorError) as exc:
        gen.check_params("rg.basic_arithmetic", {"config": {"min_terms": 5, "max_terms": 2}})
    assert exc.value.problems[0][0] == "generator_params.config"
    with pytest.raises(gen.GeneratorError, match="no dataset"):
        gen.check_params("rg.no_such_dataset", {})


@pytest.mark.django_db
def test_a_reasoning_gym_pack_calibrates_each_domain_or_names_why(user) -> None:
    items = [PackItem(f"rg.{n}") for n in ("basic_arithmetic", "spell_backward", "boxnet", "gsm_symbolic")]
    result = do_create_pack(user, "rg", items, heldout_size=20)
    assert {d.name for d in result.created} >= {"rg/basic_arithmetic", "rg/spell_backward"}
    failed = dict(result.failed)
    assert "gave its own answer" in failed["rg/boxnet"]  # its answers are None: its score cannot pass them
    for domain in TaskDomain.objects.filter(pack="rg").select_related("verifier"):
        assert domain.verifier.calibration_status == CalibrationStatus.PASSED
        assert domain.heldout_count == 20
    assert len(rg.dataset_names()) >= 100
