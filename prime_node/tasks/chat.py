"""Prompts a task wants posed as a user turn through the model's chat template.

A task returns a ``ChatPrompt`` from ``prompt()`` instead of a plain string; ``encode_prompt``
(prime_node/ml/evaluation.py), through which the trainer, the inferer and the validator all encode
prompts, then renders it with the tokenizer's chat template and opens the assistant turn. Plain strings
keep being encoded as raw text, so every existing task and model behaves as before.
"""

from __future__ import annotations


class ChatPrompt(str):
    """The content of the user turn. A ``str`` so that logs and records show it as text; string
    operations on it return plain ``str`` (raw text again), so pass it on unchanged."""

    __slots__ = ()
