"""``prime-node doctor``: checks of this machine and its path to the swarm, each with a one-line fix.

report.py (the result and its rendering), software.py (Python, torch, CUDA), machine.py (GPU, RAM, disk),
model_size.py (what the run's model takes), role.py (the role this machine would take), probes.py (the
probe protocol's requesting side), network.py (bootstrap peers, reachability, clock, bandwidth),
run.py (gathers it all). Every check is a pure function of facts, so tests inject the facts.
"""
