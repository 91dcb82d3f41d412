"""Hypothesis strategies for the wire messages (test-only: hypothesis is a dev dependency, so none of this
ships in the wheel). ``messages.message_strategy`` derives one for any message type; every other module
here registers hand-made strategies for types whose invariants random values rarely meet, and
tests/protocol/message_types.py imports them all."""
