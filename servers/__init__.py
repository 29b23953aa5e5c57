"""Server process entry points (thin: parse arguments, call into commrt):
``python -m servers.ps --index I`` (or ``commrt server``) runs one parameter-server shard."""
