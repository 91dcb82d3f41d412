"""Inference engines. The interface is what the rest of prime-node (inferer, validator, trainer) uses.

Engines are built by ``prime_node.ml.engines`` (``setup_engine``/``load_engine``), which picks the
backend the run config's ``engine`` names; this module holds the interface and the torch backend.

Interface (stable; a vLLM engine for GPU machines would implement the same ``InferenceEngine``):

    engine.generate(prompts, seeds, SamplingParams(max_new_tokens, temperature, return_hidden))
        -> list[Completion]: per prompt the generated ``tokens`` (ending with EOS when ``finished``),
           their ``logprobs`` (log_softmax(logits / T)[token], float32) and, if asked, ``hidden``:
           float32 [len(tokens), hidden_size], row t = the final hidden state (output of the model's
           last norm, the input of lm_head: ``hidden_states[-1]``) at the position that *predicted*
           token t, i.e. the activations TOPLOC commits to; on the engine's device (the proof takes
           its top-k there and copies only that).
    engine.prefill(prompts, completions) -> list[Prefill]: one teacher-forced pass over
           prompt + completion returning, for each completion token t, the logits and final hidden
           state at the position that predicts it (the same rows ``generate`` saw; logits on the host,
           hidden states on the engine's device). A validator
           compares these against the proof and replays the sampling rule on the logits.
    engine.load_weights(state_dict, policy_step); engine.policy_step.

The engine computes in its model's dtype (float32 or bfloat16, chosen by ``prime_node.ml.engines``), but
everything it hands out is float32: hidden states and logits are upcast (exactly) before TOPLOC or the
sampling rule sees them, so proofs, replay margins and log-probs are compared in one precision whatever
each side computed in; only the calibrated bounds differ per (inferer, validator) dtype pair.

Token choice follows the seeded rule in ``prime_node.ml.sampling`` (Gumbel-max on a counter-based hash
of (sample seed, completion position)), so a batch is replayable from its seeds and temperature alone.
Generation is batched with left padding and a KV cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to generate: at most ``max_new_tokens`` per sample, at ``temperature`` (0 = greedy)."""

    max_new_tokens: int
    temperature: float = 1.0
    return_hidden: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not self.temperature >= 0:
            raise ValueError("temperature must be >= 0")


@dataclass
class Completion:
    """One generated continuation (see the module doc for the exact meaning of each field)."""

    tokens: list[int]
    logprobs: list[float]
    finished: bool
    hidden: torch.Tensor | None = None


@dataclass
class Prefill:
    """Teacher-forced logits [n, vocab] and final hidden states [n, hidden] for n completion tokens."""

    logits: torch.Tensor
    hidden: torch.Tensor


class InferenceEngine(Protocol):
    policy_step: int

    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams
    ) -> list[Completion]: ...

    def prefill(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[Prefill]: ...

    def load_weights(self, state: Mapping[str, torch.Tensor], policy_step: int) -> None: ...


class TorchEngine:
    """The torch/transformers engine (CPU or CUDA) for any HF causal LM with a decoder + lm_head."""

    def __init__(self, model: Any, *, eos_token_id: int, pad_token_id: int, policy_step: int = 0) -> None:
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.policy_step = policy_step
        self._decoder = model.get_decoder()
        self._head = model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device  # type: ignore[no-any-return]

    def load_weights(self, state: Mapping[str, torch.Tensor], policy_step: int) -> None:
        import torch

        with torch.no_grad():
            self.model.load_state_dict(dict(state), strict=True)
        self.policy_step = policy_step

    def _left_pad(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        width = max(len(row) for row in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            if row:
                ids[i, width - len(row) :] = torch.as_tensor(list(row), dtype=torch.long)
                mask[i, width - len(row) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams
    ) -> list[Completion]:
        import torch

        from prime_node.ml.sampling import choose_tokens, token_logprobs

        if len(prompts) != len(seeds):
            raise ValueError("one seed per prompt")
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        ids, mask = self._left_pad(prompts)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = [Completion([], [], False, None) for _ in prompts]
        # Hidden states stay on the device, one [live rows, hidden] block per step, and never cross to the
        # host whole: on a GPU a copy per row and token would stall every step.
        hidden_steps: list[torch.Tensor] = []
        hidden_rows: list[list[int]] = [[] for _ in prompts]  # per prompt: its rows in those blocks
        block_start = 0
        active = list(range(len(prompts)))  # row of the live batch -> prompt index
        cache = None
        with torch.inference_mode():
            for t in range(params.max_new_tokens):
                result = self._decoder(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                )
                cache = result.past_key_values
                hidden = result.last_hidden_state[:, -1]
                logits = self._head(hidden)
                chosen = choose_tokens(
                    logits, [seeds[i] for i in active], [t] * len(active), params.temperature
                )
                logps = token_logprobs(logits, chosen, params.temperature)
                # The one host synchronisation of a step: the chosen ids (for the stop check) and their
                # log-probs in one copy (ids below 2^53 are exact in float64).
                chosen_list, logps_list = torch.stack([chosen.double(), logps.double()]).tolist()
                if params.return_hidden:
                    hidden_steps.append(hidden.float())
                keep: list[int] = []
                for row, index in enumerate(active):
                    token = int(chosen_list[row])
                    out[index].tokens.append(token)
                    out[index].logprobs.append(logps_list[row])
                    hidden_rows[index].append(block_start + row)
                    if token == self.eos_token_id:
                        out[index].finished = True
                    else:
                        keep.append(row)
                block_start += len(active)
                if not keep or t + 1 == params.max_new_tokens:
                    break
                if len(keep) < len(active):
                    select = torch.as_tensor(keep, device=ids.device)
                    cache.batch_select_indices(select)
                    mask, positions = mask[select], positions[select]
                    chosen = chosen[select.to(chosen.device)]
                    active = [active[row] for row in keep]
                ids = chosen.view(-1, 1).to(ids.device)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                positions = positions[:, -1:] + 1
        if params.return_hidden:  # left on the device: the proof copies only its top-k (verification/proofs)
            every = torch.cat(hidden_steps)
            for index, rows in enumerate(hidden_rows):
                out[index].hidden = every[torch.as_tensor(rows, dtype=torch.long, device=every.device)]
        return out

    def prefill(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[Prefill]:
        import torch

        if len(prompts) != len(completions):
            raise ValueError("one completion per prompt")
        rows = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
        if not rows:
            return []
        ids, mask = self._left_pad(rows)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        width = ids.shape[1]
        results: list[Prefill] = []
        with torch.inference_mode():
            hidden = self._decoder(  # no KV cache: one pass needs none, and it would double the memory
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
            ).last_hidden_state
            for i, completion in enumerate(completions):
                n = len(completion)
                start = width - n - 1  # position predicting completion token 0
                h = hidden[i, start : start + n]
                # The hidden states stay on the device (the proof check copies only its top-k).
                results.append(Prefill(logits=self._head(h).float().cpu(), hidden=h.float()))
        return results
