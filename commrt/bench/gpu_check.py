"""What ``tests/gpu/run.sh`` measures and reports on a GPU machine (issue 34).

``python -m commrt.bench.gpu_check codec OUT.json``: encode / decode throughput of the codec on
one CUDA device next to a device-to-device copy of the same fp32 buffer. GB/s counts the fp32
bytes going in (encode) or coming out (decode), as commrt.quant.speed does on the CPU, so
``of_copy`` is the codec's speed as a fraction of the copy's (a copy reads and writes those
bytes; encode reads them and writes a quarter or an eighth as many).
``python -m commrt.bench.gpu_check report DIR``: DIR/report.md and DIR/report.json from the
environment, the pytest runs' junit files and the codec figures in DIR.
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from commrt.quant import fused, torch_codec
from commrt.quant.codecs import Codec

SIZES_MIB = (256, 1024)
CODECS = (Codec(8), Codec(4))
CONFIGS = ((1024, 4), (2048, 4), (4096, 4), (4096, 8))
"""(tile, warps) tried for the fused kernels at the largest size (round 1 found 8192 / 16384
values with 8 warps slower everywhere); the defaults are fused's."""


def _seconds(fn, reps: int) -> float:
    """Median time of ``fn`` on the current stream (CUDA events), after one untimed call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _row(what: str, nbytes: int, seconds: float, copy_gbps: float | None, **extra) -> dict:
    gbps = nbytes / seconds / 1e9
    return dict(what=what, seconds=seconds, gbps=round(gbps, 1),
                of_copy=round(gbps / copy_gbps, 3) if copy_gbps else None, **extra)


def _encode_rows(x, codec: Codec, buf, copy_gbps: float, reps: int, configs) -> list[dict]:
    """Encode as callers see it (with the host sync reading the largest scale) and the kernel
    alone, exact and FAST (one reciprocal a row), for each (tile, warps)."""
    rows, nbytes = [], x.numel() * 4
    for fast in (False, True):
        fused.FAST = fast
        tag = f"{codec.name} block {codec.block}" + (" fast" if fast else " exact")
        for tile, warps in configs:
            cfg = dict(tile=tile, num_warps=warps)
            rows.append(_row(f"encode {tag}", nbytes, _seconds(lambda: fused.encode_into(codec, buf, x, **cfg), reps),
                             copy_gbps, **cfg))
            rows.append(_row(f"encode {tag}, kernel only", nbytes,
                             _seconds(lambda: fused._launch_encode(codec, buf, x, tile, warps), reps), copy_gbps, **cfg))
    fused.FAST = False
    return rows


def _codec_rows(x: torch.Tensor, codec: Codec, copy_gbps: float, reps: int, sweep: bool) -> list[dict]:
    n, nbytes = x.numel(), x.numel() * 4
    buf = torch.empty(codec.nbytes(n), dtype=torch.uint8, device=x.device)
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    configs = CONFIGS if sweep else ((fused.ENCODE_TILE, fused.NUM_WARPS),)
    rows = _encode_rows(x, codec, buf, copy_gbps, reps, configs)
    tag = f"{codec.name} block {codec.block}"
    for tile, warps in CONFIGS if sweep else ((fused.DECODE_TILE, fused.NUM_WARPS),):
        cfg = dict(tile=tile, num_warps=warps)
        rows.append(_row(f"decode {tag}", nbytes, _seconds(lambda: fused.decode(codec, buf, n, out, **cfg), reps),
                         copy_gbps, **cfg))
        rows.append(_row(f"decode+add {tag}", nbytes,
                         _seconds(lambda: fused.decode_add(codec, buf, n, out, **cfg), reps), copy_gbps, **cfg))
    if not sweep:
        return rows
    rows.append(_row(f"encode {codec.name} torch codec (reference)", nbytes,
                     _seconds(lambda: torch_codec.encode_into(codec, buf, x), 3), copy_gbps))
    rows.append(_row(f"decode {codec.name} torch codec (reference)", nbytes,
                     _seconds(lambda: torch_codec.decode(codec, buf, n, out), 3), copy_gbps))
    return rows


def measure(sizes_mib=SIZES_MIB, reps: int = 10) -> dict:
    """The figures for each size: the copy, then each codec (fused; the torch codec beside)."""
    dev = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(dev), "fused": fused.unfit(CODECS[0], torch.empty(1, device=dev))
              or "on", "sizes": []}
    for mib in sizes_mib:
        n = (mib << 20) // 4
        x = torch.randn(n, device=dev)
        dst = torch.empty_like(x)
        t = _seconds(lambda: dst.copy_(x), reps)
        copy = _row("device-to-device copy (fp32)", n * 4, t, None)
        rows = [copy]
        for codec in CODECS:
            rows += _codec_rows(x, codec, copy["gbps"], reps, sweep=mib == max(sizes_mib))
        xb = x.to(torch.bfloat16)
        buf = torch.empty(CODECS[0].nbytes(n), dtype=torch.uint8, device=dev)
        rows.append(_row("encode int8 block 256, bf16 input (GB/s of fp32-equivalent)", n * 4,
                         _seconds(lambda: fused.encode_into(CODECS[0], buf, xb), reps), copy["gbps"]))
        result["sizes"].append({"mib": mib, "rows": rows})
        del x, dst, xb, buf
        torch.cuda.empty_cache()
    return result


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available()}
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception as e:  # reported, not raised: the report says what this machine lacks
        env["triton"] = f"not importable: {type(e).__name__}: {e}"
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
    return env


def _junit(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"error": f"unreadable: {e}"}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    keys = ("tests", "failures", "errors", "skipped", "time")
    summary = {k: suite.get(k) for k in keys} if suite is not None else {}
    summary["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
                         if c.find("failure") is not None or c.find("error") is not None][:50]
    return summary


def _pct(row: dict) -> str:
    return "" if row["of_copy"] is None else f"{row['of_copy']:.0%}"


def write_report(d: Path) -> dict:
    codec = json.loads((d / "codec.json").read_text()) if (d / "codec.json").exists() else None
    report = {"environment": environment(), "tests": {p.stem: _junit(p) for p in sorted(d.glob("junit-*.xml"))},
              "codec": codec}
    (d / "report.json").write_text(json.dumps(report, indent=1))
    lines = ["# commrt GPU check", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in report["environment"].items()]
    lines += ["", "## Tests", "", "| run | tests | failures | errors | skipped | seconds |", "|---|---|---|---|---|---|"]
    for name, s in report["tests"].items():
        s = s or {}
        lines.append(f"| {name} | {s.get('tests')} | {s.get('failures')} | {s.get('errors')} | {s.get('skipped')} "
                     f"| {s.get('time')} |")
        lines += [f"- failed: `{f}`" for f in s.get("failed", [])]
    if codec:
        lines += ["", f"## Codec on {codec['device']} (fused kernels: {codec['fused']})", "",
                  "GB/s of fp32 values in (encode) or out (decode); `of copy`: against a device-to-device "
                  "copy of the same fp32 buffer.", ""]
        for size in codec["sizes"]:
            lines += [f"### {size['mib']} MiB fp32", "", "| what | tile | warps | GB/s | of copy |", "|---|---|---|---|---|"]
            lines += [f"| {r['what']} | {r.get('tile', '')} | {r.get('num_warps', '')} | {r['gbps']} | {_pct(r)} |"
                      for r in size["rows"]]
            lines.append("")
    staging = json.loads((d / "staging.json").read_text()) if (d / "staging.json").exists() else None
    report["staging"] = staging
    (d / "report.json").write_text(json.dumps(report, indent=1))
    if staging:
        lines += ["", "## all_reduce of CUDA tensors over zmq, 2 ranks, against CPU tensors", "",
                  "| smallest piece KiB | MiB | pieces | CPU ms | CUDA ms | CUDA / CPU |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['min_piece_kib']} | {r['mib']} | {r['pieces']} | {r['cpu_ms']} | {r['cuda_ms']} | {r['ratio']} |"
                  for r in staging["rows"]]
    (d / "report.md").write_text("\n".join(lines) + "\n")
    return report


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "codec":
        Path(argv[1]).write_text(json.dumps(measure(), indent=1))
        return 0
    if len(argv) == 2 and argv[0] == "report":
        write_report(Path(argv[1]))
        return 0
    if argv == ["env"]:
        sys.stdout.write(json.dumps(environment()) + "\n")
        return 0
    sys.stderr.write("usage: python -m commrt.bench.gpu_check codec OUT.json | report DIR | env\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
