"""``manage.py import_tasks DOMAIN FILE``: progress, all-or-nothing, bad lines named with file:line."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from tests import factories
from webapp.catalog.models import Task

pytestmark = pytest.mark.django_db


def test_imports_a_file(tmp_path, user):
    domain = factories.domain(user)
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+{i}=", "answer": 2 * i}) for i in range(5000)) + "\n")
    out = StringIO()
    call_command("import_tasks", "addition", str(path), stdout=out, stderr=StringIO())
    assert "imported 5000 tasks" in out.getvalue()
    assert Task.objects.filter(domain=domain).count() == 5000
    domain.refresh_from_db()
    assert domain.task_count == 5000 and 0 < domain.heldout_count < 5000


def test_bad_file_imports_nothing_and_names_lines(tmp_path, user):
    domain = factories.domain(user)
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2="}\n{oops\n')
    err = StringIO()
    with pytest.raises(CommandError, match="2 bad row"):
        call_command("import_tasks", str(domain.pk), str(path), stdout=StringIO(), stderr=err)
    assert f"{path}:2: answer: Field required" in err.getvalue()
    assert f"{path}:3: (line): not valid JSON" in err.getvalue()
    assert not Task.objects.exists()


def test_unknown_domain_or_file(tmp_path, user):
    factories.domain(user)
    with pytest.raises(CommandError, match="no domain named"):
        call_command("import_tasks", "nope", str(tmp_path / "x.jsonl"))
    with pytest.raises(CommandError, match="no such file"):
        call_command("import_tasks", "addition", str(tmp_path / "x.jsonl"))
