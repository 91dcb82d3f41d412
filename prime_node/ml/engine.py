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
           prompt + completion returning, for each completion token t, the final hidden state at the
           position that predicts it (the same rows ``generate`` saw), on the engine's device, and the
           engine's output head. A validator compares the hidden states against the proof, and
           ``prefill_replay`` replays the sampling rule and recomputes the log-probs from them a chunk
           of positions at a time: no [n, vocab] logits are kept (at a 151,936-token vocabulary the
           float64 scores of a 1,024-token completion alone take 1.2 GB).
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

import inspect
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


@dataclass(frozen=True)
class LogitHead:
    """An engine's output head as the validator applies it to rows of final hidden states: float32
    logits on the engine's device, computed in the model's dtype from the (exactly) upcast rows. It reads
    the engine's current weights: use it before the next ``load_weights``."""

    module: Any

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        import torch

        with torch.inference_mode():
            dtype = next(self.module.parameters()).dtype
            return self.module(hidden.to(dtype)).float()  # type: ignore[no-any-return]

    @property
    def vocab_size(self) -> int:
        return int(self.module.weight.shape[0])


@dataclass
class Prefill:
    """Teacher-forced final hidden states [n, hidden] (float32, on the engine's device) for n completion
    tokens, and the head that turns them into logits (``prefill_replay``)."""

    hidden: torch.Tensor
    head: LogitHead

    @property
    def logits(self) -> torch.Tensor:
        """The [n, vocab] float32 logits on the host, built on demand for small checks and tests; the
        validator never asks for them (``prefill_replay`` works a chunk of positions at a time)."""
        return self.head(self.hidden).cpu()


def prefill_replay(
    prefills: Sequence[Prefill],
    completions: Sequence[Sequence[int]],
    temperature: float,
    seeds: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a validator recomputes per token of ``completions`` (one per prefill and seed, concatenated):
    the log-prob log_softmax(logits / T)[token] (float32) and the sampling rule's replay margin (float64),
    both on the engine's device. The logits exist ``replay_chunk_rows`` positions at a time, whatever
    the batch (``sampling.replay_in_chunks``)."""
    if len(seeds) != len(completions):
        raise ValueError("one seed per completion")
    logp, margins = _replay(prefills, completions, temperature, seeds)
    assert margins is not None
    return logp, margins


def prefill_logprobs(
    prefills: Sequence[Prefill], completions: Sequence[Sequence[int]], temperature: float
) -> torch.Tensor:
    """``prefill_replay``'s log-probs alone (no seeds, no replay)."""
    return _replay(prefills, completions, temperature, None)[0]


def _replay(
    prefills: Sequence[Prefill],
    completions: Sequence[Sequence[int]],
    temperature: float,
    seeds: Sequence[int] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    import torch

    from prime_node.ml.sampling import replay_chunk_rows, replay_in_chunks

    if len(prefills) != len(completions):
        raise ValueError("one prefill per completion")
    if not prefills:
        empty = torch.zeros(0)
        return empty, None if seeds is None else empty.double()
    head = prefills[0].head
    if any(p.head != head for p in prefills):
        raise ValueError("prefills of different engines")
    flat_seeds = None if seeds is None else [s for s, c in zip(seeds, completions, strict=True) for _ in c]
    return replay_in_chunks(
        head,
        torch.cat([p.hidden for p in prefills]),
        [t for c in completions for t in c],
        temperature,
        rows=replay_chunk_rows(head.vocab_size),
        seeds=flat_seeds,
        positions=None if seeds is None else [i for c in completions for i in range(len(c))],
    )


class InferenceEngine(Protocol):
    policy_step: int

    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams
    ) -> list[Completion]: ...

    def prefill(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[Prefill]: ...

    def load_weights(self, state: Mapping[str, torch.Tensor], policy_step: int) -> None: ...


def _retire_finished(active: list[int], keep: list[int]) -> tuple[list[int], list[int] | None]:
    """The batch's rows after a step (row -> prompt index, -1 for a finished row left in place) and the
    rows to keep when the batch should shrink now (None: it stays as it is).

    Finished rows stay in the batch, their outputs ignored, until fewer than 3/4 of the rows are live:
    dropping rows copies the whole KV cache, so dropping each sample as it finished cost one copy per
    sample; this way the copies add up to at most three caches' worth per batch (plain ``generate`` in
    transformers never drops rows). On a quiet 2-core CPU, 4,096 samples × 400 tokens of the tiny model
    took 50–57 s either way (the copies cost there what the extra rows cost); on a GPU the copies are
    the larger share (not measured yet).
    """
    if 4 * len(keep) < 3 * len(active):
        return [active[row] for row in keep], keep
    if len(keep) < len(active):
        live = set(keep)
        return [index if row in live else -1 for row, index in enumerate(active)], None
    return active, None


def cache_keyword(decoder: Any) -> str:
    """The name the decoder's ``forward`` and its output give the KV cache: ``cache`` from transformers
    5.x on, ``past_key_values`` before. 5.x still takes the old name but warns on every start (and drops it
    in 5.40), so the engine asks the signature instead of picking one name for every version."""
    try:
        names = inspect.signature(decoder.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature: assume the long-standing name
        return "past_key_values"
    return "cache" if "cache" in names else "past_key_values"


class TorchEngine:
    """The torch/transformers engine (CPU or CUDA) for any HF causal LM with a decoder + lm_head."""

    def __init__(self, model: Any, *, eos_token_id: int, pad_token_id: int, policy_step: int = 0) -> None:
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.policy_step = policy_step
        self._decoder = model.get_decoder()
        self._cache_keyword = cache_keyword(self._decoder)
        self._head = model.get_output_embeddings()
        self._logit_head = LogitHead(self._head)

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

        if len(prompts) != len(seeds) or any(len(p) == 0 for p in prompts):
            raise ValueError("one seed per prompt, and no empty prompt")
        if not prompts:
            return []
        ids, mask = self._left_pad(prompts)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = [Completion([], [], False, None) for _ in prompts]
        # Hidden states stay on the device, one [live rows, hidden] block per step, and never cross to the
        # host whole: on a GPU a copy per row and token would stall every step.
        hidden_steps: list[torch.Tensor] = []
        hidden_rows: list[list[int]] = [[] for _ in prompts]  # per prompt: its rows in those blocks
        block_start = 0
        active = list(range(len(prompts)))  # row of the batch -> prompt index (-1: finished, still there)
        cache = None
        with torch.inference_mode():
            for t in range(params.max_new_tokens):
                result = self._decoder(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    use_cache=True,
                    **{self._cache_keyword: cache},
                )
                cache = getattr(result, self._cache_keyword)
                hidden = result.last_hidden_state[:, -1]
                logits = self._head(hidden)
                chosen = choose_tokens(
                    logits, [seeds[i] if i >= 0 else 0 for i in active], [t] * len(active), params.temperature
                )
                logps = token_logprobs(logits, chosen, params.temperature)
                # The one host synchronisation of a step: the chosen ids (for the stop check) and their
                # log-probs in one copy (ids below 2^53 are exact in float64).
                chosen_list, logps_list = torch.stack([chosen.double(), logps.double()]).tolist()
                if params.return_hidden:
                    hidden_steps.append(hidden.float())
                keep: list[int] = []  # rows still generating
                for row, index in enumerate(active):
                    if index < 0:
                        continue
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
                active, kept = _retire_finished(active, keep)  # kept: the rows to shrink the batch to
                if kept is not None:
                    select = torch.as_tensor(kept, device=ids.device)
                    cache.batch_select_indices(select)
                    mask, positions = mask[select], positions[select]
                    chosen = chosen[select.to(chosen.device)]
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
                # The hidden states stay on the device (the proof check copies only its top-k), and no
                # logits are made here: ``prefill_replay`` computes them a chunk of positions at a time.
                results.append(Prefill(hidden=h.float(), head=self._logit_head))
        return results
