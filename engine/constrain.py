"""Constrained decoding: a JSON Schema subset compiled to a byte matcher, and token masks.

A small model left alone writes broken JSON; here it cannot. At every step only the tokens
whose bytes keep the output a valid prefix of an allowed document get a chance, and the
end-of-sequence token only once the document is complete. Three layers:

1. Grammar nodes. A schema compiles to a graph of small nodes (literal, string, number,
   array, object, any value, plus sequence / repeat / free text for tool calls). A node reads
   one byte at a time from an immutable local state and answers with actions: keep reading,
   or start a child value (the byte goes to the child, or the child starts with the next
   byte). Completed children are popped from the stack and their parent resumes.

2. The matcher. A configuration is a stack (tuple) of frames `(node, local)`; a matcher state
   is a frozenset of configurations, so alternatives (`anyOf`, type lists, a number that could
   end or go on) are followed side by side like an NFA. States are immutable and hashable:
   transitions and masks are cached by state.

3. Token masks. `TokenIndex` keeps the vocabulary sorted by bytes; a sorted list *is* a trie
   (the tokens sharing a prefix are contiguous), so a mask is a walk that only descends into
   byte prefixes the matcher accepts. Inside a JSON string nearly every token is allowed,
   so there a vectorised precomputed mask of "plain" tokens (no quote, backslash or control
   byte, whole UTF-8 characters) is used, and only the few other tokens are checked one by one.
   The sampled token is checked first with `allows()`, so most steps need no mask at all.

The JSON written is compact and bounded: no whitespace except at most one space after `:`
and `,`, object properties in schema order (optional ones may be skipped, required ones must
appear; with `properties` given, or keys `required`, no other key is written, without them
any string keys; a required key not in `properties` comes after those, its value as
`additionalProperties` says), numbers without exponent with at most 15 integer and 6
fraction digits (more when the bounds are finer), and 15 digits in all when there is a
fraction (so that the float a reader parses compares with the bounds as the decimal
did), values inside at most 63 arrays and objects (MAX_DEPTH). Strings are as long as the
model makes them unless `maxLength` says otherwise: a cut-off document is reported as such
(finish reason "length"), never silently shortened.

Supported keywords: type (also lists), properties, required, additionalProperties, items,
enum, const, anyOf, minItems/maxItems, minLength/maxLength, minimum/maximum and
exclusiveMinimum/exclusiveMaximum, local $ref with $defs/definitions; annotations (title,
description, examples, default, ...) are ignored; any other keyword raises SchemaError, and
so does a keyword whose value is not of its kind, whatever the type. $ref and anyOf stand
alone; beside enum or const, only keywords without a subschema (type, bounds, required).
A subschema that no value satisfies (false, bounds that exclude every value) is left
out where it is optional (a property not required, one of anyOf's alternatives, the
items of an array that may be empty: `[]`, the values of a free object: `{}`); where
it is not, the schema is refused. So is a subschema that has no finite document (a
required property that contains its own object again), and so are both behind a $ref.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import re
import threading
import weakref
from fractions import Fraction
from urllib.parse import unquote
from typing import Iterable, Sequence

import numpy as np

from .errors import EngineError, SchemaError, Unsatisfiable

__all__ = [
    "TokenIndex",
    "Grammar",
    "GrammarConstraint",
    "compile_schema",
    "writes_objects",
    "can_constrain",
    "json_constraint",
    "validate",
    "Literal",
    "Seq",
    "Repeat",
    "FreeText",
    "AnyOf",
    "Object",
]

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
# Frames on one stack: a value inside at most 63 arrays and objects (a few less in a tool
# call). A recursive schema had no other bound: each "[" of `{"items": {"$ref": "#"}}` was
# one more frame in every state after it, each state held by the caches: 260 MB after
# 8,000 of them, and each byte slower than the last. Only what can still end within the
# bound may begin (Node.height), so the bound never leaves the model stuck.
MAX_DEPTH = 64
# Bounds on what a client's schema may cost (D9). An object's optional properties cost
# n at each byte of a key (each is tried): 8,000 of them made a mask take 1.6 s.
MAX_PROPERTIES = 256   # declared properties of one object
MAX_ENUM = 1024        # values of one enum
# Alternatives followed side by side: nested anyOf branches that agree on a prefix multiply
# (2^depth stacks after "[[[..." for an anyOf of two array types, each level nested once
# more: 12 levels, 4,096 stacks, made a single mask take 15 s). An anyOf's own alternatives
# (nested anyOfs and $refs taken in) are counted when compiled, as its first byte leaves them;
# stacks that multiply as the output goes on only while decoding.
MAX_CONFIGURATIONS = 256

SPACE, QUOTE, BACKSLASH, COMMA, COLON = 0x20, 0x22, 0x5C, 0x2C, 0x3A


# ---------------------------------------------------------------------------------------------
# Grammar nodes
# ---------------------------------------------------------------------------------------------

class Node:
    """A grammar node. `start` is its initial local state; locals are small tuples/bytes/ints."""

    start: object = 0
    nullable = False  # matches the empty string
    # the fewest frames a document of it needs on the stack, its own included (math.inf:
    # none is finite). Set by _set_heights for the nodes a grammar reaches; nodes made while
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
                 frac_digits: int = MAX_FRAC_DIGITS):
        self.integer, self.lo, self.hi = integer, lo, hi
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
        """Does some completion of this prefix lie within [lo, hi]?"""
        if self.lo is None and self.hi is None:
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
        return (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)

    def final(self, local):
        done = self._final.get(local)
        if done is None:
            done = self.accepting(local) and not any(self.step(local, b) for b in b"0123456789.")
            self._final[local] = done
        return done


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
# The matcher: states are frozensets of stacks of frames
# ---------------------------------------------------------------------------------------------

def _settle(stack: tuple) -> tuple:
    """Pop the frames that are complete and can take nothing more."""
    while stack and stack[-1][0].final(stack[-1][1]):
        stack = stack[:-1]
    return stack


def _feed(stack: tuple, b: int, out: list) -> None:
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
                    _feed(base + (frame,), b, out)
                else:
                    out.append(_settle(base + (frame,)))
    if below and node.accepting(local):  # the value may end here: the byte goes to the parent
        _feed(below, b, out)


def _complete(stack: tuple) -> bool:
    return all(node.accepting(local) for node, local in stack)


_VALUE_STARTS = b'"-0123456789[{ftn'  # the bytes a JSON value can begin with


def _first_byte(node: Node, b: int, memo: dict) -> frozenset | None:
    """The configurations that byte b, the first of a value that begins as `node`, leaves,
    as Grammar.step counts them: alternatives that refuse the byte are gone, those that
    end with it are one. An anyOf's are its options' (memo: node -> them, for this b).
    None: more than MAX_CONFIGURATIONS, as then every anyOf that holds it has (the count
    stops there, so that no set it keeps is larger)."""
    found = memo.get(node)
    if found is None:
        if isinstance(node, AnyOf):  # expanded by now: a $ref's one option is its target
            ways: set = set()
            for option in node.options:
                more = _first_byte(option, b, memo)
                if more is None:
                    return None
                ways |= more
                if len(ways) > MAX_CONFIGURATIONS:
                    return None
            found = frozenset(ways)
        else:
            out: list = []
            for frame in node.expand():
                _feed((frame,), b, out)
            found = frozenset(out)
        memo[node] = found
    return found


class Grammar:
    """A compiled grammar over one vocabulary, with its caches (shared by all its generations).

    Generations of several threads may share it: the caches are only read, written and
    cleared as whole entries (atomic under the GIL), and evictions hold a lock.
    """

    MAX_MASKS = 64          # cached masks, bit-packed (n_vocab / 8 bytes each)
    MAX_TRANSITIONS = 200_000

    def __init__(self, root: Node, index: TokenIndex):
        self.index = index
        _set_heights(_reached(root))
        frames = [f for f in root.expand() if f[0].height <= MAX_DEPTH]
        if not frames:
            raise SchemaError(f"every document of the schema nests more than {MAX_DEPTH} values deep")
        self.initial = frozenset(_settle((f,)) for f in frames)
        if len(self.initial) > MAX_CONFIGURATIONS:  # (nested alternatives, before any byte)
            raise SchemaError(f"the schema's alternatives (anyOf, type lists) are more than "
                              f"{MAX_CONFIGURATIONS} ways to read one output", "", "anyOf")
        self._steps: dict = {}
        self._masks: dict = {}  # state -> uint8 (n_vocab / 8,) packed mask
        self._lock = threading.Lock()

    def step(self, state: frozenset, b: int) -> frozenset | None:
        key = (state, b)
        nxt = self._steps.get(key, 0)
        if nxt == 0:
            out = []
            for stack in state:
                if stack:
                    _feed(stack, b, out)
            nxt = frozenset(out) or None
            if nxt is not None and len(nxt) > MAX_CONFIGURATIONS:
                raise SchemaError(f"the schema's alternatives (anyOf, type lists) grow past "
                                  f"{MAX_CONFIGURATIONS} ways to read one output", "", "anyOf")
            if len(self._steps) >= self.MAX_TRANSITIONS:
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
        mask = self._compute_mask(state)
        with self._lock:
            if len(self._masks) >= self.MAX_MASKS:
                self._masks.pop(next(iter(self._masks)))
            self._masks[state] = np.packbits(mask)
        return mask

    def _compute_mask(self, state: frozenset) -> np.ndarray:
        """A token is allowed when some stack of the state reads all its bytes: the mask is the
        union of the stacks' own. Those whose node has a shortcut (inside a string, free text)
        take it one by one, the others share one walk of the trie. (One walk for all, when two
        alternatives are inside a string, reads every token byte by byte: 0.5 s for 262k.)"""
        index = self.index
        mask = np.zeros(index.n_vocab, dtype=np.bool_)
        others = []
        for stack in state:
            fast = self._fast(stack)
            if fast is None:
                others.append(stack)
                continue
            sure, check = fast  # bool (n_vocab,), int ids
            mask |= sure
            alone = frozenset((stack,))
            token_bytes = index.token_bytes
            for t in check.tolist():
                if not mask[t] and self.walk(alone, token_bytes[t]) is not None:
                    mask[t] = True
        if others:
            mask[index.sorted_ids[self._trie_walk(frozenset(others))]] = True
        if self.complete(state):
            mask[index.eos_list] = True
        return mask

    def _fast(self, stack: tuple):
        """The shortcut of a stack's top node (Node.fast), or None: also when the node may end
        here, as then the next byte may go to the frame below it."""
        if not stack:
            return None
        node, local = stack[-1]
        if len(stack) > 1 and node.accepting(local):
            return None
        return node.fast(local, self.index)

    def _trie_walk(self, state: frozenset) -> list[int]:
        """Positions in index.sorted_bytes of the tokens whose bytes the matcher accepts."""
        tb = self.index.sorted_bytes
        hits = []
        todo = []
        for b, lo, hi in self.index.root:
            s = self.step(state, b)
            if s is not None:
                todo.append((lo, hi, 1, s))
        while todo:
            lo, hi, depth, s = todo.pop()
            while lo < hi and len(tb[lo]) == depth:  # tokens that end here
                hits.append(lo)
                lo += 1
            if hi - lo == 1:  # a single token left below: finish it directly
                if self.walk(s, tb[lo][depth:]) is not None:
                    hits.append(lo)
                continue
            while lo < hi:
                token = tb[lo]
                b = token[depth]
                end = hi if b == 255 else bisect.bisect_left(tb, token[:depth] + bytes((b + 1,)), lo, hi)
                s2 = self.step(s, b)
                if s2 is not None:
                    todo.append((lo, end, depth + 1, s2))
                lo = end
        return hits


class GrammarConstraint:
    """One generation's position in a grammar: the Constraint protocol of engine/generate.py."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.state = grammar.initial
        self.ended = False  # an end-of-sequence token was accepted
        self.text = bytearray()  # the bytes accepted so far

    def allows(self, token_id: int) -> bool:
        if self.ended:
            return False
        index = self.grammar.index
        if token_id in index.eos_ids:
            return self.grammar.complete(self.state)
        data = index.token_bytes[token_id]
        return bool(data) and self.grammar.walk(self.state, data) is not None

    def mask(self) -> np.ndarray:
        """bool (n_vocab,), True = allowed; end-of-sequence only when the value is complete."""
        if self.ended:
            return np.zeros(self.grammar.index.n_vocab, dtype=np.bool_)
        return self.grammar.mask(self.state)

    def advance(self, token_id: int) -> None:
        if not self.allows(token_id):
            raise EngineError(f"token {token_id} is not allowed by the constraint here")
        index = self.grammar.index
        if token_id in index.eos_ids:
            self.ended = True
            return
        data = index.token_bytes[token_id]
        self.state = self.grammar.walk(self.state, data)
        self.text += data

    def complete(self) -> bool:
        return self.ended or self.grammar.complete(self.state)

    def is_done(self) -> bool:
        return self.ended or self.grammar.done(self.state)


# ---------------------------------------------------------------------------------------------
# The vocabulary, indexed for masks
# ---------------------------------------------------------------------------------------------

_NOT_PLAIN = re.compile(rb'[\x00-\x1f"\\]')  # control bytes, quote, backslash


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
        self._without: dict = {}
        self.grammars: dict = {}  # schema key -> Grammar, bounded
        self._lock = threading.Lock()

    def without_byte(self, byte: int):
        """(tokens without `byte`, ids of tokens containing it): for free-text masks."""
        if byte not in self._without:
            has = np.zeros(self.n_vocab, dtype=np.bool_)
            has[[i for i in self.sorted_ids.tolist() if byte in self.token_bytes[i]]] = True
            self._without[byte] = (self.normal & ~has, np.flatnonzero(has))
        return self._without[byte]

    def grammar(self, key, build) -> Grammar:
        """The cached Grammar for `key`, built by `build()` on first use."""
        g = self.grammars.get(key)
        if g is None:
            g = Grammar(build(), self)
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


# ---------------------------------------------------------------------------------------------
# JSON Schema -> nodes
# ---------------------------------------------------------------------------------------------

ANNOTATIONS = frozenset({"description", "title", "$schema", "$id", "$comment", "examples",
                         "default", "deprecated", "readOnly", "writeOnly"})
KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "items", "enum",
                      "const", "anyOf", "minItems", "maxItems", "minLength", "maxLength",
                      "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "$ref",
                      "$defs", "definitions"})
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")


def _dump(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _pointer_keys(ref: str) -> list[str]:
    """The keys a local $ref walks ("#/$defs/a%20b" -> ["$defs", "a b"]): a URI fragment,
    %-encoded, holding a JSON pointer (in which ~1 is "/" and ~0 is "~")."""
    if ref == "#":
        return []
    return [unquote(part).replace("~1", "/").replace("~0", "~") for part in ref[2:].split("/")]


def _on_grid(bounds: list[tuple[str, Fraction]], unit: Fraction) -> tuple[Fraction | None, Fraction | None]:
    """(lo, hi): the inclusive bounds among multiples of unit that (keyword, value) bounds
    leave (None: unbounded)."""
    lo = hi = None
    for key, v in bounds:
        if key == "minimum":
            b = math.ceil(v / unit) * unit
            lo = b if lo is None else max(lo, b)
        elif key == "exclusiveMinimum":
            b = (math.floor(v / unit) + 1) * unit
            lo = b if lo is None else max(lo, b)
        elif key == "maximum":
            b = math.floor(v / unit) * unit
            hi = b if hi is None else min(hi, b)
        else:
            b = (math.ceil(v / unit) - 1) * unit
            hi = b if hi is None else min(hi, b)
    return lo, hi


COUNTS = ("minLength", "maxLength", "minItems", "maxItems")
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _check_values(schema: dict, path: str) -> None:
    """Refuse a keyword whose value is not of its kind, whatever the schema's type reads:
    validate() reads them all (the values of an enum are checked against the keywords
    beside it), and a malformed one is refused, never ignored."""
    at = path or "/"
    for key, v in schema.items():
        where = f"{path}/{key}"
        if key in COUNTS:
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise SchemaError(f"'{key}' at {at} must be a non-negative integer", where, key)
        elif key in BOUNDS:
            if not _is_number(v):
                raise SchemaError(f"'{key}' at {at} must be a number", where, key)
        elif key in ("$defs", "definitions", "properties"):
            if not isinstance(v, dict):
                raise SchemaError(f"'{key}' at {at} must be an object", where, key)
        elif key in ("anyOf", "enum"):
            if not isinstance(v, list) or not v:
                raise SchemaError(f"'{key}' at {at} must be a non-empty array", where, key)
        elif key == "$ref":
            if not isinstance(v, str):
                raise SchemaError(f"'$ref' at {at} must be a string", where, key)
        elif key == "required":
            if not isinstance(v, list) or not all(isinstance(name, str) for name in v):
                raise SchemaError(f"'required' at {at} must be an array of strings", where, key)
        elif key == "additionalProperties":
            if not isinstance(v, (bool, dict)):
                raise SchemaError(f"'additionalProperties' at {at} must be a boolean or a schema", where, key)
        elif key == "type":
            types = v if isinstance(v, list) else [v]
            unknown = [t for t in types if t not in TYPES]
            if unknown:
                raise SchemaError(f"unknown type {unknown[0]!r} at {at}", where, key)
            if not types or len(set(types)) != len(types):
                raise SchemaError(f"'type' at {at} must be a non-empty list of distinct types", where, key)


class _Compiler:
    """One pass over a schema. `dead`: the $refs a first pass found without a finite document,
    each with the error its uses raise, so that they are left out where they are optional
    (as the same subschema written inline is: a $ref is only compiled after the rest)."""

    def __init__(self, root, dead: dict[str, Unsatisfiable] | None = None):
        self.root = root
        self.dead = dead or {}
        self.refs: dict[str, Ref] = {}
        self.unsatisfiable: dict[str, Unsatisfiable] = {}  # $ref -> why no value satisfies its target
        self.lazy: list[tuple[AnyOf, str]] = []  # each $ref and anyOf, with its path, to expand
        self.choices: list[tuple[AnyOf, str]] = []  # every anyOf / type list, with its path
        self.any_value = AnyValue()  # one for every `{}`: each new one cost 0.1 ms (its Number)

    def resolve(self, ref: str, path: str) -> Node:
        if ref in self.dead:
            e = self.dead[ref]
            raise Unsatisfiable(str(e), e.path, e.keyword)
        if ref in self.refs:
            return self.refs[ref]
        if ref != "#" and not ref.startswith("#/"):
            raise SchemaError(f"only local $ref ('#/$defs/...') is supported, not {ref!r}", path, "$ref")
        target, where = self.root, ""
        for part in _pointer_keys(ref):
            where += "/" + part
            if isinstance(target, dict) and part in target:
                target = target[part]
            else:
                raise SchemaError(f"$ref {ref!r} points to nothing", path, "$ref")
        node = Ref(lambda: self.target(ref, target, where))
        self.refs[ref] = node
        self.lazy.append((node, path))
        return node

    def target(self, ref: str, schema, where: str) -> Node:
        """A $ref's target, compiled; one that no value satisfies matches nothing (dead_refs)."""
        try:
            return self.compile(schema, where)
        except Unsatisfiable as e:
            self.unsatisfiable[ref] = e
            return AnyOf([])

    def run(self) -> Node:
        """The root node, with every $ref and anyOf resolved, so errors surface before generation."""
        node = self.compile(self.root)
        done = 0
        while done < len(self.lazy):
            lazy, path = self.lazy[done]
            try:
                lazy.expand()
            except SchemaError as e:
                if e.path or e.keyword:
                    raise
                # (a $ref that leads back to itself: named where the expansion began)
                keyword = "$ref" if isinstance(lazy, Ref) else "anyOf"
                raise SchemaError(str(e), path, keyword) from None
            done += 1
        return node

    def dead_refs(self, nodes: list[Node]) -> dict[str, Unsatisfiable]:
        """The $refs among `nodes` (what the root reaches: _reached) that have no finite document,
        with the error their uses raise: that of a $ref no value satisfies which they cannot do
        without (as inline), if there is one, else that they can only be written by writing
        themselves again."""
        _set_heights(nodes)
        ending = {id(node) for node in nodes if node.height < math.inf}
        why = {id(self.refs[ref]): e for ref, e in self.unsatisfiable.items()}  # (by node id)
        grew = True
        while grew:
            grew = False
            for node in reversed(nodes):  # (children first, as in _set_heights)
                if id(node) not in ending and id(node) not in why:
                    because = next((why[id(part)] for part in _needed(node) if id(part) in why), None)
                    if because is not None:
                        why[id(node)] = because
                        grew = True
        reached = {id(node) for node in nodes}
        dead = {}
        for ref, node in self.refs.items():
            if id(node) in reached and id(node) not in ending:
                where = "".join("/" + part for part in _pointer_keys(ref))
                dead[ref] = why.get(id(node)) or Unsatisfiable(
                    f"no finite document satisfies the schema at {where or '/'}: a required property or "
                    "array item can only be written by writing its own object again", where, "required")
        return dead

    def compile(self, schema, path: str = "") -> Node:
        if schema is True or schema == {}:
            return self.any_value
        if schema is False:
            raise Unsatisfiable(f"the schema at {path or '/'} is false: no value is valid", path)
        if not isinstance(schema, dict):
            raise SchemaError(f"the schema at {path or '/'} must be an object or a boolean", path)
        for key in schema:
            if key not in KEYWORDS and key not in ANNOTATIONS:
                raise SchemaError(f"unsupported JSON Schema keyword '{key}' at {path or '/'}",
                                  f"{path}/{key}", key)
        _check_values(schema, path)
        constraints = {k: v for k, v in schema.items()
                       if k not in ANNOTATIONS and k not in ("$defs", "definitions")}
        if not constraints:
            return self.any_value
        if "$ref" in constraints:
            if len(constraints) > 1:
                other = sorted(set(constraints) - {"$ref"})[0]
                raise SchemaError(f"'{other}' beside '$ref' at {path or '/'} is not supported",
                                  f"{path}/{other}", other)
            return self.resolve(schema["$ref"], f"{path}/$ref")
        if "anyOf" in constraints:
            if len(constraints) > 1:
                other = sorted(set(constraints) - {"anyOf"})[0]
                raise SchemaError(f"'{other}' beside 'anyOf' at {path or '/'} is not supported",
                                  f"{path}/{other}", other)
            options = schema["anyOf"]
            return self.alternatives([(s, f"{path}/anyOf/{i}") for i, s in enumerate(options)], path)
        if "enum" in constraints or "const" in constraints:
            return self.literal(schema, path)
        types = schema.get("type")
        if types is None:
            types = self.implied_type(constraints)
        if isinstance(types, list):
            return self.alternatives([({**schema, "type": t}, path) for t in types], path)
        return getattr(self, "t_" + types)(schema, path)

    def alternatives(self, schemas: list[tuple], path: str) -> Node:
        """anyOf, or a list of types: the (schema, path) options that some value satisfies."""
        if len(schemas) > MAX_CONFIGURATIONS:  # they are all followed at once from the first byte
            raise SchemaError(f"an anyOf of more than {MAX_CONFIGURATIONS} alternatives at {path or '/'} "
                              "is not supported", f"{path}/anyOf", "anyOf")
        nodes, unsatisfiable = [], None
        for schema, where in schemas:
            try:
                nodes.append(self.compile(schema, where))
            except Unsatisfiable as e:
                unsatisfiable = e
        if not nodes:
            raise unsatisfiable
        node = AnyOf(nodes)
        self.lazy.append((node, path))
        self.choices.append((node, path))
        return node

    @staticmethod
    def implied_type(constraints):
        """A schema without 'type': generate the kind its keywords describe (a valid subset)."""
        for t, keys in (("object", ("properties", "required", "additionalProperties")),
                        ("array", ("items", "minItems", "maxItems")),
                        ("string", ("minLength", "maxLength"))):
            if any(k in constraints for k in keys):
                return t
        return "number"  # only numeric bounds are left

    def literal(self, schema, path):
        """enum or const: the values that the keywords beside it (const beside an enum too)
        allow. Those are checked by validate(), so none that holds a subschema may be there:
        what it costs would be one value's size times the schema's, not the value's alone."""
        kind = "enum" if "enum" in schema else "const"
        values = schema["enum"] if kind == "enum" else [schema["const"]]
        if len(values) > MAX_ENUM:
            raise SchemaError(f"an enum of more than {MAX_ENUM} values at {path or '/'} is not supported",
                              f"{path}/enum", "enum")
        beside = sorted(set(schema) & {"properties", "additionalProperties", "items"})
        if beside:
            raise SchemaError(f"'{beside[0]}' beside '{kind}' at {path or '/'} is not supported",
                              f"{path}/{beside[0]}", beside[0])
        rest = {k: v for k, v in schema.items() if k != kind}
        kept = [v for v in values if validate(v, rest) is None]
        if not kept:
            raise Unsatisfiable(f"no value of 'enum'/'const' at {path or '/'} satisfies the schema", path, "enum")
        return Literal(_dump(v) for v in kept)

    def t_string(self, schema, path):
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if hi is not None and lo > hi:
            raise Unsatisfiable(f"minLength > maxLength at {path or '/'}", f"{path}/minLength", "minLength")
        return String(lo, hi)

    def t_integer(self, schema, path):
        return self.number(schema, path, integer=True)

    def t_number(self, schema, path):
        return self.number(schema, path, integer=False)

    def number(self, schema, path, integer):
        bounds = [(key, Fraction(repr(v)) if isinstance(v, float) else Fraction(v))
                  for key, v in schema.items() if key in BOUNDS]
        # fraction digits: none for an integer, MAX_FRAC_DIGITS for a number, or when no
        # value with those lies between the bounds, as many as MAX_SIGNIFICANT leaves
        between = False
        for digits in [0] if integer else [MAX_FRAC_DIGITS, MAX_SIGNIFICANT]:
            unit = Fraction(1, 10 ** digits)
            lo, hi = _on_grid(bounds, unit)
            if lo is not None and hi is not None and lo > hi:
                continue
            between = True
            limit = Fraction(10 ** MAX_INT_DIGITS) - unit
            if (lo is not None and lo > limit) or (hi is not None and hi < -limit):
                raise Unsatisfiable(f"no number of at most {MAX_INT_DIGITS} integer digits lies between "
                                    f"the bounds at {path or '/'}", path, "minimum")
            node = Number(integer, lo, hi, digits)
            if node._feasible(False, "", None) or node._feasible(True, "", None):  # MAX_SIGNIFICANT
                return node
        if not between:
            what = "integer" if integer else f"number of at most {MAX_SIGNIFICANT} fraction digits"
            raise Unsatisfiable(f"no {what} lies between the bounds at {path or '/'}", path, "minimum")
        raise Unsatisfiable(f"no number of at most {MAX_SIGNIFICANT} digits lies between the bounds at "
                            f"{path or '/'}", path, "minimum")

    def t_boolean(self, schema, path):
        return Literal([b"true", b"false"])

    def t_null(self, schema, path):
        return Literal([b"null"])

    def t_array(self, schema, path):
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if hi is not None and lo > hi:
            raise Unsatisfiable(f"minItems > maxItems at {path or '/'}", f"{path}/minItems", "minItems")
        try:
            items = self.compile(schema["items"], f"{path}/items") if "items" in schema else self.any_value
        except Unsatisfiable:
            if lo > 0:
                raise
            return Literal([b"[]"])  # no item can be written: only the empty array
        return Array(items, lo, hi)

    def t_object(self, schema, path):
        props = schema.get("properties", {})
        if len(props) > MAX_PROPERTIES:
            raise SchemaError(f"more than {MAX_PROPERTIES} properties in one object at {path or '/'} "
                              "are not supported", f"{path}/properties", "properties")
        required = schema.get("required", [])
        undeclared = [name for name in dict.fromkeys(required) if name not in props]
        if len(props) + len(undeclared) > MAX_PROPERTIES:
            raise SchemaError(f"more than {MAX_PROPERTIES} properties in one object at {path or '/'} "
                              "are not supported", f"{path}/required", "required")
        extra = schema.get("additionalProperties", True)
        if "properties" in schema or extra is False or undeclared:
            # the properties declared or required only, even where others would be allowed:
            # the schema's author listed the keys that mean something (`"properties": {}` -> `{}`)
            names, values = [], []
            for name, s in props.items():
                try:
                    values.append(self.compile(s, f"{path}/properties/{name}"))
                except Unsatisfiable:
                    if name in required:
                        raise
                    continue  # an optional property no value satisfies: never written
                names.append(name)
            if undeclared:  # required, not declared: after the declared ones, valued as additionalProperties says
                if extra is False:
                    raise Unsatisfiable(f"required property {undeclared[0]!r} at {path or '/'} is neither declared "
                                        "in 'properties' nor allowed by 'additionalProperties'",
                                        f"{path}/required", "required")
                value = self.compile(extra, f"{path}/additionalProperties")
                names += undeclared
                values += [value] * len(undeclared)
            return Object(names, values, required)
        try:
            values = self.compile(extra, f"{path}/additionalProperties") if isinstance(extra, dict) else self.any_value
        except Unsatisfiable:
            return Literal([b"{}"])  # no value of any key can be written: only the empty object
        return FreeObject(values)


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


def _needed(node: Node) -> list[Node]:
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
    heights = [part.height for part in _needed(node)]
    if isinstance(node, AnyOf):
        return min(heights, default=math.inf)
    return 1 + max(heights, default=0)


def _reached(root: Node) -> list[Node]:
    """The nodes root's documents can be made of, root first (each once)."""
    nodes, seen, todo = [], set(), [root]
    while todo:
        node = todo.pop()
        if id(node) not in seen:
            seen.add(id(node))
            nodes.append(node)
            todo.extend(_parts(node))
    return nodes


def _set_heights(nodes: list[Node]) -> None:
    """Node.height of the nodes a root reaches (_reached). It is infinite when a required
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


def compile_schema(schema) -> Node:
    """JSON Schema (the supported subset) -> grammar node; SchemaError names what is not supported."""
    compiler = _Compiler(schema)
    try:
        node = compiler.run()
        nodes = _reached(node)
        dead = compiler.dead_refs(nodes)
        if dead:
            # compiled again, a use of one of those fails as the subschema inline would: it is
            # left out where optional. Only what had no finite document goes, so once is enough.
            compiler = _Compiler(schema, dead)
            node = compiler.run()
            nodes = _reached(node)
        # nested anyOfs, and $refs to anyOfs, are followed as one; those of what was left out
        # (no value satisfies it) are never followed
        reached = {id(n) for n in nodes}
        choices = [(choice, path) for choice, path in compiler.choices if id(choice) in reached]
        for b in _VALUE_STARTS:
            memo: dict = {}
            for choice, path in choices:
                if _first_byte(choice, b, memo) is None:
                    raise SchemaError(f"the anyOf at {path or '/'} and the anyOfs nested in it are more than "
                                      f"{MAX_CONFIGURATIONS} ways to read the first byte of its value",
                                      f"{path}/anyOf", "anyOf")
    except RecursionError:  # the compiler recurses once per level: a client's schema, not a bug
        raise SchemaError("the schema is nested too deeply", "") from None
    return node


def schema_key(schema) -> str:
    """The cache key of a schema: its JSON text, keys in their order (properties are written
    in schema order, so a reordered schema is another grammar)."""
    return json.dumps(schema, separators=(",", ":"))


def json_constraint(schema, index: TokenIndex) -> GrammarConstraint:
    """A constraint that lets the model write exactly one JSON document valid for `schema`."""
    key = ("json", schema_key(schema))
    return GrammarConstraint(index.grammar(key, lambda: compile_schema(schema)))


# ---------------------------------------------------------------------------------------------
# Validation of a parsed document against the supported subset
# ---------------------------------------------------------------------------------------------

def _type_ok(value, t) -> bool:
    if t == "object":
        return isinstance(value, dict)
    if t == "array":
        return isinstance(value, list)
    if t == "string":
        return isinstance(value, str)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "null":
        return value is None
    if t == "number":
        return _is_number(value)
    if t == "integer":
        return _is_number(value) and float(value).is_integer()
    return False


def _equal(a, b) -> bool:
    """JSON equality: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) in (int, float) and type(b) in (int, float) and a == b or (
        type(a) is type(b) and a == b)


def validate(value, schema, root=None, path: str = "") -> str | None:
    """None if `value` (parsed JSON) is valid for `schema`, else a message naming where it is not.

    Covers the keywords compile_schema accepts, with JSON Schema's meaning (not only the
    compact subset the matcher writes), so it can check any client-supplied document too.
    """
    root = schema if root is None else root
    if schema is True:
        return None
    if schema is False:
        return f"{path or '/'}: no value is allowed"
    at = path or "/"
    if "$ref" in schema:
        target = root
        for part in _pointer_keys(schema["$ref"]):
            target = target[part]
        err = validate(value, target, root, path)
        if err:
            return err
    if "anyOf" in schema and all(validate(value, s, root, path) for s in schema["anyOf"]):
        return f"{at}: matches none of anyOf"
    if "const" in schema and not _equal(value, schema["const"]):
        return f"{at}: is not the const value"
    if "enum" in schema and not any(_equal(value, v) for v in schema["enum"]):
        return f"{at}: is not one of the enum values"
    types = schema.get("type")
    if types is not None:
        types = types if isinstance(types, list) else [types]
        if not any(_type_ok(value, t) for t in types):
            return f"{at}: is not of type {'/'.join(types)}"
    if isinstance(value, str):
        n = len(value)
        if n < schema.get("minLength", 0) or n > schema.get("maxLength", n):
            return f"{at}: length {n} is out of bounds"
    if _is_number(value):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{at}: below minimum"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{at}: above maximum"
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            return f"{at}: not above exclusiveMinimum"
        if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
            return f"{at}: not below exclusiveMaximum"
    if isinstance(value, list):
        n = len(value)
        if n < schema.get("minItems", 0) or n > schema.get("maxItems", n):
            return f"{at}: {n} items is out of bounds"
        if "items" in schema:
            for i, item in enumerate(value):
                err = validate(item, schema["items"], root, f"{path}/{i}")
                if err:
                    return err
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                return f"{at}: missing required property {name!r}"
        extra = schema.get("additionalProperties", True)
        for name, v in value.items():
            sub = props.get(name, extra)
            if sub is False:
                return f"{at}: property {name!r} is not allowed"
            err = validate(v, sub, root, f"{path}/{name}")
            if err:
                return err
    return None
