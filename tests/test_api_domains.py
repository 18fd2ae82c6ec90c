"""/api/v1/domains/: CRUD, ownership, nested tasks and the all-or-nothing JSONL import."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from tests import factories
from webapp.catalog.models import Task, TaskDomain

pytestmark = pytest.mark.django_db


def jsonl(rows: list[object]) -> bytes:
    return b"\n".join(json.dumps(r).encode() for r in rows) + b"\n"


def test_create_and_read_domain(api, user):
    response = api.post("/api/v1/domains/", {"name": "addition", "kind": "answer", "heldout_fraction": 0.2},
                        format="json")
    assert response.status_code == 201, response.content
    domain = TaskDomain.objects.get(pk=response.json()["id"])
    assert (domain.owner, domain.kind, domain.heldout_fraction) == (user, "answer", 0.2)
    assert api.get(f"/api/v1/domains/{domain.pk}/").json()["name"] == "addition"


def test_create_domain_rejects_bad_fields(api):
    response = api.post("/api/v1/domains/", {"name": "x", "kind": "nonsense", "heldout_fraction": 1.5}, format="json")
    assert response.status_code == 400
    assert set(response.json()) >= {"kind", "heldout_fraction"}
    assert not TaskDomain.objects.exists()


def test_anonymous_is_refused():
    response = APIClient().get("/api/v1/domains/")
    assert response.status_code in (401, 403)


def test_other_users_domain_is_invisible_and_unchangeable(api, other_api, user):
    domain = factories.domain(user)
    assert other_api.get(f"/api/v1/domains/{domain.pk}/").status_code == 404
    assert other_api.patch(f"/api/v1/domains/{domain.pk}/", {"name": "stolen"}, format="json").status_code == 404
    assert other_api.get("/api/v1/domains/").json()["count"] == 0
    domain.refresh_from_db()
    assert domain.name == "addition"


def test_cannot_attach_another_users_verifier(api, other_user):
    foreign = factories.verifier(other_user)
    response = api.post("/api/v1/domains/", {"name": "d", "verifier": foreign.pk}, format="json")
    assert response.status_code == 400
    assert "verifier" in response.json()


def test_list_query_count_does_not_grow_with_rows(api, user):
    for i in range(3):
        factories.domain(user, name=f"d{i}")
    with CaptureQueriesContext(connection) as few:
        assert api.get("/api/v1/domains/").status_code == 200
    for i in range(3, 30):
        factories.domain(user, name=f"d{i}")
    with CaptureQueriesContext(connection) as many:
        assert api.get("/api/v1/domains/").json()["count"] == 30
    assert len(many) == len(few)


def test_import_jsonl_body(api, user):
    domain = factories.domain(user)
    rows = [{"id": f"t{i}", "prompt": f"{i}+1=", "answer": i + 1} for i in range(50)]
    response = api.post(f"/api/v1/domains/{domain.pk}/import/", jsonl(rows), content_type="application/x-ndjson")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["imported"] == 50 and body["task_count"] == 50
    assert Task.objects.filter(domain=domain).count() == 50
    assert Task.objects.get(domain=domain, external_id="t7").reference == {"answer": "8"}
    domain.refresh_from_db()
    assert domain.task_count == 50
    assert domain.heldout_count == Task.objects.filter(domain=domain, split="heldout").count()


def test_import_multipart_file(api, user):
    from django.core.files.uploadedfile import SimpleUploadedFile

    domain = factories.domain(user, kind="code")
    data = jsonl([{"prompt": "def add(a, b):", "tests": "assert add(1, 2) == 3", "split": "heldout"}])
    response = api.post(f"/api/v1/domains/{domain.pk}/import/",
                        {"file": SimpleUploadedFile("tasks.jsonl", data)}, format="multipart")
    assert response.status_code == 201, response.content
    task = Task.objects.get(domain=domain)
    assert (task.split, task.reference) == ("heldout", {"tests": "assert add(1, 2) == 3"})


def test_import_with_bad_rows_imports_nothing_and_lists_each(api, user):
    domain = factories.domain(user, kind="code")
    lines = [
        json.dumps({"prompt": "ok", "tests": "assert True"}),
        "{not json",
        json.dumps({"prompt": "", "tests": "assert True"}),
        json.dumps({"prompt": "p", "tests": "assert (("}),
        json.dumps(["a", "list"]),
        json.dumps({"prompt": "p", "tests": "assert 1", "tset": "typo"}),
        json.dumps({"prompt": "fine again", "tests": "assert 1"}),
    ]
    response = api.post(f"/api/v1/domains/{domain.pk}/import/", "\n".join(lines).encode(),
                        content_type="application/x-ndjson")
    assert response.status_code == 400
    body = response.json()
    assert "nothing was imported" in body["detail"]
    by_line = {(e["line"], e["field"]) for e in body["errors"]}
    assert {(2, "(line)"), (3, "prompt"), (4, "tests"), (5, "(line)"), (6, "tset")} <= by_line
    assert all(e["line"] not in (1, 7) for e in body["errors"])
    assert not Task.objects.filter(domain=domain).exists()
    domain.refresh_from_db()
    assert domain.task_count == 0


def test_import_rejects_duplicate_and_existing_ids(api, user):
    domain = factories.domain(user)
    ok = api.post(f"/api/v1/domains/{domain.pk}/import/", jsonl([{"id": "a", "prompt": "p", "answer": 1}]),
                  content_type="application/x-ndjson")
    assert ok.status_code == 201
    response = api.post(f"/api/v1/domains/{domain.pk}/import/",
                        jsonl([{"id": "a", "prompt": "p", "answer": 1}, {"id": "b", "prompt": "p", "answer": 2},
                               {"id": "b", "prompt": "q", "answer": 3}]),
                        content_type="application/x-ndjson")
    assert response.status_code == 400
    reasons = {e["line"]: e["reason"] for e in response.json()["errors"]}
    assert "already exists" in reasons[1] and "first on line 2" in reasons[3]
    assert Task.objects.filter(domain=domain).count() == 1


def test_import_invalid_utf8_and_empty_file(api, user):
    domain = factories.domain(user)
    response = api.post(f"/api/v1/domains/{domain.pk}/import/", b'{"prompt": "\xff", "answer": 1}\n',
                        content_type="application/x-ndjson")
    assert response.status_code == 400 and response.json()["errors"][0]["reason"] == "not UTF-8 text"
    empty = api.post(f"/api/v1/domains/{domain.pk}/import/", b"\n\n", content_type="application/x-ndjson")
    assert empty.status_code == 400 and "no rows" in empty.json()["errors"][0]["reason"]


def test_import_into_other_users_domain_is_refused(other_api, user):
    domain = factories.domain(user)
    response = other_api.post(f"/api/v1/domains/{domain.pk}/import/", jsonl([{"prompt": "p", "answer": 1}]),
                              content_type="application/x-ndjson")
    assert response.status_code == 404
    assert not Task.objects.exists()


def test_tasks_are_listed_with_cursor_pagination(api, user):
    domain = factories.domain(user)
    api.post(f"/api/v1/domains/{domain.pk}/import/",
             jsonl([{"id": str(i), "prompt": f"p{i}", "answer": i, "split": "train"} for i in range(250)]),
             content_type="application/x-ndjson")
    seen: list[str] = []
    url: str | None = f"/api/v1/domains/{domain.pk}/tasks/?page_size=100"
    while url:
        page = api.get(url).json()
        seen += [t["external_id"] for t in page["results"]]
        url = page["next"]
    assert len(seen) == 250 and len(set(seen)) == 250
    assert seen[0] == "249"  # newest first
    assert api.get(f"/api/v1/domains/{domain.pk}/tasks/?split=heldout").json()["results"] == []
