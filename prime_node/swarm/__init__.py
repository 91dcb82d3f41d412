"""The weight swarm's I/O side: checkpoint directories as pieces, the signed manifest, the verified and
resumable piece store, and the node service that shares, fetches, re-serves and drops versions."""
