"""prime-node: one agent for a globally decentralized reinforcement-learning run.

This package is the only layer with I/O: CLI, configuration, the libp2p host, storage, the ML engines and
the services of each role. It builds on ``crypto`` (pure functions) and ``protocol`` (sans-IO state
machines). Keep this module light: ``prime-node --help`` imports it.
"""

__version__ = "0.1.0"
