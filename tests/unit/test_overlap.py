"""dtypes.overlaps decides in-place handling of the collectives (issue 12.1): by address, so
views, numpy arrays over one buffer and strided views are all recognised."""
import numpy as np
import torch

from commrt.runtime.dtypes import as_tensor, overlaps


def test_views_of_one_tensor():
    t = torch.zeros(12)
    assert overlaps(t, t) and overlaps(t[4:8], t) and overlaps(t, t[11:])
    assert not overlaps(t[:4], t[4:8]) and not overlaps(t[4:8], t[8:])
    assert overlaps(t[3:5], t[4:6])
    assert not overlaps(t[:0], t) and not overlaps(t[5:5], t[4:6])  # empty tensors share nothing


def test_other_tensors_and_dtypes():
    a, b = torch.zeros(8), torch.zeros(8)
    assert not overlaps(a, b)
    assert overlaps(a.view(torch.uint8)[4:8], a[1:2]) and not overlaps(a.view(torch.uint8)[4:8], a[2:])


def test_strided_views_use_their_whole_reach():
    m = torch.zeros(4, 6)
    col = m[:, 5]  # reaches from element 5 to element 23
    assert overlaps(col, m[3]) and overlaps(col, m[1, 2:4])
    assert not overlaps(m[0, :5], col)


def test_numpy_arrays_over_one_buffer_are_seen():
    buf = np.zeros(10, dtype=np.float32)
    a, b = as_tensor(buf[:6]), as_tensor(buf[4:])
    assert overlaps(a, b) and not overlaps(as_tensor(buf[:4]), b)


def test_requires_grad_is_detached_in_place():
    p = torch.ones(3, requires_grad=True)
    t = as_tensor(p)
    assert not t.requires_grad and t.data_ptr() == p.data_ptr()
