"""Speculative decoding from the context: drafts without a draft model.

A decode step's time goes into reading the weights, so a step that feeds a sequence
k + 1 tokens costs far less than k + 1 steps (docs/performance.md). When the next
tokens can be guessed, the scheduler feeds the guess (a draft) after the last token
in one step, takes the logits of every position, and keeps the longest prefix of
the draft the model agrees with, plus the model's own next token: 1 to k + 1 tokens
per step instead of 1.

Where drafts come from:
- the context (prompt lookup): the longest n-gram (up to NGRAM_MAX tokens) ending
  the sequence that occurred before, in the prompt or the output; the tokens that
  followed it there are the draft. An answer that repeats a passage, returns code
  with one fix or quotes its source is mostly such runs;
- a constraint (engine/jump_forward.py): the tokens of the text it forces.

Verification is the sampler's own: at each drafted position the request's `pick`
chooses a token from the logits there (greedy, or drawn with its seeded generator,
under its constraint's mask), and the draft token is accepted when it is the token
chosen. For a deterministic draft this is exactly the speculative sampling rule
(the draft distribution q is a point mass on d: accept d with probability
min(1, p(d)/q(d)) = p(d); on rejection draw from max(0, p - q) renormalized, which
is p with d removed): drawing x from p and accepting d when x = d does both at once,
and x itself is the next token. So the output has the distribution of decoding one
token per step; with a seed, even the same tokens, since the draws happen in the same
order (up to the near ties the batch rules already allow: a row's logits do not
depend on the rows beside it beyond float rounding).

What it costs: a step of n rows is measured (StepCost), the acceptance of each
request's drafts is observed (a per-token rate, also from the drafts not sent: the
model's next token is compared with the draft's first for free), and a draft is as
long as maximizes the expected tokens per second of the whole step; where no length
pays, none is sent (free text, whose guesses mostly fail, runs as without).

The scheduler's side of it (which requests of a step draft, within what room, and the
bookkeeping after the step) is engine/drafting.py; the constants are in engine/tuning.py.
Next: engine/jump_forward.py, the forced text.
"""

from __future__ import annotations

import math

from . import tuning
from .constrain import GrammarConstraint
from .jump_forward import forced_tokens


class PromptLookup:
    """Drafts from n-gram matches in the tokens so far (prompt and accepted output)."""

    def __init__(self, tokens: list[int], n_max: int = tuning.NGRAM_MAX):
        self.n_max = n_max
        self.tokens: list[int] = []
        # index[n][the n tokens before position e] = e, the latest such e < len(tokens):
        # the suffix itself is not indexed, so a lookup finds an earlier occurrence
        self.index: list[dict] = [{} for _ in range(n_max + 1)]
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Tokens accepted after those so far."""
        old = len(self.tokens)
        self.tokens.extend(tokens)
        for e in range(max(old, 1), len(self.tokens)):  # ends e < len: all but the suffix
            for n in range(1, min(self.n_max, e) + 1):
                self.index[n][tuple(self.tokens[e - n: e])] = e

    def propose(self, limit: int) -> tuple[list[int], int]:
        """Up to `limit` tokens that followed the longest earlier match of the suffix, and
        the match's length (0: none)."""
        tokens = self.tokens
        for n in range(min(self.n_max, len(tokens)), 0, -1):
            e = self.index[n].get(tuple(tokens[-n:]))
            if e is not None:
                return tokens[e: e + limit], n
        return [], 0


class Acceptance:
    """A per-token acceptance rate: the chance that a draft token, its predecessors
    accepted, is the model's choice too (smoothed over the observations)."""

    def __init__(self, prior: float):
        self.rate = prior

    def observe(self, drafted: int, accepted: int) -> None:
        """`accepted` of `drafted` tokens were taken: that many yes, then one no (if any)."""
        for _ in range(accepted):
            self.rate += tuning.SMOOTHING * (1.0 - self.rate)
        if accepted < drafted:
            self.rate -= tuning.SMOOTHING * self.rate

    def expected(self, k: int) -> float:
        """The tokens a draft of k is expected to add: a + a^2 + ... + a^k."""
        a = self.rate
        return sum(a ** i for i in range(1, k + 1))


class StepCost:
    """Seconds of a forward step by its rows, as measured, for the ratios that decide a
    draft's length.

    Each row count keeps its fastest step: on a shared machine other processes only
    ever add time, so the fastest is the step's own cost. A row count not measured yet
    is estimated from the nearest one measured, by the prior ratio (ROW_COST_PRIOR per
    row), and no count costs less than a smaller one. The prior times the one-row
    cost also caps the estimate: a row count first measured in a busy moment would
    otherwise look too dear to draft for, and never be measured again.
    """

    def __init__(self):
        self.seconds: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        self.seconds[rows] = min(seconds, self.seconds.get(rows, math.inf))

    def __call__(self, rows: int) -> float:
        """The cost of a step of `rows` rows, in seconds (or in one-row steps, before any
        measurement)."""
        per_row = tuning.ROW_COST_PRIOR
        prior = lambda n: 1.0 + per_row * (n - 1)  # noqa: E731
        if not self.seconds:
            return prior(rows)
        near = min(self.seconds, key=lambda n: (abs(n - rows), n))
        cost = self.seconds[near] * prior(rows) / prior(near)
        cost = max([cost] + [seconds for n, seconds in self.seconds.items() if n < rows])
        one = self.seconds.get(1)
        return cost if one is None else min(cost, one * prior(rows))


class Drafter:
    """One request's drafts: from its constraint's forced text, else from its context."""

    def __init__(self, tokens: list[int], constraint=None, tokenizer=None):
        self.lookup = PromptLookup(tokens)
        # (a constraint of another kind still holds: `pick` obeys it, drafts or not)
        self.constraint = constraint if isinstance(constraint, GrammarConstraint) else None
        self.tokenizer = tokenizer
        self.context = {n: Acceptance(prior) for n, prior in tuning.ACCEPTANCE_PRIOR.items()}  # by match length
        self.forced = Acceptance(tuning.FORCED_PRIOR)

    def extend(self, tokens: list[int]) -> None:
        self.lookup.extend(tokens)

    def propose(self, limit: int) -> tuple[list[int], Acceptance]:
        """A draft of at most `limit` (> 0) tokens to follow the sequence, and the rate
        that predicts its acceptance (None: no draft). Called after the constraint took
        the last token."""
        constraint = self.constraint
        if constraint is not None:
            forced = forced_tokens(constraint, self.tokenizer)[:limit]
            forced = forced[: constraint.allowed_prefix(forced)]  # (its guessed spaces may not fit a budget)
            if forced:
                return forced, self.forced
        draft, n = self.lookup.propose(limit)
        if not draft:
            return [], None
        if constraint is not None:
            draft = draft[: constraint.allowed_prefix(draft)]
        return draft, self.context[n]


def draft_lengths(proposals: list[tuple[list[int], Acceptance]], rows: int, tokens: int,
                  cost: StepCost) -> list[int]:
    """How many tokens of each proposal to send in a step that already has `rows` rows
    and yields `tokens` tokens: each in turn as long as maximizes the step's expected
    tokens per second (0 when no length pays)."""
    lengths = []
    for draft, acceptance in proposals:
        best_k, best = 0, tokens / cost(rows)
        gain = 0.0
        for k in range(1, len(draft) + 1):
            gain += acceptance.rate ** k
            rate = (tokens + gain) / cost(rows + k)
            if rate > best:
                best_k, best = k, rate
        lengths.append(best_k)
        rows += best_k
        tokens += acceptance.expected(best_k)
    return lengths
