"""Constrained decoding: a JSON Schema subset compiled to a byte matcher, and token masks.

A small model left alone writes broken JSON; here it cannot. At every step only the tokens
whose bytes keep the output a valid prefix of an allowed document get a chance, and the
end-of-sequence token only once the document is complete. Five files, one concern each,
read in this order (each imports only those before it):

1. masks.py, the token masks. `TokenIndex` keeps the vocabulary sorted by bytes; a sorted
   list *is* a trie (the tokens sharing a prefix are contiguous), so a mask is a walk that
   only descends into byte prefixes a `Recognizer` accepts; it knows no grammar (as in
   llguidance, the parser implements the recognizer the token trie walks). Inside a JSON
   string nearly every token is allowed, so there a vectorised precomputed mask of
   "plain" tokens (no quote, backslash or control byte, whole UTF-8 characters) is used,
   and only the few other tokens are checked one by one. The sampled token is checked
   first with `allows()`, so most steps need no mask at all. `can_constrain`: whether a
   vocabulary can be constrained.

2. grammar.py, the grammar nodes. A schema compiles to a graph of small nodes (literal,
   string, number, array, object, any value, plus sequence / repeat / free text for tool
   calls). A node reads one byte at a time from an immutable local state and answers with
   actions: keep reading, or start a child value (the byte goes to the child, or the child
   starts with the next byte). Completed children are popped from the stack and their
   parent resumes. Also there: how deep a node's documents must nest (Node.height), the
   nodes' mask shortcuts, from the vocabulary's precomputed masks (Node.fast), and the
   shortest bytes that complete a node from a local state (Node.finish, a search over
   its actions by default), which the output budget counts.

3. matcher.py, the matcher. A configuration is a stack (tuple) of frames `(node, local)`;
   a matcher state is a frozenset of configurations, so alternatives (`anyOf`, type lists,
   a number that could end or go on) are followed side by side like an NFA. States are
   immutable and hashable: transitions and masks are cached by state (`Grammar`, shared by
   every generation of one schema, the recognizer of masks.py); `GrammarConstraint` is
   one generation's position, and its budget: with `limit(max_tokens)` a token is
   allowed only if the shortest completion after it (Grammar.plan: its frames' finishes,
   in the fewest tokens that write them) fits the tokens left, so that a document the
   limit cuts is whole all the same; a limit below the shortest document is refused
   (OutputBudgetTooSmall).

4. validation.py, `validate`: a parsed document against the supported subset, with JSON
   Schema's meaning (the compiler keeps with it the values of an enum that the keywords
   beside it allow).

5. schema.py, the JSON Schema compiler: schema -> nodes, the bounds on what a schema may
   cost (`Budget`: of one schema, or of a request's tools together), and `json_constraint`
   (schema + vocabulary -> a generation's constraint).

The JSON written is compact and bounded: no whitespace except at most one space after `:`
and `,`, object properties in schema order (optional ones may be skipped, required ones must
appear; with `properties` given, or keys `required`, no other key is written, without them
any string keys; a required key not in `properties` comes after those, its value as
`additionalProperties` says), numbers without exponent with at most 15 integer and 6
fraction digits (more when the bounds are finer), and 15 digits in all when there is a
fraction (so that the float a reader parses compares with the bounds as the decimal
did), values inside at most 63 arrays and objects (MAX_DEPTH). Strings are as long as the
model makes them unless `maxLength` says otherwise, or the budget closes them: a document
the budget closed is reported as cut (finish reason "length"), and it is whole.

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

from .grammar import AnyOf, FreeText, Literal, Object, Repeat, Seq, writes_objects
from .masks import TokenIndex, can_constrain
from .matcher import Grammar, GrammarConstraint
from .schema import Budget, compile_schema, json_constraint, schema_key
from .validation import validate

__all__ = [
    "TokenIndex",
    "Grammar",
    "GrammarConstraint",
    "compile_schema",
    "Budget",
    "writes_objects",
    "can_constrain",
    "json_constraint",
    "schema_key",
    "validate",
    "Literal",
    "Seq",
    "Repeat",
    "FreeText",
    "AnyOf",
    "Object",
]
