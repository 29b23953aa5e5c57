"""The replica fault-tolerance store in a process of its own, the launcher's place: the emulated
test (tests/multirank/test_replica_ft_emulated.py) runs it on a node of its own, since the test
process cannot reach the namespaces' addresses.

    python -m tests.multirank.programs.replica_ft_store HOST PORT LIFETIME_S

Prints ``READY`` once listening; serves until SIGTERM or LIFETIME_S (a deadline, so a test that
forgets it does not leave it behind).
"""
from __future__ import annotations

import signal
import sys
import threading

from commrt.runtime.config import load_config
from commrt.train.replica_ft import serve


def main() -> None:
    host, port, lifetime = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    transport, server = serve(load_config(), host, port)
    print("READY", flush=True)
    try:
        stop.wait(lifetime)
    finally:
        server.close()
        transport.close()


if __name__ == "__main__":
    main()
