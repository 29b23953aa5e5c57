"""Worker process entry points (thin: parse arguments, call into commrt)."""
