"""The training config's sharding keys (FSDP strategies, hpZ, MiCS) and the layout they give
at a world size: pure, no processes."""
import pytest

from commrt.runtime.errors import ConfigError
from commrt.train.config import TrainConfig
from commrt.train.sharding import Plan, plan


def zero(**keys):
    return TrainConfig.from_dict({"zero_optimization": keys}).zero


@pytest.mark.parametrize("name,stage,hybrid", [("FULL_SHARD", 3, False), ("SHARD_GRAD_OP", 2, False),
                                               ("NO_SHARD", 0, False), ("HYBRID_SHARD", 3, True),
                                               ("_HYBRID_SHARD_ZERO2", 2, True)])
def test_fsdp_strategies_map_onto_stages(name, stage, hybrid):
    z = zero(sharding_strategy=name)
    assert (z.stage, z.hybrid) == (stage, hybrid)
    assert zero(sharding_strategy=name, stage=stage).stage == stage  # both, consistently: fine


def test_stage_alone_and_default():
    assert zero().stage == 0 and zero(stage=2).stage == 2 and not zero(stage=3).hybrid


@pytest.mark.parametrize("keys,says", [
    ({"stage": 2, "sharding_strategy": "FULL_SHARD"}, "contradicts"),
    ({"stage": 3, "sharding_strategy": "_HYBRID_SHARD_ZERO2"}, "contradicts"),
    ({"sharding_strategy": "FULL"}, "valid: ['FULL_SHARD'"),
    ({"stage": 2, "zero_hpz_partition_size": 2}, "needs stage 3"),
    ({"sharding_strategy": "SHARD_GRAD_OP", "zero_hpz_partition_size": 4}, "_HYBRID_SHARD_ZERO2"),
    ({"stage": 3, "zero_hpz_partition_size": 0}, "int >= 1"),
    ({"stage": 2, "mics_shard_size": 2}, "needs stage 3"),
    ({"stage": 3, "mics_shard_size": 2, "shard_group_size": 4}, "disagree"),
    ({"stage": 3, "shard_group_size": 2}, "applies only to"),
    ({"sharding_strategy": "HYBRID_SHARD", "zero_hpz_partition_size": 2}, "cannot be combined"),
])
def test_inconsistent_keys_are_config_errors(keys, says):
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("(", r"\(")):
        zero(**keys)


@pytest.mark.parametrize("raw,says", [
    ({"bf16": True}, "bf16 = True is invalid"),  # was a TypeError
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled"),
    ({"zero_optimization": 3}, "zero_optimization = 3 is invalid"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": -5}}, "stage3_prefetch_bucket_size = -5"),
    # zeropp_loco_param not a table, or its values not numbers: a bare TypeError or AttributeError
    *[({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True, "zeropp_loco_param": loco}},
       "zeropp_loco_param = ") for loco in (True, [0.8], {"err_beta": "0.8"}, {"reset_T": None}, {"reset_T": 2.5})],
    ({"gradient_clipping": float("nan")}, "gradient_clipping = nan"),
    ({"optimizer": "adam"}, "optimizer = 'adam' is invalid"),  # was an AttributeError
    ({"optimizer": {"type": "AdamW", "params": None}}, "optimizer.params = None"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}}, "lr = '1e-3'"),  # failed only mid-step
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "lr = -1"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, "betas = [0.9]"),  # was an IndexError
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}}, "beta2 = 1.5"),
    ({"optimizer": {"type": "SGD", "params": {"momentum": -0.5}}}, "momentum = -0.5"),
    # accepted and ignored (AdamW with bias correction ran): refused, saying what runs
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "adam_w_mode = False is not supported"),
    ({"optimizer": {"type": "LAMB", "params": {"bias_correction": False}}}, "bias_correction = False is not"),
    ({"optimizer": {"type": "AdamW", "params": {"bias_correction": "false"}}}, "bias_correction = 'false'"),
])
def test_malformed_values_are_config_errors(raw, says):
    """Found by the training review: each was accepted, or failed with a bare TypeError,
    IndexError or AttributeError (or inside the first optimizer step) instead."""
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("(", r"\(")):
        TrainConfig.from_dict(raw)


def test_plans_at_a_world_size():
    assert plan(zero(stage=3), 4, 2) == Plan(3, 4, 1, 0)
    assert plan(zero(stage=3, zero_hpz_partition_size=2), 4, 4) == Plan(3, 4, 1, 2)
    assert plan(zero(stage=3, zero_hpz_partition_size=4), 4, 4) == Plan(3, 4, 1, 0)  # the node is the world
    assert plan(zero(sharding_strategy="HYBRID_SHARD"), 6, 3) == Plan(3, 3, 2, 0)  # default: ranks per node
    assert plan(zero(sharding_strategy="_HYBRID_SHARD_ZERO2", shard_group_size=2), 6, 6) == Plan(2, 2, 3, 0)
    assert plan(zero(stage=3, mics_shard_size=3), 6, 1) == Plan(3, 3, 2, 0)  # any size dividing the world
    assert plan(zero(mics_shard_size=2, sharding_strategy="HYBRID_SHARD"), 4, 4) == Plan(3, 2, 2, 0)


@pytest.mark.parametrize("keys,world,per_node,says", [
    ({"stage": 3, "zero_hpz_partition_size": 4}, 6, 6, "does not divide the world of 6 ranks; valid: [1, 2, 3, 6]"),
    ({"stage": 3, "mics_shard_size": 4}, 6, 6, "mics_shard_size = 4 does not divide"),
    # instructlab/training 678: a 2-rank job on machines with 8 ranks per node
    ({"sharding_strategy": "HYBRID_SHARD"}, 2, 8, "larger than the world of 2 rank(s); use a size that divides 2: [1, 2]"),
    ({"stage": 3, "zero_hpz_partition_size": 8}, 2, 8, "larger than the world of 2"),
])
def test_group_sizes_that_do_not_fit_the_world(keys, world, per_node, says):
    with pytest.raises(ConfigError) as info:
        plan(zero(**keys), world, per_node)
    assert says in str(info.value)


def test_auto_picks_the_node():
    assert plan(zero(stage=3, zero_hpz_partition_size="auto"), 8, 4) == Plan(3, 8, 1, 4)
    assert plan(zero(stage=3, zero_hpz_partition_size="auto"), 4, 4) == Plan(3, 4, 1, 0)  # one node: off
    assert plan(zero(sharding_strategy="auto"), 8, 4) == Plan(3, 4, 2, 0)
    assert plan(zero(sharding_strategy="auto"), 4, 4) == Plan(3, 4, 1, 0)


def test_nodes_of_different_sizes_are_no_nodes_to_auto():
    """per_node 0 (what groups.ranks_per_node says on uneven nodes): "auto" shards over every
    rank, and hybrid without a size says to give one (it divided by zero)."""
    assert plan(zero(stage=3, sharding_strategy="auto"), 4, 0) == Plan(3, 4, 1, 0)
    assert plan(zero(stage=3, zero_hpz_partition_size="auto"), 4, 0) == Plan(3, 4, 1, 0)
    with pytest.raises(ConfigError, match="set shard_group_size"):
        plan(zero(sharding_strategy="HYBRID_SHARD"), 4, 0)
    assert plan(zero(sharding_strategy="HYBRID_SHARD", shard_group_size=2), 4, 0) == Plan(3, 2, 2, 0)


def test_with_stage_drops_the_strategy_name():
    cfg = TrainConfig.from_dict({"zero_optimization": {"sharding_strategy": "FULL_SHARD"}})
    assert cfg.with_stage(1).zero.stage == 1


def test_run_ready_finishes_only_the_done_front_in_order():
    """Zero.progress: hybrid's follow-up all-reduce starts from a hook once its reduce-scatter
    is done; only from the front, so every rank starts follow-ups in the same order."""
    from commrt.train.followups import Followup, run_ready

    class W:
        def __init__(self, done):
            self.done = done

        def is_completed(self):
            return self.done

        def wait(self):
            assert self.done

    ran = []
    works = [Followup(W(True), ran.append, (1,)),
             Followup(W(True), lambda: works.append(Followup(W(True), ran.append, (9,)))),
             Followup(W(False), ran.append, (3,)), Followup(W(True), ran.append, (4,))]
    assert run_ready(works) == 2 and ran == [1] and len(works) == 3  # stops at the one in flight
    works[0].work.done = True
    assert run_ready(works) == 3 and ran == [1, 3, 4, 9] and not works


def test_auto_weighs_the_measured_links():
    from commrt.train.sharding import Links
    slow_across, flat = Links(intra=2e9, inter=0.1e9), Links(intra=1e9, inter=0.9e9)
    assert plan(zero(stage=3, zero_hpz_partition_size="auto"), 8, 4, slow_across) == Plan(3, 8, 1, 4)
    assert plan(zero(stage=3, zero_hpz_partition_size="auto"), 8, 4, flat) == Plan(3, 8, 1, 0)
    assert plan(zero(sharding_strategy="auto"), 8, 4, slow_across) == Plan(3, 4, 2, 0)
    assert plan(zero(sharding_strategy="auto"), 8, 4, flat) == Plan(3, 8, 1, 0)
    # a setting that is not "auto" is never second-guessed
    assert plan(zero(stage=3, zero_hpz_partition_size=4), 8, 4, flat) == Plan(3, 8, 1, 4)


def test_deepspeed_batch_sizes_must_agree_with_the_accumulation_steps():
    """Found by the training review: train_batch_size and train_micro_batch_size_per_gpu were
    accepted and ignored, so a DeepSpeed config that implies 4 accumulation steps (32 = 4 x 4 x 2)
    ran with 1; now a ConfigError names the product, and consistent sizes pass."""
    cfg = TrainConfig.from_dict({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})
    with pytest.raises(ConfigError, match=r"= 8; set gradient_accumulation_steps"):
        cfg.check_batch(2)
    TrainConfig.from_dict({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                           "gradient_accumulation_steps": 4}).check_batch(2)
    TrainConfig.from_dict({"train_batch_size": 32}).check_batch(2)  # one of them alone: nothing to check
    with pytest.raises(ConfigError, match="train_batch_size = 0"):
        TrainConfig.from_dict({"train_batch_size": 0})
