"""What the collectives do to a flat buffer, for numpy arrays and torch tensors alike.

A collective's buffers are whatever the caller passed: numpy arrays stay numpy (a rank that only
moves numpy buffers never imports torch: issue 32.2), torch tensors stay tensors and get torch's
own calls, exactly as before. Each helper picks by type; torch is looked up in sys.modules (a
tensor exists only once torch is loaded), or imported lazily where a torch dtype must be made.
Buffers here are flat (1-D, contiguous) and on the CPU unless a helper says otherwise.
"""
from __future__ import annotations

import sys

import numpy as np

UINT8 = np.dtype(np.uint8)


def numel(x) -> int:
    return x.size if isinstance(x, np.ndarray) else x.numel()


def nbytes(x) -> int:
    return x.nbytes if isinstance(x, np.ndarray) else x.numel() * x.element_size()


def is_contiguous(x) -> bool:
    """A contiguous numpy array or tensor (anything else: False)."""
    if isinstance(x, np.ndarray):
        return x.flags.c_contiguous
    return is_tensor(x) and x.is_contiguous()


def flat_plain(x):
    """A contiguous buffer's memory as a flat buffer outside autograd (a tensor that requires
    grad is detached: collectives write in place, and numpy refuses such a tensor, issue 30.5)."""
    if isinstance(x, np.ndarray):
        return x.reshape(-1)
    return (x.detach() if x.requires_grad else x).view(-1)


def address(x) -> int:
    """The address of the first element (torch's data_ptr)."""
    return x.__array_interface__["data"][0] if isinstance(x, np.ndarray) else x.data_ptr()


def empty_like(x):
    return np.empty_like(x) if isinstance(x, np.ndarray) else sys.modules["torch"].empty_like(x)


def empty(n: int, like):
    """A flat buffer of ``n`` elements of ``like``'s type, dtype and device."""
    if isinstance(like, np.ndarray):
        return np.empty(n, like.dtype)
    return sys.modules["torch"].empty(n, dtype=like.dtype, device=like.device)


def empty_of(n: int, dtype):
    """A flat CPU buffer of ``n`` elements of ``dtype``: numpy's, or a tensor for torch's."""
    if isinstance(dtype, np.dtype):
        return np.empty(n, dtype)
    return sys.modules["torch"].empty(n, dtype=dtype)


def zeros(n: int, like):
    if isinstance(like, np.ndarray):
        return np.zeros(n, like.dtype)
    return sys.modules["torch"].zeros(n, dtype=like.dtype, device=like.device)


def clone(x):
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def as_bytes(x) -> np.ndarray:
    """Zero-copy uint8 numpy view of a flat buffer (a bfloat16 tensor's too)."""
    if isinstance(x, np.ndarray):
        return x.view(UINT8)
    return x.view(sys.modules["torch"].uint8).numpy()


def as_numpy(x) -> np.ndarray | None:
    """A numpy view of a CPU buffer, or None where numpy has no such type (bfloat16)."""
    if isinstance(x, np.ndarray):
        return x
    try:
        return x.numpy()
    except TypeError:
        return None




def frombuffer(data, dtype):
    """A flat view of raw bytes (a received frame, shared memory) as ``dtype``, numpy's or
    torch's: the type of buffer the operation runs on."""
    if isinstance(dtype, np.dtype):
        return np.frombuffer(data, dtype)
    return sys.modules["torch"].frombuffer(data, dtype=dtype)




def assign(dst, src) -> None:
    """dst[...] = src, on the buffers' own device (torch's copy_ for a tensor, CUDA included)."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


def swap_blocks(x, a: int, b: int, s: int):
    """Flat ``x`` seen as [a, b, s] blocks, returned flat as [b, a, s] (a contiguous copy)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x.reshape(a, b, s).transpose(1, 0, 2)).reshape(-1)
    return x.view(a, b, s).transpose(0, 1).contiguous().view(-1)


def swap_blocks_into(out, x, a: int, b: int, s: int) -> None:
    """out (flat, [b, a, s]) = flat ``x`` seen as [a, b, s] with its first two axes swapped."""
    if isinstance(out, np.ndarray):
        out.reshape(b, a, s)[...] = x.reshape(a, b, s).transpose(1, 0, 2)
    else:
        out.view(b, a, s).copy_(x.view(a, b, s).transpose(0, 1))


def is_tensor(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)
