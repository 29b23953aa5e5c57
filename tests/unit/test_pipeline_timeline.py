"""Timelines and bubbles of pipeline steps (pure: no processes)."""
import pytest

from commrt.pipeline.timeline import Event, Timeline, gantt, theory_bubble


def test_theory_bubble_is_gpipes_formula_and_interleaving_divides_the_warm_up():
    assert theory_bubble(2, 8) == pytest.approx(1 / 9)
    assert theory_bubble(4, 4) == pytest.approx(3 / 7)
    assert theory_bubble(1, 5) == 0.0
    assert theory_bubble(2, 8, 2) == pytest.approx(1 / 17)


def test_bubble_is_the_idle_part_of_the_wall_time_and_waits_are_not_busy():
    tl = Timeline(started=0.0)
    tl.add("R", 0, 0, 0.0, 1.0)
    tl.add("F", 0, 0, 1.0, 2.0)
    tl.add("B", 0, 0, 2.0, 4.0)
    tl.ended = 5.0
    assert tl.busy() == 3.0 and tl.waited() == 1.0
    assert tl.bubble() == pytest.approx(0.4)
    assert tl.own() == pytest.approx(1.0)  # the second neither computing nor waiting: the runtime's own


def test_gantt_marks_each_column_by_what_covers_most_of_it():
    events = [Event("R", 0, 0, 0.0, 2.0), Event("F", 0, 0, 2.0, 4.0), Event("B", 0, 0, 4.0, 8.0)]
    assert gantt(events, 10.0, width=10) == "rrFFBBBB.."
