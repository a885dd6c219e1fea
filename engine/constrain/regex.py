"""Regular expressions -> a grammar node for one JSON string (`pattern`, and `format` by formats.py).

The subset read (JSON Schema's patterns are ECMA-262's; jsonschema checks them with Python's
`re`, so what the subset means is what both agree on): literals; escapes \\t \\n \\r \\f \\v \\0
\\xHH \\uHHHH and of any punctuation; classes `[...]` with ranges and `^`; `.`; \\d \\w \\s
(ASCII digits and word characters, the whitespace both engines agree on) and \\D \\S (what
neither engine counts as a digit or a space), \\W (the ASCII characters that are not word
characters); groups `(...)` and `(?:...)`; `|`; `*` `+` `?` `{m}` `{m,}` `{m,n}` (lazy or
not: the same strings); `^` at the start of an alternative of the whole pattern, `$` at its
end. Anything else (lookarounds, backreferences, \\b, named groups, flags, \\p) is a
PatternError, which the compiler refuses as a 400 naming the keyword.

A pattern is compiled to a Thompson NFA over the bytes of the string's JSON text (each
character as raw UTF-8, or escaped where JSON requires it: \\" \\\\ and control characters
as \\n, \\u001b ...), then made deterministic (at most MAX_DFA_STATES states). `Pattern`
reads the DFA with a character count, for minLength and maxLength, and accepts a byte
only when some end is still within reach, so the model never writes itself into a dead end.

Next: formats.py, the formats as patterns; schema.py compiles both to `Pattern`.
"""

from __future__ import annotations

import bisect
import functools
import json
import unicodedata
import weakref
from collections import deque

import numpy as np

from .. import tuning
from .grammar import QUOTE, SET, Node
from .masks import TokenIndex

# Bounds on what one pattern may cost to compile (D9): the NFA grows with the pattern and
# its counted repetitions (`.{0,1000}` is a thousand copies of `.`), the DFA at worst
# exponentially. At the bounds, a pattern compiles in about 0.3 s (0.15 ms a DFA state).
MAX_PATTERN_LENGTH = 1_000   # characters of one pattern
MAX_NFA_STATES = 20_000
MAX_DFA_STATES = 2_000

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # not characters: never in UTF-8, nor in a JSON string we write


class PatternError(ValueError):
    """A pattern outside the subset, or past a bound (`limit` names it, else None)."""

    def __init__(self, message: str, limit: str | None = None):
        super().__init__(message)
        self.limit = limit


# -- sets of code points: sorted, disjoint inclusive ranges -------------------------------------

def _normalize(ranges) -> tuple:
    out: list = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def _complement(ranges) -> tuple:
    out, nxt = [], 0
    for lo, hi in _normalize(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return tuple(out)


def _chars(text: str) -> tuple:
    return _normalize((ord(c), ord(c)) for c in text)


DIGITS = _chars("0123456789")
WORD = _normalize([*DIGITS, (0x41, 0x5A), (0x61, 0x7A), (0x5F, 0x5F)])
# whitespace ECMA-262 and Python agree on (ECMA adds U+FEFF; Python, U+001C-U+001F and U+0085)
SPACES = _normalize([*_chars("\t\n\v\f\r \u00a0\u1680\u2028\u2029\u202f\u205f\u3000"), (0x2000, 0x200A)])
ANY_SPACE = _normalize([*SPACES, (0x1C, 0x1F), (0x85, 0x85), (0xFEFF, 0xFEFF)])
NOT_NEWLINE = _complement(_chars("\n\r\u2028\u2029"))  # `.` (Python's also takes \r, U+2028, U+2029)
ANY = _complement(())


@functools.cache
def _unicode_digits() -> tuple:
    """Every character Python's \\d matches (Unicode's decimal digits; ECMA's are 0-9 only)."""
    return _normalize((c, c) for c in range(MAX_CODE_POINT + 1) if unicodedata.category(chr(c)) == "Nd")


def _class_escape(letter: str, wide: bool) -> tuple:
    """The set of \\d \\w \\s \\D \\W \\S: narrow, what both engines match (in a pattern or a
    class), or wide, what either does (in a negated class, whose complement both then match)."""
    if letter.isupper():
        return _complement(_class_escape(letter.lower(), not wide))
    if letter == "d":
        return _unicode_digits() if wide else DIGITS
    if letter == "w":  # Python's \w takes the letters of every script
        return _normalize([*WORD, (0x80, MAX_CODE_POINT)]) if wide else WORD
    return ANY_SPACE if wide else SPACES


# -- the parser: pattern -> tree of ("set", ranges) ("cat", parts) ("alt", options) ("rep", t, lo, hi)

_ESCAPED = {"t": 9, "n": 10, "r": 13, "f": 12, "v": 11, "0": 0}
_SYNTAX = set("^$\\.*+?()[]{}|/-")


class _Parser:
    def __init__(self, pattern: str):
        self.text, self.i = pattern, 0

    def error(self, what: str) -> PatternError:
        return PatternError(f"{what} (at character {self.i} of the pattern) is not supported")

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.text[j] if j < len(self.text) else ""

    def take(self) -> str:
        c = self.peek()
        self.i += 1
        return c

    def top(self) -> list[tuple[bool, tuple, bool]]:
        """The whole pattern: its alternatives, each (anchored at the start, tree, at the end)."""
        options = []
        while True:
            start = self.peek() == "^"
            if start:
                self.i += 1
            tree = self.sequence(top=True)
            end = self.peek() == "$"
            if end:
                self.i += 1
            options.append((start, tree, end))
            if self.peek() != "|":
                break
            self.i += 1
        if self.i < len(self.text):
            raise self.error(f"{self.peek()!r} here")
        return options

    def alternation(self):
        options = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self, top: bool = False):
        parts = []
        while self.peek() not in ("", "|", ")"):
            if top and self.peek() == "$" and self.peek(1) in ("", "|"):
                break  # the end anchor of an alternative of the whole pattern
            parts.append(self.quantified(self.atom()))
        return ("cat", parts)

    def atom(self):
        c = self.take()
        if c == "(":
            if self.peek() == "?":
                if self.peek(1) != ":":
                    raise self.error("a lookaround, named group or flag '(?'")
                self.i += 2
            tree = self.alternation()
            if self.take() != ")":
                raise self.error("an unclosed group")
            return tree
        if c == "[":
            return ("set", self.klass())
        if c == ".":
            return ("set", NOT_NEWLINE)
        if c == "\\":
            return ("set", self.escape(in_class=False))
        if c in ("^", "$"):
            raise self.error(f"{c!r} away from the ends of the pattern")
        if c in ("*", "+", "?", ")"):
            raise self.error(f"{c!r} with nothing to repeat")
        if c == "{" and self.counts(self.i) is not None:
            raise self.error("'{' with nothing to repeat")
        return ("set", _chars(c))

    def escape(self, in_class: bool, negated: bool = False) -> tuple:
        c = self.take()
        if c in "dwsDWS" and c:
            return _class_escape(c, wide=negated)
        if c in _ESCAPED and c:
            if c == "0" and self.peek().isdigit():
                raise self.error("an octal escape")
            return _chars(chr(_ESCAPED[c]))
        if c == "b" and in_class:
            return _chars("\b")
        if c in ("x", "u"):
            digits = self.text[self.i:self.i + (2 if c == "x" else 4)]
            if len(digits) != (2 if c == "x" else 4) or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"a malformed \\{c} escape")
            self.i += len(digits)
            cp = int(digits, 16)
            if SURROGATES[0] <= cp <= SURROGATES[1]:
                raise self.error("a surrogate escape")
            return ((cp, cp),)
        if c and c in _SYNTAX:
            return _chars(c)
        raise self.error(f"the escape \\{c}" if c else "a trailing backslash")

    def klass(self) -> tuple:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        if self.peek() == "]":
            raise self.error("a class beginning with ']'")  # empty in ECMA-262, ']' in Python
        ranges: list = []
        while self.peek() != "]":
            if not self.peek():
                raise self.error("an unclosed class")
            lo = self.member(negated)
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                hi = self.member(negated)
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1]:
                    raise self.error("a range with a class at an end")
                if lo[0][0] > hi[0][0]:
                    raise self.error("a range out of order")
                ranges.append((lo[0][0], hi[0][0]))
            else:
                ranges.extend(lo)
        self.i += 1
        return _complement(ranges) if negated else _normalize(ranges)

    def member(self, negated: bool) -> tuple:
        c = self.take()
        if c == "\\":
            return self.escape(in_class=True, negated=negated)
        if c == "[" and self.peek() in (":", "=", "."):
            raise self.error("a POSIX class")
        return _chars(c)

    def counts(self, j: int):
        """`{m}`, `{m,}`, `{m,n}` from j (after the '{'): (m, n or None, the index after it),
        or None (then the '{' is a literal)."""
        text = self.text
        k = j
        while k < len(text) and text[k].isdigit():
            k += 1
        if k == j:
            if text[j:j + 1] == ",":
                raise self.error("'{,n}' (a literal in ECMA-262, a count in Python)")
            return None
        lo, hi = int(text[j:k]), None
        if text[k:k + 1] == "}":
            return lo, lo, k + 1
        if text[k:k + 1] != ",":
            return None
        m = k + 1
        while m < len(text) and text[m].isdigit():
            m += 1
        if text[m:m + 1] != "}":
            return None
        hi = int(text[k + 1:m]) if m > k + 1 else None
        return lo, hi, m + 1

    def quantified(self, tree):
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{":
                found = self.counts(self.i + 1)
                if found is None:
                    return tree
                lo, hi, self.i = found
                if hi is not None and lo > hi:
                    raise self.error("a count out of order")
            else:
                return tree
            if self.peek() == "?":  # lazy: the same strings
                self.i += 1
            if self.peek() in ("*", "+", "?") or self.peek() == "{" and self.counts(self.i + 1) is not None:
                raise self.error("a quantifier on a quantifier")
            tree = ("rep", tree, lo, hi)


# -- the NFA over the bytes of the JSON text ------------------------------------------------------

_SHORT = {0x08: b"\\b", 0x09: b"\\t", 0x0A: b"\\n", 0x0C: b"\\f", 0x0D: b"\\r", 0x22: b'\\"', 0x5C: b"\\\\"}


def _utf8_sequences(lo: int, hi: int):
    """The byte-range sequences whose strings are the UTF-8 encodings of [lo, hi] (no surrogates)."""
    for a, b in ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, MAX_CODE_POINT)):
        if lo <= b and hi >= a:
            yield from _split(max(lo, a), min(hi, b))


def _split(lo: int, hi: int):
    n = len(chr(lo).encode())
    for i in range(1, n):
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m:
                yield from _split(lo, lo | m)
                yield from _split((lo | m) + 1, hi)
                return
            if hi & m != m:
                yield from _split(lo, (hi & ~m) - 1)
                yield from _split(hi & ~m, hi)
                return
    yield list(zip(chr(lo).encode(), chr(hi).encode()))


def _encodings(ranges) -> list[list[tuple[int, int]]]:
    """The byte-range sequences of the characters of `ranges` written inside a JSON string:
    raw UTF-8, but \\" \\\\ and control characters escaped (\\n; \\u001b, of hex digits of either case)."""
    out = []
    for lo, hi in ranges:
        for cp in range(lo, min(hi, 0x5C) + 1):
            if cp in _SHORT:
                out.append([(b, b) for b in _SHORT[cp]])
            elif cp < 0x20:
                for text in {"\\u%04x" % cp, "\\u%04X" % cp}:
                    out.append([(b, b) for b in text.encode()])
        for a, b in _without(lo, hi):
            out.extend(_utf8_sequences(a, b))
    return out


def _without(lo: int, hi: int):
    """[lo, hi] less control characters, quote, backslash and surrogates: the characters written raw."""
    for a, b in ((0x20, 0x21), (0x23, 0x5B), (0x5D, SURROGATES[0] - 1), (SURROGATES[1] + 1, MAX_CODE_POINT)):
        if lo <= b and hi >= a:
            yield max(lo, a), min(hi, b)


class _NFA:
    """States are ints; edges[s]: (lo, hi, t) byte ranges; eps[s]: empty moves; inner: the
    states inside a character's bytes (the others are between characters)."""

    def __init__(self):
        self.edges: list[list] = []
        self.eps: list[list] = []
        self.inner: set = set()

    def new(self) -> int:
        if len(self.edges) >= MAX_NFA_STATES:
            raise PatternError(f"the pattern compiles to more than {MAX_NFA_STATES:,} NFA states (MAX_NFA_STATES)", "MAX_NFA_STATES")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def build(self, tree) -> tuple[int, int]:
        """(start, end) of a fragment for `tree`."""
        kind = tree[0]
        start = self.new()
        if kind == "set":
            end = self.new()
            # UTF-8 sequences share their ends ([80-BF] to the end), escapes their beginnings (\\u00)
            tails, heads = {(): end}, {(): start}
            for seq in _encodings(tree[1]):
                if seq[0] == (0x5C, 0x5C):
                    self.head(tuple(seq), heads, end)
                else:
                    self.edges[start].append((*seq[0], self.tail(tuple(seq[1:]), tails)))
            return start, end
        if kind == "cat":
            at = start
            for part in tree[1]:
                s, e = self.build(part)
                self.eps[at].append(s)
                at = e
            return start, at
        if kind == "alt":
            end = self.new()
            for option in tree[1]:
                s, e = self.build(option)
                self.eps[start].append(s)
                self.eps[e].append(end)
            return start, end
        _, child, lo, hi = tree
        at = start
        for _ in range(lo):
            s, e = self.build(child)
            self.eps[at].append(s)
            at = e
        end = self.new()
        self.eps[at].append(end)
        if hi is None:  # a loop: child, then back
            s, e = self.build(child)
            self.eps[at].append(s)
            self.eps[e].append(at)
        else:
            for _ in range(hi - lo):
                s, e = self.build(child)
                self.eps[at].append(s)
                self.eps[e].append(end)
                at = e
        return start, end

    def head(self, seq: tuple, heads: dict, end: int) -> None:
        """The byte ranges `seq` from the start to the end, through the states of the
        sequences that begin alike."""
        for k in range(1, len(seq)):
            if seq[:k] not in heads:
                heads[seq[:k]] = self.new()
                self.inner.add(heads[seq[:k]])
                self.edges[heads[seq[:k - 1]]].append((*seq[k - 1], heads[seq[:k]]))
        self.edges[heads[seq[:-1]]].append((*seq[-1], end))

    def tail(self, seq: tuple, tails: dict) -> int:
        """The state inside a character from which the byte ranges `seq` lead to the end."""
        at = tails.get(seq)
        if at is None:
            at = tails[seq] = self.new()
            self.inner.add(at)
            self.edges[at].append((*seq[0], self.tail(seq[1:], tails)))
        return at

    def closure(self, states) -> frozenset:
        seen, todo = set(states), list(states)
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)


# -- the DFA --------------------------------------------------------------------------------------

class DFA:
    """A deterministic automaton over the bytes of a JSON string's content, trimmed to the
    states from which an end is reachable (so a refused byte is the only dead end).

    `next[s][classes[b]]`: the state after byte b (-1: refused); `accepting[s]`; `between[s]`:
    s is between two characters (not inside one's bytes); `dist[s]`: the fewest characters
    still to begin before an end; `plain_dists`: where the plain tokens lead, for masks.
    `empty`: no string matches (then there are no states)."""

    def __init__(self, nfa: _NFA, start: int, end: int):
        cuts = sorted({0, 256} | {x for edges in nfa.edges for lo, hi, _ in edges for x in (lo, hi + 1)})
        self.classes = bytes(bisect.bisect_right(cuts, b) - 1 for b in range(256))
        reps = cuts[:-1]  # a byte of each class: the bytes of a class go alike from every state
        classes = self.classes
        sets = [nfa.closure([start])]
        ids = {sets[0]: 0}
        closures: dict = {}  # the NFA states a byte leads to -> their closure
        table = []
        for k in range(MAX_DFA_STATES + 1):
            if k == len(sets):
                break
            if k == MAX_DFA_STATES:
                raise PatternError(f"the pattern compiles to more than {MAX_DFA_STATES:,} DFA states (MAX_DFA_STATES)",
                                   "MAX_DFA_STATES")
            targets: list[set] = [set() for _ in reps]  # by byte class
            for s in sets[k]:
                for lo, hi, t in nfa.edges[s]:
                    for c in range(classes[lo], classes[hi] + 1):
                        targets[c].add(t)
            row = []
            for found in targets:
                if not found:
                    row.append(-1)
                    continue
                key = frozenset(found)
                nxt = closures.get(key)
                if nxt is None:
                    nxt = closures[key] = nfa.closure(found)
                if nxt not in ids:
                    ids[nxt] = len(sets)
                    sets.append(nxt)
                row.append(ids[nxt])
            table.append(row)
        accepting = [end in s for s in sets]
        between = [not (s & nfa.inner) for s in sets]
        self._trim(table, accepting, between)

    def _trim(self, table, accepting, between):
        """Keep the states an end is reachable from (renumbered, start first); dist of each."""
        n = len(table)
        back: list[list] = [[] for _ in range(n)]
        for s, row in enumerate(table):
            for t in set(row) - {-1}:
                back[t].append(s)
        dist = [None] * n  # 0-1 BFS backwards: an edge out of a state between characters begins one
        todo = deque()
        for s in range(n):
            if accepting[s]:
                dist[s] = 0
                todo.append(s)
        while todo:
            t = todo.popleft()
            for s in back[t]:
                d = dist[t] + (1 if between[s] else 0)
                if dist[s] is None or d < dist[s]:
                    dist[s] = d
                    (todo.appendleft if d == dist[t] else todo.append)(s)
        if dist[0] is None:
            self.empty = True
            return
        self.empty = False
        keep = [s for s in range(n) if dist[s] is not None]
        new = {s: i for i, s in enumerate(keep)}
        self.next = [[new.get(t, -1) for t in table[s]] for s in keep]
        self.accepting = [accepting[s] for s in keep]
        self.between = [between[s] for s in keep]
        self.dist = [dist[s] for s in keep]
        self._table = None  # numpy's copies, made by the first plain_dists
        self._narrow: dict = {}

    def step(self, s: int, b: int) -> int:
        return self.next[s][self.classes[b]]

    def narrow(self, s: int) -> bool:
        """Do few bytes begin a character from s (at most NARROW)? Then a trie walk, which only
        descends into those, is quicker than reading every plain token (cached)."""
        found = self._narrow.get(s)
        if found is None:
            row, classes = self.next[s], self.classes
            found = self._narrow[s] = sum(row[classes[b]] >= 0 for b in range(0x20, 0xF5)) <= NARROW
        return found

    def plain_dists(self, s: int, plain: _PlainTokens) -> np.ndarray:
        """int16 (n_plain,): for each of an index's plain tokens, the dist of the state it
        leads to from state s (UNREACHABLE: it is refused). Every token read at once, a
        byte position at a time (cached: the masks of a state at any count share it)."""
        key = (self, plain, s)
        found = _WALKS.get(key)
        if found is None:
            if self._table is None:  # (numpy's copy of the table: the dead state last, its own way out)
                dead = len(self.next)
                self._table = np.array([[dead if t < 0 else t for t in row] for row in self.next]
                                       + [[dead] * len(self.next[0])], dtype=np.int16)
                self._dists = np.array(self.dist + [UNREACHABLE], dtype=np.int16)
                self._classes = np.frombuffer(self.classes, dtype=np.uint8)
            dead = len(self.next)
            state = np.full(len(plain.ids), s, dtype=np.int16)
            rows = np.arange(len(plain.ids))  # those still reading, alive: fewer at each byte
            for column in plain.columns:  # the tokens with a k-th byte come first
                rows = rows[rows < len(column)]
                state[rows] = self._table[state[rows], self._classes[column[rows]]]
                rows = rows[state[rows] != dead]
                if not len(rows):
                    break
            found = self._dists[state]
            if len(_WALKS) >= tuning.MAX_PATTERN_WALKS:
                _WALKS.pop(next(iter(_WALKS)), None)
            _WALKS[key] = found
        return found


# bytes that may begin a character, at most, for a mask to walk the trie (digits, signs, hex
# digits: 1-2 ms a mask for SmolLM2), not read every plain token (2-4 ms; an e-mail
# address's local part took 20 ms by the trie)
NARROW = 24
UNREACHABLE = np.iinfo(np.int16).max  # the dist of the dead state (DFA states are far fewer)
_WALKS: dict = {}  # (DFA, plain tokens, state) -> DFA.plain_dists, the oldest evicted first


class _PlainTokens:
    """An index's plain tokens (TokenIndex.plain: what may be written raw inside a string),
    longest first, and their bytes by position: columns[k] holds the k-th byte of each
    token that has one (they are a prefix of the tokens, so a walk shortens as it goes)."""

    def __init__(self, index: TokenIndex):
        ids = np.flatnonzero(index.plain)
        lengths = np.array([len(index.token_bytes[i]) for i in ids.tolist()], dtype=np.int64)
        order = np.argsort(-lengths, kind="stable")
        self.ids, lengths = ids[order], lengths[order]
        self.nchars = index.nchars[self.ids]
        data = [index.token_bytes[i] for i in self.ids.tolist()]
        width = int(lengths[0]) if len(data) else 0
        self.columns = [np.frombuffer(bytes(token[k] for token in data[:int(np.count_nonzero(lengths > k))]),
                                      dtype=np.uint8) for k in range(width)]


_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # TokenIndex -> its _PlainTokens


def _plain_tokens(index: TokenIndex) -> _PlainTokens:
    found = _PLAIN.get(index)
    if found is None:
        found = _PLAIN[index] = _PlainTokens(index)
    return found


@functools.lru_cache(maxsize=64)  # formats, and a client's patterns, recur in request after request
def compile_regex(pattern: str, search: bool = True) -> DFA:
    """The DFA of the strings `pattern` matches. search: as JSON Schema's `pattern` reads it,
    anywhere in the string unless anchored (`^`, `$`); else (formats) the whole string."""
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise PatternError(f"a pattern of more than {MAX_PATTERN_LENGTH:,} characters (MAX_PATTERN_LENGTH) is not supported",
                           "MAX_PATTERN_LENGTH")
    options = []
    anything = ("rep", ("set", ANY), 0, None)
    for start, tree, end in _Parser(pattern).top():
        if not search:
            start = end = True
        options.append(("cat", [*([] if start else [anything]), tree, *([] if end else [anything])]))
    nfa = _NFA()
    begin, finish = nfa.build(("alt", options))
    return DFA(nfa, begin, finish)


class Pattern(Node):
    """A JSON string whose characters a DFA reads to an end, of min_len to max_len characters.

    Locals: (0,) before the quote; (1, s, n) DFA state s, n characters begun (capped at
    min_len without max_len, so that states repeat and masks are reused); (5,) closed.
    A byte is taken only when, after it, an end is within the length bounds (_live)."""

    start = (0,)

    def __init__(self, dfa: DFA, min_len: int = 0, max_len: int | None = None):
        self.dfa, self.min_len, self.max_len = dfa, min_len, max_len
        self._lives: dict = {}

    def satisfiable(self) -> bool:
        return not self.dfa.empty and self._live(0, 0)

    def _count(self, s: int, n: int) -> int:
        if not self.dfa.between[s]:
            return n
        n += 1
        return n if self.max_len is not None else min(n, self.min_len)

    def _live(self, s: int, n: int) -> bool:
        """Can the string end within the bounds from state s, n characters begun?"""
        dist = self.dfa.dist[s]
        if self.max_len is not None and n + dist > self.max_len:
            return False
        if n + dist >= self.min_len:
            return True  # the shortest way to an end is long enough
        found = self._lives.get((s, n))
        if found is None:
            found = self._search(s, n)
        return found

    def _search(self, s: int, n: int) -> bool:
        """A breadth-first search for an end of at least min_len characters (and at most
        max_len) from (s, n); when there is none, none is from any pair it visited either."""
        dfa, seen, todo = self.dfa, {(s, n)}, deque([(s, n)])
        while todo:
            at, k = todo.popleft()
            if dfa.accepting[at] and k >= self.min_len or self._lives.get((at, k)):
                self._lives[(s, n)] = True
                return True
            for t in set(dfa.next[at]) - {-1}:
                pair = (t, self._count(at, k))
                if pair not in seen and (self.max_len is None or pair[1] + dfa.dist[t] <= self.max_len):
                    seen.add(pair)
                    todo.append(pair)
        for pair in seen:
            self._lives[pair] = False
        return False

    def step(self, local, b):
        phase = local[0]
        if phase == 1:
            _, s, n = local
            if b == QUOTE and self.dfa.between[s]:
                return ((SET, (5,)),) if self.dfa.accepting[s] and n >= self.min_len else ()
            t = self.dfa.step(s, b)
            if t < 0:
                return ()
            n = self._count(s, n)
            return ((SET, (1, t, n)),) if self._live(t, n) else ()
        if phase == 0:
            return ((SET, (1, 0, 0)),) if b == QUOTE else ()
        return ()

    def accepting(self, local):
        return local[0] == 5

    def final(self, local):
        return local[0] == 5

    def fast(self, local, index: TokenIndex):
        """Between characters, where many bytes may come (not DFA.narrow): the plain tokens
        the DFA reads to a state an end is reachable from within the bounds are surely
        allowed (those _live would have to search for, and the other tokens, checked byte by byte)."""
        if local[0] != 1 or not self.dfa.between[local[1]] or self.dfa.narrow(local[1]):
            return None
        _, s, n = local
        plain = _plain_tokens(index)
        dists = self.dfa.plain_dists(s, plain)
        begun = n + plain.nchars  # (n_plain,) characters begun after each token
        if self.max_len is None:
            begun = np.minimum(begun, self.min_len)
        ends = begun + dists      # the fewest characters at an end after each token
        alive = dists != UNREACHABLE
        if self.max_len is not None:
            alive &= ends <= self.max_len
        sure = alive & (ends >= self.min_len)
        mask = np.zeros(index.n_vocab, dtype=np.bool_)
        mask[plain.ids[sure]] = True
        return mask, np.concatenate([index.string_specials, plain.ids[alive & ~sure]])


def matches(dfa: DFA, text: str) -> bool:
    """Does the string `text` match? (its JSON text read as the model would write it)"""
    if dfa.empty:
        return False
    s = 0
    for b in json.dumps(text, ensure_ascii=False)[1:-1].encode():
        s = dfa.step(s, b)
        if s < 0:
            return False
    return dfa.accepting[s]
