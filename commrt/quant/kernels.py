"""Where a quantized hop computes: the numpy codec on host arrays, the torch codec on tensors
(on their device). The hops in exchange.py are written once over these few operations; both
sides produce the same bytes and the same fp32 values (see torch_codec.py), so ranks that hold
CUDA tensors and ranks that hold CPU tensors still agree bit for bit."""
from __future__ import annotations

import numpy as np
import torch

from commrt.quant import fused, torch_codec
from commrt.quant.codecs import Codec


class Host:
    """numpy arrays: the codec on the CPU, one thread (see codecs.py)."""

    @staticmethod
    def empty_bytes(n: int, like) -> np.ndarray:
        return np.empty(n, dtype=np.uint8)

    @staticmethod
    def zero_bytes(n: int, like) -> np.ndarray:
        return np.zeros(n, dtype=np.uint8)

    @staticmethod
    def zero_floats(n: int, like) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    @staticmethod
    def encode(codec: Codec, out, x, offset: int) -> tuple[float, str | None]:
        return codec.encode_into(out, x, offset=offset, mark=True)

    @staticmethod
    def decode(codec: Codec, buf, numel: int) -> np.ndarray:
        return codec.decode(buf, numel)

    @staticmethod
    def decode_add(codec: Codec, buf, numel: int, acc: np.ndarray) -> None:
        acc += codec.decode(buf, numel)

    @staticmethod
    def marked(codec: Codec, buf, numel: int) -> bool:
        return codec.marked(buf, numel)

    @staticmethod
    def cat(parts: list) -> np.ndarray:
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.float32)

    @staticmethod
    def max_abs_diff(a, b) -> float:
        return float(np.abs(a - b).max()) if a.size else 0.0

    @staticmethod
    def divide(acc: np.ndarray, n: int) -> None:
        acc /= n

    @staticmethod
    def all_finite(x: np.ndarray) -> bool:
        return bool(np.isfinite(x).all())


class Device:
    """torch tensors: on the tensor's device, nothing goes through host memory; CUDA tensors
    take the fused Triton kernels where they apply, else the torch codec (see fused.py)."""

    @staticmethod
    def empty_bytes(n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, device=like.device)

    @staticmethod
    def zero_bytes(n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8, device=like.device)

    @staticmethod
    def zero_floats(n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float32, device=like.device)

    @staticmethod
    def encode(codec: Codec, out, x, offset: int) -> tuple[float, str | None]:
        return fused.encode_into(codec, out, x, offset=offset, mark=True)

    @staticmethod
    def decode(codec: Codec, buf, numel: int) -> torch.Tensor:
        return fused.decode(codec, buf, numel)

    @staticmethod
    def decode_add(codec: Codec, buf, numel: int, acc: torch.Tensor) -> None:
        fused.decode_add(codec, buf, numel, acc)

    @staticmethod
    def marked(codec: Codec, buf, numel: int) -> bool:
        return torch_codec.marked(codec, buf, numel)

    @staticmethod
    def cat(parts: list) -> torch.Tensor:
        return torch.cat(parts)

    @staticmethod
    def max_abs_diff(a, b) -> float:
        return float((a - b).abs().max()) if a.numel() else 0.0

    @staticmethod
    def divide(acc: torch.Tensor, n: int) -> None:
        """acc /= n, correctly rounded as numpy's: torch's CUDA kernel multiplies by the
        reciprocal when the divisor is a Python or CPU scalar (one bit off at times), not when
        it is a tensor on the device."""
        acc.div_(torch.tensor(n, dtype=acc.dtype, device=acc.device))

    @staticmethod
    def all_finite(x: torch.Tensor) -> bool:
        return bool(torch.isfinite(x).all())


def of(x) -> type[Host] | type[Device]:
    """The kernels for ``x``: Device for a torch tensor, Host for a numpy array."""
    return Device if isinstance(x, torch.Tensor) else Host
