"""Overhead of fault_tolerance = "replica" on a healthy step: the same program (tests/multirank/programs/replica_ft_job.py), replica mode vs --off (DataParallel), 3 ranks; off, on, off.

    PYTHONPATH=. python tests/perf/replica_ft_overhead.py STEPS WIDTH
"""
import subprocess, sys, os, json, socket, statistics
sys.path.insert(0, os.getcwd())
from commrt.runtime.config import load_config
from commrt.train.replica_ft import serve
steps, width = int(sys.argv[1]), sys.argv[2]
def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
env = {**os.environ, "PYTHONPATH": os.getcwd()}
def run(off):
    p = port()
    srv = None if off else serve(load_config(), "127.0.0.1", p)
    ps = [subprocess.Popen([sys.executable, "-m", "tests.multirank.programs.replica_ft_job", str(r), "3", f"127.0.0.1:{p}",
                            str(steps), f"/tmp/replica_ft_ov{r}", "--width", width] + (["--off"] if off else []), env=env,
                           stderr=subprocess.DEVNULL) for r in range(3)]
    for q in ps: q.wait(timeout=600)
    if srv: srv[1].close(); srv[0].close()
    per = []
    for r in range(3):
        t = json.load(open(f"/tmp/replica_ft_ov{r}.json"))["times"]
        v = [t[k][1] for k in sorted(t, key=int)][steps // 5:]
        per.append(statistics.median(v))
    return max(per)
off1 = run(True); on = run(False); off2 = run(True)
print(f"median step (slowest rank): off {off1*1e3:.2f} / {off2*1e3:.2f} ms, replica {on*1e3:.2f} ms, ratio {on/((off1+off2)/2):.3f}")
