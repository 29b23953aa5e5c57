"""The whitelist of element types that may cross the wire, with their codes.

The table is keyed by name, so numpy arrays and torch tensors share it and a rank that only
moves numpy buffers never imports torch (issue 32.2); ``BY_NAME`` (name -> torch dtype) and
the torch-only helpers load torch when first used."""
from __future__ import annotations

import sys

import numpy as np

# code -> name; codes are part of the wire format: never renumber.
NAMES = {1: "float32", 2: "float64", 3: "float16", 4: "bfloat16", 5: "int8", 6: "uint8", 7: "int32",
         8: "int64", 9: "bool"}
CODES = {name: code for code, name in NAMES.items()}
NUMPY = {name: np.dtype(name) for name in CODES if name != "bfloat16"}  # numpy has no bfloat16
_CODE_OF: dict = {}  # dtype object (torch or numpy) -> code, filled on first sight
SEEN = _CODE_OF  # read-only to callers: ``dtype in SEEN`` is the cheapest "it may cross the wire"


def dtype_name(dtype) -> str:
    """'float32' for torch.float32, numpy's float32 or the name itself."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def code_of(dtype) -> int:
    """The wire code of a torch dtype, a numpy dtype or a name."""
    try:
        return _CODE_OF[dtype]
    except KeyError:
        pass
    except TypeError:  # unhashable: not a dtype
        raise TypeError(f"dtype {dtype!r} is not supported; valid: {list(CODES)}") from None
    name = dtype_name(dtype)
    if name not in CODES or (isinstance(dtype, np.dtype) and not dtype.isnative):
        raise TypeError(f"dtype {dtype} is not supported; valid: {list(CODES)}")
    _CODE_OF[dtype] = CODES[name]
    return CODES[name]


def name_of(code: int) -> str:
    return NAMES.get(code, f"<code {code}>")


def _torch_dtypes() -> dict:
    import torch  # lazy: torch is heavy, and only torch users ask for its dtypes
    return {n: getattr(torch, n) for n in CODES}


def __getattr__(name: str):
    """``BY_NAME``: name -> torch dtype, built (importing torch) when first asked for."""
    if name == "BY_NAME":
        value = globals()["BY_NAME"] = _torch_dtypes()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_dtype(name: str):
    """'float32' / 'fp32' / 'bf16' ... -> torch dtype (for CLIs and configs)."""
    aliases = {"fp32": "float32", "float": "float32", "fp64": "float64", "double": "float64",
               "fp16": "float16", "half": "float16", "bf16": "bfloat16", "int": "int32"}
    key = aliases.get(name.lower(), name.lower())
    if key not in CODES:
        raise ValueError(f"unknown dtype '{name}'; valid: {sorted(CODES)}")
    return __getattr__("BY_NAME")[key]


def as_buffer(obj, writes: bool = True):
    """A numpy array or a torch tensor, as given, ready to be updated in place: a read-only
    array is refused where the op ``writes`` it (an input only read, as all_gather's or a send's,
    may be read-only), and a tensor that requires grad is detached (same memory): like
    torch.distributed, a collective updates it in place outside autograd."""
    if isinstance(obj, np.ndarray):
        if writes and not obj.flags.writeable:
            raise ValueError("numpy array is read-only; collectives update tensors in place")
        return obj
    torch = sys.modules.get("torch")  # a tensor can only exist once torch is loaded
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.detach() if obj.requires_grad else obj
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(obj).__name__}")


def as_tensor(obj, writes: bool = True):
    """A torch view of a torch tensor or numpy array, sharing memory (updates land in place); an
    array that is only read (``writes`` false) is copied where torch cannot view it: read-only
    or with a negative stride (torch has neither; ``negative_strides``)."""
    import torch  # lazy: only torch-level callers ask for a tensor
    buf = as_buffer(obj, writes)
    if isinstance(buf, np.ndarray):
        viewable = buf.flags.writeable and not negative_strides(buf)
        return torch.from_numpy(buf if viewable or writes else np.ascontiguousarray(buf))
    return buf


def negative_strides(a: np.ndarray) -> bool:
    """A numpy array torch cannot view (``a[::-1]``): it runs on a copy, stored back."""
    return any(s < 0 for s in a.strides)


def byte_span(t) -> tuple[int, int]:
    """[first, last + 1) address of the bytes ``t`` (array or tensor) can reach via its strides."""
    if isinstance(t, np.ndarray):
        at = t.__array_interface__["data"][0]
        if t.size == 0:
            return at, at
        back = sum((n - 1) * s for n, s in zip(t.shape, t.strides) if s < 0)  # numpy's may be negative
        reach = sum((n - 1) * s for n, s in zip(t.shape, t.strides) if s > 0)
        return at + back, at + reach + t.itemsize
    lo = t.data_ptr()
    if t.numel() == 0:
        return lo, lo
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0)
    return lo, lo + (reach + 1) * t.element_size()


def overlaps(a, b) -> bool:
    """Whether two buffers share any memory. Compared by address, not by storage object: two
    numpy arrays over one buffer become tensors with different storages but the same bytes."""
    if _device(a) != _device(b):
        return False
    (alo, ahi), (blo, bhi) = byte_span(a), byte_span(b)
    return alo < bhi and blo < ahi


def _device(t) -> str:
    return "cpu" if isinstance(t, np.ndarray) else str(t.device)
