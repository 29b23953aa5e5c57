"""[train] fault_tolerance: the valid values, and the ZeRO setups replica mode refuses (issue 33.2)."""
from __future__ import annotations

import pytest

from commrt.runtime.errors import ConfigError
from commrt.train.config import TrainConfig
from commrt.train.replica_state import make_optimizer
from commrt.optim.rules import OptimSpec


def test_off_by_default_and_replica_at_stage_0():
    assert TrainConfig.from_dict({}).fault_tolerance == "off"
    cfg = TrainConfig.from_dict({"fault_tolerance": "replica", "zero_optimization": {"sharding_strategy": "NO_SHARD"}})
    assert cfg.fault_tolerance == "replica" and cfg.zero.stage == 0


def test_unknown_value_names_the_valid_ones():
    with pytest.raises(ConfigError, match=r"fault_tolerance = 'replicas' is invalid; valid: \['off', 'replica'\]"):
        TrainConfig.from_dict({"fault_tolerance": "replicas"})


@pytest.mark.parametrize("zero, why", [
    ({"stage": 1}, "needs zero_optimization.stage 0.*stage 1 shards"),
    ({"stage": 3}, "needs zero_optimization.stage 0.*stage 3 shards"),
    ({"sharding_strategy": "HYBRID_SHARD"}, "does not support HYBRID_SHARD"),
    ({"stage": 3, "zero_hpz_partition_size": 2}, "does not support HYBRID_SHARD, MiCS or hpZ"),
])
def test_sharded_stages_are_refused(zero, why):
    with pytest.raises(ConfigError, match=why):
        TrainConfig.from_dict({"fault_tolerance": "replica", "zero_optimization": zero})


def test_lamb_has_no_torch_optimizer():
    with pytest.raises(ConfigError, match="AdamW or SGD, not 'lamb'"):
        make_optimizer(OptimSpec("lamb"), [])
