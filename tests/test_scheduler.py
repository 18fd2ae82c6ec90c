"""The pure scheduler: the AReaL staleness bound, weighting across domains, backpressure, completion."""

from __future__ import annotations

import pytest

from workers.pipeline.scheduler import (
    DomainShare,
    PipelineLimits,
    PipelineState,
    admission_capacity,
    open_window,
    plan,
    split_by_weight,
)

LIMITS = PipelineLimits(batch_groups=4, max_staleness=1, rollout_batch=100, max_in_flight=100, max_steps=1000)


def state(**kw):
    base = dict(version=0, step=0, accepted=0, running=0, ready=0, training=False, domains=[DomainShare(1, 1.0)])
    base.update(kw)
    return PipelineState(**base)


def test_staleness_bound_matches_areal_formula():
    # (max_staleness + v + 1) * B - (accepted + running)
    assert admission_capacity(state(), LIMITS) == (1 + 0 + 1) * 4
    assert admission_capacity(state(version=3, step=3, accepted=14, running=2), LIMITS) == (1 + 3 + 1) * 4 - 16
    assert admission_capacity(state(version=0, accepted=4, running=4), LIMITS) == 0


def test_synchronous_mode_admits_one_batch_per_version():
    sync = PipelineLimits(batch_groups=4, max_staleness=0, rollout_batch=100, max_in_flight=100, max_steps=10)
    assert admission_capacity(state(), sync) == 4
    assert admission_capacity(state(accepted=4), sync) == 0  # wait for the train step
    assert admission_capacity(state(version=1, step=1, accepted=4), sync) == 4


@pytest.mark.parametrize(("staleness", "ahead", "window"), [(3, True, (3 + 2) * 4), (1, False, (1 + 1) * 4), (0, False, 4)])
def test_open_window_is_the_most_groups_admission_lets_be_open(staleness, ahead, window):
    """``open_window`` (bench/pipeline.py's Little's-law bound) is what the admission formula allows: at
    version 5, with step 6 claimed and training, the groups neither trained nor dropped reach it and no more."""
    limits = PipelineLimits(batch_groups=4, max_staleness=staleness, rollout_batch=100, max_in_flight=100,
                            max_steps=1000, admit_ahead=ahead)
    assert open_window(limits) == window
    trained, training = 5 * 4, 4  # steps 1-5 trained; step 6's batch is in training (accepted, still open)
    room = admission_capacity(state(version=5, step=5, accepted=trained + training, training=True), limits)
    assert training + room == window
    assert admission_capacity(state(version=5, step=5, accepted=trained + training, running=room, training=True),
                              limits) == 0


def test_backpressure_and_rollout_batch():
    tight = PipelineLimits(batch_groups=8, max_staleness=4, rollout_batch=3, max_in_flight=10, max_steps=1000)
    assert admission_capacity(state(running=0), tight) == 3
    assert admission_capacity(state(running=9), tight) == 1
    assert admission_capacity(state(running=10), tight) == 0


def test_never_admits_more_than_remaining_steps_can_train():
    near_end = PipelineLimits(batch_groups=4, max_staleness=8, rollout_batch=100, max_in_flight=100, max_steps=2)
    assert admission_capacity(state(version=1, step=1, accepted=4, running=0), near_end) == 4
    assert admission_capacity(state(version=1, step=1, accepted=6, running=2), near_end) == 0


def test_weights_split_admissions_in_proportion():
    domains = [DomainShare(1, 3.0), DomainShare(2, 1.0)]
    assert split_by_weight(domains, 8) == {1: 6, 2: 2}
    # a domain behind its share catches up first
    assert split_by_weight([DomainShare(1, 1.0, admitted=10), DomainShare(2, 1.0, admitted=0)], 4) == {2: 4}


def test_priority_wins_and_exhausted_domains_are_skipped():
    domains = [DomainShare(1, 5.0), DomainShare(2, 1.0, priority=1), DomainShare(3, 1.0, priority=2, exhausted=True)]
    assert split_by_weight(domains, 3) == {2: 3}


def test_three_hundred_domains_share_by_weight():
    domains = [DomainShare(i, 2.0 if i % 2 else 1.0) for i in range(300)]
    out = split_by_weight(domains, 3000)
    assert len(out) == 300 and sum(out.values()) == 3000
    for domain_id, got in out.items():
        exact = 3000 * (2.0 if domain_id % 2 else 1.0) / 450
        assert abs(got - exact) <= 1, (domain_id, got, exact)  # each domain within one admission of its share


def test_plan_trains_when_a_batch_is_ready_and_completes_at_max_steps():
    p = plan(state(accepted=4, ready=4), LIMITS)
    assert p.train and p.admit_total == 4
    assert not plan(state(accepted=4, ready=4, training=True), LIMITS).train
    done = plan(state(step=1000, version=1000), LIMITS)
    assert done.complete and done.admit_total == 0 and not done.train
    assert not plan(state(step=1000, training=True), LIMITS).complete


def test_retries_of_invalid_verdicts_come_before_new_prompts():
    domains = [DomainShare(1, 1.0, retries=2), DomainShare(2, 5.0, retries=1), DomainShare(3, 1.0)]
    p = plan(state(domains=domains), PipelineLimits(batch_groups=4, max_staleness=0, rollout_batch=8, max_in_flight=100,
                                             max_steps=10))
    assert p.retry == {1: 2, 2: 1}
    assert sum(p.admit.values()) == 1 and p.admit_total == 4  # the rest by weight
    # with no room, retries wait like anything else, and are never more than the capacity
    full = plan(state(domains=domains, accepted=4), PipelineLimits(batch_groups=4, max_staleness=0, rollout_batch=8,
                                                          max_in_flight=100, max_steps=10))
    assert full.admit_total == 0
    tight = plan(state(domains=domains, accepted=2), PipelineLimits(batch_groups=4, max_staleness=0, rollout_batch=8,
                                                           max_in_flight=100, max_steps=10))
    assert tight.retry == {1: 2} and not tight.admit


def test_a_retried_prompt_counts_towards_its_domains_share():
    domains = [DomainShare(1, 1.0, admitted=0, retries=2), DomainShare(2, 1.0, admitted=0)]
    p = plan(state(domains=domains), PipelineLimits(batch_groups=4, max_staleness=0, rollout_batch=4, max_in_flight=100,
                                             max_steps=10))
    assert p.retry == {1: 2} and p.admit == {2: 2}


def test_generation_is_handed_out_in_whole_chunks_while_the_gpu_worker_has_work():
    limits = PipelineLimits(batch_groups=8, max_staleness=4, rollout_batch=8, max_in_flight=10, max_steps=1000)
    # two groups of room, but a rollout task is still to come for 8 others: wait for a whole chunk
    assert plan(state(running=8, waiting=8), limits).admit_total == 0
    # ... or a train step is running, or about to be claimed
    assert plan(state(running=8, training=True), limits).admit_total == 0
    assert plan(state(running=8, accepted=8, ready=8), limits).admit_total == 0
    # nothing else for the device to do: a partial chunk keeps it busy
    assert plan(state(running=8, waiting=0), limits).admit_total == 2
    assert plan(state(running=0, waiting=0), limits).admit_total == 8


def test_async_admits_the_next_prompts_while_a_step_trains():
    ahead = PipelineLimits(batch_groups=4, max_staleness=1, rollout_batch=4, max_in_flight=100, max_steps=100,
                   admit_ahead=True)
    at_bound = state(version=2, step=2, accepted=12, running=4)  # (1 + 2 + 1) * 4 = 16 admitted: no room
    assert admission_capacity(at_bound, ahead) == 0
    # step 3 is claimed: its version exists before these prompts reach the device
    assert admission_capacity(state(version=2, step=2, accepted=12, running=4, training=True), ahead) == 4
    # the synchronous mode never does: generation waits for the step
    sync = PipelineLimits(batch_groups=4, max_staleness=0, rollout_batch=4, max_in_flight=100, max_steps=100)
    assert admission_capacity(state(version=2, step=2, accepted=12, running=0, training=True), sync) == 0


# ---------------------------------------------------------------- every decision of a tick: decide()

from workers.pipeline.scheduler import GroupFacts, RunSnapshot, Share, decide  # noqa: E402

TICK = PipelineLimits(batch_groups=2, max_staleness=1, rollout_batch=4, max_in_flight=8, max_steps=10,
                      admit_ahead=True, stall_s=90.0, max_attempts=3)


def snap(*groups: GroupFacts, **kw) -> RunSnapshot:
    base = dict(status="running", version=2, step=2, trained=4, groups=list(groups), domains=[DomainShare(1, 1.0)])
    base.update(kw)
    return RunSnapshot(**base)


def g(gid: int, status: str, **kw) -> GroupFacts:
    return GroupFacts(id=gid, status=status, **kw)


CASES = [
    # (name, snapshot, limits, what the tick must hold)
    ("an idle run admits a whole chunk", snap(), TICK,
     {"admit": {1: 4}, "claim_train": None}),
    ("B ready groups claim the next step", snap(g(1, "ready", generated_version=2), g(2, "ready", generated_version=2)),
     TICK, {"claim_train": 3}),
    ("a claimed step is not claimed twice",
     snap(g(1, "ready", generated_version=2), g(2, "ready", generated_version=2), train_claim=3), TICK,
     {"claim_train": None}),
    ("too stale ready groups are dropped with the reason, and do not count",
     snap(g(1, "ready", generated_version=0), g(2, "ready", generated_version=2)), TICK,
     {"drop": {"staler than 1 version(s) at step 3": [1]}, "claim_train": None}),
    ("a group still being judged is dropped as soon as it is too stale, and frees its place",
     snap(g(1, "verifying", generated_version=0), g(2, "verifying", generated_version=1)), TICK,
     {"drop": {"staler than 1 version(s) at step 3": [1]}, "admit": {1: 3}}),  # (1+2+1)*2 - (4 trained + 1)
    ("a too stale group whose judge is gone is dropped, not judged again nor counted as stranded",
     snap(g(1, "verifying", generated_version=0, holder_gone="sandbox@a stopped"),
          g(2, "verifying", generated_version=2, holder_gone="sandbox@a stopped"), recovering=True), TICK,
     {"drop": {"staler than 1 version(s) at step 3": [1]}, "reverify": [2], "why": {"sandbox@a stopped": 1}}),
    ("a too stale group stranded too often is dropped as too stale (it could never be trained)",
     snap(g(1, "verifying", generated_version=0, age_s=500.0, attempt=3), recovering=True), TICK,
     {"drop": {"staler than 1 version(s) at step 3": [1]}, "why": {}}),
    ("the last step trained: complete, dropping what is left",
     snap(g(7, "verifying"), step=10, version=10, trained=20), TICK,
     {"complete": "reached max_steps=10", "drop": {"run completed before it was trained": [7]}}),
    ("the last step still training: wait", snap(g(7, "training"), step=10, version=10, train_claim=11), TICK,
     {"complete": None, "admit": {}}),
    ("pausing with work in flight waits", snap(g(1, "generating"), status="pausing"), TICK,
     {"mark_paused": False, "admit": {}}),
    ("pausing with nothing in flight is paused", snap(g(1, "ready"), status="pausing"), TICK,
     {"mark_paused": True}),
    ("pausing drops a too stale group still being judged, and does not wait for it",
     snap(g(1, "verifying", generated_version=0, holder_gone="sandbox@a stopped"), g(2, "ready", generated_version=2),
          status="pausing", recovering=True), TICK,
     {"drop": {"staler than 1 version(s) at step 3": [1]}, "reverify": [], "mark_paused": True}),
    ("an ended run revokes and drops what is left",
     snap(g(1, "admitted"), g(2, "ready"), status="cancelled"), TICK,
     {"revoke": True, "drop": {"run cancelled before it was trained": [1, 2]}}),
    ("a paused run does nothing", snap(g(1, "ready"), status="paused"), TICK,
     {"admit": {}, "claim_train": None, "mark_paused": False}),
    ("retries are admitted ahead of new prompts", snap(domains=[DomainShare(1, 1.0, retries=3)]), TICK,
     {"retry": {1: 3}, "admit": {1: 1}}),
    ("backpressure: a full pipeline admits nothing", snap(*[g(i, "verifying") for i in range(8)]), TICK,
     {"admit": {}}),
    # recovery: only on the periodic tick
    ("a gone holder is acted on only when recovering",
     snap(g(1, "generating", holder_gone="gpu@a restarted")), TICK, {"regenerate": []}),
    ("a gone holder's generation is handed out again",
     snap(g(1, "generating", holder_gone="gpu@a restarted"), recovering=True), TICK,
     {"regenerate": [1], "why": {"gpu@a restarted": 1}}),
    ("a gone holder's judging is handed out again",
     snap(g(1, "verifying", holder_gone="sandbox@a went silent"), recovering=True), TICK,
     {"reverify": [1], "regenerate": []}),
    ("work without progress for stall_s is handed out again",
     snap(g(1, "admitted", age_s=91.0), g(2, "verifying", age_s=10.0), recovering=True), TICK,
     {"regenerate": [1], "reverify": [], "why": {"no progress for 90 s": 1}}),
    ("stranded too often: dropped with the reason",
     snap(g(1, "verifying", age_s=500.0, attempt=3), recovering=True), TICK,
     {"drop": {"stalled in verifying after 3 attempts (no progress for 90 s)": [1]}, "reverify": []}),
    ("a broker that lost its data: everything in flight, and the train claim",
     snap(g(1, "admitted"), g(2, "verifying"), g(3, "ready", generated_version=2), train_claim=3,
          recovering=True, broker_reset=True), TICK,
     {"regenerate": [1], "reverify": [2], "resend_train": "the broker lost its queued messages"}),
    ("a broker that lost its data: a train claim a live worker holds is left to it",
     snap(g(1, "admitted"), train_claim=3, train_holder_alive=True, recovering=True, broker_reset=True), TICK,
     {"regenerate": [1], "resend_train": None}),
    ("a train claim a live worker holds is still re-sent once it has stalled",
     snap(train_claim=3, train_holder_alive=True, train_claim_age_s=91.0, recovering=True), TICK,
     {"resend_train": "no progress for 90 s"}),
    ("a train claim whose holder is gone is re-sent",
     snap(train_claim=3, train_holder_gone="gpu@a stopped", recovering=True), TICK,
     {"resend_train": "gpu@a stopped"}),
    ("a fresh train claim is left alone", snap(train_claim=3, train_claim_age_s=5.0, recovering=True), TICK,
     {"resend_train": None}),
    # several runs on shared workers
    ("a run ahead of its share while another waits admits nothing new",
     snap(share=Share(share=1.0, device_s=100.0, others=[(1.0, 40.0, True)])), TICK,
     {"admit": {}, "deferred": True}),
    ("the share is per unit of weight: twice the share may use twice the time",
     snap(share=Share(share=2.0, device_s=100.0, others=[(1.0, 60.0, True)])), TICK,
     {"admit": {1: 4}, "deferred": False}),
    ("it is work-conserving: a run behind with nothing waiting holds nobody back",
     snap(share=Share(share=1.0, device_s=100.0, others=[(1.0, 10.0, False)])), TICK,
     {"admit": {1: 4}, "deferred": False}),
    ("a deferred run still claims its train step",
     snap(g(1, "ready", generated_version=2), g(2, "ready", generated_version=2),
          share=Share(share=1.0, device_s=100.0, others=[(1.0, 1.0, True)])), TICK,
     {"claim_train": 3, "deferred": True}),
]


@pytest.mark.parametrize(("name", "snapshot", "limits", "expected"), CASES, ids=[c[0] for c in CASES])
def test_every_decision_of_a_tick(name, snapshot, limits, expected):
    tick = decide(snapshot, limits)
    for field_name, want in expected.items():
        assert getattr(tick, field_name) == want, (name, field_name, getattr(tick, field_name))
