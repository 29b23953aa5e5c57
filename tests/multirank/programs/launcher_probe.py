"""For launcher tests: report the torchrun environment, optionally fail or hang."""
import hashlib
import os
import sys
import time

rank = int(os.environ["RANK"])
secret = os.environ.get("COMMRT_JOB_SECRET")
print(f"env RANK={rank} WORLD_SIZE={os.environ['WORLD_SIZE']} LOCAL_RANK={os.environ['LOCAL_RANK']} "
      f"MASTER_PORT={os.environ['MASTER_PORT']} "
      f"SECRET={hashlib.sha256(secret.encode()).hexdigest()[:12] if secret else 'none'}", flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
if mode == "fail" and rank == 1:
    print("rank 1 is failing on purpose", flush=True)
    sys.exit(7)
if mode == "fail":
    time.sleep(60)  # the launcher must stop us long before this
