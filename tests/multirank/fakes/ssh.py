"""A stand-in for ``ssh`` into an emulated cluster: ``ssh -o BatchMode=yes HOST COMMAND`` runs
COMMAND with ``bash -c`` in HOST's network namespace (FAKE_SSH_NAMESPACES: host=ns,...), with
stdin passed through and a fresh login-like environment (PATH, HOME only), as sshd gives, so the
remote side sees only what the launcher put on the command and on stdin. Every argv it gets is
appended to FAKE_SSH_LOG, for the test to check that no secret was on it."""
from __future__ import annotations

import os
import sys


def main() -> int:
    argv = sys.argv[1:]
    with open(os.environ["FAKE_SSH_LOG"], "a") as fh:
        fh.write(repr(argv) + "\n")
    while argv and argv[0] == "-o":
        argv = argv[2:]
    host, command = argv[0], argv[1]
    spaces = dict(item.split("=", 1) for item in os.environ["FAKE_SSH_NAMESPACES"].split(","))
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("FAKE_SSH_HOME", "/nonexistent")}
    os.execvpe("ip", ["ip", "netns", "exec", spaces[host], "bash", "-c", command], env)


if __name__ == "__main__":
    sys.exit(main())
