"""``commrt bench``'s sizes and counts: what -b / -e / -f / -n accept, refused before any rank
starts as a ConfigError (printed by the CLI as one line), and each size measured once."""
import contextlib

import pytest

from commrt.bench import metrics
from commrt.bench.runner import BenchSpec
from commrt.runtime.errors import ConfigError


@pytest.mark.parametrize("text", ["inf", "nan", "4T", "K", "", "1e999", "-inf"])
def test_unreadable_sizes_are_config_errors(text):
    """'inf' and '1e999' were an OverflowError, 'nan' and '4T' float's own ValueError: a traceback."""
    with pytest.raises(ConfigError, match="cannot read size"):
        metrics.parse_size(text)


@pytest.mark.parametrize("text,value", [("0", 0), ("1.5K", 1536), ("4kib", 4096), ("4 M", 4 << 20), ("2GB", 2 << 30)])
def test_sizes_read_as_nccl_tests_does(text, value):
    assert metrics.parse_size(text) == value


def test_a_factor_near_one_gives_each_size_once():
    """-b 1 -e 8 -f 1.5 gave 1, 1, 2, 3, 5, 7: the size 1 measured (and printed) twice."""
    assert metrics.size_series(1, 8, 1.5) == [1, 2, 3, 5, 7]
    sizes = metrics.size_series(1, 1 << 20, 1.01)
    assert len(set(sizes)) == len(sizes) and sizes == sorted(sizes)


@pytest.mark.parametrize("args", [(0, 8, 2), (8, 4, 2), (4, 8, 1), (4, 8, float("nan")), (4, 8, float("inf"))])
def test_bad_series_are_config_errors(args):
    """-b 8 -e 4 printed a ValueError traceback; -f nan was accepted (one size)."""
    with pytest.raises(ConfigError):
        metrics.size_series(*args)


@pytest.mark.parametrize("iters,warmup", [(0, 5), (-1, 5), (20, -1)])
def test_a_spec_without_timed_iterations_is_refused(iters, warmup):
    """-n 0 divided by zero on every rank, after the start-up (back-to-back's elapsed / iters)."""
    with pytest.raises(ConfigError, match="iters"):
        BenchSpec("all_reduce", ("zmq",), 4096, 8192, 2, iters, warmup, "float32", "sum")


def test_sizes_that_round_to_the_same_case_are_measured_once():
    """-b 4 -e 16 of an all_to_all over 3 ranks printed three rows of the same 12 B case."""
    from commrt.bench.cases import distinct_sizes
    assert distinct_sizes("all_to_all", 3, [4, 8, 16, 32], 4) == [4, 32]  # 3, 3, 3 and 6 elements
    assert distinct_sizes("all_reduce", 3, [1, 2, 4, 8], 4) == [1, 8]  # 1, 1, 1 and 2 elements
    assert distinct_sizes("all_reduce", 4, [4096, 8192], 2) == [4096, 8192]


@pytest.mark.parametrize("backend,minbytes,iters,warmup,says", [
    ("zmq", "4K", 0, 5, "iters"), ("zmq", "4K", 10, -1, "warmup"), ("zmq,mpi", "4K", 10, 1, "valid"),
    ("zmq", "1", 10, 1, "under 4 bytes"), ("zmq,gloo,zmq", "4K", 10, 1, "twice")])
def test_p2p_refuses_what_it_cannot_measure(backend, minbytes, iters, warmup, says, monkeypatch):
    """bench p2p built no BenchSpec: -n 0 failed on rank 0 after the start-up (median of no round
    trips, the stream divided by zero), an unknown backend on every rank."""
    import argparse
    import commrt.launch
    from commrt.bench import p2p
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(commrt.launch, "launch", lambda *a, **k: pytest.fail("launched"))
    args = argparse.Namespace(backend=backend, minbytes=minbytes, maxbytes="64K", stepfactor=2.0, iters=iters,
                              warmup=warmup, nproc=2, json=None)
    with pytest.raises(ConfigError, match=says):
        p2p.run(args)


@pytest.mark.parametrize("argv", [["-n", "0"], ["--warmup", "-1"], ["-w", "0"], ["-s", "0"]])
def test_bench_ps_refuses_no_iterations_before_the_launch(argv, monkeypatch):
    """-n 0 divided by zero on every worker after the start-up."""
    import commrt.launch
    from commrt.bench import ps
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(commrt.launch, "launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(SystemExit, match="need -n >= 1"):
        ps.main(argv)


@pytest.mark.parametrize("collective,dtype,op,inp", [
    ("all_reduce", "float32", "max", "torch"), ("all_reduce", "int32", "sum", "torch"),
    ("broadcast", "float32", "sum", "torch"), ("reduce_scatter", "float32", "min", "torch"),
    ("all_gather", "float32", "sum", "numpy")])
def test_a_quantized_column_that_would_time_the_exact_op_is_refused(collective, dtype, op, inp):
    """QuantBackend hands what it cannot quantize to the exact backend: -o max, -d int32 or a
    broadcast printed exact times under 'zmq+int8'; reduce_scatter -o min and --input numpy
    failed on every rank after the start-up."""
    with pytest.raises(ConfigError, match="no quantized op"):
        BenchSpec(collective, ("zmq", "zmq+int8"), 4096, 8192, 2, 2, 1, dtype, op, input=inp)
    BenchSpec(collective, ("zmq",), 4096, 8192, 2, 2, 1, dtype, op, input=inp)  # the exact one alone runs


def test_quantized_columns_that_measure_the_quantized_op_are_kept():
    for coll in ("all_reduce", "reduce_scatter", "all_gather"):
        BenchSpec(coll, ("zmq", "zmq+int4"), 4096, 8192, 2, 2, 1, "bfloat16", "avg")
    from commrt.bench.quant import with_quant
    with pytest.raises(ConfigError, match="int9"):
        with_quant(("zmq",), "int9")


@pytest.mark.parametrize("dtype,op,says", [("foo", "sum", "unknown dtype"), ("float32", "foo", "unknown reduce op")])
def test_an_unknown_dtype_or_op_is_refused_where_the_spec_is_made(dtype, op, says):
    """-d foo / -o foo launched the ranks, each of which printed a ValueError traceback."""
    with pytest.raises(ConfigError, match=says):
        BenchSpec("all_reduce", ("zmq",), 4096, 8192, 2, 2, 1, dtype, op)


@pytest.mark.parametrize("argv", [["bench", "all_reduce"], ["bench", "p2p"], ["bench", "ps"], ["bench", "train"]])
def test_a_json_file_that_cannot_be_written_is_refused_before_the_launch(argv, tmp_path, monkeypatch, capsys):
    # the results were written after the whole run: a missing directory was rank 0's
    # FileNotFoundError traceback at the end, the run's figures lost with it
    import commrt.launch
    from commrt import cli
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(commrt.launch, "launch", lambda *a, **k: pytest.fail("launched"))
    bad = str(tmp_path / "no" / "such" / "dir" / "out.json")
    monkeypatch.setattr("sys.argv", ["commrt", *argv, "--json", bad])
    with pytest.raises(SystemExit, match="--json") if argv[1] != "p2p" else contextlib.nullcontext():
        assert cli.main([*argv, "--json", bad]) == 1
    if argv[1] == "p2p":  # a ConfigError: one line from the CLI
        assert "--json" in capsys.readouterr().err


def test_bench_ps_measures_a_size_named_twice_once(monkeypatch):
    # --params 64K,65536 made two rows of one parameter 'p65536': the second row's pushes went
    # on from the first's, and its exact -k*lr check counted every element wrong (exit 1)
    from commrt.bench import ps
    seen = []
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("COMMRT_PS_SERVERS", "127.0.0.1:1")
    monkeypatch.setattr(ps, "_rank", lambda args, sizes: seen.append(sizes) or 0)
    assert ps.main(["--params", "64K,65536,1M"]) == 0
    assert seen == [[65536, 1 << 20]]


@pytest.mark.parametrize("backends", [("zmq", "zmq"), ("zmq", "gloo", "zmq+int8", "zmq+int8"), ("zmq:ring", "zmq:ring")])
def test_a_backend_named_twice_is_refused_where_the_spec_is_made(backends):
    # --backend zmq,zmq (or --quant int8,int8, --backend zmq:ring --algo ring) started two
    # worlds in one namespace: every rank failed after the start-up with "duplicate rank"
    with pytest.raises(ConfigError, match="twice"):
        BenchSpec("all_reduce", backends, 4096, 8192, 2, 1, 0, "float32", "sum")


@pytest.mark.parametrize("collective", ["all_reduce", "p2p"])
def test_a_program_calling_the_cli_with_a_list_relaunches_those_words(collective, monkeypatch):
    """commrt.cli.main(["bench", ...]) from a program relaunched itself with sys.argv's words
    after 'bench': the program's sys.argv has none, a ValueError traceback."""
    from types import SimpleNamespace

    from commrt import launch
    from commrt.cli import main
    launched = []

    def fake_launch(nproc, cmd, **kw):  # the ranks themselves are not what is checked
        launched.append(cmd)
        return SimpleNamespace(returncode=0)
    monkeypatch.setattr(launch, "launch", fake_launch)
    words = [collective, "--nproc", "2", "-b", "4K", "-e", "4K", "-n", "1"]
    assert main(["bench", *words]) == 0
    assert launched[0][1:] == ["-m", "commrt.cli", "bench", *words]
