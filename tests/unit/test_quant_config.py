"""The [quant] config section: defaults, TOML / environment, validation."""
import pytest

from commrt.runtime.config import Config, ConfigError, load_config


def test_defaults_and_environment(tmp_path):
    assert (Config().quant.block, Config().quant.scale_dtype, Config().quant.rounding) == (256, "fp32", "nearest")
    path = tmp_path / "c.toml"
    path.write_text('[quant]\nblock = 64\nscale_dtype = "fp16"\n')
    cfg = load_config(path, environ={"COMMRT_QUANT_ROUNDING": "stochastic"})
    assert (cfg.quant.block, cfg.quant.scale_dtype, cfg.quant.rounding) == (64, "fp16", "stochastic")
    assert cfg.digest() != Config().digest()  # ranks must agree on how blocks are encoded


@pytest.mark.parametrize("key,value,msg", [("block", 3, "even integer"), ("block", 0, "even integer"),
                                           ("scale_dtype", "bf16", "valid: \\['fp32', 'fp16'\\]"),
                                           ("rounding", "up", "valid: \\['nearest', 'stochastic'\\]")])
def test_invalid_values_are_refused(key, value, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(overrides={"quant": {key: value}}, environ={})


def test_zero_plus_plus_keys():
    from commrt.train.config import TrainConfig
    z = TrainConfig.from_dict({"zero_optimization": {
        "stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
        "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}, "zero_hpz_partition_size": 1}}).zero
    assert z.zero_quantized_weights and z.zero_quantized_gradients and z.zeropp_loco_param["reset_T"] == 1024
    for zero, msg in (({"stage": 2, "zero_quantized_weights": True}, "needs stage 3"),
                      ({"stage": 2, "zero_hpz_partition_size": 2}, "needs stage 3"),
                      ({"stage": 2, "zeropp_loco_param": {"err_beta": 0.5}}, "needs zero_quantized_gradients"),
                      ({"stage": 2, "zero_quantized_gradients": True, "zeropp_loco_param": {"beta": 1}},
                       "valid keys: err_beta")):
        with pytest.raises(ConfigError, match=msg):
            TrainConfig.from_dict({"zero_optimization": zero})
