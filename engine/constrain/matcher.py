"""The matcher: bytes in, states out. A state is every way the output so far can be read.

A configuration is a stack (tuple) of frames `(node, local)`: the value being read on top,
the values it is inside below it. A state is a frozenset of configurations, so alternatives
(`anyOf`, type lists, a number that could end or go on) are followed side by side like an
NFA. States are immutable and hashable: `Grammar` caches transitions and masks by state,
and many generations share one Grammar. `GrammarConstraint` is one generation's position.

A Grammar is the recognizer masks.py's trie walk reads (`step`, `walk`); it computes its
masks with that walk, and with the shortcuts of the nodes on top of its stacks.

The output budget: `GrammarConstraint.limit(max_tokens)` makes a constraint keep room to
end. A state's plan (`Grammar.plan`) is the shortest completion of one of its stacks
(each frame's Node.finish, top first) and the fewest tokens that write it; a token is
allowed only if some completion after it fits the tokens left. Near the end, masks are
exact for the budget (`Grammar.needs`: the plan after each token the state allows).

Next: validation.py, schema.py (the compiler).
"""

from __future__ import annotations

import threading

import numpy as np

from .. import tuning
from ..errors import EngineError, OutputBudgetTooSmall, SchemaError
from .grammar import PUSH, SET, Node, reachable, set_documents, set_heights
from .masks import TokenIndex

# Frames on one stack: a value inside at most 63 arrays and objects (a few less in a tool
# call). A recursive schema had no other bound: each "[" of `{"items": {"$ref": "#"}}` was
# one more frame in every state after it, each state held by the caches: 260 MB after
# 8,000 of them, and each byte slower than the last. Only what can still end within the
# bound may begin (Node.height), so the bound never leaves the model stuck.
MAX_DEPTH = 64
# Alternatives followed side by side: nested anyOf branches that agree on a prefix multiply
# (2^depth stacks after "[[[..." for an anyOf of two array types, each level nested once
# more: 12 levels, 4,096 stacks, made a single mask take 15 s). An anyOf's own alternatives
# (nested anyOfs and $refs taken in) are counted when compiled, as its first byte leaves them;
# stacks that multiply as the output goes on only while decoding.
MAX_CONFIGURATIONS = 256


def _settle(stack: tuple) -> tuple:
    """Pop the frames that are complete and can take nothing more."""
    while stack and stack[-1][0].final(stack[-1][1]):
        stack = stack[:-1]
    return stack


def feed(stack: tuple, b: int, out: list) -> None:
    """Read byte `b` on `stack`: add the stacks it leads to (none: refused) to `out`."""
    node, local = stack[-1]
    below = stack[:-1]
    for action in node.step(local, b):
        if action[0] == SET:
            out.append(_settle(below + ((node, action[1]),)))
        else:
            base = below + ((node, action[1]),)
            for frame in action[2].expand():
                if len(base) + frame[0].height > MAX_DEPTH:
                    continue  # it could not end within MAX_DEPTH frames
                if action[0] == PUSH:
                    feed(base + (frame,), b, out)
                else:
                    out.append(_settle(base + (frame,)))
    if below and node.accepting(local):  # the value may end here: the byte goes to the parent
        feed(below, b, out)


def _complete(stack: tuple) -> bool:
    return all(node.accepting(local) for node, local in stack)


class Grammar:
    """A compiled grammar over one vocabulary, with its caches (shared by all its generations;
    their sizes, MAX_MASKS and MAX_TRANSITIONS, are in engine/tuning.py).

    Generations of several threads may share it: the caches are only read, written and
    cleared as whole entries (atomic under the GIL), and evictions hold a lock.
    """

    def __init__(self, root: Node, index: TokenIndex):
        self.index = index
        nodes = reachable(root)
        set_heights(nodes)
        set_documents(nodes)
        frames = [f for f in root.expand() if f[0].height <= MAX_DEPTH]
        if not frames:
            raise SchemaError(f"every document of the schema nests more than {MAX_DEPTH} values deep")
        self.initial = frozenset(_settle((f,)) for f in frames)
        if len(self.initial) > MAX_CONFIGURATIONS:  # (nested alternatives, before any byte)
            raise SchemaError(f"the schema's alternatives (anyOf, type lists) are more than "
                              f"{MAX_CONFIGURATIONS} ways to read one output", "", "anyOf")
        self._steps: dict = {}
        self._masks: dict = {}  # state -> uint8 (n_vocab / 8,) packed mask
        self.forced: dict = {}  # state -> the bytes it forces, the state after (engine/jump_forward.py)
        self._finishes: dict = {}  # (node, local) -> its shortest completion (Node.finish)
        self._plans: dict = {}     # state -> (tokens, bytes) of its cheapest completion found
        self._needs: dict = {}     # state -> (ids it allows, the tokens needed after each)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, index: TokenIndex, key, root) -> Grammar:
        """The grammar `key` over `index`'s vocabulary, cached there (with its masks, it is
        of that vocabulary); `root()` builds its root node on first use."""
        return index.grammar(key, lambda: cls(root(), index))

    def step(self, state: frozenset, b: int) -> frozenset | None:
        key = (state, b)
        nxt = self._steps.get(key, 0)
        if nxt == 0:
            out = []
            for stack in state:
                if stack:
                    feed(stack, b, out)
            nxt = frozenset(out) or None
            if nxt is not None and len(nxt) > MAX_CONFIGURATIONS:
                raise SchemaError(f"the schema's alternatives (anyOf, type lists) grow past "
                                  f"{MAX_CONFIGURATIONS} ways to read one output", "", "anyOf")
            if len(self._steps) >= tuning.MAX_TRANSITIONS:
                self._steps.clear()
            self._steps[key] = nxt
        return nxt

    def walk(self, state: frozenset | None, data: bytes) -> frozenset | None:
        for b in data:
            if state is None:
                return None
            state = self.step(state, b)
        return state

    def complete(self, state: frozenset) -> bool:
        return any(_complete(stack) for stack in state)

    def done(self, state: frozenset) -> bool:
        """Nothing more can be written: every alternative is closed."""
        return all(not stack for stack in state)

    def mask(self, state: frozenset) -> np.ndarray:
        """bool (n_vocab,): the tokens allowed in `state` (cached)."""
        packed = self._masks.get(state)
        if packed is not None:
            return np.unpackbits(packed, count=self.index.n_vocab).view(np.bool_)
        mask = self._allowed(state)
        with self._lock:
            if len(self._masks) >= tuning.MAX_MASKS:
                self._masks.pop(next(iter(self._masks)))
            self._masks[state] = np.packbits(mask)
        return mask

    def plan(self, state: frozenset) -> tuple[float, bytes]:
        """(tokens, bytes): a completion of `state`, the shortest bytes that complete one of
        its stacks (each frame's Node.finish, top first), and the tokens that write them
        (TokenIndex.count_tokens: an upper bound, math.inf when no completion is known)."""
        plan = self._plans.get(state)
        if plan is None:
            plan = (np.inf, b"")
            for stack in state:
                data = self._stack_finish(stack)
                if data is not None:
                    plan = min(plan, (self.index.count_tokens(data), data))
            if len(self._plans) >= tuning.MAX_TRANSITIONS:
                self._plans.clear()
            self._plans[state] = plan
        return plan

    def _stack_finish(self, stack: tuple) -> bytes | None:
        out = b""
        for frame in reversed(stack):
            data = self._finishes.get(frame, self)  # (self: not known yet; None is an answer)
            if data is self:
                data = frame[0].finish(frame[1])
                if len(self._finishes) >= tuning.MAX_TRANSITIONS:
                    self._finishes.clear()
                self._finishes[frame] = data
            if data is None:
                return None
            out += data
        return out

    def needs(self, state: frozenset) -> tuple[np.ndarray, np.ndarray]:
        """(ids, tokens): the tokens `state` allows but end-of-sequence, and how many tokens
        the output needs after each at least (Grammar.plan), cached like masks. One walk of
        the trie without the nodes' shortcuts: paid only where the budget is near."""
        needs = self._needs.get(state)
        if needs is None:
            after: list = []
            ids = self.index.trie_walk(self, state, after)
            needs = (ids, np.array([self.plan(s)[0] for s in after], dtype=np.float64))
            with self._lock:
                if len(self._needs) >= tuning.MAX_MASKS:
                    self._needs.pop(next(iter(self._needs)))
                self._needs[state] = needs
        return needs

    def _allowed(self, state: frozenset) -> np.ndarray:
        """bool (n_vocab,): the tokens this grammar reads in `state`.

        A token is allowed when some stack of the state reads all its bytes: the mask is the
        union of the stacks' own. Those whose node has a shortcut (inside a string, free text)
        take it one by one, the others share one walk of the trie. (One walk for all, when two
        alternatives are inside a string, reads every token byte by byte: 0.5 s for 262k.)"""
        index = self.index
        mask = np.zeros(index.n_vocab, dtype=np.bool_)
        others = []
        token_bytes = index.token_bytes
        for stack in state:
            fast = self._shortcut(stack)
            if fast is None:
                others.append(stack)
                continue
            sure, check = fast  # bool (n_vocab,), int ids
            mask |= sure
            alone = frozenset((stack,))
            for t in check.tolist():
                if not mask[t] and self.walk(alone, token_bytes[t]) is not None:
                    mask[t] = True
        if others:
            mask[index.trie_walk(self, frozenset(others))] = True
        if self.complete(state):
            mask[index.eos_list] = True
        return mask

    def _shortcut(self, stack: tuple):
        """The shortcut of a stack's top node (Node.fast), or None: also when the node may end
        here, as then the next byte may go to the frame below it."""
        if not stack:
            return None
        node, local = stack[-1]
        if len(stack) > 1 and node.accepting(local):
            return None
        return node.fast(local, self.index)


class GrammarConstraint:
    """One generation's position in a grammar: the Constraint protocol of engine/generate.py.

    With a budget (`limit`: the tokens the output may still take), a token is allowed only
    if after it the output can still be completed within the tokens left: a document cut
    by the limit is whole all the same. `plan` is a completion known to fit (the tokens
    that write it, at most `left`): its first token always does, so the budget never
    leaves the model without a token.
    """

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.state = grammar.initial
        self.ended = False  # an end-of-sequence token was accepted
        self.text = bytearray()  # the bytes accepted so far
        self.left: int | None = None  # tokens the output may still take (None: no budget)
        self.plan = b""
        self.squeezed_at: int | None = None  # len(text) when the budget first refused the model's token

    def limit(self, max_tokens: int) -> None:
        """Let the output take at most `max_tokens` more tokens, and end complete within them;
        OutputBudgetTooSmall when even the shortest completion needs more."""
        needed, plan = self.grammar.plan(self.state)
        if needed > max_tokens:
            raise OutputBudgetTooSmall(int(needed) if needed < np.inf else -1, max_tokens)
        self.left, self.plan = max_tokens, plan

    def allows(self, token_id: int) -> bool:
        """Whether the token may come next (the sampler asks it of the token it drew, so a
        refusal for the budget alone is the model cut short: `squeezed_at`)."""
        if self.ended:
            return False
        index = self.grammar.index
        if token_id in index.eos_ids:
            return self.grammar.complete(self.state)
        data = index.token_bytes[token_id]
        after = self.grammar.walk(self.state, data) if data else None
        if after is None:
            return False
        if self.left is not None and self._fit(data, after) is None:
            if self.squeezed_at is None:
                self.squeezed_at = len(self.text)
            return False
        return True

    def _fit(self, data: bytes, after: frozenset) -> bytes | None:
        """A completion of `after` (the state after the token `data`) that fits the tokens
        left after it, or None. The grammar's plan for it first, then the rest of ours."""
        needed, plan = self.grammar.plan(after)
        if needed <= self.left - 1:
            return plan
        if self.plan.startswith(data):
            rest = self.plan[len(data):]
            if self.grammar.index.count_tokens(rest) <= self.left - 1:
                return rest
        return None

    def mask(self) -> np.ndarray:
        """bool (n_vocab,), True = allowed; end-of-sequence only when the value is complete.
        Far from the budget's end (tuning.BUDGET_HORIZON) it may hold a token that the
        budget refuses, one that commits the output to that many more tokens at once: the
        sampler draws again when `allows` says no."""
        grammar = self.grammar
        if self.ended:
            return np.zeros(grammar.index.n_vocab, dtype=np.bool_)
        mask = grammar.mask(self.state)
        if self.left is None or self.left - 1 >= grammar.plan(self.state)[0] + tuning.BUDGET_HORIZON:
            return mask
        ids, needed = grammar.needs(self.state)
        mask[ids[needed > self.left - 1]] = False
        for token_id in grammar.index.ids_of_prefixes(self.plan):  # (the plan's first token at least)
            data = grammar.index.token_bytes[token_id]
            mask[token_id] = self._fit(data, grammar.walk(self.state, data)) is not None
        return mask

    def advance(self, token_id: int) -> None:
        if not self.allows(token_id):
            raise EngineError(f"token {token_id} is not allowed by the constraint here")
        index = self.grammar.index
        if token_id in index.eos_ids:
            self.ended = True
            return
        data = index.token_bytes[token_id]
        after = self.grammar.walk(self.state, data)
        if self.left is not None:
            self.plan = self._fit(data, after)
            self.left -= 1
        self.state = after
        self.text += data

    def complete(self) -> bool:
        return self.ended or self.grammar.complete(self.state)

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order from here, the constraint allows (nothing advances;
        with a budget, those that leave it room to end)."""
        if self.ended:
            return 0
        index, grammar = self.grammar.index, self.grammar
        state, left = self.state, self.left
        for n, token_id in enumerate(tokens):
            if token_id in index.eos_ids:
                return n + 1 if grammar.complete(state) else n
            data = index.token_bytes[token_id]
            state = grammar.walk(state, data) if data else None
            if state is None or left is not None and grammar.plan(state)[0] > left - 1 - n:
                return n
        return len(tokens)

    def is_done(self) -> bool:
        return self.ended or self.grammar.done(self.state)
