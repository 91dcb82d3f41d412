"""Seeded, replayable token sampling: the exact rule a validator re-applies to check every token.

Rule (version 1). For a sample with 63-bit seed ``s``, completion position ``t`` (0 for the first
generated token), vocabulary index ``v`` and temperature ``T``:

    mix(x)   = splitmix64 finaliser on u64: x ^= x>>30; x *= 0xBF58476D1CE4E5B9; x ^= x>>27;
               x *= 0x94D049BB133111EB; x ^= x>>31           (all arithmetic mod 2^64)
    key(s,t) = mix(s ^ mix(t + 0x9E3779B97F4A7C15))
    u(s,t,v) = ((mix(key(s,t) + (v + 1) * 0x9E3779B97F4A7C15) >> 11) + 0.5) / 2^53      in (0, 1)
    g(s,t,v) = -ln(-ln(u(s,t,v)))                                                       (float64)
    token    = argmax_v ( float64(logits_v) / T + g(s,t,v) )      if T > 0
             = argmax_v ( logits_v )                               if T == 0 (greedy)

Ties go to the lowest index. This is Gumbel-max sampling, so a token is drawn from softmax(logits / T),
yet the choice is a pure function of (logits, s, t, T): anyone holding the logits replays it. The
reported log-prob is ``log_softmax(logits / T)[token]`` (``T == 0`` uses T = 1). The logits are those
of the last position fed to the model, i.e. the position that predicts completion token ``t``.

A validator recomputes logits by one prefill pass; they differ from KV-cache generation by float
rounding, so it checks ``replay_margin(...) <= tolerance`` rather than exact equality. On the CPU the
noise is computed with numpy's wrapping uint64 arithmetic; for logits on a GPU it is computed there
(``gumbel_noise_torch``: the same bits in wrapping int64, so a [batch, vocab] float64 matrix never
crosses to the host each step). The hash bits agree exactly; the two float64 ``log`` implementations may
differ in the last bit, far inside the replay tolerance.

A validator never holds the logits of a whole batch: ``replay_in_chunks`` takes the final hidden states
and the output head and computes the logits, the float64 scores and the per-token values for
``replay_chunk_rows`` positions at a time (at Qwen3's 151,936-token vocabulary the float64 scores of
one 1,024-token completion alone take 1.2 GB). Each row's values are those of the whole-matrix calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

if TYPE_CHECKING:
    import torch

RULE_VERSION = 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK63 = (1 << 63) - 1
REPLAY_CHUNK_BYTES = 128 << 20
"""One chunk's float64 [rows, vocab] scores at most (the noise and its hash temporaries are as big)."""


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return cast(np.ndarray, x ^ (x >> np.uint64(31)))


def gumbel_noise(seeds: Sequence[int], positions: Sequence[int], vocab_size: int) -> np.ndarray:
    """float64 array [len(seeds), vocab_size]: the noise g(seed_i, position_i, v) of the rule."""
    with np.errstate(over="ignore"):
        s = np.asarray([seed & _MASK63 for seed in seeds], dtype=np.uint64)
        t = np.asarray(positions, dtype=np.uint64)
        key = _mix(s ^ _mix(t + _GOLDEN))
        v = np.arange(1, vocab_size + 1, dtype=np.uint64) * _GOLDEN
        bits = _mix(key[:, None] + v[None, :]) >> np.uint64(11)
    u = (bits.astype(np.float64) + 0.5) / float(1 << 53)
    noise: np.ndarray = -np.log(-np.log(u))
    return noise


def _signed(value: np.uint64) -> int:
    """A u64 constant as the int64 with the same bits (torch has no wrapping uint64 multiply)."""
    return int(value) - (1 << 64) if int(value) >= 1 << 63 else int(value)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (``>>`` on int64 is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix_torch(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shift_right(x, 30)
    x = x * _signed(_M1)
    x = x ^ _shift_right(x, 27)
    x = x * _signed(_M2)
    return x ^ _shift_right(x, 31)


def gumbel_noise_torch(
    seeds: Sequence[int], positions: Sequence[int], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """``gumbel_noise`` computed on ``device`` (float64 [len(seeds), vocab_size]): the same hash bits in
    wrapping int64 arithmetic."""
    import torch

    golden = _signed(_GOLDEN)
    s = torch.as_tensor([seed & _MASK63 for seed in seeds], dtype=torch.int64, device=device)
    t = torch.as_tensor(list(positions), dtype=torch.int64, device=device)
    key = _mix_torch(s ^ _mix_torch(t + golden))
    v = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=device) * golden
    bits = _shift_right(_mix_torch(key[:, None] + v[None, :]), 11)
    u = (bits.to(torch.float64) + 0.5) / float(1 << 53)
    return -torch.log(-torch.log(u))


def _scores(
    logits: torch.Tensor, seeds: Sequence[int], positions: Sequence[int], temperature: float
) -> torch.Tensor:
    """float64 scores of the rule, on the device of ``logits`` when it is a GPU, else on the CPU."""
    import torch

    device = logits.device if logits.device.type != "cpu" else torch.device("cpu")
    scaled = logits.detach().to(device, torch.float64)
    if temperature == 0:
        return scaled
    if device.type == "cpu":
        noise = torch.from_numpy(gumbel_noise(seeds, positions, scaled.shape[-1]))
    else:
        noise = gumbel_noise_torch(seeds, positions, scaled.shape[-1], device)
    return scaled / temperature + noise


def choose_tokens(
    logits: torch.Tensor, seeds: Sequence[int], positions: Sequence[int], temperature: float
) -> torch.Tensor:
    """The rule's token for each row of ``logits`` [batch, vocab]; a LongTensor [batch] on the logits'
    device (the caller copies the chosen ids once, with whatever else it needs from that step)."""
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    return _scores(logits, seeds, positions, temperature).argmax(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[token] per row, float32 (T == 0 counts as 1)."""
    import torch

    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    return logp.gather(-1, tokens.to(logits.device).view(-1, 1)).squeeze(-1)


def replay_margin(
    logits: torch.Tensor,
    seeds: Sequence[int],
    positions: Sequence[int],
    temperature: float,
    tokens: Sequence[int],
) -> torch.Tensor:
    """How far each claimed token's score is below the best score (0 when the rule picks it exactly).

    A validator recomputes ``logits`` by prefill and accepts a token whose margin is at most a small
    tolerance (float noise between KV-cache generation and prefill), refuses one with a larger margin.
    """
    import torch

    scores = _scores(logits, seeds, positions, temperature)
    index = torch.as_tensor(list(tokens), dtype=torch.long, device=scores.device).view(-1, 1)
    claimed = scores.gather(-1, index).squeeze(-1)
    margin: torch.Tensor = scores.max(dim=-1).values - claimed
    return margin


def replay_chunk_rows(vocab_size: int) -> int:
    """Positions per ``replay_in_chunks`` chunk: a float64 [rows, vocab] fits ``REPLAY_CHUNK_BYTES``."""
    return max(1, REPLAY_CHUNK_BYTES // (8 * max(1, vocab_size)))


def replay_in_chunks(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    tokens: Sequence[int],
    temperature: float,
    *,
    rows: int,
    seeds: Sequence[int] | None = None,
    positions: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logprobs`` and, given ``seeds`` and ``positions``, ``replay_margin`` of N tokens from their
    final hidden states ``hidden`` [N, hidden], with ``logits_of`` (the output head: [n, hidden] ->
    float32 [n, vocab]) applied to ``rows`` positions at a time; both [N], on the device of ``hidden``."""
    import torch

    count = len(tokens)
    if (seeds is None) != (positions is None):
        raise ValueError("seeds and positions go together")
    if hidden.shape[0] != count or (seeds is not None and not len(seeds) == len(positions or ()) == count):
        raise ValueError("one hidden state, seed and position per token")
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=hidden.device)
    logps: list[torch.Tensor] = []
    margins: list[torch.Tensor] = []
    for start in range(0, count, max(1, rows)):
        stop = min(count, start + max(1, rows))
        logits = logits_of(hidden[start:stop])
        logps.append(token_logprobs(logits, ids[start:stop], temperature))
        if seeds is not None and positions is not None:
            margins.append(
                replay_margin(
                    logits, seeds[start:stop], positions[start:stop], temperature, tokens[start:stop]
                ).to(hidden.device)
            )
    empty = torch.zeros(0, device=hidden.device)
    logp = torch.cat(logps) if logps else empty.float()
    if seeds is None:
        return logp, None
    return logp, torch.cat(margins) if margins else empty.double()
