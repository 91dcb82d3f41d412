"""Verification of untrusted inference: TOPLOC proofs from hidden states, and the validator's checks.

Imports torch lazily (inside functions), so importing this package stays cheap.
"""
