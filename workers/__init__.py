"""Worker entry points of this repository (thin: each runs a program from ``commrt.apps``).
Run from the repository root as ``python -m workers.<name>``; not installed with commrt."""
