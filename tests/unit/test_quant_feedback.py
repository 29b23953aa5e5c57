"""Error feedback: the mean of N steps' quantized values converges to the exact mean."""
import numpy as np
import pytest

from commrt.quant import ErrorFeedback
from commrt.quant.codecs import Codec


def mean_error(steps: int, fb: ErrorFeedback | None, codec=Codec(4, 64)) -> float:
    """The same input every step (the worst case for plain rounding: the same error each time)."""
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    buf = np.empty(codec.nbytes(x.size), dtype=np.uint8)
    total = np.zeros(x.size)
    for _ in range(steps):
        if fb is not None:
            fb.begin()
        src = fb.compensate("send", x) if fb is not None else x
        codec.encode_into(buf, src)
        got = codec.decode(buf, x.size)
        if fb is not None:
            fb.update("send", src, got)
        total += got
    return float(np.abs(total / steps - x).max())


@pytest.mark.parametrize("err_beta", [0.0, 0.8])
def test_mean_of_n_steps_converges_to_the_exact_mean(err_beta):
    plain = mean_error(200, None)
    e100 = mean_error(100, ErrorFeedback(err_beta, reset_T=0))
    e400 = mean_error(400, ErrorFeedback(err_beta, reset_T=0))
    assert plain > 0.05  # int4 rounding keeps its bias without feedback...
    assert e100 < plain / 5 and e400 < e100 / 2.5  # ...with feedback it shrinks like 1/N


def test_reset_T_forgets_the_error_every_T_calls():
    fb = ErrorFeedback(0.5, reset_T=3)
    x = np.full(4, 0.3, dtype=np.float32)
    for _ in range(3):
        fb.begin()
        fb.update("s", fb.compensate("s", x), np.zeros(4, dtype=np.float32))
    assert fb.error("s") is not None and fb.calls == 3
    fb.begin()  # the 4th call starts again from zero, as DeepSpeed's loco_idx > reset_T
    assert np.array_equal(fb.compensate("s", x), x)
    fb.update("s", x, np.zeros(4, dtype=np.float32))
    assert np.allclose(fb.error("s"), 0.15) and fb.calls == 1


def test_a_call_that_never_updates_changes_nothing():
    """A collective that raised never reaches update: the memory and the count stay, even
    where that call would have reset (test_quant.py checks it on real ranks)."""
    fb = ErrorFeedback(0.5, reset_T=2)
    x = np.full(4, 0.3, dtype=np.float32)
    for _ in range(2):
        fb.begin()
        fb.update("s", fb.compensate("s", x), np.zeros(4, dtype=np.float32))
    kept = fb.error("s")
    fb.begin(4)  # the 3rd call would reset; it raises before any update
    assert fb.calls == 2 and np.array_equal(fb.error("s"), kept)


def test_loco_param_keys_and_validation():
    fb = ErrorFeedback.from_loco({"err_beta": 0.5, "reset_T": 10})
    assert (fb.err_beta, fb.reset_T) == (0.5, 10)
    assert (ErrorFeedback.from_loco(None).err_beta, ErrorFeedback.from_loco({}).reset_T) == (0.8, 1024)
    with pytest.raises(ValueError, match="valid: \\['err_beta', 'reset_T'\\]"):
        ErrorFeedback.from_loco({"beta": 1})
    with pytest.raises(ValueError, match="in \\[0, 1\\)"):
        ErrorFeedback(1.0)
