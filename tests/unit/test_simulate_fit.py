"""The simulator's validation (commrt/plan/simulate_fit.py): the fit recovers a known network
from 2-rank ring rows it generated, predicts the other rows exactly, and flags a row that misses."""
import json

import pytest

from commrt.plan import simulate_fit as sf
from commrt.plan.simulate import simulate


def _rows(alpha, beta):
    rows = []
    for n in (2, 4, 5):
        for size in (4096, 65536, 1 << 20):
            for algo in ("ring", "recursive_doubling", "rabenseifner"):
                t = simulate(sf._net(n, alpha, beta), "all_reduce", algo, size).seconds
                rows.append(sf.Row("all_reduce", algo, n, size, t))
    return rows


def test_fit_recovers_the_network_and_predicts_the_rest():
    rows = _rows(30e-6, 0.8e9)
    alpha, beta = sf.fit(rows)
    assert alpha == pytest.approx(30e-6, rel=1e-6) and beta == pytest.approx(0.8e9, rel=1e-6)
    assert all(abs(e["error"]) < 1e-6 for e in sf.compare(rows, alpha, beta, cpu=False))


def test_a_miss_is_flagged_and_bench_json_is_read(tmp_path):
    rows = _rows(30e-6, 0.8e9)
    slow = rows[-1]._replace(seconds=rows[-1].seconds * 2)
    text = sf.markdown(sf.compare(rows[:-1] + [slow], *sf.fit(rows), cpu=False), 30e-6, 0.8e9)
    assert text.count("**") == 2 and "26 of 27 rows within 15%" in text
    doc = {"collective": "all_reduce", "nproc": 2, "backends": ["gloo", "zmq:ring"],
           "rows": [{"gloo": {"size": 4096, "time_us": 9.0}, "zmq:ring": {"size": 4096, "time_us": 50.0}}]}
    (tmp_path / "b.json").write_text(json.dumps(doc))
    (row,) = sf.measured([str(tmp_path / "b.json")])
    assert row[:4] == ("all_reduce", "ring", 2, 4096) and row.seconds == pytest.approx(50e-6)


def test_an_op_measured_alone_is_replayed_alone(tmp_path):
    from commrt.plan import fit_cpu
    doc = {"collective": "all_reduce", "nproc": 16, "backends": ["zmq:rabenseifner"], "warmup": 2, "iters": 5,
           "rows": [{"zmq:rabenseifner": {"size": 65536, "alone": {"time_us": 9000.0}}}]}
    (tmp_path / "a.json").write_text(json.dumps(doc))
    (row,) = sf.measured([str(tmp_path / "a.json")])
    assert row.alone and row.seconds == pytest.approx(9e-3)
    (case,) = sf.medians([row], per_node=2, nic_bps=100e6)
    p = fit_cpu.Params(0.0, 1e12, 50e-6, 0.0, 1e12, 2)
    alone = fit_cpu.predict(p, case)
    # one op, its links' buckets drained by the ops before (the barrier between is too short to refill)
    drained = fit_cpu.network(p, 16, 2, 100e6, rested=False)
    assert alone == pytest.approx(simulate(drained, "all_reduce", "rabenseifner", 65536).seconds)
    assert alone > 1.2 * fit_cpu.predict(p, case._replace(alone=False))  # not one of a loop (ops overlap there)
    assert alone > 1.2 * fit_cpu.predict(p, case._replace(alone=False), back_to_back=False)  # not a rested link


def test_cpu_floor_runs_the_real_executor():
    assert sf.cpu_floor(sf.Row("all_reduce", "recursive_doubling", 4, 4096, 0.0), iters=2) > 0


def _bench_json(path, params, world, per_node=0, mbit=0.0, scale=1.0):
    from commrt.plan import fit_cpu
    algos = ("recursive_doubling", "ring", "rabenseifner")
    rows = [{f"zmq:{a}": {"size": s, "time_us": 1e6 * scale * fit_cpu.predict(
        params, fit_cpu.Case("all_reduce", a, world, s, per_node, mbit * 1e6))} for a in algos} for s in (4096, 1 << 20)]
    path.write_text(json.dumps({"collective": "all_reduce", "nproc": world, "rows": rows,
                                "backends": [f"zmq:{a}" for a in algos]}))
    return str(path)


def test_the_cpu_model_is_fitted_on_one_run_and_checks_the_others(tmp_path, capsys, monkeypatch):
    from commrt.plan import fit_cpu
    monkeypatch.setattr(fit_cpu, "WARM", 0)  # one op per replay, not a loop: 5x faster, the same path
    monkeypatch.setattr(fit_cpu, "REPEAT", 1)
    true = fit_cpu.Params(5e-6, 2e9, 40e-6, 0.3e-9, 3e9, 2)
    fit_files = [_bench_json(tmp_path / f"a{n}_{k}.json", true, n, scale=s)
                 for n in (2, 8) for k, s in enumerate((0.5, 1.0, 1.1))]  # the median of three is the model
    check = [_bench_json(tmp_path / "b4.json", true, 4)]
    emu = [_bench_json(tmp_path / "e.json", true, 8, per_node=2, mbit=100, scale=2.0)]  # twice the model
    assert sf.main([*fit_files, "--cores", "2", "--check", *check, "--emulated", *emu,
                    "--per-node", "2", "--mbit", "100"]) == 0
    out = capsys.readouterr().out
    assert "fit: 12 of 12 rows within 15%" in out and "check: 6 of 6 rows within 15%" in out
    assert "emulated: 0 of 6 rows within 15%" in out and "| emulated | ring | 4x2 | 4096 |" in out
    with pytest.raises(SystemExit, match="--per-node"):
        sf.main([*fit_files, "--cores", "2", "--emulated", *emu])


@pytest.mark.parametrize("doc, kind", [
    ({"benchmark": "ps", "workers": 2, "servers": 2, "rows": [{"size": 4096, "ps_time_us": 9.0}]}, "a 'commrt bench ps' file"),
    ({"benchmark": "p2p", "nproc": 2, "backends": ["zmq"], "rows": [{"zmq": {"size": 4096, "stream_us": 9.0}}]},
     "a 'commrt bench p2p' file"),
    ({"command": "commrt bench train", "rows": []}, "not a 'commrt bench COLLECTIVE --json' file"),
])
def test_a_p2p_or_ps_file_is_refused_in_one_line(tmp_path, doc, kind):
    """bench ps's JSON was a KeyError traceback; p2p's read as no rows, then 'needs the ring rows'."""
    (tmp_path / "x.json").write_text(json.dumps(doc))
    for argv in ([str(tmp_path / "x.json")], [str(tmp_path / "x.json"), "--cores", "2"]):
        with pytest.raises(SystemExit, match=f"x.json is {kind}; it fits collective runs only"):
            sf.main(argv)
    with pytest.raises(SystemExit, match="nope.json"):
        sf.main([str(tmp_path / "nope.json")])


def test_a_cpu_fit_without_the_rows_or_cores_it_needs_is_one_line(tmp_path, capsys, monkeypatch):
    """--cores over fewer than 5 measured cases was fit_cpu's ValueError traceback, --cores -1
    a ConfigError traceback from the first replay, --per-node -2 with --emulated another."""
    from commrt.plan import fit_cpu
    monkeypatch.setattr(fit_cpu, "WARM", 0)  # one op per replay, as above
    monkeypatch.setattr(fit_cpu, "REPEAT", 1)
    one = _bench_json(tmp_path / "a.json", fit_cpu.Params(5e-6, 2e9, 40e-6, 0.3e-9, 3e9, 2), 2)  # 3 algos x 2 sizes
    doc = json.loads((tmp_path / "a.json").read_text())
    doc["rows"] = doc["rows"][:1]  # 3 cases
    (tmp_path / "b.json").write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="needs >= 5 measured cases .* got 3"):
        sf.main([str(tmp_path / "b.json"), "--cores", "2"])
    with pytest.raises(SystemExit):
        sf.main([one, "--cores", "-1"])
    assert "--cores -1: cores shared by the ranks" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--emulated needs --per-node G and --mbit RATE"):
        sf.run_cpu(sf.argparse.Namespace(json=[one], cores=2, sharing="fcfs", check=[], emulated=[one],
                                         per_node=-2, mbit=100.0))
