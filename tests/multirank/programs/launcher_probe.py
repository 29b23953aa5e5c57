"""For launcher tests: report the torchrun environment, optionally fail or hang.

    launcher_probe [ok | fail | hang DIR]   hang: write this rank's PID and its child's PID to
                                            DIR/rank<r>.pids, then wait to be stopped
"""
import hashlib
import os
import subprocess
import sys
import time

rank = int(os.environ["RANK"])
secret = os.environ.get("COMMRT_JOB_SECRET")
print(f"env RANK={rank} WORLD_SIZE={os.environ['WORLD_SIZE']} LOCAL_RANK={os.environ['LOCAL_RANK']} "
      f"MASTER_PORT={os.environ['MASTER_PORT']} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "
      f"SECRET={hashlib.sha256(secret.encode()).hexdigest()[:12] if secret else 'none'}", flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
if mode == "fail" and rank == 1:
    print("rank 1 is failing on purpose", flush=True)
    sys.exit(7)
if mode == "fail":
    time.sleep(600)  # the launcher must stop us: waiting would end in its timeout
if mode == "hang":  # a child of our own, in our process group: the launcher must stop it too
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    path = os.path.join(sys.argv[2], f"rank{rank}.pids")
    with open(path + ".tmp", "w") as fh:
        fh.write(f"{os.getpid()} {child.pid}\n")
    os.replace(path + ".tmp", path)
    time.sleep(600)
