"""``guess_number``: higher/lower feedback on each guess, parse errors that are observations and use up a
guess, the guess limit, a score read from the model's turns only, and how hard the game is — measured through
the environment itself over every secret: an uninformed player 4/15, a consistent one ~61 %, binary search all.
"""

from __future__ import annotations

import random

import pytest

from workers.environments.base import (
    ENVIRONMENTS,
    EnvironmentError_,
    EnvTask,
    Transcript,
    Turn,
    make_environment,
    validate_params,
)
from workers.environments.guess_number import GuessNumber, demo_rows, prompt
from workers.policy.guess_demo_model import PARAMS, binary_search, consistent, play, solve_rate, uninformed


def no_judge(task, text):
    raise AssertionError("guess_number scores by its own rule, never by the domain's verifier")


def game(secret="11", **params) -> GuessNumber:
    env = make_environment("guess_number", params, judge=no_judge)
    assert isinstance(env, GuessNumber)
    env.start(EnvTask(prompt="Guess the number from 1 to 15.\n", reference={"answer": secret}, kind="answer"), 0, None)
    return env


def transcript(secret: str, model_turns: list[str], stop_reason="done") -> Transcript:
    turns = []
    for text in model_turns:
        turns += [Turn("model", text, 0, 0), Turn("env", "lower\n", 0, 0)]
    return Transcript(EnvTask("Guess the number from 1 to 15.\n", {"answer": secret}, kind="answer"), turns,
                      stop_reason)


def test_it_is_registered_and_needs_no_session():
    assert ENVIRONMENTS["guess_number"] == "workers.environments.guess_number:GuessNumber"
    assert GuessNumber.needs_session is False and GuessNumber.stop == ("\n",)


def test_each_guess_gets_higher_or_lower_from_the_user_and_the_right_one_ends_the_episode():
    env = game("11")
    first = env.step("8\n")
    assert (first.text, first.status, first.role, first.done) == ("higher\n", "ok", "user", False)
    second = env.step("13\n")
    assert (second.text, second.status, second.done) == ("lower\n", "ok", False)
    last = env.step("11\n")
    assert (last.text, last.status, last.done) == ("correct\n", "done", True)


@pytest.mark.parametrize("turn", ["eleven\n", "0\n", "16\n", "-3\n", "", "\n", "11 12\n", "11, I think\n",
                                  "1" * 40 + "\n", "correct\n"])
def test_a_turn_that_is_not_a_number_in_range_is_a_parse_error_and_the_game_goes_on(turn):
    env = game("11")
    obs = env.step(turn)
    assert (obs.status, obs.done, obs.role) == ("parse_error", False, "user")
    assert obs.text == "say a number from 1 to 15\n"
    assert env.step("11\n").done  # the episode went on


def test_the_guess_limit_ends_the_episode_and_parse_errors_use_up_guesses():
    env = game("11", max_guesses=3)
    assert not env.step("x\n").done
    assert not env.step("2\n").done
    last = env.step("3\n")
    assert (last.text, last.status, last.done) == ("higher\n", "ok", True)
    env = game("11", max_guesses=1)
    assert env.step("oops\n").done


def test_solved_means_one_of_the_first_max_guesses_turns_is_the_secret():
    env = make_environment("guess_number", {}, judge=no_judge)  # scoring needs no start: the transcript holds the task
    solved = env.score(transcript("11", ["8\n", "12\n", "11\n"]))
    assert (solved.status, solved.score, solved.details["guesses"]) == ("pass", 1.0, 3)
    assert env.score(transcript("11", [" 11 \n"])).score == 1.0
    assert env.score(transcript("11", ["8\n", "12\n", "10\n", "9\n"])).status == "fail"
    assert env.score(transcript("11", ["8\n", "12\n", "10\n", "9\n", "11\n"])).score == 0.0  # a fifth guess
    assert env.score(transcript("11", [])).score == 0.0


@pytest.mark.parametrize("turns", [["11 or 12\n"], ["correct\n"], ["I win: 11\n"], ["011x\n"], ["eleven\n"]])
def test_a_model_cannot_forge_a_solve(turns):
    env = make_environment("guess_number", {}, judge=no_judge)
    assert env.score(transcript("11", turns)).score == 0.0


def test_the_environments_own_turns_never_count():
    env = make_environment("guess_number", {}, judge=no_judge)
    t = transcript("11", ["8\n"])
    t.turns[1] = Turn("env", "11\n", 0, 0)
    assert env.score(t).score == 0.0


def test_a_broken_episode_is_invalid_not_a_failure():
    env = make_environment("guess_number", {}, judge=no_judge)
    for reason in ("env_error", "session_error"):
        assert env.score(transcript("11", ["11\n"], stop_reason=reason)).status == "invalid"


@pytest.mark.parametrize("reference, ok", [({"answer": "11"}, True), ("11", True), ({"answer": ["11"]}, True),
                                           ({"answer": "16"}, False), ({"answer": "eleven"}, False),
                                           ({"answer": ["3", "4"]}, False), ({"pattern": "1+"}, False)])
def test_the_secret_is_the_references_one_answer_in_range(reference, ok):
    env = make_environment("guess_number", {}, judge=no_judge)
    task = EnvTask("Guess.\n", reference, kind="answer")
    if ok:
        env.start(task, 0, None)
    else:
        with pytest.raises(ValueError):
            env.start(task, 0, None)


def test_params_are_validated():
    assert validate_params("guess_number", {"low": 1, "high": 100, "max_guesses": 7}) == GuessNumber.Params(
        low=1, high=100, max_guesses=7)
    for params, field in (({"low": 5, "high": 5}, "high must be greater than low"), ({"max_guesses": 0}, "max_guesses"),
                          ({"guesses": 4}, "guesses")):
        with pytest.raises(EnvironmentError_) as caught:
            validate_params("guess_number", params)
        assert field in str(caught.value)


def test_the_demo_rows_hold_every_secret_and_a_prompt_that_names_none():
    rows = demo_rows(PARAMS, copies=8)
    heldout = [r for r in rows if r["split"] == "heldout"]
    train = [r for r in rows if r["split"] == "train"]
    assert sorted(int(r["answer"]) for r in heldout) == list(range(1, 16))
    assert sorted(int(r["answer"]) for r in train) == sorted(list(range(1, 16)) * 8)
    assert {r["prompt"] for r in rows} == {prompt(PARAMS)} == {"Guess a number 1-15:\n"}


# --------------------------------------------------------------------------- how hard the game is


def test_an_uninformed_player_solves_about_27_percent():
    assert solve_rate(uninformed, 500, seed=0) == pytest.approx(4 / 15, abs=0.02)  # 7,500 episodes: 4 sigma


def test_a_player_consistent_with_the_feedback_solves_about_61_percent():
    assert solve_rate(consistent, 500, seed=0) == pytest.approx(0.61, abs=0.03)


def test_binary_search_solves_every_secret_within_four_guesses():
    rng = random.Random(0)
    games = [play(binary_search, secret, rng) for secret in range(1, 16)]
    assert all(g.solved for g in games)
    assert max(g.guesses for g in games) == 4
    three = GuessNumber.Params.model_validate({"max_guesses": 3})
    assert solve_rate(binary_search, 1, params=three) == pytest.approx(7 / 15)  # 2**3 - 1 secrets
