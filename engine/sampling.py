"""Choosing the next token from the logits.

A request's `SamplingParams` (engine/api.py) say how. First, when the request has them,
the logits are adjusted as OpenAI defines it: `logit_bias` added, then each token already
in this request's output loses `presence_penalty` once and `frequency_penalty` × its
count there (the prompt does not count). Temperature 0 is greedy: the
argmax, deterministic (the lowest id wins a tie). Otherwise the logits are divided
by the temperature, then filtered, in this order, by top_k (keep the k most
likely), top_p (keep the smallest set whose probability reaches p) and min_p
(drop tokens below min_p × the top probability), and one token is drawn with the
request's own numpy Generator (seeded when `seed` is given, so a seeded request
repeats exactly).

A constraint (engine/constrain/) restricts which tokens may come next. Its
mask costs a pass over the vocabulary, so the sampler first draws as if
unconstrained and asks `allows(token)`; only when the answer is no does it
build the mask and draw again, from the same filtered candidates restricted to
the allowed ones. Both ways the token comes from one distribution: the filtered
one renormalized over the allowed tokens (a rejected draw followed by a draw
from that restriction is exactly a draw from it). Only when no candidate is
allowed (or all those allowed have underflowed to 0 at a tiny temperature) are
the filters applied to the allowed tokens alone. (llama.cpp instead
redraws with the filters applied to the allowed tokens, which mixes the two.)

With `logprobs`, each pick also notes the picked token's log probability and the most
likely tokens' (`reported`, one entry per pick, in order): the log-softmax of the logits
as the model gave them, before bias, penalties and temperature, as llama-server reports
`n_probs` (its `post_sampling_probs` off) and OpenAI its logprobs. That costs a pass over
the vocabulary, made only when asked; so is the adjustment.

A mask may allow a few tokens more than `allows` does (a constraint's output
budget, far from its end): a token drawn from it that `allows` refuses is taken
out and the draw made again, which is still a draw from the same restriction.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import NamedTuple, Protocol

import numpy as np

from .api import SamplingParams, TokenLogprob
from .errors import EngineError


class Constraint(Protocol):
    def allows(self, token_id: int) -> bool: ...
    def mask(self) -> np.ndarray: ...          # bool (V,), True = allowed (a few more at most: allows decides)
    def advance(self, token_id: int) -> None: ...
    def is_done(self) -> bool: ...


class Reported(NamedTuple):
    """A picked token's log probability, and the most likely tokens' (ids, most likely first)."""

    logprob: float
    top: tuple[tuple[int, float], ...]


class Sampler:
    """The token picker of one request: its parameters, its random generator, its constraint."""

    def __init__(self, params: SamplingParams, constraint: Constraint | None = None, draws: int = 0):
        self.params = params
        self.constraint = constraint
        self.rng = np.random.default_rng(params.seed)
        self.output_counts: Counter[int] = Counter()  # the picked tokens, for the penalties
        self.reported: deque[Reported] = deque()  # with logprobs: one per pick (a reader pops them)
        self._bias_ids = np.array([i for i, _ in params.logit_bias], dtype=np.int64)
        self._bias_values = np.array([v for _, v in params.logit_bias], dtype=np.float64)
        self._penalized = bool(params.presence_penalty or params.frequency_penalty)
        # Random numbers drawn so far: a sampler made with `draws` goes on as one that had drawn
        # them (a generation taken over), each draw one step of the PCG64 generator.
        self.rng.bit_generator.advance(draws)
        self.draws = draws

    def pick(self, logits: np.ndarray) -> int:
        """The next token id for logits (V,); advances the constraint with it."""
        raw = logits
        if self._penalized or len(self._bias_ids):
            logits = self._adjusted(logits)
        token = self._pick(logits)
        if self._penalized:
            self.output_counts[token] += 1
        if self.params.logprobs is not None:
            self.reported.append(report(raw, token, self.params.logprobs))
        return token

    def _adjusted(self, logits: np.ndarray) -> np.ndarray:
        """The logits (V,) with the bias added and the penalties taken off, in float64."""
        z = logits.astype(np.float64)                               # (V,) a copy
        z[self._bias_ids] += self._bias_values
        if self.output_counts:
            ids = np.fromiter(self.output_counts.keys(), np.int64)  # (U,) the tokens output so far
            counts = np.fromiter(self.output_counts.values(), np.float64)
            z[ids] -= self.params.presence_penalty + self.params.frequency_penalty * counts
        return z

    def _pick(self, logits: np.ndarray) -> int:
        """The token drawn from (adjusted) logits, as the constraint allows; advances it."""
        ids, probs = self._candidates(logits)
        token = self._draw(ids, probs)
        if self.constraint is not None:
            if not self.constraint.allows(token):
                allowed = self.constraint.mask()                   # (V,) bool
                token = self._restricted(logits, ids, probs, allowed)
                while not self.constraint.allows(token):  # (a mask may hold a few more: Constraint.mask)
                    allowed[token] = False
                    token = self._restricted(logits, ids, probs, allowed)
            self.constraint.advance(token)
        return token

    def _restricted(self, logits: np.ndarray, ids: np.ndarray, probs: np.ndarray, allowed: np.ndarray) -> int:
        """A token drawn from the candidates (ids, probs) restricted to the allowed ones."""
        if not allowed.any():
            raise EngineError("the output constraint allows no token at this point")
        keep = allowed[ids]                                # (C,) the candidates allowed
        kept = probs[keep]
        if kept.sum() > 0:
            return self._draw(ids[keep], kept)
        # no allowed candidate can be drawn (none is left: always when greedy; or all
        # underflowed to 0 at a tiny temperature): the filters over the allowed tokens
        return self._draw(*self._candidates(np.where(allowed, logits, -np.inf)))

    def _candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The token ids that may be drawn, and their probabilities (to be renormalized),
        after temperature, top_k, top_p and min_p; greedy: the argmax alone."""
        p = self.params
        if p.temperature == 0:
            return np.array([int(np.argmax(logits))]), np.ones(1)
        z = logits.astype(np.float64)                               # (V,)
        with np.errstate(over="ignore"):  # a tiny temperature: -inf at worst, whose exp is 0
            z = (z - z.max()) / p.temperature                       # (V,) <= 0, the best is 0
        ids = np.arange(z.shape[0])                                 # (V,) candidate ids
        if p.top_k and p.top_k < z.shape[0]:
            ids = np.argpartition(-z, p.top_k - 1)[: p.top_k]       # (k,)
            z = z[ids]
        probs = np.exp(z)                                           # (C,) the best is 1
        probs /= probs.sum()                                        # (C,)
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")               # (C,) most likely first
            cumulative = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cumulative, p.top_p)) + 1]
            ids, probs = ids[keep], probs[keep]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs.max()
            ids, probs = ids[keep], probs[keep]
        return ids, probs

    def _draw(self, ids: np.ndarray, probs: np.ndarray) -> int:
        """One of `ids`, drawn by `probs` (renormalized) with this request's generator."""
        if len(ids) == 1:
            return int(ids[0])
        probs = probs / probs.sum()
        u = self.rng.random()
        self.draws += 1
        i = min(int(np.searchsorted(np.cumsum(probs), u, side="right")), len(ids) - 1)
        return int(ids[i])


def report(logits: np.ndarray, token: int, n_top: int) -> Reported:
    """`token`'s log probability under logits (V,), and the `n_top` most likely tokens'
    (the lowest id first among equals, as the greedy pick)."""
    z = logits.astype(np.float64)                                   # (V,)
    z -= z.max()
    logprobs = z - np.log(np.exp(z).sum())                          # (V,) log-softmax
    n_top = min(n_top, len(z))
    top = np.argpartition(-logprobs, n_top - 1)[:n_top] if n_top else np.zeros(0, np.int64)  # (n_top,)
    top = top[np.lexsort((top, -logprobs[top]))]                    # most likely first
    return Reported(float(logprobs[token]), tuple((int(i), float(logprobs[i])) for i in top))


def token_logprob(tokenizer, token: int, reported: Reported) -> TokenLogprob:
    """A report as the plain event a client reads: ids with their pieces (bytes)."""
    top = tuple((i, tokenizer.piece(i), logprob) for i, logprob in reported.top)
    return TokenLogprob(token, tokenizer.piece(token), reported.logprob, top)
