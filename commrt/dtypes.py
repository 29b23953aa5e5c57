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
    """A torch view of a torch tensor or numpy array, sharing memory (updates land in place)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, np.ndarray):
        if not obj.flags.writeable:
            raise ValueError("numpy array is read-only; collectives update tensors in place")
        return torch.from_numpy(obj)
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(obj).__name__}")
