"""Generator domains and domain packs: seeded tasks (deterministic, train and held-out disjoint by content),
parameters checked by the generator, a pack made through the API and ``manage.py create_pack`` with a domain
that cannot calibrate named with its reason while the rest are created, and an endless train stream."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command

from tests import factories
from webapp.catalog import generated
from webapp.catalog.models import CalibrationStatus, Task, TaskDomain, Verifier
from webapp.runs.loop import admission
from workers.domains import generators as gen
from workers.verifiers.base import JudgeInput, build_verifier

# ---------------------------------------------------------------- the pure half


def test_a_stream_is_the_same_for_the_same_seed_and_differs_for_another() -> None:
    params = gen.check_params("demo.product", {"difficulty": 3})
    first = [gen.generate("demo.product", params, 7, "train", i) for i in range(50)]
    assert first == [gen.generate("demo.product", params, 7, "train", i) for i in range(50)]
    assert first != [gen.generate("demo.product", params, 8, "train", i) for i in range(50)]
    assert gen.heldout_set("demo.product", params, 7, 20) == gen.heldout_set("demo.product", params, 7, 20)
    assert all(gen.score("demo.product", t.answer, t) == 1.0 for t in first)


def test_train_never_holds_a_heldout_task_even_in_a_tiny_problem_space() -> None:
    # one-digit sums: 100 distinct tasks, so the two seed spaces collide all the time
    params = gen.check_params("demo.addition", {"difficulty": 1})
    held = gen.heldout_set("demo.addition", params, 0, 30)
    hashes = {gen.content_hash(t.prompt) for _, t in held}
    assert len(hashes) == 30
    train, after = gen.train_batch("demo.addition", params, 0, 0, 500, hashes)
    assert len(train) == 500 and after > 500  # some indexes were skipped: they were held out
    assert not hashes & {gen.content_hash(t.prompt) for _, t in train}


def test_parameters_are_checked_by_the_generator() -> None:
    with pytest.raises(gen.GeneratorError) as exc:
        gen.check_params("demo.addition", {"difficulty": 9, "colour": "red"})
    fields = dict(exc.value.problems)
    assert "less than or equal to 5" in fields["generator_params.difficulty"]
    assert fields["generator_params.colour"] == "unknown parameter"
    with pytest.raises(gen.GeneratorError, match="unknown generator 'nope'"):
        gen.check_params("nope", {})


def test_the_generator_verifier_scores_with_the_generator() -> None:
    verifier = build_verifier("generator", {})
    ref = {"generator": "demo.addition", "answer": "85", "entry": {}}
    assert verifier.judge(JudgeInput("37+48=", "85\n", ref, "generated")).status == "pass"
    assert verifier.judge(JudgeInput("37+48=", "86", ref, "generated")).status == "fail"
    bad = verifier.judge(JudgeInput("37+48=", "85", {**ref, "generator": "nope"}, "generated"))
    assert bad.status == "invalid" and "unknown generator" in (bad.reason or "")


# ---------------------------------------------------------------- the database half


@pytest.mark.django_db
def test_a_generator_domain_materializes_heldout_once_and_train_without_end(user) -> None:
    domain = generated.do_create_generator_domain(user, name="sums", generator="demo.addition",
                                                  params={"difficulty": 1}, heldout_size=30)
    assert (domain.kind, domain.heldout_count, domain.task_count) == ("generated", 30, 30 + generated.TRAIN_BATCH)
    held = set(Task.objects.filter(domain=domain, split="heldout").values_list("prompt", flat=True))
    run = factories.run(user)
    seen: list[int] = []
    for _ in range(8):  # 8 x 40 admitted: more than the first batch, so admission makes more
        seen += [t.pk for t in admission.next_tasks(run, domain.pk, 40, generated=True)]
    assert len(seen) == len(set(seen)) == 320  # an endless stream: nothing admitted twice
    domain.refresh_from_db()
    assert domain.task_count == 30 + Task.objects.filter(domain=domain, split="train").count() >= 30 + 320
    assert not held & set(Task.objects.filter(pk__in=seen).values_list("prompt", flat=True))
    # harder from now on: new train tasks use the new parameters, the held-out set stays
    TaskDomain.objects.filter(pk=domain.pk).update(generator_params={"difficulty": 3})
    generated.extend_train(domain.pk, 5)
    newest = Task.objects.filter(domain=domain, split="train").order_by("-id")[0]
    assert newest.metadata["params"]["difficulty"] == 3 and len(newest.prompt) == len("123+456=")
    assert set(Task.objects.filter(domain=domain, split="heldout").values_list("prompt", flat=True)) == held


@pytest.mark.django_db
def test_a_domain_whose_prompts_never_fit_the_model_is_set_aside(user) -> None:
    """Admitted by weight, a domain whose prompts are all longer than the model's context would have its
    groups dropped for ever: after 8 such drops and no group generated it is set aside, with an event; a
    domain with one prompt that fitted is not."""
    from webapp.runs.models import PromptGroup, RunEvent

    long = generated.do_create_generator_domain(user, name="long", generator="demo.addition",
                                                params={"difficulty": 1}, heldout_size=10)
    mixed = generated.do_create_generator_domain(user, name="mixed", generator="demo.addition",
                                                 params={"difficulty": 1}, heldout_size=10)
    run = factories.run(user)
    reason = "the prompt is 1381 tokens: the model's context of 1024 leaves no room for 24 more (sampling.max_tokens)"
    for domain, n in ((long, 7), (mixed, 8)):
        PromptGroup.objects.bulk_create([PromptGroup(run=run, key=f"{domain.pk}-{i}", domain=domain,
                                                     status="dropped", drop_reason=reason) for i in range(n)])
    PromptGroup.objects.create(run=run, key="fitted", domain=mixed, status="trained", generated_version=0)
    assert len(admission.admit(run, {long.pk: 8, mixed.pk: 4}, {})) == 12  # 7 drops: not yet
    assert admission.set_aside_unfit(run) == set()
    PromptGroup.objects.filter(run=run, domain=long, status="admitted").update(status="dropped", drop_reason=reason)
    ids = admission.admit(run, {long.pk: 4, mixed.pk: 4}, {})
    assert set(PromptGroup.objects.filter(pk__in=ids).values_list("domain_id", flat=True)) == {mixed.pk}
    assert run.state["set_aside"] == {str(long.pk): f"none of its 15 prompts so far fits the model: {reason}"}
    event = RunEvent.objects.get(run=run, kind="domain.set_aside")
    assert event.message.startswith("domain long set aside: none of its 15 prompts") and event.level == "warning"
    admission.admit(run, {long.pk: 4}, {})
    assert RunEvent.objects.filter(run=run, kind="domain.set_aside").count() == 1  # said once
    run.refresh_from_db()
    assert run.status == "draft"  # mixed and the run's own domain are left


@pytest.mark.django_db
def test_a_run_none_of_whose_domains_fits_the_model_fails_with_the_reason(user) -> None:
    from webapp.runs.models import PromptGroup, Run

    run = factories.run(user)
    Run.objects.filter(pk=run.pk).update(status="running")
    run.refresh_from_db()
    domain_id = run.run_domains.get().domain_id
    reason = "the prompt is 90 tokens: the model's context of 64 leaves no room for 6 more (sampling.max_tokens)"
    PromptGroup.objects.bulk_create([PromptGroup(run=run, key=str(i), domain_id=domain_id, status="dropped",
                                                 drop_reason=reason) for i in range(8)])
    assert admission.admit(run, {domain_id: 4}, {}) == []
    run.refresh_from_db()
    assert run.status == "failed"
    assert run.status_reason == ("no domain is left to admit from: 1 set aside, as none of their prompts fits "
                                 f"the model (none of its 8 prompts so far fits the model: {reason})")


@pytest.mark.django_db
def test_a_domain_whose_space_is_all_heldout_is_refused(user) -> None:
    from webapp.common.errors import ValidationFailed

    with pytest.raises(ValidationFailed, match="nothing left to train on"):
        generated.do_create_generator_domain(user, name="tiny", generator="demo.addition", params={"difficulty": 1},
                                             heldout_size=200)
    assert not TaskDomain.objects.exists()


class Lenient:
    """A generator whose score accepts anything: its calibration must fail (a known-bad answer passes)."""

    name, label, tags = "test.lenient", "accepts anything", ("test",)
    Params = gen.GeneratorParams

    def generate(self, params: gen.GeneratorParams, seed: int, index: int) -> gen.Generated:
        return gen.Generated(f"say {seed % 997 + index}", str(seed % 997 + index))

    def score(self, answer: str, task: gen.Generated) -> float:
        return 1.0


@pytest.fixture
def lenient(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(gen.BUILTIN, "test.lenient", Lenient())


@pytest.mark.django_db
def test_a_pack_through_the_api_names_what_it_could_not_make(api, user, lenient) -> None:
    body = {"pack": "mine", "heldout_size": 20, "tags": ["week1"], "items": [
        {"generator": "demo.addition", "params": {"difficulty": 2}},
        {"generator": "demo.product", "params": {"difficulty": 2}, "name": "products"},
        {"generator": "test.lenient"},
        {"generator": "demo.addition", "params": {"difficulty": 7}, "name": "too-hard"},
        {"generator": "nope"},
    ]}
    response = api.post("/api/v1/domain-packs/", body, format="json")
    assert response.status_code == 201, response.content
    out = response.json()
    assert [d["name"] for d in out["created"]] == ["mine/addition-d2", "mine/products"]
    failed = {f["name"]: f["reason"] for f in out["failed"]}
    assert "accepted a known-bad answer" in failed["mine/lenient"]
    assert "difficulty" in failed["mine/too-hard"] and "unknown generator" in failed["mine/nope"]
    domains = list(TaskDomain.objects.filter(pack="mine").select_related("verifier").order_by("name"))
    assert [d.name for d in domains] == ["mine/addition-d2", "mine/products"]
    for d in domains:
        assert d.verifier is not None and d.verifier.kind == "generator"
        assert d.verifier.calibration_status == CalibrationStatus.PASSED
        assert d.heldout_count == 20 and "week1" in d.tags and "demo" in d.tags
    assert not Verifier.objects.filter(name__startswith="mine/lenient").exists()  # rolled back with its domain
    # the parameters are shown and checked on the domain, as a person would change them
    detail = api.get(f"/api/v1/domains/{domains[0].pk}/").json()
    assert (detail["generator"], detail["generator_params"]) == ("demo.addition", {"difficulty": 2})
    refused = api.patch(f"/api/v1/domains/{domains[0].pk}/", {"generator_params": {"difficulty": 0}}, format="json")
    assert refused.status_code == 400 and "difficulty" in str(refused.json()["generator_params"])
    assert api.patch(f"/api/v1/domains/{domains[0].pk}/", {"generator_params": {"difficulty": 3}},
                     format="json").status_code == 200
    assert TaskDomain.objects.get(pk=domains[0].pk).generator_params == {"difficulty": 3}


@pytest.mark.django_db
def test_create_pack_command_shows_progress_and_names_failures(user, lenient) -> None:
    out, err = io.StringIO(), io.StringIO()
    call_command("create_pack", "demo", owner=user.username, only="addition-d2,multiplication-d3",
                 heldout_size=10, stdout=out, stderr=err)
    assert "created 2 domain(s) of 2" in out.getvalue()
    assert "pack demo" in err.getvalue()  # tqdm's bar
    assert set(TaskDomain.objects.filter(pack="demo").values_list("name", flat=True)) == {
        "demo/addition-d2", "demo/multiplication-d3"}
    err = io.StringIO()
    call_command("create_pack", "mixed", owner=user.username, stdout=out, stderr=err, heldout_size=10,
                 items='[{"generator": "test.lenient"}, {"generator": "demo.product"}]')
    assert "not created: mixed/lenient: calibration" in err.getvalue() or "not created: mixed/lenient: its score" \
        in err.getvalue()
    assert TaskDomain.objects.filter(name="mixed/product").exists()
