"""Ten all_reduce steps with a checkpoint after each; on the first attempt rank 1 crashes at
step 5 (exit code 3; COMMRT_TEST_FAIL="rank:step:exit3|sigkill|sigterm|abort" picks another). Under ``commrt launch --max-restarts 1`` the group restarts, resumes from
the checkpoint, and ends with the value an uninterrupted run reaches."""
from __future__ import annotations

import json
import os
import signal
import sys

import torch

import commrt


def main() -> int:
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
        t = torch.tensor([float(step + rank)])
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
