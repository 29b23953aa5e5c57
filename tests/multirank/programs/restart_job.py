"""Ten all_reduce steps with a checkpoint after each; on the first attempt rank 1 crashes at
step 5 (exit code 3; COMMRT_TEST_FAIL="rank:step:exit3|sigkill|sigterm|abort" picks another). Under ``commrt launch --max-restarts 1`` the group restarts, resumes from
the checkpoint, and ends with the value an uninterrupted run reaches.

    restart_job DIR ps   (under --servers 1 --max-restarts 1) attempt 0 seeds the parameter
                         server and rank 1 fails; attempt 1 asks `commrt server-status`, which
                         still shows the seeded values: the same server process (it has no
                         checkpoint_dir, so a restarted one would be empty).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np

import commrt


def ps_main() -> int:
    import torch  # the parameter server's client takes tensors; the main job runs on numpy (no torch import)
    from commrt.ps import PSClient
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0:
        client = PSClient()
        client.init({"w": torch.arange(8.0)})  # worker 0 seeds; worker 1 waits for that
        client.close()
        if rank == 1:
            os._exit(3)
        return 0
    if rank == 0:
        proc = subprocess.run([sys.executable, "-m", "commrt.cli", "server-status"], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        stats = json.loads(proc.stdout)
        print(f"attempt {attempt} server-status: server {stats[0]['server']} holds {stats[0]['segments']} "
              f"segments, {stats[0]['param_bytes']} bytes", flush=True)
    return 0


def main() -> int:
    if sys.argv[2:] == ["ps"]:
        return ps_main()
    path = os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json")
    state = json.load(open(path)) if os.path.exists(path) else {"step": 0, "value": 0.0}
    commrt.init_process_group()
    rank, attempt = commrt.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"attempt {attempt} resumes at step {state['step']}", flush=True)
    victim, at, how = os.environ.get("COMMRT_TEST_FAIL", "1:5:exit3").split(":")
    for step in range(state["step"], 10):
        if attempt == 0 and step == int(at) and rank == int(victim):
            if how == "exit3":
                os._exit(3)
            os.kill(os.getpid(), {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM,
                                  "abort": signal.SIGABRT}[how])
        t = np.array([float(step + rank)])
        commrt.all_reduce(t)
        state = {"step": step + 1, "value": state["value"] + float(t[0])}
        with open(path + ".tmp", "w") as fh:
            json.dump(state, fh)
        os.replace(path + ".tmp", path)
    print(f"FINAL {state['value']}", flush=True)
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
