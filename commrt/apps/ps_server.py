"""One parameter-server shard: ``commrt server [--config F] [--index I] [--resume]``.

The same as ``python -m commrt.apps.ps_server`` (and ``python -m servers.ps`` from the repository
root). Settings come from the [ps] section of the config (or
``COMMRT_PS_*`` variables); SIGTERM/SIGINT stop it after a final checkpoint.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from commrt.runtime.config import load_config
from commrt.runtime.errors import CommError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commrt server", description=__doc__)
    p.add_argument("--config", help="cluster TOML file (default: $COMMRT_CONFIG)")
    p.add_argument("--index", type=int, default=0, help="which entry of [ps] servers to serve")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint and log")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port plus the index "
                   "([ps] metrics_port; bound to [ps] metrics_addr, loopback by default)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from commrt.ps.server import Server, install_signal_handlers  # sockets and numpy: not for --help
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s server{args.index} %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config)
        if args.metrics_port is not None:
            cfg = dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, metrics_port=args.metrics_port))
        server = Server(cfg, args.index, resume=args.resume)
    except CommError as exc:
        print(f"commrt server: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    install_signal_handlers(server)
    return server.serve()  # non-zero when a durable write failed (the workers were told why)


if __name__ == "__main__":
    sys.exit(main())
