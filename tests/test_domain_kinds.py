"""Every domain kind, through the API a user has: rows imported as the example files give them, a verifier
attached, and known-good and known-bad completions judged against the references *the importer stored*
(never against references written by hand). Also: what attaching refuses, and what the model is shown."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from django.urls import reverse

from workers.domains import kinds

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parent.parent


class _Judge(BaseHTTPRequestHandler):
    """A stand-in for an OpenAI-compatible judge: passes a response with exactly as many lines as the
    task's own rubric asks for ("Three lines …"), which it can only know if that rubric reached it."""

    prompts: list[str] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]
        type(self).prompts.append(prompt)
        rubric = prompt.split("## Rubric\n", 1)[1].split("## Task", 1)[0]
        response = prompt.split("<response-", 1)[1].split(">\n", 1)[1].rsplit("\n</response-", 1)[0]
        lines = len([ln for ln in response.splitlines() if ln.strip()])
        good = "For this task: Three lines" in rubric and lines == 3
        text = f"{lines} lines.\nSCORE: {10 if good else 1}"
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def judge_url() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


# (domain kind, verifier kind, verifier config, example row ids to import, {row id: ([good], [bad])})
CASES = [
    ("answer", "exact_match", {}, ["add-1", "half"], {"add-1": (["5"], ["6", ""]), "half": ([".5", "0.5"], ["0.4"])}),
    ("answer", "math", {}, ["add-1", "half"], {"add-1": (["5"], ["7"]), "half": (["1/2", "0.5"], ["1/3"])}),
    ("answer", "regex", {}, ["year"], {"year": (["1995"], ["2001", "199"])}),
    ("code", "python_tests", {}, ["square", "rev"], {
        "square": (["def square(x):\n    return x * x"], ["def square(x):\n    return x + x", "square = 9"]),
        "rev": (["def rev(s):\n    return s[::-1]"], ["def rev(s):\n    return s"])}),
    ("command", "command", {}, ["count", "hello"], {
        "count": (["wc -l < input.txt > count.txt"], ["echo 2 > count.txt", "exit 0"]),
        "hello": (["echo hello > hello.txt"], ["echo bye > hello.txt", ""])}),
    ("document_qa", "f1", {}, ["capital"], {"capital": (["Paris"], ["London"])}),
    ("json", "json_match", {"mode": "equal"}, ["point"], {
        "point": (['{"x": 1, "y": 2}', 'Here: ```json\n{"y": 2, "x": 1}\n```'], ['{"x": 2, "y": 1}', "{}"])}),
    # schema mode: non-conforming JSON fails, including the empty object that used to pass any schema
    ("json", "json_match", {"mode": "schema"}, ["person"], {
        "person": (['{"name": "Bo", "age": 3}'], ['{"name": "Bo"}', '{"name": 1, "age": -1}', "{}", "[]"])}),
    ("open", "llm_judge", {"rubric": "Judge the poem."}, ["haiku"], {
        "haiku": (["waves fold on the sand\nsalt wind carries gull voices\nthe tide keeps its time"],
                  ["the sea is big", ""])}),
]


def _import(api: Any, kind: str, verifier_id: int, row_ids: list[str]) -> dict[str, dict[str, Any]]:
    return _import_rows(api, kind, verifier_id, [r for r in kinds.KINDS[kind].examples if r["id"] in row_ids])


@pytest.mark.parametrize(("kind", "verifier_kind", "config", "row_ids", "completions"), CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2].get('mode', '')}".rstrip("-") for c in CASES])
def test_each_kind_judges_known_good_pass_and_known_bad_fail_against_stored_references(
        api: Any, judge_url: str, kind: str, verifier_kind: str, config: dict[str, Any], row_ids: list[str],
        completions: dict[str, tuple[list[str], list[str]]]) -> None:
    if verifier_kind == "llm_judge":
        config = {**config, "endpoint": judge_url, "model": "stand-in"}
    verifier = api.post("/api/v1/verifiers/", {"name": f"{kind}-{verifier_kind}", "kind": verifier_kind,
                                               "config": config}, format="json")
    assert verifier.status_code == 201, verifier.content
    tasks = _import(api, kind, verifier.json()["id"], row_ids)
    assert set(tasks) == set(row_ids)
    items = [{"task": tasks[rid]["id"], "completion": c, "expect": expect}
             for rid, (good, bad) in completions.items()
             for expect, group in (("pass", good), ("fail", bad)) for c in group]
    response = api.post(f"/api/v1/verifiers/{verifier.json()['id']}/dry-run/",
                        {"items": [{k: v for k, v in i.items() if k != "expect"} for i in items]}, format="json")
    assert response.status_code == 200, response.content
    got = [(r["completion"], r["verdict"], r["reason"]) for r in response.json()["results"]]
    assert [v for _, v, _ in got] == [i["expect"] for i in items], got
    if verifier_kind == "llm_judge":  # the task's rubric reached the judge as a rubric, not as the reference
        assert all("For this task: Three lines" in p.split("## Task")[0] for p in _Judge.prompts)


def test_a_verifier_that_cannot_judge_the_kind_is_refused_when_attached(api: Any) -> None:
    exact = api.post("/api/v1/verifiers/", {"name": "exact", "kind": "exact_match"}, format="json").json()
    refused = api.post("/api/v1/domains/", {"name": "j", "kind": "json", "verifier": exact["id"]}, format="json")
    assert refused.status_code == 400
    assert "cannot judge a 'json' domain" in refused.json()["verifier"][0]
    assert "json_match" in refused.json()["verifier"][0]
    domain = api.post("/api/v1/domains/", {"name": "j", "kind": "json"}, format="json").json()
    patched = api.patch(f"/api/v1/domains/{domain['id']}/", {"verifier": exact["id"]}, format="json")
    assert patched.status_code == 400 and "cannot judge" in patched.json()["verifier"][0]
    # and a verifier already attached cannot change to a kind that cannot judge its domains
    match = api.post("/api/v1/verifiers/", {"name": "match", "kind": "json_match"}, format="json").json()
    assert api.patch(f"/api/v1/domains/{domain['id']}/", {"verifier": match["id"]}, format="json").status_code == 200
    changed = api.patch(f"/api/v1/verifiers/{match['id']}/", {"kind": "exact_match", "config": {}}, format="json")
    assert changed.status_code == 400 and "attached to domain 'j'" in changed.json()["kind"][0]


def test_calibration_cases_in_another_shape_than_the_tasks_store_are_refused(api: Any) -> None:
    response = api.post("/api/v1/verifiers/", {"name": "cmd", "kind": "command", "calibration_cases": [
        {"completion": "true", "reference": {"test_scrpt": "true"}, "expected": "pass"},
        {"completion": "true", "reference": {"script": "true"}, "expected": "pass"}]}, format="json")
    assert response.status_code == 400
    (problem,) = response.json()["calibration_cases"]
    assert problem.startswith("case 1:") and "test_scrpt" in problem


def test_a_kind_does_not_change_under_stored_tasks(api: Any) -> None:
    domain = api.post("/api/v1/domains/", {"name": "a", "kind": "answer"}, format="json").json()
    api.post(f"/api/v1/domains/{domain['id']}/import/", b'{"prompt": "1+1=", "answer": 2}\n',
             content_type="application/x-ndjson")
    response = api.patch(f"/api/v1/domains/{domain['id']}/", {"kind": "json"}, format="json")
    assert response.status_code == 400 and "cannot change" in response.json()["kind"][0]


def test_the_prompt_template_shows_the_document_and_never_the_answer(api: Any) -> None:
    leaky = api.post("/api/v1/domains/", {"name": "d", "kind": "document_qa", "prompt_template": "{prompt} {answers}"},
                     format="json")
    assert leaky.status_code == 400 and "{answers} is not a field" in leaky.json()["prompt_template"][0]
    domain = api.post("/api/v1/domains/", {"name": "d", "kind": "document_qa", "system_prompt": "Answer briefly."},
                      format="json").json()
    api.post(f"/api/v1/domains/{domain['id']}/import/", kinds.example_jsonl("document_qa").encode(),
             content_type="application/x-ndjson")
    from webapp.catalog.models import Task

    task = Task.objects.select_related("domain").get(domain_id=domain["id"])
    shown = task.model_prompt()
    assert shown == ("Answer briefly.\n\nFrance is a country in Europe. Its capital is Paris.\n\n"
                     "Question: What is the capital of France?\nAnswer:")
    custom = api.patch(f"/api/v1/domains/{domain['id']}/", {"prompt_template": "Q: {prompt} [{metadata.source}]"},
                       format="json")
    assert custom.status_code == 200, custom.content
    task.domain.refresh_from_db()
    assert task.model_prompt() == "Answer briefly.\n\nQ: What is the capital of France? []"


def test_answer_domains_keep_showing_the_bare_prompt() -> None:
    from workers.domains.prompts import render

    assert render("answer", "", "", prompt="12+34=", reference={"answer": "46"}) == "12+34="


def test_the_generated_example_files_and_readme_table_are_up_to_date() -> None:
    assert kinds.main(["--root", str(ROOT)]) == 0, "run `python -m workers.domains.kinds --write`"
    for name in kinds.KINDS:
        for line in (ROOT / "assets" / "examples" / f"{name}.jsonl").read_text().splitlines():
            kinds.parse_row(name, json.loads(line))  # every example row is a valid row of its kind


def test_the_domain_page_refuses_an_incompatible_verifier_and_previews_the_prompt(client: Any, user: Any) -> None:
    from tests import factories

    client.force_login(user)
    exact = factories.verifier(user, name="exact")
    response = client.post(reverse("domain-new"), {"name": "docs", "kind": "code", "verifier": exact.pk,
                                                   "heldout_fraction": 0.1})
    assert response.status_code == 200
    assert "cannot judge a &#x27;code&#x27; domain" in response.content.decode()
    domain = factories.domain(user, name="qa", kind="document_qa")
    from webapp.catalog.services import do_import_tasks

    do_import_tasks(domain, [kinds.example_jsonl("document_qa")])
    page = client.get(reverse("domain", args=[domain.pk])).content.decode()
    assert "Its capital is Paris.\n\nQuestion: What is the capital of France?" in page
    saved = client.post(reverse("domain", args=[domain.pk]), {
        "settings": "1", "name": "qa", "kind": "document_qa", "verifier": exact.pk, "heldout_fraction": 0.1,
        "prompt_template": "{context} | {prompt}", "system_prompt": ""})
    assert saved.status_code == 302
    domain.refresh_from_db()
    assert domain.verifier_id == exact.pk and domain.prompt_template == "{context} | {prompt}"
    assert "Its capital is Paris. | What is the capital of France?" in client.get(
        reverse("domain", args=[domain.pk])).content.decode()


def test_a_command_row_with_test_script_is_judged_by_its_script(api: Any) -> None:
    """The field name the importer used to store and the verifier never read: now one name, one reading."""
    verifier = api.post("/api/v1/verifiers/", {"name": "cmd", "kind": "command"}, format="json").json()
    tasks = _import_rows(api, "command", verifier["id"],
                         [{"id": "t", "prompt": "Create out.txt.", "test_script": "test -f out.txt"}])
    assert tasks["t"]["reference"]["script"] == "test -f out.txt"
    response = api.post(f"/api/v1/verifiers/{verifier['id']}/dry-run/", {"items": [
        {"task": tasks["t"]["id"], "completion": "touch out.txt"},
        {"task": tasks["t"]["id"], "completion": "touch other.txt"}]}, format="json")
    assert [r["verdict"] for r in response.json()["results"]] == ["pass", "fail"]


def _import_rows(api: Any, kind: str, verifier_id: int, rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    domain = api.post("/api/v1/domains/", {"name": f"{kind}-rows", "kind": kind, "verifier": verifier_id},
                      format="json").json()
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    assert api.post(f"/api/v1/domains/{domain['id']}/import/", body,
                    content_type="application/x-ndjson").status_code == 201
    return {t["external_id"]: t for t in api.get(f"/api/v1/domains/{domain['id']}/tasks/").json()["results"]}


def test_the_django_choices_are_the_kinds() -> None:
    from webapp.catalog.models import DomainKind

    assert [(v, str(label)) for v, label in DomainKind.choices] == [(k, s.label) for k, s in kinds.KINDS.items()]
