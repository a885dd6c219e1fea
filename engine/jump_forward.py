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

from .constrain import GrammarConstraint

MAX_FORCED_BYTES = 64  # a forced run is at most this long per step (a key and its quotes fit)


def forced_bytes(constraint: GrammarConstraint, limit: int = MAX_FORCED_BYTES) -> bytes:
    """The bytes that must come next, whatever the model picks (b"" when it has a choice)."""
    if constraint.ended:
        return b""
    grammar, state = constraint.grammar, constraint.state
    cache = grammar.forced
    cached = cache.get(state)
    if cached is not None:
        return cached[:limit]
    out = bytearray()
    at = state
    while len(out) < limit and not grammar.complete(at):  # (complete: the end token is a choice)
        nexts = [(b, s) for b in range(256) if (s := grammar.step(at, b)) is not None]
        if len(nexts) != 1:
            break
        b, at = nexts[0]
        out.append(b)
    forced = bytes(out)
    if len(cache) >= grammar.MAX_MASKS * 16:
        cache.clear()
    cache[state] = forced
    return forced


def forced_tokens(constraint: GrammarConstraint, tokenizer) -> list[int]:
    """The canonical tokens of the forced bytes ([] when nothing is forced)."""
    data = forced_bytes(constraint)
    while data:  # whole characters only: a cut multi-byte character would not tokenize
        try:
            text = data.decode("utf-8")
            break
        except UnicodeDecodeError:
            data = data[:-1]
    else:
        return []
    return tokenizer.encode(text, add_special=False)
