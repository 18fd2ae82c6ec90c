"""What a tick reads stays the size of the pipeline, not of the run: the trained groups are counted by each
step's record (``Run.trained_groups``), the groups that fit the model are remembered, and the books check the
count against the groups themselves."""

from __future__ import annotations

import importlib
import re
import time
from pathlib import Path

import pytest
from django.apps import apps
from django.db import connection, transaction
from django.db.models import Count
from django.test.utils import CaptureQueriesContext

from tests import factories
from webapp.runs.loop import admission, tick, training
from webapp.runs.loop.accounting import accounting
from webapp.runs.models import PromptGroup, Run
from webapp.runs.services import DomainWeight, do_create_run
from workers.pipeline.spec import RunSpec


def two_domain_run(user):
    a, b = factories.domain(user, name="a"), factories.domain(user, name="b")
    run = do_create_run(user, name="two", base_model=factories.base_model(user), domains=[DomainWeight(a), DomainWeight(b)])
    return run, a, b


def train(run: Run, step: int, groups: list[PromptGroup]) -> None:
    """Claim ``groups`` for ``step`` and record the step, as the GPU worker does."""
    PromptGroup.objects.filter(pk__in=[g.pk for g in groups]).update(status="training", trained_step=step)
    training.finish(run, step, groups, version_path=Path(f"/versions/{step}"), metrics={}, finished_at=time.time())


def groups(run: Run, domain, status: str, n: int) -> list[PromptGroup]:
    return PromptGroup.objects.bulk_create([
        PromptGroup(run=run, key=f"{domain.pk}-{status}-{i}-{time.monotonic_ns()}", domain=domain, status=status,
                    drop_reason="too stale" if status == "dropped" else "") for i in range(n)])


def snapshot(run: Run):
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        return tick.snapshot(locked, RunSpec.model_validate(locked.spec))


@pytest.mark.django_db
def test_a_tick_counts_what_the_group_table_holds_without_reading_the_trained_groups(user):
    run, a, b = two_domain_run(user)
    train(run, 1, groups(run, a, "ready", 3) + groups(run, b, "ready", 1))
    step2 = groups(run, a, "ready", 2)
    train(run, 2, step2)
    run.refresh_from_db()
    # a second delivery of step 2: recorded once, counted once
    training.finish(run, 2, step2, version_path=Path("/versions/2"), metrics={}, finished_at=time.time())
    groups(run, a, "dropped", 4)
    groups(run, a, "verifying", 1)
    groups(run, b, "admitted", 2)
    run.refresh_from_db()
    assert run.trained_groups == {str(a.pk): 5, str(b.pk): 1}

    snap = snapshot(run)
    table = PromptGroup.objects.filter(run=run)
    assert snap.trained == table.filter(status="trained").count() == 6
    admitted = dict(table.exclude(status="dropped").values_list("domain_id").annotate(n=Count("id")).order_by())
    assert {d.domain_id: d.admitted for d in snap.domains} == admitted == {a.pk: 6, b.pk: 3}
    assert not [p for p in accounting(run).problems if "by domain" in p]


@pytest.mark.django_db
def test_the_books_catch_a_trained_count_that_differs_from_the_groups(user):
    run, a, _ = two_domain_run(user)
    train(run, 1, groups(run, a, "ready", 2))
    assert not [p for p in accounting(run).problems if "by domain" in p]
    Run.objects.filter(pk=run.pk).update(trained_groups={str(a.pk): 3})
    problems = [p for p in accounting(run).problems if "by domain" in p]
    assert problems == [f"the run's trained groups by domain, {{'{a.pk}': 3}}, differ from the groups marked "
                        f"trained, {{'{a.pk}': 2}}"]


@pytest.mark.django_db
def test_the_migration_counts_the_trained_groups_of_runs_that_trained_before_it(user):
    run, a, b = two_domain_run(user)
    train(run, 1, groups(run, a, "ready", 2) + groups(run, b, "ready", 1))
    other = factories.run(user, name="untrained")
    Run.objects.update(trained_groups={})
    migration = importlib.import_module("webapp.runs.migrations.0010_run_trained_groups")
    migration.count_trained(apps, None)
    assert Run.objects.get(pk=run.pk).trained_groups == {str(a.pk): 2, str(b.pk): 1}
    assert Run.objects.get(pk=other.pk).trained_groups == {}


@pytest.mark.django_db
def test_a_domain_that_fitted_the_model_is_not_looked_at_again(user, django_assert_num_queries):
    run, a, b = two_domain_run(user)
    assert admission.set_aside_unfit(run) == set() and run.state["fitted"] == []
    PromptGroup.objects.filter(pk=groups(run, a, "verifying", 1)[0].pk).update(generated_version=0)
    assert admission.set_aside_unfit(run) == set() and run.state["fitted"] == [a.pk]
    PromptGroup.objects.filter(pk=groups(run, b, "verifying", 1)[0].pk).update(generated_version=0)
    admission.set_aside_unfit(run)
    assert run.state["fitted"] == [a.pk, b.pk]
    with django_assert_num_queries(1):  # the run's domains; no group is read
        assert admission.set_aside_unfit(run) == set()


@pytest.mark.django_db
def test_groups_without_a_domain_are_counted_under_an_empty_key(user):
    run, a, _ = two_domain_run(user)
    orphan = PromptGroup.objects.create(run=run, key="no-domain", domain=None, status="ready")
    train(run, 1, [orphan, *groups(run, a, "ready", 1)])
    run.refresh_from_db()
    assert run.trained_groups == {"": 1, str(a.pk): 1}
    assert snapshot(run).trained == 2
    assert not [p for p in accounting(run).problems if "by domain" in p]


@pytest.mark.django_db
def test_a_deleted_domains_count_is_its_groups_without_a_domain(user):
    run, _, b = two_domain_run(user)
    train(run, 1, groups(run, b, "ready", 2))
    key = str(b.pk)
    run.run_domains.filter(domain=b).delete()
    b.delete()  # its groups' domain is set to NULL; the run's count still names it
    assert Run.objects.get(pk=run.pk).trained_groups == {key: 2}
    assert not [p for p in accounting(run).problems if "by domain" in p]


@pytest.mark.django_db
def test_a_start_or_resume_sets_a_count_that_differs_from_the_groups_right(user, redis_url, caplog):
    from webapp.runs import services

    run, a, _ = two_domain_run(user)
    train(run, 1, groups(run, a, "ready", 3))
    Run.objects.filter(pk=run.pk).update(trained_groups={str(a.pk): 1})  # e.g. a worker of the old code
    services.do_start_run(Run.objects.get(pk=run.pk), actor=user, force=True)
    assert tick.advance(run.pk) == "running"
    assert Run.objects.get(pk=run.pk).trained_groups == {str(a.pk): 3}
    assert "recounted" in caplog.text


@pytest.mark.django_db
def test_admission_keeps_the_domains_that_fit(user):
    run, a, _ = two_domain_run(user)
    PromptGroup.objects.filter(pk=groups(run, a, "verifying", 1)[0].pk).update(generated_version=0)
    admission.admit(run, {a.pk: 1}, {})
    assert Run.objects.get(pk=run.pk).state["fitted"] == [a.pk]  # written with the admission


@pytest.mark.django_db
def test_the_run_page_counts_every_status_without_reading_the_trained_groups(client, user):
    from webapp.ui.views import _group_counts

    run, a, b = two_domain_run(user)
    train(run, 1, groups(run, a, "ready", 3) + groups(run, b, "ready", 2))
    groups(run, a, "dropped", 4)
    groups(run, b, "verifying", 1)
    groups(run, a, "admitted", 2)
    groups(run, a, "ready", 1)
    table = dict(PromptGroup.objects.filter(run=run).values_list("status").annotate(n=Count("id")).order_by())
    assert table == {"trained": 5, "dropped": 4, "verifying": 1, "admitted": 2, "ready": 1}

    client.force_login(user)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    shown = re.findall(r'<span class="tag">(\w+): (\d+)</span>', html.split('id="group-counts"')[1].split("</p>")[0])
    # in the pipeline's order, each status as the group table holds it
    assert shown == [("admitted", "2"), ("verifying", "1"), ("ready", "1"), ("trained", "5"), ("dropped", "4")]

    run = Run.objects.get(pk=run.pk)
    with CaptureQueriesContext(connection) as queries:
        assert _group_counts(run) == table
    assert len(queries) == 1 and "'trained'" not in queries[0]["sql"], queries.captured_queries
