"""/api/v1/verifiers/: validated configs, calibration cases, dry runs, and calibration on a real worker."""

from __future__ import annotations

import time

import pytest

from webapp.catalog.models import CalibrationReport, Verifier

GOOD_CASES = [
    {"completion": "5", "reference": {"answer": "5"}, "expected": "pass", "label": "good"},
    {"completion": " 8 ", "reference": {"answer": "8"}, "expected": "pass", "label": "good"},
    {"completion": "6", "reference": {"answer": "5"}, "expected": "fail", "label": "bad"},
    {"completion": "12", "reference": {"answer": "21"}, "expected": "fail", "label": "bad"},
    {"completion": "", "reference": {"answer": "5"}, "expected": "fail", "label": "hack"},
    {"completion": ":", "reference": {"answer": "5"}, "expected": "fail", "label": "hack"},
]


@pytest.mark.django_db
def test_create_with_cases_and_read_back(api, user):
    response = api.post("/api/v1/verifiers/", {"name": "exact", "kind": "exact_match", "config": {},
                                               "calibration_cases": GOOD_CASES}, format="json")
    assert response.status_code == 201, response.content
    verifier = Verifier.objects.get(pk=response.json()["id"])
    assert verifier.owner == user and verifier.calibration_cases.count() == 6
    assert verifier.calibration_status == "none"
    assert api.get(f"/api/v1/verifiers/{verifier.pk}/").json()["last_calibration"] is None


@pytest.mark.django_db
@pytest.mark.parametrize(("kind", "config", "needle"), [
    ("regex", {"pattern": "("}, "pattern"),
    ("exact_match", {"no_such_option": True}, "no_such_option"),
    ("nonsense", {}, "kind"),
    ("exact_match", [], "config"),
])
def test_bad_config_is_refused_with_the_field(api, kind, config, needle):
    response = api.post("/api/v1/verifiers/", {"name": "v", "kind": kind, "config": config}, format="json")
    assert response.status_code == 400
    assert needle in str(response.json())
    assert not Verifier.objects.exists()


@pytest.mark.django_db
def test_changing_the_config_resets_calibration(api, user):
    verifier = Verifier.objects.create(owner=user, name="v", kind="exact_match", calibration_status="passed")
    assert api.patch(f"/api/v1/verifiers/{verifier.pk}/", {"description": "x"}, format="json").status_code == 200
    verifier.refresh_from_db()
    assert verifier.calibration_status == "passed"
    assert api.patch(f"/api/v1/verifiers/{verifier.pk}/", {"config": {"ignore_case": True}},
                     format="json").status_code == 200
    verifier.refresh_from_db()
    assert verifier.calibration_status == "none"


@pytest.mark.django_db
def test_dry_run_judges_now(api, user):
    verifier = Verifier.objects.create(owner=user, name="v", kind="exact_match")
    response = api.post(f"/api/v1/verifiers/{verifier.pk}/dry-run/", {"items": [
        {"prompt": "2+3=", "completion": "5", "reference": {"answer": "5"}},
        {"prompt": "2+3=", "completion": "6", "reference": {"answer": "5"}},
        {"prompt": "2+3=", "completion": "5", "reference": {"wrong_key": 1}},
    ]}, format="json")
    assert response.status_code == 200, response.content
    verdicts = [r["verdict"] for r in response.json()["results"]]
    assert verdicts == ["pass", "fail", "invalid"]
    assert api.post(f"/api/v1/verifiers/{verifier.pk}/dry-run/", {"items": []}, format="json").status_code == 400


@pytest.mark.django_db
def test_calibrate_without_cases_is_409(api, user):
    verifier = Verifier.objects.create(owner=user, name="v", kind="exact_match")
    response = api.post(f"/api/v1/verifiers/{verifier.pk}/calibrate/")
    assert response.status_code == 409 and "no calibration cases" in response.json()["detail"]


@pytest.mark.django_db
def test_other_user_cannot_see_calibrate_or_dry_run(other_api, user):
    verifier = Verifier.objects.create(owner=user, name="v", kind="exact_match")
    assert other_api.get(f"/api/v1/verifiers/{verifier.pk}/").status_code == 404
    assert other_api.post(f"/api/v1/verifiers/{verifier.pk}/calibrate/").status_code == 404
    assert other_api.post(f"/api/v1/verifiers/{verifier.pk}/dry-run/", {"items": [{}]}, format="json").status_code == 404


def wait_for_report(pk: int, timeout: float = 60) -> CalibrationReport:
    deadline = time.monotonic() + timeout
    while True:
        report = CalibrationReport.objects.get(pk=pk)
        if report.status in ("done", "error"):
            return report
        assert time.monotonic() < deadline, f"calibration still {report.status}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_calibration_on_the_verify_worker_passes_good_and_refuses_noisy(start_worker, api, user):
    start_worker("verify")
    good = api.post("/api/v1/verifiers/", {"name": "exact", "kind": "exact_match", "config": {},
                                           "calibration_cases": GOOD_CASES}, format="json").json()
    noisy = api.post("/api/v1/verifiers/", {"name": "anything", "kind": "regex", "config": {"pattern": ".*"},
                                            "calibration_cases": GOOD_CASES}, format="json").json()
    with_capture = []
    for v in (good, noisy):
        response = api.post(f"/api/v1/verifiers/{v['id']}/calibrate/")
        assert response.status_code == 202 and response.json()["status"] == "pending"
        with_capture.append(response.json()["id"])
    good_report, noisy_report = (wait_for_report(pk) for pk in with_capture)
    assert (good_report.status, good_report.passed) == ("done", True), good_report.summary
    assert (noisy_report.status, noisy_report.passed) == ("done", False)
    assert noisy_report.summary["false_positive_rate"]["value"] == 1.0
    assert noisy_report.summary["failures"]
    assert Verifier.objects.get(pk=good["id"]).calibration_status == "passed"
    assert Verifier.objects.get(pk=noisy["id"]).calibration_status == "failed"
    shown = api.get(f"/api/v1/verifiers/{noisy['id']}/").json()["last_calibration"]
    assert shown["passed"] is False and shown["id"] == noisy_report.pk


REWARD = ("def score(prompt, completion, reference):\n"
          "    return 1.0 if completion.strip() == reference[\"answer\"] else 0.0\n")


@pytest.mark.django_db
def test_python_reward_is_validated_and_dry_run_when_saved(api, user):
    created = api.post("/api/v1/verifiers/", {"name": "mine", "kind": "python_reward", "config": {"code": REWARD},
                                              "calibration_cases": GOOD_CASES}, format="json")
    assert created.status_code == 201, created.content
    verifier = Verifier.objects.get(pk=created.json()["id"])
    assert verifier.config["code"] == REWARD
    assert verifier.calibration_cases.count() == 6
    # does not compile: the line is named, nothing is stored
    response = api.post("/api/v1/verifiers/", {"name": "broken", "kind": "python_reward",
                                               "config": {"code": "def score(p, c, r):\n    return (\n"}}, format="json")
    assert response.status_code == 400 and "line 2" in str(response.json()["config"]), response.content
    response = api.post("/api/v1/verifiers/", {"name": "no-score", "kind": "python_reward",
                                               "config": {"code": "def reward(p, c, r):\n    return 1\n"}}, format="json")
    assert response.status_code == 400 and "defines no top-level score" in str(response.json()["config"])
    # compiles, but fails on a calibration case when dry-run: the case and the line are named
    typo = REWARD.replace('reference["answer"]', 'reference["answr"]')
    response = api.post("/api/v1/verifiers/", {"name": "typo", "kind": "python_reward", "config": {"code": typo},
                                               "calibration_cases": GOOD_CASES}, format="json")
    assert response.status_code == 400, response.content
    message = response.json()["config"][0]
    assert message.startswith("dry run on the calibration cases: case 1: score() raised at line 2") and "KeyError" in message
    # an edit dry-runs on the stored cases too, and is refused without changing the verifier
    out_of_range = REWARD.replace("1.0 if", "10.0 if")
    response = api.patch(f"/api/v1/verifiers/{verifier.pk}/", {"config": {"code": out_of_range}}, format="json")
    assert response.status_code == 400 and "outside the declared range" in response.json()["config"][0]
    verifier.refresh_from_db()
    assert verifier.config["code"] == REWARD
    assert not Verifier.objects.filter(name__in=["broken", "no-score", "typo"]).exists()
    # judged now through the dry-run endpoint, by the user's code in the sandbox
    response = api.post(f"/api/v1/verifiers/{verifier.pk}/dry-run/", {"items": [
        {"prompt": "2+3=", "completion": "5", "reference": {"answer": "5"}},
        {"prompt": "2+3=", "completion": "6", "reference": {"answer": "5"}},
    ]}, format="json")
    assert [r["verdict"] for r in response.json()["results"]] == ["pass", "fail"]
    schema = api.get("/api/v1/schema/", HTTP_ACCEPT="application/json").json()
    assert "python_reward" in str(schema["components"]["schemas"])
