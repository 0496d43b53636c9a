"""``Planner.step_is_idle``: which scheduled requests an engine may leave out of a step.

A request decoding inside a block has nothing to store until the block completes; an
engine adapter may leave it out of ``StepInput.scheduled`` (the vLLM adapter and the
reference engine do), and the plans must be the same as when it is listed.
"""

from __future__ import annotations

import pytest
from planner_kit import (
    Harness,
    full,
    make_config,
    mamba,
    prompt,
    start_load,
    three_groups,
    window,
)

from kvoffload.config import OffloadConfig
from kvoffload.jobs import StepPlan


def stored_blocks(plans: list[StepPlan]) -> list[tuple[int, ...]]:
    return [tuple(b for job in plan.stores for t in job.groups for b in t.block_ids)
            for plan in plans]


def decode(config: OffloadConfig, leave_out: bool) -> tuple[list[StepPlan], int]:
    """A 10-token prompt (block size 4), then 13 decode steps, one new block id per
    block; returns every step's plan and how many steps left the request out."""
    h = Harness(config)
    groups = len(config.groups)
    req = h.request("a", prompt(10))
    h.admit(req, [[1, 2, 3]] * groups)
    plans = [h.step(h.sched(req, [[1, 2, 3]] * groups, 0, 10))]
    next_id, left_out = 4, 0
    for _ in range(13):
        computed = req.num_tokens
        req.append(7)
        new: list[list[int]] = [[]] * groups
        if computed % 4 == 0:  # the token at ``computed`` starts a block
            new, next_id = [[next_id]] * groups, next_id + 1
        if leave_out and not any(new) and h.planner.step_is_idle("a", computed + 1):
            plans.append(h.step())
            left_out += 1
        else:
            plans.append(h.step(h.sched(req, new, computed, 1)))
        for job in plans[-1].stores:
            h.complete(job.job_id)
    return plans, left_out


@pytest.mark.parametrize("groups", [(full(),), (full(), window(8))])
def test_decode_steps_inside_a_block_are_idle_and_leaving_them_out_plans_the_same(
        groups: tuple) -> None:
    config = make_config(*groups, policy="value")
    listed, _ = decode(config, leave_out=False)
    skipped, left_out = decode(config, leave_out=True)
    assert stored_blocks(skipped) == stored_blocks(listed)
    assert left_out >= 6  # most decode steps
    assert sum(map(len, stored_blocks(listed))) > 0  # decode blocks were stored


def test_mamba_states_at_step_ends_make_no_step_idle() -> None:
    config = make_config(full(), mamba())
    _, left_out = decode(config, leave_out=True)
    assert left_out == 0


def test_an_unknown_a_finished_or_a_loading_request_is_never_idle() -> None:
    h = Harness(three_groups())
    assert not h.planner.step_is_idle("nobody", 1)
    req, _ = start_load(h)
    assert not h.planner.step_is_idle(req.request_id, 1)  # listing it must raise
    h.planner.request_finished(req)
    assert not h.planner.step_is_idle(req.request_id, 1)
