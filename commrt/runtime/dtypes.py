"""The whitelist of element types that may cross the wire, with their codes."""
from __future__ import annotations

import numpy as np
import torch

# code -> (name, torch dtype); codes are part of the wire format: never renumber.
_TABLE = {
    1: ("float32", torch.float32),
    2: ("float64", torch.float64),
    3: ("float16", torch.float16),
    4: ("bfloat16", torch.bfloat16),
    5: ("int8", torch.int8),
    6: ("uint8", torch.uint8),
    7: ("int32", torch.int32),
    8: ("int64", torch.int64),
}
_CODE_OF = {tdt: code for code, (_, tdt) in _TABLE.items()}
NAMES = {code: name for code, (name, _) in _TABLE.items()}
BY_NAME = {name: tdt for name, tdt in _TABLE.values()}


def code_of(dtype: torch.dtype) -> int:
    try:
        return _CODE_OF[dtype]
    except KeyError:
        valid = [name for name, _ in _TABLE.values()]
        raise TypeError(f"dtype {dtype} is not supported; valid: {valid}") from None


def name_of(code: int) -> str:
    return NAMES.get(code, f"<code {code}>")


def parse_dtype(name: str) -> torch.dtype:
    """'float32' / 'fp32' / 'bf16' ... -> torch dtype (for CLIs and configs)."""
    aliases = {"fp32": "float32", "float": "float32", "fp64": "float64", "double": "float64",
               "fp16": "float16", "half": "float16", "bf16": "bfloat16", "int": "int32"}
    key = aliases.get(name.lower(), name.lower())
    if key not in BY_NAME:
        raise ValueError(f"unknown dtype '{name}'; valid: {sorted(BY_NAME)}")
    return BY_NAME[key]


def as_tensor(obj) -> torch.Tensor:
    """A torch view of a torch tensor or numpy array, sharing memory (updates land in place).

    A tensor that requires grad is detached (same memory): like torch.distributed, a collective
    updates it in place outside autograd, instead of numpy refusing to view it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach() if obj.requires_grad else obj
    if isinstance(obj, np.ndarray):
        if not obj.flags.writeable:
            raise ValueError("numpy array is read-only; collectives update tensors in place")
        return torch.from_numpy(obj)
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(obj).__name__}")


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) address of the bytes ``t`` can reach through its strides."""
    lo = t.data_ptr()
    if t.numel() == 0:
        return lo, lo
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0)
    return lo, lo + (reach + 1) * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share any memory. Compared by address, not by storage object: two
    numpy arrays over one buffer become tensors with different storages but the same bytes."""
    if a.device != b.device:
        return False
    (alo, ahi), (blo, bhi) = byte_span(a), byte_span(b)
    return alo < bhi and blo < ahi
