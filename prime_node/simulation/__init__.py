"""Large-scale simulation of the weight swarm: the real protocol.swarm state machines over modelled links."""
