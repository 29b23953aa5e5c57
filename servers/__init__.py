"""Server entry points of this repository (thin: ``python -m servers.ps`` runs
``commrt.apps.ps_server``, as ``commrt server`` does); not installed with commrt."""
