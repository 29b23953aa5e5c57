"""Server process entry points (thin: parse arguments, call into commrt). The parameter-server
shard (issue 5) lands here as ``python -m servers.ps``."""
