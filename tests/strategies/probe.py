"""Hypothesis strategy for probe requests (a time probe moves no bytes, a transfer some), which random
fields rarely satisfy. Importing this module also registers the ``probe.*`` types with the codec."""

from __future__ import annotations

from hypothesis import strategies as st

from protocol.probe import DOWNLOAD, MAX_PROBE_BYTES, TIME, UPLOAD, ProbeRequest
from tests.strategies.messages import register_strategy

probe_requests = st.one_of(
    st.just(ProbeRequest(TIME)),
    st.builds(ProbeRequest, st.sampled_from([DOWNLOAD, UPLOAD]), st.integers(1, MAX_PROBE_BYTES)),
)
register_strategy(ProbeRequest, probe_requests)
