"""The whole runtime config: one field per TOML section, and the digest ranks compare."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from commrt.runtime.config.comm import ClusterConfig, CommConfig, SecurityConfig
from commrt.runtime.config.ps import PsConfig
from commrt.runtime.config.quant_log import LogConfig, QuantConfig

DIGESTED = (("comm", "backend"), ("comm", "chunk_bytes"), ("comm", "small_bytes"),
            ("comm", "max_frame_bytes"), ("comm", "check_call_sites"), ("comm", "hierarchical"),
            ("security", "mode"), ("comm", "intra_node"), ("comm", "algorithms"),
            ("cluster", "store_proxy"), ("comm", "shm_slot_bytes"))
QUANT_DIGESTED = ("block", "scale_dtype", "rounding", "pieces")
"""How blocks are encoded and how the two-hop path cuts its calls; not ``profile`` or
``cpu_codec``, which may differ between ranks."""


@dataclass(frozen=True)
class Config:
    comm: CommConfig = field(default_factory=CommConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    ps: PsConfig = field(default_factory=PsConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def digest(self) -> str:
        """Hash of the settings every rank must agree on: what decides the algorithms and the
        wire, the security mode, and how ranks reach the store (a rank expecting a store proxy
        its leader does not serve must fail on the digest, not time out). Not per-host ones
        (paths to the secret or keys, timeouts, memory habits): hosts that keep their keys in
        different places must still meet."""
        shared = {f"{s}.{n}": getattr(getattr(self, s), n) for s, n in DIGESTED}
        quant = {n: getattr(self.quant, n) for n in QUANT_DIGESTED}
        if quant != {n: getattr(QuantConfig, n) for n in QUANT_DIGESTED}:  # ranks must decode alike
            shared["quant"] = quant
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


SECTION_TYPES = {"comm": CommConfig, "cluster": ClusterConfig, "security": SecurityConfig,
                 "ps": PsConfig, "quant": QuantConfig, "log": LogConfig}
OTHER_SECTIONS = ("train",)  # read by their own layers (commrt/train/config.py)
