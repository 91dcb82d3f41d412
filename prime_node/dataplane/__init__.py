"""The data plane: a wallet-authenticated, integrity-checked channel for bulk swarm frames, over TCP or any
other ``trio.abc.Stream`` (streams.py is the seam; tests use prime_node/testing/memory_streams.py).

See docs/dataplane.md for why it exists (Noise+yamux moves ~55 MB/s here) and what it guarantees.
"""
