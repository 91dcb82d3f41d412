"""The data plane: a wallet-authenticated, integrity-checked TCP channel for bulk swarm frames.

See docs/dataplane.md for why it exists (Noise+yamux moves ~55 MB/s here) and what it guarantees.
"""
