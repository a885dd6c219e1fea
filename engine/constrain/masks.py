"""Token masks: which tokens of the vocabulary a recognizer of bytes lets come next.

`TokenIndex` keeps the vocabulary sorted by bytes; a sorted list *is* a trie (the tokens
sharing a prefix are contiguous), so a mask is a walk that only descends into byte
prefixes the recognizer accepts (`trie_walk`). The recognizer is anything with the
methods of `Recognizer`: this module knows no grammar, the grammar builds on it (as
llguidance's token trie walks the `Recognizer` its parser implements). Inside a JSON
string nearly every token is allowed, so there the grammar nodes take a precomputed
mask of "plain" tokens (no quote, backslash or control byte, whole UTF-8 characters)
from here, and only the few other tokens are checked one by one (Node.fast). The
sampler checks the sampled token first with `allows()`, so most steps need no mask at
all. `can_constrain` says whether a vocabulary can be constrained at all.

Next: grammar.py, the nodes; matcher.py's `Grammar` is the recognizer.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
import weakref
from typing import Iterable, Protocol, Sequence

import numpy as np

_NOT_PLAIN = re.compile(rb'[\x00-\x1f"\\]')  # control bytes, quote, backslash


class Recognizer(Protocol):
    """What the trie walk needs of a grammar: states it reads bytes from (None: refused)."""

    def step(self, state, b: int): ...
    def walk(self, state, data: bytes): ...


def _plain_chars(data: bytes) -> int:
    """Characters of `data` if it may appear as-is inside a JSON string, else -1."""
    if _NOT_PLAIN.search(data):
        return -1
    try:
        return len(data.decode("utf-8"))
    except UnicodeDecodeError:
        return -1


class TokenIndex:
    """The token bytes of a vocabulary, sorted (an implicit trie) and classified for masks.

    Tokens with no bytes (control tokens) are never allowed; `eos_ids` are allowed exactly
    when the grammar is complete.
    """

    def __init__(self, token_bytes: Sequence[bytes], eos_ids: Iterable[int]):
        self.token_bytes = list(token_bytes)
        self.n_vocab = len(self.token_bytes)
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.eos_list = sorted(self.eos_ids)
        ids = sorted((i for i, data in enumerate(self.token_bytes) if data and i not in self.eos_ids),
                     key=self.token_bytes.__getitem__)
        self.sorted_ids = np.array(ids, dtype=np.int64)          # (n_real,)
        self.sorted_bytes = [self.token_bytes[i] for i in ids]   # ascending
        self.normal = np.zeros(self.n_vocab, dtype=np.bool_)     # (n_vocab,) tokens with bytes
        self.normal[self.sorted_ids] = True
        # the trie's first level: (first byte, lo, hi) ranges of sorted positions
        self.root = []
        lo, tb = 0, self.sorted_bytes
        while lo < len(tb):
            b = tb[lo][0]
            hi = bisect.bisect_left(tb, bytes((b + 1,)), lo) if b < 255 else len(tb)
            self.root.append((b, lo, hi))
            lo = hi
        # inside a JSON string: plain tokens and their length in characters
        self.nchars = np.full(self.n_vocab, -1, dtype=np.int32)  # (n_vocab,)
        self.nchars[self.sorted_ids] = [_plain_chars(data) for data in self.sorted_bytes]
        self.plain = self.nchars >= 0                            # (n_vocab,)
        self.string_specials = np.flatnonzero(self.normal & ~self.plain)
        # for the output budget: how many tokens some bytes take (count_tokens)
        self.token_set = frozenset(self.sorted_bytes)
        self.longest = max(map(len, self.sorted_bytes), default=0)
        self._without: dict = {}
        self.grammars: dict = {}  # schema key -> its grammar over this vocabulary, bounded
        self._lock = threading.Lock()

    def without_byte(self, byte: int):
        """(tokens without `byte`, ids of tokens containing it): for free-text masks."""
        if byte not in self._without:
            has = np.zeros(self.n_vocab, dtype=np.bool_)
            has[[i for i in self.sorted_ids.tolist() if byte in self.token_bytes[i]]] = True
            self._without[byte] = (self.normal & ~has, np.flatnonzero(has))
        return self._without[byte]

    def count_tokens(self, data: bytes) -> float:
        """The fewest tokens that write `data` (math.inf: none do): at most one per byte where
        each byte is a token (both real vocabularies), so a sound bound on what some bytes
        cost. (The longest token first is not always the fewest.) A pass from the end, each
        point trying the tokens that begin there."""
        fewest = [math.inf] * len(data) + [0]
        for at in range(len(data) - 1, -1, -1):
            for end in range(at + 1, min(len(data), at + self.longest) + 1):
                if fewest[end] + 1 < fewest[at] and data[at:end] in self.token_set:
                    fewest[at] = fewest[end] + 1
        return fewest[0]

    def ids_of_prefixes(self, data: bytes) -> list[int]:
        """The tokens whose bytes begin `data`."""
        ids = []
        for end in range(1, min(len(data), self.longest) + 1):
            at = bisect.bisect_left(self.sorted_bytes, data[:end])
            while at < len(self.sorted_bytes) and self.sorted_bytes[at] == data[:end]:
                ids.append(int(self.sorted_ids[at]))
                at += 1
        return ids

    def trie_walk(self, recognizer: Recognizer, state, states: list | None = None) -> np.ndarray:
        """The ids of the tokens whose bytes `recognizer` reads whole from `state` (and, into
        `states` when given, the state after each, in the same order)."""
        tb = self.sorted_bytes
        hits = []
        todo = []
        for b, lo, hi in self.root:
            s = recognizer.step(state, b)
            if s is not None:
                todo.append((lo, hi, 1, s))
        while todo:
            lo, hi, depth, s = todo.pop()
            while lo < hi and len(tb[lo]) == depth:  # tokens that end here
                hits.append(lo)
                if states is not None:
                    states.append(s)
                lo += 1
            if hi - lo == 1:  # a single token left below: finish it directly
                end = recognizer.walk(s, tb[lo][depth:])
                if end is not None:
                    hits.append(lo)
                    if states is not None:
                        states.append(end)
                continue
            while lo < hi:
                token = tb[lo]
                b = token[depth]
                end = hi if b == 255 else bisect.bisect_left(tb, token[:depth] + bytes((b + 1,)), lo, hi)
                s2 = recognizer.step(s, b)
                if s2 is not None:
                    todo.append((lo, end, depth + 1, s2))
                lo = end
        return self.sorted_ids[hits]

    def grammar(self, key, build):
        """The cached grammar for `key` over this vocabulary, built by `build()` on first
        use (matcher.py's `Grammar.of` asks for its grammars here)."""
        g = self.grammars.get(key)
        if g is None:
            g = build()
            with self._lock:
                if len(self.grammars) >= 32:
                    self.grammars.pop(next(iter(self.grammars)))
                self.grammars[key] = g
        return g

    _of_tokenizer: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
    _of_vocabulary: dict = {}  # (token bytes, eos ids) -> index: a model loaded again reuses it
    _building = threading.Lock()

    @classmethod
    def of(cls, tokenizer) -> TokenIndex:
        """The index of a Tokenizer (built once per vocabulary, about a second for 262k tokens)."""
        with cls._building:
            index = cls._of_tokenizer.get(tokenizer)
            if index is None:
                words = tuple(tokenizer.token_bytes(i) for i in range(tokenizer.n_vocab))
                key = (words, frozenset(tokenizer.eos_ids))
                index = cls._of_vocabulary.get(key)
                if index is None:
                    index = cls(words, tokenizer.eos_ids)
                    if len(cls._of_vocabulary) >= 4:
                        cls._of_vocabulary.pop(next(iter(cls._of_vocabulary)))
                    cls._of_vocabulary[key] = index
                cls._of_tokenizer[tokenizer] = index
        return index


# bytes every document may need as a token of its own: printable ASCII and newline
NEEDED_BYTES = frozenset([0x0A, *range(0x20, 0x7F)])


def can_constrain(tokenizer) -> bool:
    """Can the matcher never be stuck in this vocabulary? True when each printable ASCII byte
    (and newline) is a token by itself, as in byte-level BPE or SentencePiece with byte
    fallback: JSON structure, numbers and escapes are ASCII, and a string can always go on
    or close. (Non-ASCII characters of enum values and keys need their bytes as tokens too;
    both real vocabularies have them.)

    It builds the vocabulary's TokenIndex on the way (once per tokenizer, 0.2 s for 49k
    tokens, 1 s for 262k): called at model load, in a worker thread, so that no request
    pays for it on the server's event loop.
    """
    index = TokenIndex.of(tokenizer)
    single = {b for b, lo, hi in index.root if len(index.sorted_bytes[lo]) == 1}
    return NEEDED_BYTES <= single

