"""``prime-node demo``: a whole swarm on one machine, as separate processes on loopback.

supervisor.py starts and stops the child processes; setup.py writes the wallets, the run config and the
command line of every node; summary.py turns the nodes' status documents into the demo's result;
view.py draws the live table; orchestrator.py ties them together.
"""
