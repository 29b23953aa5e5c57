"""backends.base.plain: the small-op path's one-call check (issue 32) takes exactly the buffers
flat_view would hand back as they are, and leaves every other case to flat_view."""
import numpy as np
import pytest
import torch

from commrt.backends.base import avg_as_is, flat_view, plain
from commrt.runtime import dtypes


@pytest.fixture(autouse=True)
def _seen():
    for d in (np.dtype(np.float32), np.dtype(np.int64), torch.float32, torch.bfloat16):
        dtypes.code_of(d)  # as after a first op of each


@pytest.mark.parametrize("make", [
    lambda: np.arange(12, dtype=np.float32),
    lambda: np.arange(12, dtype=np.int64).reshape(3, 4),
    lambda: np.ones((), np.float32),
    lambda: torch.arange(12.0),
    lambda: torch.arange(12.0).reshape(3, 4),
    lambda: torch.zeros(5, dtype=torch.bfloat16),
    lambda: torch.zeros(0),
], ids=["np-1d", "np-2d", "np-0d", "torch-1d", "torch-2d", "bf16", "empty"])
def test_plain_buffers_are_flat_views_of_the_same_memory(make):
    t = make()
    got, want = plain(t), flat_view(t)
    assert want[1] is None and got is not None
    assert type(got) is type(want[0]) and got.shape == want[0].shape
    if got.size if isinstance(got, np.ndarray) else got.numel():
        got[0] = 7
        assert t.reshape(-1)[0] == 7  # the caller's memory, not a copy


@pytest.mark.parametrize("make", [
    lambda: np.arange(12, dtype=np.float32)[::2],  # strided: flat_view copies and writes back
    lambda: np.asfortranarray(np.ones((3, 4), np.float32)),
    lambda: _read_only(np.ones(4, np.float32)),  # refused by flat_view, with its error
    lambda: np.ones(4, np.complex64),  # not on the wire: refused
    lambda: np.ones((2, 2), np.float32).view(np.matrix),  # a subclass: flat_view's rules
    lambda: torch.ones(4, requires_grad=True),  # detached first
    lambda: torch.ones(4, 2).t(),
    lambda: torch.ones(4, dtype=torch.complex64),
    lambda: torch.ones(4, 4)[:, :1],  # one column, stride 4
    lambda: torch.ones(8).as_strided((1,), (5,)),  # "contiguous" to torch: one element, stride 5
    lambda: [1.0, 2.0],
], ids=["strided", "fortran", "read-only", "complex", "matrix", "grad", "transposed", "torch-complex",
        "column", "one-strided", "list"])
def test_anything_else_goes_to_flat_view(make):
    assert plain(make()) is None


def _read_only(a):
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("dtype, as_is", [
    (np.dtype(np.float32), True), (np.dtype(np.float16), True), (np.dtype(np.complex64), True),
    (np.dtype(np.int8), False), (np.dtype(np.int64), False), (np.dtype(np.bool_), False),
    (torch.float32, True), (torch.bfloat16, True), (torch.complex64, True),
    (torch.int8, False), (torch.uint8, False), (torch.int64, False), (torch.bool, False),
])
def test_an_average_runs_as_is_only_on_floats(dtype, as_is):
    """The fast path of an AVG (all_reduce, reduce_scatter) skips ``widened`` and
    ``check_defined``: only where neither would do anything (a narrow integer is widened, so
    its sum cannot wrap; bool is refused), asked twice for the cache."""
    assert avg_as_is(dtype) is as_is
    assert avg_as_is(dtype) is as_is
