"""Pipeline schedules as data and their pre-flight check, without processes (issue 16)."""
import pytest

from commrt.pipeline import (Action, ScheduleError, format_grid, gpipe_actions, interleaved_actions,
    one_f_one_b_actions, pipedream_actions, validate)
from commrt.pipeline.schedules import B, F, parse_actions

GRID = [(p, m) for p in range(1, 9) for m in range(1, 17)]
SHIPPED = {
    "gpipe": gpipe_actions,
    "1f1b": one_f_one_b_actions,
    "interleaved2": lambda p, m: interleaved_actions(p, m, 2),
    "pipedream3": lambda p, m: pipedream_actions(p, m, 3),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_schedule_passes_for_stages_1_to_8_and_microbatches_1_to_16(name):
    for p, m in GRID:
        acts = SHIPPED[name](p, m)
        validate(acts)
        total = m * 3 if name == "pipedream3" else m
        stages = {a.stage for row in acts for a in row}
        for s in stages:  # every stage runs F and B of every micro-batch exactly once
            for kind in (F, B):
                got = sorted(a.mb for row in acts for a in row if a.stage == s and a.kind == kind)
                assert got == list(range(total)), (name, p, m, s, kind)


def test_interleaved_with_three_stages_per_rank_passes_the_grid():
    for p, m in GRID:
        validate(interleaved_actions(p, m, 3))
        assert {a.stage for row in interleaved_actions(p, m, 3) for a in row} == set(range(3 * p))


def _in_flight(row):
    """Most micro-batches whose forward ran and whose backward has not, over one rank's actions."""
    live, peak = 0, 0
    for a in row:
        live += (a.kind == F) - (a.kind == B)
        peak = max(peak, live)
    return peak


def test_1f1b_bounds_the_micro_batches_in_flight_and_gpipe_does_not():
    for p, m in GRID:
        for s, row in enumerate(one_f_one_b_actions(p, m)):
            assert _in_flight(row) == min(p - s, m)
        for row in gpipe_actions(p, m):
            assert _in_flight(row) == m


def test_compact_form_round_trips_and_the_grid_marks_the_step():
    acts = one_f_one_b_actions(2, 2)
    assert [str(a) for a in acts[0][:3]] == ["0F0", "0SEND_F0", "0F1"]
    assert all(Action.parse(str(a)) == a for row in acts for a in row)
    grid = format_grid(acts, mark=(1, 2))
    assert "rank 0" in grid and "rank 1" in grid and "1B0 <<" in grid
    with pytest.raises(ValueError):
        Action.parse("0X1")


def _err(acts) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(acts)
    return info.value


def test_swapped_send_order_is_caught_at_the_receive_that_gets_the_wrong_micro_batch():
    acts = one_f_one_b_actions(3, 4)
    row = acts[0]
    row[1], row[3] = row[3], row[1]  # 0F0 0SEND_F1 0F1 0SEND_F0 -> SEND_F1 before F1 ran
    e = _err(acts)
    assert (e.rank, e.step, str(e.action)) == (0, 1, "0SEND_F1") and "before computing" in e.reason
    acts = one_f_one_b_actions(3, 4)
    row = acts[0]
    row[0:4] = [Action(0, F, 0), Action(0, F, 1), Action(0, "SEND_F", 1), Action(0, "SEND_F", 0)]
    e = _err(acts)
    want = acts[1].index(Action(1, "RECV_F", 0))
    assert (e.rank, e.step, str(e.action)) == (1, want, "1RECV_F0")
    assert "next message on that channel is micro-batch 1 (rank 0, step 2: 0SEND_F1)" in e.reason
    assert "1RECV_F0 <<" in e.grid


def test_a_missing_receive_is_caught_at_the_computation_that_needed_it():
    acts = one_f_one_b_actions(3, 4)
    i = acts[2].index(Action(2, "RECV_F", 1))
    del acts[2][i]
    e = _err(acts)
    assert (e.rank, e.step, str(e.action)) == (2, i, "2F1") and "never received from stage 1" in e.reason


def test_a_receive_cycle_is_a_deadlock_naming_the_blocked_ranks():
    acts = parse_actions(["0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"])
    e = _err(acts)
    assert (e.rank, e.step, str(e.action)) == (0, 0, "0RECV_B0")
    assert "deadlock" in e.reason and "rank 1 at step 0 (1RECV_F0)" in e.reason


def test_a_send_nobody_receives_and_a_skipped_micro_batch_are_caught():
    acts = parse_actions(["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0 1SEND_B0"])
    e = _err(acts)
    assert (e.rank, e.step, str(e.action)) == (1, 4, "1SEND_B0") and "never receives" in e.reason
    acts = parse_actions(["0F0 0F1 0B0"])
    e = _err(acts)
    assert e.rank == 0 and "micro-batch 1 is skipped: stage 0 never runs 0B1" in e.reason


def test_computing_twice_or_on_a_foreign_stage_is_caught():
    e = _err(parse_actions(["0F0 0F0 0B0"]))
    assert (e.rank, e.step) == (0, 1) and "twice" in e.reason
    e = _err(parse_actions(["0F0 0B0 1F0", "1F0"]))
    assert "also computes on rank" in e.reason


def test_a_bogus_action_kind_is_named_not_reported_as_a_micro_batch_range():
    """issue 30 item 15: a schedule of unknown kinds only said "micro-batch 0 is out of range 0..-1"."""
    e = _err([[Action(0, "X", 0)]])
    assert (e.rank, e.step) == (0, 0) and "unknown action kind 'X'; valid kinds: F" in e.reason
    assert "out of range" not in e.reason
