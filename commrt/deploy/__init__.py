"""Starting a job under a scheduler: SLURM, Kubernetes or plain hosts over ssh (issue 20).

``hostlist`` and ``plan`` are pure: what a scheduler sets in a process's environment -> commrt's
node, rank, address and parameter-server settings. ``commrt.apps.node`` (``commrt node``) runs a plan on one
node; ``ssh`` (``commrt launch --hosts FILE``) starts one node per host over ssh. The recipes
that use them are in the repository's deploy/ folder.
"""
