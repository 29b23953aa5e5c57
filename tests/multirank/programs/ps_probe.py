"""A worker that first sends requests the server must refuse, then does real work: the server
has to stay up and unchanged through the bad ones."""
from __future__ import annotations

import sys

import torch

from commrt.runtime.config import load_config
from commrt.runtime.errors import RequestRejected
from commrt.ps import PSClient
from commrt.ps import protocol as P


def main() -> int:
    client = PSClient(load_config())
    params = {"w": torch.arange(10, dtype=torch.float32)}
    client.init(params)
    if "--impersonate" in sys.argv:  # rank 0's key, a request in worker 1's name
        client.worker = 1
        try:
            client._exchange(P.PULL, 0, {0: ([0], [])})
            print("PROBE FAILED: a request in another worker's name was served", flush=True)
            return 1
        except RequestRejected as exc:
            print(f"refused as expected: {exc}", flush=True)
        client.worker = 0
    for body, frames in (([0], [b"\0" * 3]), ([7], [b"\0" * 40]), ([0, 0], [b"\0" * 40] * 2)):
        try:
            client._exchange(P.PUSH, 0, {0: (body, frames)})
            print("PROBE FAILED: a bad push was accepted", flush=True)
            return 1
        except RequestRejected as exc:
            print(f"refused as expected: {exc}", flush=True)
    try:
        client.push({"w": torch.ones(3)})
        print("PROBE FAILED: a wrong shape was sent", flush=True)
        return 1
    except RequestRejected as exc:
        print(f"refused locally: {exc}", flush=True)
    if "--impersonate" in sys.argv:
        print("PROBE OK", flush=True)
        client.close()
        return 0
    client.push({"w": torch.ones(10)})
    client.pull(params)
    expected = torch.arange(10, dtype=torch.float32) - client.cfg.ps.lr
    if not torch.allclose(params["w"], expected):
        print(f"PROBE FAILED: {params['w']} != {expected}", flush=True)
        return 1
    print(client.stats()[0], flush=True)
    print("PROBE OK", flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
