"""Jump-forward: the text a constraint forces, computed in one forward step.

Much of a constrained output is not the model's to choose: after `{"name": "Ada", `
a schema with `age` next allows only `"age":`; a tool call's wrapper and name are
fixed once begun. Decoding those bytes one token per forward step wastes steps.
Here the matcher is asked which bytes are the only possible continuation (a byte
is forced when it is the one byte the grammar state accepts, and the document
cannot end there), and their canonical tokens become a draft that the scheduler
feeds in one step with the token before them (engine/speculate.py).

They are a draft, not appended unseen: the model still picks every token under the
mask, and a forced token it would not have chosen (a different split of the same
bytes, or a token that merges the forced text with what follows) is rejected like
any draft. So the output is token for token what constrained decoding one token
per step writes, valid by construction, and its tokenization is the model's own.
That verification is what keeps the seam canonical. llguidance, which appends
forced tokens unseen, holds the last one back: the text after it is free, and the
model may prefer a token spanning both (`":` then ` "` may be `": "`). Here the
last forced token is drafted all the same: if the model prefers the merged token,
it picks it at that very row, the draft's tail is dropped, and the output is what
holding back would have given, in as many steps; if not, the step gained a token.
"""

from __future__ import annotations

from . import tuning
from .constrain import GrammarConstraint
from .constrain.grammar import SPACE


def forced_bytes(constraint: GrammarConstraint, limit: int = tuning.MAX_FORCED_BYTES) -> bytes:
    """The bytes that must come next, whatever the model picks (b"" when it has a choice)."""
    if constraint.ended:
        return b""
    return _forced_from(constraint.grammar, constraint.state)[0][:limit]


def draft_bytes(constraint: GrammarConstraint, limit: int = tuning.MAX_FORCED_BYTES) -> bytes:
    """The forced bytes, continued through each optional space that forced text follows.

    The grammar lets a JSON document put one space after a ',' or a ':' or not, so the
    text forced after `"name": "Ada",` stops at that choice, and a record's keys would
    cost a step each for their space alone. Models write the space (`", "age": `, as
    json.dumps does), so the draft assumes it where more forced text comes after it:
    ` "age":` in one step. It is a guess, not a certainty, which is why the result is
    only drafted (the model verifies it like any draft), never appended unseen.
    """
    if constraint.ended:
        return b""
    grammar = constraint.grammar
    out, at = _forced_from(grammar, constraint.state)
    while len(out) < limit and not grammar.complete(at):
        spaced = grammar.step(at, SPACE)
        if spaced is None:
            break
        more, after = _forced_from(grammar, spaced)
        if not more:  # free text after the space (a number, inside a string): no guess
            break
        out, at = out + bytes((SPACE,)) + more, after
    return out[:limit]


def _forced_from(grammar, state) -> tuple[bytes, frozenset]:
    """The bytes forced from `state` (at most MAX_FORCED_BYTES), and the state after them."""
    cache = grammar.forced
    cached = cache.get(state)
    if cached is not None:
        return cached
    out = bytearray()
    at = state
    while len(out) < tuning.MAX_FORCED_BYTES and not grammar.complete(at):  # (complete: the end token is a choice)
        nexts = [(b, s) for b in range(256) if (s := grammar.step(at, b)) is not None]
        if len(nexts) != 1:
            break
        b, at = nexts[0]
        out.append(b)
    if len(cache) >= tuning.FORCED_RUNS:
        cache.clear()
    cache[state] = (bytes(out), at)
    return cache[state]


def forced_tokens(constraint: GrammarConstraint, tokenizer) -> list[int]:
    """The canonical tokens of the bytes to draft ([] when the model has a choice)."""
    data = draft_bytes(constraint)
    while data:  # whole characters only: a cut multi-byte character would not tokenize
        try:
            text = data.decode("utf-8")
            break
        except UnicodeDecodeError:
            data = data[:-1]
    else:
        return []
    return tokenizer.encode(text, add_special=False)
