"""Grammar nodes: what a JSON document (or a tool call) may be, one byte at a time.

A node reads one byte at a time from an immutable local state and answers with actions:
keep reading (SET), or start a child value (PUSH: the byte goes to the child; ENTER: the
child starts with the next byte). The matcher (matcher.py) keeps the stacks of frames
`(node, local)` these actions build. Also here: what a node's documents are made of, and
how deep they must nest (Node.height), which the matcher and the compiler both read; and
how a value can end: the shortest bytes that complete a node from a local (Node.finish)
and a node's shortest document (`document`), which the matcher's output budget counts.
A new node gets Node.finish from its actions (a bounded search); it overrides it when
its locals are many (a number's digits) or costly to step.

Next: matcher.py, which reads these nodes byte by byte.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import json
import math
from fractions import Fraction
from typing import Iterable, Sequence

from ..errors import SchemaError
from .masks import TokenIndex

# Actions a node returns from step(local, byte):
SET = 0    # (SET, local): the byte is consumed, the frame moves to `local`
PUSH = 1   # (PUSH, local, child): the frame resumes at `local` after `child`; the byte goes to child
ENTER = 2  # (ENTER, local, child): the byte is consumed, then `child` starts with the next byte

MAX_INT_DIGITS = 15    # integer part of an unbounded number
MAX_FRAC_DIGITS = 6    # fraction digits of a "number" (unless its bounds need more)
# digits of a number with a fraction, in all. Decimals of at most 15 significant digits
# map one to one, and in order, onto 64-bit floats (which JSON readers parse numbers
# into), so comparing one with a bound gives the answer the reader's float gives. Past
# it, 100000000000.000001 reads as 1e11, which an exclusiveMinimum of 1e11 refuses.
MAX_SIGNIFICANT = 15
MAX_ANY_DEPTH = 6      # nesting depth of schema-less ("any") values

SPACE, QUOTE, BACKSLASH, COMMA, COLON = 0x20, 0x22, 0x5C, 0x2C, 0x3A


class Node:
    """A grammar node. `start` is its initial local state; locals are small tuples/bytes/ints."""

    start: object = 0
    nullable = False  # matches the empty string
    # the fewest frames a document of it needs on the stack, its own included (math.inf:
    # none is finite). Set by set_heights for the nodes a grammar reaches; nodes made while
    # decoding (values of schema-less values) need one frame, their parts being optional.
    height: float = 1

    def expand(self) -> list[tuple[Node, object]]:
        """The frames that begin a value of this node (several for alternatives)."""
        return [(self, self.start)]

    def step(self, local, b: int) -> Sequence[tuple]:
        """The frames after reading byte `b` in state `local` (none: the byte is refused).

        Nodes that only `expand` into other nodes (alternatives, references) are
        never stepped themselves.
        """
        raise TypeError(f"{type(self).__name__} expands into other nodes and is never stepped")

    def accepting(self, local) -> bool:
        """The bytes read so far form a complete value (it may still go on)."""
        return False

    def final(self, local) -> bool:
        """Complete and nothing can follow: the frame is popped at once."""
        return False

    def fast(self, local, index: TokenIndex):
        """Optional shortcut for masks: (bool (n_vocab,) surely allowed, ids to check) or None."""
        return None

    def finish(self, local) -> bytes | None:
        """The shortest bytes that complete a value of this node from `local` (b"" when it is
        accepting; None: no finite completion), which the output budget reads (matcher.py).
        Default: a search over the node's own actions, a child costing its shortest
        document (`document`); nodes whose locals are many or costly to step override it."""
        return search_finish(self, local)


class Literal(Node):
    """One of a fixed set of byte strings: const, enum, true/false/null, tags of tool calls.

    Local: (lo, hi, n): the options sorted[lo:hi] are those that begin with the n bytes
    read so far (sorted, they are contiguous, and the one that is only those bytes comes
    first). Not the bytes themselves: a set of every prefix of every option cost n^2
    memory, 400 MB for a const string of 20,000 characters (a 60 kB request body).
    """

    def __init__(self, options: Iterable[bytes]):
        self.options = frozenset(options)
        if not self.options:
            raise SchemaError("an empty set of allowed values admits no document")
        self.sorted = sorted(self.options)
        self.start = (0, len(self.sorted), 0)
        self.nullable = b"" in self.options

    def step(self, local, b):
        lo, hi, n = local
        byte = bytes((b,))
        key = lambda option: option[n:n + 1]  # b"" for the option that ends here: first
        lo = bisect.bisect_left(self.sorted, byte, lo, hi, key=key)
        hi = bisect.bisect_right(self.sorted, byte, lo, hi, key=key)
        return ((SET, (lo, hi, n + 1)),) if lo < hi else ()

    def accepting(self, local):
        lo, _, n = local
        return len(self.sorted[lo]) == n

    def final(self, local):
        lo, hi, n = local
        return hi - lo == 1 and len(self.sorted[lo]) == n

    def finish(self, local):
        lo, hi, n = local
        return min(self.sorted[lo:hi], key=_shortest_first)[n:]


def _utf8_lead(b: int):
    """(continuation bytes needed, allowed range of the next byte) for a UTF-8 lead byte."""
    if 0xC2 <= b <= 0xDF:
        return 1, 0x80, 0xBF
    if b == 0xE0:
        return 2, 0xA0, 0xBF
    if b == 0xED:  # no UTF-16 surrogates
        return 2, 0x80, 0x9F
    if 0xE1 <= b <= 0xEF:
        return 2, 0x80, 0xBF
    if b == 0xF0:
        return 3, 0x90, 0xBF
    if 0xF1 <= b <= 0xF3:
        return 3, 0x80, 0xBF
    if b == 0xF4:
        return 3, 0x80, 0x8F
    return None


_ESCAPES = frozenset(b'"\\/bfnrt')
_HEX = frozenset(b"0123456789abcdefABCDEF")


class String(Node):
    """A JSON string of valid UTF-8 with min/max length in characters.

    Locals: (0,) before the quote; (1, n) in content, n characters so far; (2, n) after a
    backslash; (3, n, k, d) in a \\u escape (four hex digits) with k of them read (d: first one was 'd',
    so no surrogate); (4, n, need, lo, hi) inside a multi-byte character; (5,) closed.
    Without maxLength, n is capped at minLength so that states repeat and masks are reused.
    """

    start = (0,)

    def __init__(self, min_len: int = 0, max_len: int | None = None):
        self.min_len, self.max_len = min_len, max_len

    def _count(self, n):
        n += 1
        return n if self.max_len is not None else min(n, self.min_len)

    def _room(self, n):
        return self.max_len is None or n < self.max_len

    def step(self, local, b):
        phase = local[0]
        if phase == 1:
            n = local[1]
            if b == QUOTE:
                return ((SET, (5,)),) if n >= self.min_len else ()
            if not self._room(n) or b < 0x20:
                return ()
            if b == BACKSLASH:
                return ((SET, (2, self._count(n))),)
            if b < 0x80:
                return ((SET, (1, self._count(n))),)
            lead = _utf8_lead(b)
            return ((SET, (4, self._count(n)) + lead),) if lead else ()
        if phase == 0:
            return ((SET, (1, 0)),) if b == QUOTE else ()
        if phase == 4:
            _, n, need, lo, hi = local
            if not lo <= b <= hi:
                return ()
            return ((SET, (1, n) if need == 1 else (4, n, need - 1, 0x80, 0xBF)),)
        if phase == 2:
            if b in _ESCAPES:
                return ((SET, (1, local[1])),)
            return ((SET, (3, local[1], 0, False)),) if b == ord("u") else ()
        if phase == 3:
            _, n, k, d = local
            if b not in _HEX or (k == 1 and d and b not in b"01234567"):
                return ()
            return ((SET, (1, n) if k == 3 else (3, n, k + 1, k == 0 and b in b"dD")),)
        return ()

    def accepting(self, local):
        return local[0] == 5

    def final(self, local):
        return local[0] == 5

    def finish(self, local):
        phase = local[0]
        if phase == 5:
            return b""
        if phase == 0:
            return b'"' + b" " * self.min_len + b'"'
        n = local[1]
        rest = b" " * max(0, self.min_len - n) + b'"'  # (a space: the smallest byte a string may hold)
        if phase == 2:
            return b'"' + rest  # the escape \" (its character is counted)
        if phase == 3:
            return b"0" * (4 - local[2]) + rest
        if phase == 4:
            _, _, need, lo, _ = local
            return bytes((lo,)) + b"\x80" * (need - 1) + rest
        return rest

    def fast(self, local, index):
        if local[0] != 1:
            return None
        if self.max_len is None:
            return index.plain, index.string_specials
        # plain tokens that still fit, every other token checked byte by byte
        return index.plain & (index.nchars <= self.max_len - local[1]), index.string_specials


@functools.cache
def _digit_grid(frac_digits: int, int_digits: int) -> tuple[tuple[int, ...], tuple[Fraction, ...]]:
    """By integer digits (0 for "0"): the fraction digits a Number allows, and the step between
    its values. Shared: a schema may hold thousands of numbers, each paid 0.1 ms for its own."""
    limits = tuple(max(0, min(frac_digits, MAX_SIGNIFICANT - n)) for n in range(int_digits + 1))
    return limits, tuple(Fraction(1, 10 ** f) for f in limits)


class Number(Node):
    """A JSON integer or number (no exponent) within inclusive bounds, of bounded length.

    Locals: (negative, integer digits, fraction digits or None before a '.'). A byte is only
    accepted when some completion of the new prefix still lies within [lo, hi], so the model
    can never write itself into a dead end. A fraction has at most frac_digits digits
    (MAX_FRAC_DIGITS, more for bounds that need them), and a number with one at most
    MAX_SIGNIFICANT digits in all (fewer fraction digits for a longer integer part), so
    that the float a reader parses meets the bounds as the decimal does (MAX_SIGNIFICANT).
    """

    start = (False, "", None)

    def __init__(self, integer: bool, lo: Fraction | None = None, hi: Fraction | None = None,
                 frac_digits: int = MAX_FRAC_DIGITS, multiple: int = 1):
        self.integer, self.lo, self.hi = integer, lo, hi
        self.multiple = multiple  # an integer's multipleOf (the integers of a range hold one if
        # ceil(a / m) * m <= b: the same test as for a unit)
        self.frac_digits = 0 if integer else frac_digits
        self.int_digits = MAX_INT_DIGITS
        if lo is not None and hi is not None:  # fewer when the bounds are closer to 0, never more
            self.int_digits = max(1, min(MAX_INT_DIGITS, len(str(math.floor(max(abs(lo), abs(hi)))))))
        self._frac_limits, self._units = _digit_grid(self.frac_digits, self.int_digits)
        self._final: dict = {}

    def _frac_limit(self, ip: str) -> int:
        """Fraction digits a number whose integer part is ip may have (MAX_SIGNIFICANT in all)."""
        return self._frac_limits[0 if ip in ("", "0") else len(ip)]

    def _ranges(self, ip: str, fp: str | None):
        """(low, high, unit): the magnitudes the completions of this prefix may have,
        inclusive, multiples of unit (one range per length the integer part may reach)."""
        units, top = self._units, self.int_digits
        if ip == "" or (ip == "0" and fp is None):
            yield Fraction(0), 1 - units[0], units[0]
            if ip == "":
                for n in range(1, top + 1):
                    yield Fraction(10 ** (n - 1)), Fraction(10 ** n) - units[n], units[n]
        elif fp is None:  # the integer part may still grow, to n digits
            v = int(ip)
            for n in range(len(ip), top + 1):
                scale = 10 ** (n - len(ip))
                yield Fraction(v * scale), Fraction((v + 1) * scale) - units[n], units[n]
        else:
            n = 0 if ip == "0" else len(ip)
            base = int(ip) + Fraction(int(fp or "0"), 10 ** len(fp))
            width = 0 if len(fp) == self._frac_limits[n] else Fraction(1, 10 ** len(fp)) - units[n]
            yield base, base + width, units[n]

    def _feasible(self, neg: bool, ip: str, fp: str | None) -> bool:
        """Does some completion of this prefix lie within [lo, hi] (a multiple, for an integer)?"""
        if self.lo is None and self.hi is None and self.multiple == 1:
            return True
        for a, b, unit in self._ranges(ip, fp):
            if neg:
                a, b = -b, -a
                if self.integer:  # "-0" is not written
                    b = min(b, Fraction(-1))
            if self.lo is not None:
                a = max(a, self.lo)
            if self.hi is not None:
                b = min(b, self.hi)
            if self.integer:
                unit = self.multiple
            if math.ceil(a / unit) * unit <= b:
                return True
        return False

    def step(self, local, b):
        neg, ip, fp = local
        if 0x30 <= b <= 0x39:
            d = chr(b)
            if fp is None:
                if ip == "0" or len(ip) >= self.int_digits or (neg and self.integer and ip == "" and d == "0"):
                    return ()
                new = (neg, ip + d, None)
            else:
                if len(fp) >= self._frac_limit(ip):
                    return ()
                new = (neg, ip, fp + d)
        elif b == 0x2D and local == self.start:  # '-'
            new = (True, "", None)
        elif b == 0x2E and ip and fp is None and self._frac_limit(ip):  # '.'
            new = (neg, ip, "")
        else:
            return ()
        return ((SET, new),) if self._feasible(*new) else ()

    def accepting(self, local):
        neg, ip, fp = local
        if ip == "" or fp == "":
            return False
        value = int(ip) + (Fraction(int(fp), 10 ** len(fp)) if fp else 0)
        value = -value if neg else value
        return ((self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)
                and (self.multiple == 1 or value % self.multiple == 0))

    def final(self, local):
        done = self._final.get(local)
        if done is None:
            done = self.accepting(local) and not any(self.step(local, b) for b in b"0123456789.")
            self._final[local] = done
        return done

    def finish(self, local):
        """Not the shortest always, but short and sound: a byte at a time, one that ends the
        number if there is one, else the first the bounds allow (no prefix the step accepts
        is a dead end, see the class docstring). A search would try 10^k prefixes for k digits."""
        out = bytearray()
        while not self.accepting(local):
            nexts = [(b, actions[0][1]) for b in b"0123456789.-" if (actions := self.step(local, b))]
            if not nexts:
                return None
            b, local = next(((b, at) for b, at in nexts if self.accepting(at)), nexts[0])
            out.append(b)
        return bytes(out)


class Array(Node):
    """`[item, item, ...]` with minItems/maxItems. Locals: (0,) (1,) first item or ']',
    (2, n) after n items, (3, n, spaced) after a comma, (5,) closed."""

    start = (0,)

    def __init__(self, items: Node, min_items: int = 0, max_items: int | None = None):
        self.items, self.min_items, self.max_items = items, min_items, max_items

    def step(self, local, b):
        phase = local[0]
        if phase == 0:
            return ((SET, (1,)),) if b == 0x5B else ()
        if phase == 1:
            if b == 0x5D:
                return ((SET, (5,)),) if self.min_items == 0 else ()
            return ((PUSH, (2, 1), self.items),) if self.max_items != 0 else ()
        if phase == 2:
            n = local[1]
            if b == COMMA and (self.max_items is None or n < self.max_items):
                return ((SET, (3, n, False)),)
            if b == 0x5D and n >= self.min_items:
                return ((SET, (5,)),)
            return ()
        if phase == 3:
            _, n, spaced = local
            if b == SPACE:
                return () if spaced else ((SET, (3, n, True)),)
            return ((PUSH, (2, n + 1), self.items),)
        return ()

    def accepting(self, local):
        return local[0] == 5

    final = accepting

    def finish(self, local):
        phase = local[0]
        if phase == 5:
            return b""
        if phase == 0:
            return _join(b"[", self.finish((1,)))
        item = document(self.items)
        if phase == 1:
            return b"]" if self.min_items == 0 else _join(item, self.finish((2, 1)))
        n = local[1] + (phase == 3)  # (after a comma, an item must come: then the items after it)
        missing = max(0, self.min_items - n)
        if not missing:
            rest = b"]"
        else:
            rest = None if item is None else (b"," + item) * missing + b"]"
        return _join(item, rest) if phase == 3 else rest


class Object(Node):
    """An object with declared properties, written in schema order; optional ones may be skipped.

    Locals: (0,) before '{'; (1, i, prefix, spaced, first) reading a key, the next candidate
    property being i; (2, j) after key j; (3, j, spaced) before value j; (4, j) after value j;
    (5,) closed.
    """

    start = (0,)

    def __init__(self, names: Sequence[str], values: Sequence[Node], required: Iterable[str] = ()):
        required = set(required)
        n = len(names)
        self.keys = [json.dumps(name, ensure_ascii=False).encode() for name in names]
        self.values = list(values)
        self.n = n
        self.required_values = [v for name, v in zip(names, self.values) if name in required]
        # last[i]: the last property that may come next when i is the first not yet passed
        # (the first required one from i on); can_close[i]: none required from i on. (A list
        # of the candidates for each i took n^2 memory: 2.8 MB for 256 properties.)
        self.last, self.can_close = [n - 1] * (n + 1), [True] * (n + 1)
        for i in range(n - 1, -1, -1):
            self.last[i] = i if names[i] in required else self.last[i + 1]
            self.can_close[i] = self.can_close[i + 1] and names[i] not in required

    def step(self, local, b):
        phase = local[0]
        if phase == 1:
            _, i, prefix, spaced, first = local
            if not prefix:
                if b == 0x7D:
                    return ((SET, (5,)),) if first and self.can_close[i] else ()
                if b == SPACE:
                    return () if first or spaced else ((SET, (1, i, b"", True, first)),)
            nxt = prefix + bytes((b,))
            for j in range(i, self.last[i] + 1):
                key = self.keys[j]
                if key == nxt:  # keys end with a quote: none is a prefix of another
                    return ((SET, (2, j)),)
                if key.startswith(nxt):
                    return ((SET, (1, i, nxt, spaced, first)),)
            return ()
        if phase == 3:
            _, j, spaced = local
            if b == SPACE:
                return () if spaced else ((SET, (3, j, True)),)
            return ((PUSH, (4, j), self.values[j]),)
        if phase == 4:
            j = local[1]
            if b == COMMA and j + 1 < self.n:
                return ((SET, (1, j + 1, b"", False, False)),)
            if b == 0x7D and self.can_close[j + 1]:
                return ((SET, (5,)),)
            return ()
        if phase == 2:
            return ((SET, (3, local[1], False)),) if b == COLON else ()
        if phase == 0:
            return ((SET, (1, 0, b"", False, True)),) if b == 0x7B else ()
        return ()

    def accepting(self, local):
        return local[0] == 5

    final = accepting

    def finish(self, local):
        phase = local[0]
        if phase == 5:
            return b""
        if phase == 0:
            return _join(b"{", self._keys_from(0, b"", True))
        if phase == 1:
            _, i, prefix, _, first = local
            return self._keys_from(i, prefix, first)
        j = local[1]
        after = self._tails()[j]
        if phase == 4:
            return after
        value = _join(document(self.values[j]), after)
        return _join(b":", value) if phase == 2 else value

    def _keys_from(self, i: int, prefix: bytes, first: bool) -> bytes | None:
        """The shortest rest of an object whose next key, from property i on, begins with prefix."""
        if not prefix and first and self.can_close[i]:
            return b"}"
        tails = self._tails()
        options = (_join(self.keys[j][len(prefix):] + b":", _join(document(self.values[j]), tails[j]))
                   for j in range(i, self.last[i] + 1) if self.keys[j].startswith(prefix))
        return min((o for o in options if o is not None), key=_shortest_first, default=None)

    def _tails(self) -> list:
        """tails[j]: the shortest rest after value j (from the last property back: a chain of
        required properties, called recursively, would be as deep as it is long)."""
        tails = [None] * self.n
        for j in range(self.n - 1, -1, -1):
            if self.can_close[j + 1]:
                tails[j] = b"}"
                continue
            options = (_join(self.keys[k] + b":", _join(document(self.values[k]), tails[k]))
                       for k in range(j + 1, self.last[j + 1] + 1))
            best = min((o for o in options if o is not None), key=_shortest_first, default=None)
            tails[j] = _join(b",", best)
        return tails


class FreeObject(Node):
    """An object without declared properties: any string keys, values of one schema.

    Locals: (0,) (1, first, spaced) before a key, (2,) after a key, (3, spaced) before a value,
    (4,) after a value, (5,) closed."""

    start = (0,)
    key = String()

    def __init__(self, values: Node):
        self.values = values

    def step(self, local, b):
        phase = local[0]
        if phase == 0:
            return ((SET, (1, True, False)),) if b == 0x7B else ()
        if phase == 1:
            _, first, spaced = local
            if b == 0x7D:
                return ((SET, (5,)),) if first else ()
            if b == SPACE:
                return () if first or spaced else ((SET, (1, first, True)),)
            return ((PUSH, (2,), self.key),) if b == QUOTE else ()
        if phase == 2:
            return ((SET, (3, False)),) if b == COLON else ()
        if phase == 3:
            if b == SPACE:
                return () if local[1] else ((SET, (3, True)),)
            return ((PUSH, (4,), self.values),)
        if phase == 4:
            if b == COMMA:
                return ((SET, (1, False, False)),)
            return ((SET, (5,)),) if b == 0x7D else ()
        return ()

    def accepting(self, local):
        return local[0] == 5

    final = accepting


class AnyOf(Node):
    """Alternatives, followed side by side by the matcher."""

    def __init__(self, options: Sequence[Node]):
        self.options = list(options)
        self._frames = None
        self._expanding = False

    @property
    def nullable(self):
        return any(o.nullable for o in self.options)

    def expand(self):
        if self._frames is None:
            if self._expanding:
                raise SchemaError("a $ref or anyOf refers to itself without consuming input")
            self._expanding = True
            try:  # each frame once: alternatives that share a $ref would double at every level
                self._frames = list(dict.fromkeys(f for o in self.options for f in o.expand()))
            finally:
                self._expanding = False
        return self._frames


class Ref(AnyOf):
    """A local $ref: resolved lazily, so that schemas may be recursive."""

    def __init__(self, resolve):
        super().__init__([])
        self._resolve = resolve

    def expand(self):
        if not self.options:
            self.options = [self._resolve()]
        return super().expand()


class AnyValue(AnyOf):
    """Any JSON value (the schema `{}` or `true`), nested at most MAX_ANY_DEPTH deep."""

    def __init__(self, depth: int = 0):
        options = [String(), Number(integer=False), Literal([b"true", b"false", b"null"])]
        if depth < MAX_ANY_DEPTH:
            inner = _LazyAny(depth + 1)
            options += [Array(inner), FreeObject(inner)]
        super().__init__(options)


class _LazyAny(AnyOf):
    def __init__(self, depth):
        super().__init__([])
        self.depth = depth

    def expand(self):
        if not self.options:
            self.options = [AnyValue(self.depth)]
        return super().expand()


class Seq(Node):
    """Children one after the other. Local: index of the next child."""

    start = 0

    def __init__(self, children: Sequence[Node]):
        self.children = list(children)
        self.nullable = all(c.nullable for c in self.children)

    def step(self, local, b):
        return ((PUSH, local + 1, self.children[local]),) if local < len(self.children) else ()

    def accepting(self, local):
        return all(c.nullable for c in self.children[local:])

    def final(self, local):
        return local == len(self.children)


class Repeat(Node):
    """`child` between lo and hi times (child must not match the empty string)."""

    start = 0

    def __init__(self, child: Node, lo: int = 0, hi: int | None = None):
        assert not child.nullable, "a repeated node must consume input"
        self.child, self.lo, self.hi = child, lo, hi
        self.nullable = lo == 0

    def step(self, local, b):
        return ((PUSH, local + 1, self.child),) if self.hi is None or local < self.hi else ()

    def accepting(self, local):
        return local >= self.lo

    def final(self, local):
        return local == self.hi


class FreeText(Node):
    """Any bytes until `opener` appears, then `then` (or, with then=None, the opener is banned).

    Local: how many bytes of the opener the text currently ends with (a KMP automaton), or -1
    once the opener was written and `then` runs. Used for tool_choice "auto" and "none".
    """

    start = 0

    def __init__(self, opener: bytes, then: Node | None):
        self.opener, self.then = opener, then
        self.nullable = True
        m = len(opener)
        fail = [0] * (m + 1)  # KMP failure function
        k = 0
        for i in range(1, m):
            while k and opener[i] != opener[k]:
                k = fail[k]
            if opener[i] == opener[k]:
                k += 1
            fail[i + 1] = k
        self._next = []  # _next[k][b]: matched length after byte b
        for k in range(m):
            row = []
            for b in range(256):
                j = k
                while j and opener[j] != b:
                    j = fail[j]
                row.append(j + 1 if opener[j] == b else 0)
            self._next.append(row)

    def step(self, local, b):
        if local < 0:
            return ()
        k = self._next[local][b]
        if k < len(self.opener):
            return ((SET, k),)
        return ((ENTER, -1, self.then),) if self.then is not None else ()

    def accepting(self, local):
        return True

    def final(self, local):
        return local < 0

    def fast(self, local, index):
        if local < 0:
            return None
        return index.without_byte(self.opener[-1])


# ---------------------------------------------------------------------------------------------
# What a node's documents are made of
# ---------------------------------------------------------------------------------------------

def writes_objects(node: Node) -> bool:
    """Is every document of a compiled node a JSON object? Each way it can begin is an object's
    (a function call's arguments must be one, whatever $ref or anyOf its schema goes through)."""
    return all(isinstance(n, (Object, FreeObject)) or isinstance(n, Literal) and all(o[:1] == b"{" for o in n.options)
               for n, _ in node.expand())


def _parts(node: Node) -> list[Node]:
    """The nodes a node's documents are made of (Seq, Repeat and FreeText: those of tools.py,
    which wraps compiled schemas in them)."""
    if isinstance(node, Array):
        return [node.items]
    if isinstance(node, Object):
        return node.values
    if isinstance(node, Seq):
        return node.children
    if isinstance(node, FreeObject):
        return [node.values]
    if isinstance(node, AnyOf):
        return node.options
    if isinstance(node, Repeat):
        return [node.child]
    if isinstance(node, FreeText):
        return [node.then] if node.then is not None else []
    return []


def needed(node: Node) -> list[Node]:
    """The parts a node's documents cannot do without: all of them, or (alternatives) one.
    (A sequence pushes each child, one that may be empty too; free text needs none, but
    counts what follows its opener, so that a call that could not end is refused at once.)"""
    if isinstance(node, Array):
        return [node.items] if node.min_items else []
    if isinstance(node, Object):
        return node.required_values
    if isinstance(node, Repeat):
        return [node.child] if node.lo else []
    if isinstance(node, (AnyOf, FreeText)):
        return _parts(node)
    if isinstance(node, Seq):
        return node.children
    return []  # literals, strings, numbers, free objects: a short document always exists


def _height(node: Node) -> float:
    """A node's height (Node.height) from those of its parts."""
    heights = [part.height for part in needed(node)]
    if isinstance(node, AnyOf):
        return min(heights, default=math.inf)
    return 1 + max(heights, default=0)


def reachable(root: Node) -> list[Node]:
    """The nodes root's documents can be made of, root first (each once)."""
    nodes, seen, todo = [], set(), [root]
    while todo:
        node = todo.pop()
        if id(node) not in seen:
            seen.add(id(node))
            nodes.append(node)
            todo.extend(_parts(node))
    return nodes


def set_heights(nodes: list[Node]) -> None:
    """Node.height of the nodes a root reaches (reachable). It is infinite when a required
    property, or an array's required items, can only be written by writing their own object
    again (`{"properties": {"c": {"$ref": "#"}}, "required": ["c"]}`): the model would write
    until the token limit. A fixpoint: from infinity, heights only go down, until none does."""
    for node in nodes:
        node.height = math.inf
    lowered = True
    while lowered:
        lowered = False
        for node in reversed(nodes):  # children before parents: a tree settles in one pass
            height = _height(node)
            if height < node.height:
                node.height, lowered = height, True



# ---------------------------------------------------------------------------------------------
# How a value can end: the shortest completions the output budget counts
# ---------------------------------------------------------------------------------------------

# Locals the default search (search_finish) visits before it gives up on a node: its nodes
# have a few locals per byte of their documents; past it, "no completion" is sound (the
# budget then lets the node be begun only while nothing else is possible), never wrong.
MAX_SEARCH = 4096


def _shortest_first(data: bytes):
    return len(data), data


def _join(a: bytes | None, b: bytes | None) -> bytes | None:
    return None if a is None or b is None else a + b


def shorter(a: bytes | None, b: bytes | None) -> bool:
    """Is completion a shorter than b (None: none at all, longer than any)?"""
    return a is not None and (b is None or _shortest_first(a) < _shortest_first(b))


def document(node: Node) -> bytes | None:
    """The shortest document of a node (None: none is finite): set for the nodes a grammar
    reaches (set_documents), computed when first asked for those made while decoding (the
    values inside schema-less values)."""
    doc = node.__dict__.get("document", search_finish)  # (a sentinel: None is an answer)
    if doc is search_finish:
        node.document = None  # asked for again while computing: no finite document that way
        node.document = doc = _shortest_document(node)
    return doc


def _shortest_document(node: Node) -> bytes | None:
    best = None
    for frame_node, local in node.expand():
        doc = frame_node.finish(local)
        if shorter(doc, best):
            best = doc
    return best


def set_documents(nodes: list[Node]) -> None:
    """The shortest document of each node a root reaches (reachable): a fixpoint, as a
    recursive schema's nodes need each other's. From none, documents only get shorter."""
    inner = [node for node in nodes if _parts(node)]
    for node in inner:
        node.document = None
    for node in nodes:  # (a leaf's document needs no other: once)
        if not _parts(node):
            node.document = _shortest_document(node)
    lowered = True
    while lowered:
        lowered = False
        for node in reversed(inner):  # children before parents: a tree settles in one pass
            doc = _shortest_document(node)
            if shorter(doc, node.document):
                node.document, lowered = doc, True


def search_finish(node: Node, local) -> bytes | None:
    """Node.finish by default: the shortest path of bytes from `local` to an accepting local
    (Dijkstra over the node's actions; a child it starts costs the child's document)."""
    tie = itertools.count()  # (locals need not compare)
    heap, seen = [(0, b"", next(tie), local)], set()
    while heap:
        _, out, _, at = heapq.heappop(heap)
        if at in seen:
            continue
        if node.accepting(at):
            return out
        seen.add(at)
        if len(seen) > MAX_SEARCH:
            return None
        for b in range(256):
            for action in node.step(at, b):
                edge = _edge(action, b)
                if edge is not None and action[1] not in seen:
                    heapq.heappush(heap, (len(out) + len(edge), out + edge, next(tie), action[1]))
    return None


def _edge(action: tuple, b: int) -> bytes | None:
    """The bytes an action read with byte b takes to reach its local (None: it cannot)."""
    if action[0] == SET:
        return bytes((b,))
    doc = document(action[2])
    if doc is None:
        return None
    if action[0] == ENTER:
        return bytes((b,)) + doc
    return doc if not doc or doc[0] == b else None  # PUSH: the byte is the child's first
