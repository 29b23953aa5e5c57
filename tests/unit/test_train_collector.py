"""Python's collector at step boundaries (``[train] manual_gc_interval``, train/collector.py):
off after the first step, cyclic garbage freed at every N-th step and not between, the
collector handed back when the last user closes; the engine at world size 1 collects at its
optimizer steps and trains exactly as without it."""
import gc
import weakref

import pytest
import torch

from commrt.runtime.errors import ConfigError
from commrt.train import TrainConfig, initialize
from commrt.train.collector import ManualGC
from tests.unit.test_train_world1 import Net, _batches, _loss, _plain


class _Cycle:
    def __init__(self):
        self.me = self


def _garbage() -> weakref.ref:
    """A reference cycle nobody holds: only a collection frees it."""
    return weakref.ref(_Cycle())


@pytest.fixture(autouse=True)
def _collector_back():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_interval_0_leaves_the_collector_alone():
    c = ManualGC(0)
    for _ in range(3):
        c.step()
    assert gc.isenabled() and gc.get_freeze_count() == 0 and c.collections == 0


def test_cycles_live_until_every_nth_step_and_the_collector_comes_back_on_close():
    c = ManualGC(3)
    c.step()  # step 1: collect, freeze, collector off
    assert not gc.isenabled() and gc.get_freeze_count() > 0
    for step in (2, 3, 4, 5, 6):
        ref = _garbage()
        for _ in range(2000):  # what would have started the automatic collector
            _Cycle()
        c.step()
        assert (ref() is None) == (step % 3 == 0), f"step {step}"
    assert c.collections == 3  # steps 1, 3 and 6
    c.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_replica_that_skipped_ahead_collects_at_the_jobs_steps():
    """train_lm's replica loop passes the job's step: a replica that rejoined at step 6 collects
    at 8 with the others (its 3rd call), not at its own 4th call."""
    c = ManualGC(4)
    c.step(at=6)  # its first step here: collect, freeze, collector off
    ref = _garbage()
    c.step(at=7)
    assert ref() is not None and c.collections == 1
    c.step(at=8)
    assert ref() is None and c.collections == 2
    c.close()


def test_the_last_of_two_users_hands_the_collector_back():
    a, b = ManualGC(2), ManualGC(5)
    a.step(), b.step()
    a.close()
    assert not gc.isenabled()  # b still collects at its steps
    b.close()
    b.close()  # twice: nothing more
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    c = ManualGC(1)
    c.step()
    c.close()
    assert not gc.isenabled()


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_a_bad_interval_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="manual_gc_interval"):
        TrainConfig.from_dict({"manual_gc_interval": bad})
    with pytest.raises(ConfigError, match="manual_gc_interval"):
        ManualGC(bad)


def test_the_engine_collects_at_its_steps_and_trains_as_without(world1):
    want = _plain(4, 0.0, "adamw")
    torch.manual_seed(0)
    cfg = TrainConfig.from_dict({"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
                                 "manual_gc_interval": 2, "zero_optimization": {"stage": 3}})
    engine = initialize(Net(), cfg)
    for idx in _batches(4):
        engine.backward(_loss(engine, idx))
        assert engine.step()
        assert not gc.isenabled()
    assert engine.collector.steps == 4 and engine.collector.collections == 3  # steps 1, 2 and 4
    got = engine.full_state_dict()
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=0, atol=1e-6, msg=name)
    engine.close()
    assert gc.isenabled()


def test_a_pipeline_schedule_collects_at_the_end_of_its_step(world1):
    from commrt.pipeline import OneFOneB, PipelineStage
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    sched = OneFOneB(PipelineStage(model, 0, 1), 2, lambda out, y: torch.nn.functional.mse_loss(out, y),
                     manual_gc_interval=2)
    x, y = torch.ones(4, 4), torch.zeros(4, 2)
    for step in (1, 2, 3):
        ref = _garbage()
        sched.step(x, target=y)
        assert not gc.isenabled()
        assert (ref() is None) == (step != 3), f"step {step}"  # collected at steps 1 and 2, not 3
    sched.close()
    assert gc.isenabled()


def test_collector_time_counts_the_collections_of_this_process():
    """``commrt bench train``'s gc column: the time a step spent stopped in Python's collector,
    which its phases would count as compute."""
    from commrt.train.collector import CollectorTime
    CollectorTime.install()
    CollectorTime.install()  # one callback however often installed
    assert gc.callbacks.count(CollectorTime._callback) == 1
    seconds, full = CollectorTime.read()
    gc.collect()
    gc.collect(0)
    after, full_after = CollectorTime.read()
    assert full_after == full + 1 and after > seconds
