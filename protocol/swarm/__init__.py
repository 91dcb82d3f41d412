"""The weight swarm's sans-IO core: wire messages, piece picking, upload scheduling, super-seeding,
retention and the checkpoint catalogue (offers, manifest requests, follow policy), as pure state
machines (events and a ``now`` in, actions out). The node's data plane and the large-scale simulator
drive the same objects."""
