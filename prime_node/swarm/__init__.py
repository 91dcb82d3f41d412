"""The weight swarm's I/O side that needs no network: checkpoint directories as pieces, the signed
manifest, the verified and resumable piece store, atomic output, retention."""
