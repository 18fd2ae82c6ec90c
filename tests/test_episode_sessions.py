"""An episode's sandbox session as the loop keeps it: opened on the first tool call (its start latency
measured apart from the call's), the files ``python_tool``'s ``artifacts`` names collected when it closes and
stored bounded (``generation.session_record``), and those names validated where a domain declares them.
Real sessions, no database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sandboxes.session import SessionPool
from webapp.runs.loop.generation import PREVIEW_BYTES, LazySession, session_record, session_spec
from workers.environments.base import (
    EnvironmentError_,
    EnvTask,
    Transcript,
    Turn,
    make_environment,
    validate_params,
)
from workers.pipeline.spec import EpisodeSpec
from workers.verifiers.base import JudgeInput, Verdict, build_verifier


@pytest.fixture(scope="module")
def pool() -> Iterator[SessionPool]:
    with SessionPool() as p:
        yield p


def judge(task: EnvTask, completion: str) -> Verdict:
    return build_verifier("exact_match", {"extract": "marker"}).judge(JudgeInput(task.prompt, completion, task.reference))


@pytest.mark.parametrize("patterns, problem", [
    (["/etc/passwd"], "must be a relative path"),
    (["../outside.txt"], "must be a relative path"),
    (["a//b"], "must be a relative path"),
    (["x" * 201], "at most 200 characters"),
    ([f"f{i}.txt" for i in range(9)], "at most 8 items"),
    ("out.txt", "tuple"),
])
def test_artifact_paths_are_validated_where_a_domain_declares_them(patterns: object, problem: str) -> None:
    with pytest.raises(EnvironmentError_) as caught:
        validate_params("python_tool", {"artifacts": patterns})
    assert caught.value.problems and all(p.startswith("environment_params.artifacts") for p in caught.value.problems)
    assert problem in str(caught.value)


def test_artifact_paths_that_are_fine() -> None:
    params = validate_params("python_tool", {"artifacts": ["out.txt", "results/*.csv", "**/*.log"]})
    assert params.artifacts == ("out.txt", "results/*.csv", "**/*.log")  # type: ignore[attr-defined]
    assert validate_params("python_tool", {}).artifacts == ()  # type: ignore[attr-defined]


def test_an_episode_keeps_its_artifacts_and_its_session_start_and_its_reward_ignores_them(pool: SessionPool) -> None:
    env = make_environment("python_tool", {"artifacts": ["out.txt", "big.txt", "blob.bin", "missing.txt"]}, judge)
    session = LazySession(pool, session_spec(env, EpisodeSpec(tool_seconds=2.0)))
    task = EnvTask(prompt="6*7=", reference={"answer": "42"})
    env.start(task, 0, session)
    assert session.session is None and session.start_s is None  # nothing opened before the first call
    obs = env.step("<py>open('out.txt', 'w').write('first line\\n' * 3)\n"
                   "open('big.txt', 'w').write('x' * 10000)\nopen('blob.bin', 'wb').write(b'\\0\\1')\n"
                   "open('reward', 'w').write('1.0')\nprint('done')</py>")
    assert obs.status == "ok" and obs.info["result"] == "done"
    assert session.start_s is not None and session.start_s > 0
    # the call's latency is the cell's own time, not the session's start that came with it
    assert 0 < obs.info["latency_s"] < session.start_s
    env.close()
    session.close()
    record = session_record(session)
    assert record["session_start_s"] == pytest.approx(session.start_s, abs=1e-6)
    kept = {a["path"]: a for a in record["artifacts"]}
    assert set(kept) == {"out.txt", "big.txt", "blob.bin"}  # what the pattern found; reward was not declared
    assert kept["out.txt"]["preview"] == "first line\n" * 3 and kept["out.txt"]["size"] == 33
    assert not kept["out.txt"]["truncated"] and len(kept["out.txt"]["sha256"]) == 64
    assert kept["big.txt"]["size"] == 10000 and len(kept["big.txt"]["preview"]) == PREVIEW_BYTES
    assert kept["big.txt"]["truncated"]
    assert kept["blob.bin"]["binary"] and kept["blob.bin"]["preview"] is None
    # the reward comes from the transcript and the verifier, not from a file in the session
    transcript = Transcript(task, [Turn("model", "Answer: 41", 0, 3)], "done")
    assert env.score(transcript).status == "fail"


def test_an_episode_that_never_calls_the_tool_opens_no_session(pool: SessionPool) -> None:
    env = make_environment("python_tool", {"artifacts": ["out.txt"]}, judge)
    session = LazySession(pool, session_spec(env, EpisodeSpec()))
    env.start(EnvTask(prompt="1+1=", reference={"answer": "2"}), 0, session)
    assert env.step("Answer: 2").done
    env.close()
    assert session.close() == [] and session_record(session) == {}
