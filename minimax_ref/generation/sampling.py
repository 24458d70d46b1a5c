"""Sampling: the filtered distribution of a logit row and seeded draws from it.

Contract (`SamplingParams`, `filtered_probs`, `sample`): logits are fp32; temperature 0 is greedy
(argmax, ties to the lowest id); otherwise logits / temperature (a normal float32: `SamplingParams`; computed as
(logits - row max) / temperature, the same distribution, so that a small temperature overflows to -inf on unlikely
tokens instead of to inf - inf = NaN), then top-k (keep the k largest; 0 = off; chosen on the logits, which
temperature does not reorder, so a huge temperature that rounds the quotients together cannot widen it), then top-p
(keep the smallest set of most likely tokens whose probability reaches top_p, always at least one; 1.0 = off), then
one draw with `torch.multinomial` from an explicit `torch.Generator`. The same seed gives the same tokens.
Speculative decoding draws its drafts and checks them against the target with these same distributions, and draws
its emitted token by inverse CDF (`sample_inverse_cdf`).

A batch whose rows are separate requests samples with `RowSampling`: each row with its own setting, from its own
generator, so a row's tokens do not depend on which rows share its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InputError


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# A positive temperature must be a normal float32: logits are divided by it in fp32, where a smaller one is
# subnormal or 0 (the quotients inf / NaN) and a larger one is inf (every quotient 0).
MIN_TEMPERATURE = 2.0 ** -126  # about 1.18e-38, the smallest normal float32
MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)  # about 3.40e38


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE] (a normal float32, about 1.2e-38 to
    3.4e38), top_p in (0, 1] (1 = off), top_k >= 0 (0 = off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise InputError(f"temperature={t!r}: must be a number >= 0 (0 = greedy)")
        if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
            raise InputError(f"temperature={t!r}: a positive temperature must be a normal float32, "
                             f"{MIN_TEMPERATURE:.4g} to {MAX_TEMPERATURE:.4g} (logits are divided by it in fp32); "
                             "use 0 for greedy decoding")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p={self.top_p!r}: must be a number in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InputError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution [..., V] fp32 of `logits` [..., V] after temperature, top-k and top-p.

    Greedy parameters give a one-hot distribution on the argmax. Sampling, the drafter's drafts and
    speculative verification all use this function, so they see the same distribution.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # shifted by the row max (<= 0 after it): a tiny temperature sends unlikely tokens to -inf, never inf - inf
    z = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        # on the logits: a huge temperature may round distinct quotients together, which would keep more than k
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the strictly more likely tokens
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of `probs` [B, V] -> LongTensor [B] on probs' device.

    `torch.multinomial` runs on the generator's device (a CPU generator gets a CPU copy of probs), so
    a seed gives the same tokens whatever device the model is on.
    """
    on_cpu = generator is not None and generator.device.type == "cpu"
    out = torch.multinomial(probs.cpu() if on_cpu else probs, 1, generator=generator)
    return out.squeeze(-1).to(probs.device)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of `logits` [B, V] -> LongTensor [B]: the argmax when greedy (no draw from
    the generator), else `draw(filtered_probs(logits, params), generator)`."""
    if params.greedy:
        return logits.argmax(-1)
    return draw(filtered_probs(logits, params), generator)


@dataclass(frozen=True, eq=False)
class RowSampling:
    """How each row of a batch samples: row b with `params[b]` from `generators[b]` (a CPU generator, or None: the
    default generator; greedy rows never draw). Distributions of rows that share a setting are computed together;
    each sampled row then draws alone from its own generator (`draw` of its one row), so what it draws does not
    depend on the other rows."""

    params: tuple[SamplingParams, ...]
    generators: tuple[torch.Generator | None, ...]

    @classmethod
    def same(cls, params: SamplingParams, rows: int, generator: torch.Generator | None) -> RowSampling:
        """Every one of `rows` rows with `params`, drawing one row after another from the one `generator`."""
        return cls((params,) * rows, (generator,) * rows)

    @property
    def greedy(self) -> bool:
        """Every row is greedy (no draw, no distribution needed)."""
        return all(p.greedy for p in self.params)

    def take(self, rows: list[int]) -> RowSampling:
        """The settings and generators of `rows` only, in that order."""
        return RowSampling(tuple(self.params[r] for r in rows), tuple(self.generators[r] for r in rows))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's `filtered_probs` [B, ..., V] fp32 of `logits` [B, ..., V] with its own setting (greedy rows:
        one-hot on the argmax)."""
        by_setting: dict[SamplingParams, list[int]] = {}
        for b, p in enumerate(self.params):
            by_setting.setdefault(p, []).append(b)
        if len(by_setting) == 1:
            return filtered_probs(logits, self.params[0])
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        for params, rows in by_setting.items():
            out[rows] = filtered_probs(logits[rows], params)
        return out

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row of `logits` [B, V]: the argmax for a greedy row, else one `draw` from its filtered
        distribution with its own generator. Returns (tokens [B] on logits' device, the distributions [B, V] fp32,
        or None when every row is greedy)."""
        tokens = logits.argmax(-1)
        if self.greedy:
            return tokens, None
        probs = self.probs(logits)
        host = probs.cpu()  # the generators are the host's: one copy for every row
        picked = tokens.tolist()
        for b, (p, g) in enumerate(zip(self.params, self.generators)):
            if not p.greedy:
                picked[b] = int(draw(host[b:b + 1], g))
        return torch.tensor(picked, device=logits.device), probs


def sample_inverse_cdf(probs: torch.Tensor, u: float | torch.Tensor) -> int:
    """The token i whose interval [cdf[i-1], cdf[i]) of the cumulative distribution contains u.

    probs: [V] non-negative, meant to sum to 1 (no normalisation happens here); u in [0, 1).
    The cumulative sum is taken in fp64; tokens of probability 0 are never returned. If u is at or
    past the total mass (rounding), the last token of positive probability is returned.
    """
    p = probs.double()
    cdf = p.cumsum(0)
    i = int(torch.searchsorted(cdf, torch.tensor([float(u)], dtype=torch.float64, device=cdf.device), right=True))
    if i >= p.numel():
        i = int(p.nonzero().max())
    return i


__all__ = ["MAX_TEMPERATURE", "MIN_TEMPERATURE", "RowSampling",
           "SamplingParams", "draw", "filtered_probs", "sample", "sample_inverse_cdf"]
