"""The JSON Schema compiler: a schema (the supported subset) -> grammar nodes, or SchemaError.

It refuses by name what it cannot enforce (a keyword, a malformed value, a schema that
costs too much: MAX_PROPERTIES, MAX_ENUM, MAX_SUBSCHEMAS and MAX_ENUM_VALUES, and the
matcher's MAX_CONFIGURATIONS and MAX_DEPTH), and leaves out what no value satisfies where
it is optional. `json_constraint` is the entry point: a schema and a vocabulary -> one
generation's constraint.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

from ..errors import SchemaError, Unsatisfiable
from .grammar import (MAX_FRAC_DIGITS, MAX_INT_DIGITS, MAX_SIGNIFICANT, AnyOf, AnyValue, Array, FreeObject,
                      Literal, Node, Number, Object, Ref, String, needed, reachable, set_heights)
from .masks import TokenIndex
from .matcher import MAX_CONFIGURATIONS, Grammar, GrammarConstraint, feed
from .validation import is_number, pointer_keys, validate

# Bounds on what a client's schema may cost (D9). An object's optional properties cost
# n at each byte of a key (each is tried): 8,000 of them made a mask take 1.6 s.
MAX_PROPERTIES = 256   # declared properties of one object
MAX_ENUM = 1024        # values of one enum
# ... and of a whole schema, or of all the tools of a request together (one grammar): the
# bounds above are per object and per enum, so a 2-4 MB body of them compiled for 2-4 s
# (256 objects of 256 properties; of 64 enums of 40 values), and 128 tools for 128 times
# one. Compiling costs about 25 us a subschema and 4 us an enum value: 0.25 s and 0.04 s
# at the bounds. OpenAI's structured outputs allow 5,000 properties in all.
MAX_SUBSCHEMAS = 10_000    # subschemas compiled: properties' values, items, alternatives, $ref targets
MAX_ENUM_VALUES = 10_000   # values of all the enums and consts together

ANNOTATIONS = frozenset({"description", "title", "$schema", "$id", "$comment", "examples",
                         "default", "deprecated", "readOnly", "writeOnly"})
KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "items", "enum",
                      "const", "anyOf", "minItems", "maxItems", "minLength", "maxLength",
                      "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "$ref",
                      "$defs", "definitions"})
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")


def _dump(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


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
            if not is_number(v):
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


class Budget:
    """What one request's schemas may still cost (MAX_SUBSCHEMAS, MAX_ENUM_VALUES): a
    json_schema has its own, a request's tools share one (engine/tools.py). Spent as the
    compiler goes, so that a schema past a bound is refused before it is compiled whole."""

    def __init__(self):
        self.subschemas, self.values = MAX_SUBSCHEMAS, MAX_ENUM_VALUES  # what is left of each

    def spend_subschema(self, path: str) -> None:
        self.subschemas -= 1
        if self.subschemas < 0:
            raise SchemaError(f"more than {MAX_SUBSCHEMAS:,} subschemas in all, the one at {path or '/'} among "
                              "them (the tools of a request count together)", path)

    def spend_values(self, n: int, path: str, keyword: str) -> None:
        """n values of an enum or a const (`keyword`) at `path`."""
        self.values -= n
        if self.values < 0:
            raise SchemaError(f"more than {MAX_ENUM_VALUES:,} enum and const values in all, those at {path or '/'} "
                              "among them (the tools of a request count together)", f"{path}/{keyword}", keyword)


class _Compiler:
    """One pass over a schema. `dead`: the $refs a first pass found without a finite document,
    each with the error its uses raise, so that they are left out where they are optional
    (as the same subschema written inline is: a $ref is only compiled after the rest)."""

    def __init__(self, root, budget: Budget, dead: dict[str, Unsatisfiable] | None = None):
        self.root = root
        self.budget = budget
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
        for part in pointer_keys(ref):
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
        """The $refs among `nodes` (what the root reaches: reachable) that have no finite document,
        with the error their uses raise: that of a $ref no value satisfies which they cannot do
        without (as inline), if there is one, else that they can only be written by writing
        themselves again."""
        set_heights(nodes)
        ending = {id(node) for node in nodes if node.height < math.inf}
        why = {id(self.refs[ref]): e for ref, e in self.unsatisfiable.items()}  # (by node id)
        grew = True
        while grew:
            grew = False
            for node in reversed(nodes):  # (children first, as in set_heights)
                if id(node) not in ending and id(node) not in why:
                    because = next((why[id(part)] for part in needed(node) if id(part) in why), None)
                    if because is not None:
                        why[id(node)] = because
                        grew = True
        reached = {id(node) for node in nodes}
        dead = {}
        for ref, node in self.refs.items():
            if id(node) in reached and id(node) not in ending:
                where = "".join("/" + part for part in pointer_keys(ref))
                dead[ref] = why.get(id(node)) or Unsatisfiable(
                    f"no finite document satisfies the schema at {where or '/'}: a required property or "
                    "array item can only be written by writing its own object again", where, "required")
        return dead

    def compile(self, schema, path: str = "") -> Node:
        self.budget.spend_subschema(path)
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
        self.budget.spend_values(len(values), path, kind)
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
                feed((frame,), b, out)
            found = frozenset(out)
        memo[node] = found
    return found


def compile_schema(schema, budget: Budget | None = None) -> Node:
    """JSON Schema (the supported subset) -> grammar node; SchemaError names what is not supported.
    `budget`: what it may cost, shared with other schemas of the request (default: its own)."""
    compiler = _Compiler(schema, budget or Budget())
    try:
        node = compiler.run()
        nodes = reachable(node)
        dead = compiler.dead_refs(nodes)
        if dead:
            # compiled again, a use of one of those fails as the subschema inline would: it is
            # left out where optional. Only what had no finite document goes, so once is enough.
            # (with a budget of its own: it compiles part of what the first pass paid for)
            compiler = _Compiler(schema, Budget(), dead)
            node = compiler.run()
            nodes = reachable(node)
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
    return GrammarConstraint(Grammar.of(index, key, lambda: compile_schema(schema)))

