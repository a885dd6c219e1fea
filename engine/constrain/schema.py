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
from .formats import FORMATS
from .grammar import (MAX_FRAC_DIGITS, MAX_INT_DIGITS, MAX_SIGNIFICANT, AnyOf, AnyValue, Array, FreeObject,
                      Literal, Node, Number, Object, Ref, Repeat, Seq, String, needed, reachable, set_heights)
from .masks import TokenIndex
from .matcher import MAX_CONFIGURATIONS, Grammar, GrammarConstraint, feed
from .regex import Pattern, PatternError, compile_regex
from .validation import equal, is_number, pointer_keys, validate

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
# ... and DFA states of its distinct patterns and formats: a state costs about 0.15 ms to
# compile (each pattern has regex.py's bounds, MAX_DFA_STATES among them): 0.75 s at the
# bound. All the formats together are 1,600 states.
MAX_PATTERN_STATES = 5_000
MAX_MERGES = 64  # allOf and $ref inside allOf, one inside the other: a loop of them is refused here

# (`discriminator`: OpenAPI's, which pydantic writes beside a oneOf; it names the property
# that tells the alternatives apart, which the compiler checks for itself)
ANNOTATIONS = frozenset({"description", "title", "$schema", "$id", "$comment", "examples",
                         "default", "deprecated", "readOnly", "writeOnly", "discriminator"})
KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "items", "enum",
                      "const", "anyOf", "oneOf", "allOf", "minItems", "maxItems", "minLength", "maxLength",
                      "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "$ref",
                      "$defs", "definitions", "pattern", "format", "prefixItems", "minProperties",
                      "maxProperties", "nullable"})
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


COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
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
        elif key == "multipleOf":
            if not is_number(v) or v <= 0:
                raise SchemaError(f"'multipleOf' at {at} must be a number above 0", where, key)
        elif key in ("pattern", "format"):
            if not isinstance(v, str):
                raise SchemaError(f"'{key}' at {at} must be a string", where, key)
            if key == "format" and v not in FORMATS:  # (on any type: never ignored)
                raise SchemaError(f"unsupported format {v!r} at {at} (supported: {', '.join(FORMATS)})", where, key)
        elif key == "nullable":
            if not isinstance(v, bool):
                raise SchemaError(f"'nullable' at {at} must be a boolean", where, key)
        elif key in ("$defs", "definitions", "properties"):
            if not isinstance(v, dict):
                raise SchemaError(f"'{key}' at {at} must be an object", where, key)
        elif key in ("anyOf", "oneOf", "allOf", "enum", "prefixItems"):
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


def _values(schema: dict):
    """The values a schema's const or enum allows (None: it has neither)."""
    if "const" in schema:
        return [schema["const"]]
    return schema.get("enum")


def _kind(value) -> str:
    """The JSON type of a parsed value (an integral number is an integer)."""
    if isinstance(value, bool):
        return "boolean"
    if is_number(value):
        return "integer" if float(value).is_integer() else "number"
    return {dict: "object", list: "array", str: "string", type(None): "null"}[type(value)]


def _told_apart(f, g) -> bool:
    """Can no value match both of two oneOf alternatives, by the facts of each (_Compiler.facts)?"""
    (types, values, tags), (types2, values2, tags2) = f, g
    if types is not None and types2 is not None:
        widen = lambda ts: ts | ({"integer"} if "number" in ts else set())
        if not widen(types) & widen(types2):
            return True
    if values is not None and values2 is not None and not any(equal(v, w) for v in values for w in values2):
        return True
    return any(not any(equal(v, w) for v in tags[name] for w in tags2[name]) for name in tags.keys() & tags2.keys())


class Budget:
    """What one request's schemas may still cost (MAX_SUBSCHEMAS, MAX_ENUM_VALUES): a
    json_schema has its own, a request's tools share one (engine/tools.py). Spent as the
    compiler goes, so that a schema past a bound is refused before it is compiled whole."""

    def __init__(self):
        self.subschemas, self.values = MAX_SUBSCHEMAS, MAX_ENUM_VALUES  # what is left of each
        self.states = MAX_PATTERN_STATES
        self.patterns: set = set()  # those paid for: one used twice is compiled once

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

    def spend_pattern(self, regex: str, states: int, path: str, keyword: str) -> None:
        """A pattern or format (`keyword`) at `path` of `states` DFA states."""
        if regex in self.patterns:
            return
        self.patterns.add(regex)
        self.states -= states
        if self.states < 0:
            raise SchemaError(f"more than {MAX_PATTERN_STATES:,} DFA states of patterns and formats in all "
                              f"(MAX_PATTERN_STATES), those at {path or '/'} among them", f"{path}/{keyword}", keyword)


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
        target, where = self.lookup(ref, path)
        node = Ref(lambda: self.target(ref, target, where))
        self.refs[ref] = node
        self.lazy.append((node, path))
        return node

    def lookup(self, ref: str, path: str):
        """(the schema a local $ref at `path` points to, its path)."""
        if ref != "#" and not ref.startswith("#/"):
            raise SchemaError(f"only local $ref ('#/$defs/...') is supported, not {ref!r}", path, "$ref")
        target, where = self.root, ""
        for part in pointer_keys(ref):
            where += "/" + part
            if isinstance(target, dict) and part in target:
                target = target[part]
            else:
                raise SchemaError(f"$ref {ref!r} points to nothing", path, "$ref")
        return target, where

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

    def check(self, schema, path: str) -> dict:
        """A schema's constraints (its keywords less annotations and $defs), once its keywords
        are known and their values of their kind."""
        if not isinstance(schema, dict):
            raise SchemaError(f"the schema at {path or '/'} must be an object or a boolean", path)
        for key in schema:
            if key not in KEYWORDS and key not in ANNOTATIONS:
                raise SchemaError(f"unsupported JSON Schema keyword '{key}' at {path or '/'}",
                                  f"{path}/{key}", key)
        _check_values(schema, path)
        if "pattern" in schema:  # (whatever the type: a pattern is never ignored, nor one past a bound)
            self.regex(schema["pattern"], True, path, "pattern")
        return {k: v for k, v in schema.items() if k not in ANNOTATIONS and k not in ("$defs", "definitions")}

    def compile(self, schema, path: str = "") -> Node:
        self.budget.spend_subschema(path)
        if schema is True or schema == {}:
            return self.any_value
        if schema is False:
            raise Unsatisfiable(f"the schema at {path or '/'} is false: no value is valid", path)
        constraints = self.check(schema, path)
        if not constraints:
            return self.any_value
        if "nullable" in constraints:  # OpenAPI 3.0's: null is valid too (or, false, nothing more)
            rest = {k: v for k, v in constraints.items() if k != "nullable"} or True
            if not constraints["nullable"]:
                return self.compile(rest, path)
            return self.alternatives([(rest, path), ({"type": "null"}, path)], path, "nullable")
        if "allOf" in constraints or "$ref" in constraints and len(constraints) > 1:
            return self.compile(self.merged(constraints, path), path)
        if "$ref" in constraints:
            return self.resolve(schema["$ref"], f"{path}/$ref")
        for kind in ("anyOf", "oneOf"):
            if kind in constraints:
                rest = {k: v for k, v in constraints.items() if k != kind}
                options = [{"allOf": [rest, o]} if rest else o for o in constraints[kind]]
                if kind == "oneOf":
                    self.apart(options, path)
                return self.alternatives([(o, f"{path}/{kind}/{i}") for i, o in enumerate(options)], path, kind)
        if "enum" in constraints or "const" in constraints:
            return self.literal(schema, path)
        types = schema.get("type")
        if types is None:
            types = self.implied_type(constraints)
        if isinstance(types, list):
            return self.alternatives([({**schema, "type": t}, path) for t in types], path, "type")
        return getattr(self, "t_" + types)(schema, path)

    def alternatives(self, schemas: list[tuple], path: str, keyword: str) -> Node:
        """anyOf, oneOf, a list of types, nullable: the (schema, path) options that some value satisfies."""
        if len(schemas) > MAX_CONFIGURATIONS:  # they are all followed at once from the first byte
            raise SchemaError(f"an {keyword} of more than {MAX_CONFIGURATIONS} alternatives at {path or '/'} "
                              "is not supported", f"{path}/{keyword}", keyword)
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

    # -- allOf, and $ref beside other keywords: one schema of what all the parts say -------------

    def merged(self, schema: dict, path: str) -> dict:
        """allOf (and a $ref beside other keywords, which 2020-12 reads as one): one schema
        that says what all its parts say, the $refs at their tops followed. A keyword in two
        parts is combined where that is plain (types met, bounds the tighter, properties and
        items merged as allOf, enums met); else refused naming allOf."""
        parts = self.parts(schema, path, 0)
        out: dict = {}
        for part in parts:
            for key, v in part.items():
                out[key] = v if key not in out else self.combine(key, out[key], v, path)
        declared = set(out.get("properties", {}))
        for part in parts:  # additionalProperties reads the properties of its own part only
            if part.get("additionalProperties", True) is not True and declared - set(part.get("properties", {})):
                raise SchemaError(f"'additionalProperties' in one part of the allOf at {path or '/'} and properties "
                                  "declared in another is not supported", f"{path}/allOf", "allOf")
        return out

    def parts(self, schema, path: str, depth: int) -> list[dict]:
        """The constraints of an allOf's parts, nested allOfs and $refs followed."""
        if depth > MAX_MERGES:
            raise SchemaError(f"allOf and $ref nest more than {MAX_MERGES} deep at {path or '/'}",
                              f"{path}/allOf", "allOf")
        if schema is True:
            return []
        if schema is False:
            raise Unsatisfiable(f"a part of the allOf at {path or '/'} is false: no value is valid", path)
        self.budget.spend_subschema(path)
        own = self.check(schema, path)
        out = []
        for part in own.pop("allOf", []):
            out += self.parts(part, path, depth + 1)
        if "$ref" in own:
            out += self.parts(self.lookup(own.pop("$ref"), path)[0], path, depth + 1)
        return out + [own]

    def combine(self, key: str, a, b, path: str):
        """The one value of a keyword that two parts of an allOf give, or an error naming allOf."""
        if key == "properties":
            return {**a, **{name: {"allOf": [a[name], v]} if name in a else v for name, v in b.items()}}
        if equal(a, b):
            return a
        if key in ("minLength", "minItems", "minProperties", "minimum", "exclusiveMinimum"):
            return max(a, b)
        if key in ("maxLength", "maxItems", "maxProperties", "maximum", "exclusiveMaximum"):
            return min(a, b)
        if key == "required":
            return list(dict.fromkeys(a + b))
        if key == "type":
            return self.met_types(a, b, path)
        if key in ("items", "additionalProperties"):
            return a if b is True else b if a is True else {"allOf": [a, b]}
        if key in ("enum", "const"):
            kept = [v for v in (a if key == "enum" else [a]) if any(equal(v, w) for w in (b if key == "enum" else [b]))]
            if not kept:
                raise Unsatisfiable(f"no value of '{key}' in all parts of the allOf at {path or '/'}", f"{path}/allOf", "allOf")
            return kept if key == "enum" else kept[0]
        if key == "multipleOf" and all(isinstance(m, int) for m in (a, b)):
            return math.lcm(a, b)
        raise SchemaError(f"'{key}' in two parts of the allOf at {path or '/'}, with different values, is not "
                          "supported", f"{path}/allOf", "allOf")

    @staticmethod
    def met_types(a, b, path: str):
        """The types two parts of an allOf both allow (an integer is a number)."""
        a, b = (t if isinstance(t, list) else [t] for t in (a, b))
        both = [t for t in a if t in b or t == "integer" and "number" in b]
        both += [t for t in b if t == "integer" and t not in both and "number" in a]
        if not both:
            raise Unsatisfiable(f"the parts of the allOf at {path or '/'} share no type", f"{path}/allOf", "allOf")
        return both if len(both) > 1 else both[0]

    # -- oneOf: anyOf, where no value can match two alternatives ---------------------------------

    def apart(self, options: list, path: str) -> None:
        """Refuse a oneOf unless each two of its alternatives are told apart by their types,
        their const/enum values, or a property both require whose const/enum values differ
        (a discriminator's): then a value that matches one matches no other, and oneOf is anyOf."""
        facts = [self.facts(o, f"{path}/oneOf/{i}") for i, o in enumerate(options)]
        for i, f in enumerate(facts):
            for j in range(i):
                if not _told_apart(f, facts[j]):
                    raise SchemaError(f"alternatives {j} and {i} of the oneOf at {path or '/'} may both match one "
                                      "value (no type, const or enum, nor a required property's const or enum, "
                                      "tells them apart), which is not supported", f"{path}/oneOf", "oneOf")

    def facts(self, option, path: str):
        """(types or None, const/enum values or None, {required property: its const/enum values})."""
        if option is False:
            return set(), [], {}
        schema = self.merged({"allOf": [option]}, path)
        values = _values(schema)
        types = schema.get("type")
        types = set(types if isinstance(types, list) else [types]) if types else None
        if values is not None:
            kinds = {_kind(v) for v in values}
            types = kinds if types is None else types & (kinds | ({"integer"} if "number" in kinds else set()))
        tags = {}
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if isinstance(props.get(name), dict):
                found = _values(self.merged({"allOf": [props[name]]}, f"{path}/properties/{name}"))
                if found is not None:
                    tags[name] = found
        return types, values, tags

    @staticmethod
    def implied_type(constraints):
        """A schema without 'type': generate the kind its keywords describe (a valid subset)."""
        for t, keys in (("object", ("properties", "required", "additionalProperties", "minProperties",
                                    "maxProperties")),
                        ("array", ("items", "prefixItems", "minItems", "maxItems")),
                        ("string", ("minLength", "maxLength", "pattern", "format"))):
            if any(k in constraints for k in keys):
                return t
        return "number"  # only numeric bounds (and multipleOf) are left

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
        beside = sorted(set(schema) & {"properties", "additionalProperties", "items", "prefixItems"})
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
        if "pattern" in schema and "format" in schema:
            raise SchemaError(f"'pattern' beside 'format' at {path or '/'} is not supported", f"{path}/pattern", "pattern")
        if "format" in schema:
            regex, most = FORMATS[schema["format"]]
            keyword, search = "format", False
            hi = most if hi is None else min(hi, most or hi)
        elif "pattern" in schema:
            regex, keyword, search = schema["pattern"], "pattern", True
        else:
            return String(lo, hi)
        node = Pattern(self.regex(regex, search, path, keyword), lo, hi)
        if not node.satisfiable():
            raise Unsatisfiable(f"no string within the length bounds at {path or '/'} matches its '{keyword}'",
                                f"{path}/{keyword}", keyword)
        return node

    def regex(self, regex: str, search: bool, path: str, keyword: str):
        """The DFA of a pattern or a format (`keyword`) at `path`, paid for."""
        try:
            dfa = compile_regex(regex, search)
        except PatternError as e:
            raise SchemaError(f"'pattern' at {path or '/'}: {e}", f"{path}/pattern", "pattern") from None
        self.budget.spend_pattern(regex, 0 if dfa.empty else len(dfa.next), path, keyword)
        return dfa

    def t_integer(self, schema, path):
        return self.number(schema, path, integer=True)

    def t_number(self, schema, path):
        return self.number(schema, path, integer=False)

    def number(self, schema, path, integer):
        multiple = schema.get("multipleOf", 1)
        if not float(multiple).is_integer():
            # a double's division decides it for the readers (jsonschema's too): 0.07 / 0.01 is
            # 7.000000000000001, so 0.07 is not a multiple of 0.01
            raise SchemaError(f"a 'multipleOf' that is not an integer, at {path or '/'}, is not supported",
                              f"{path}/multipleOf", "multipleOf")
        multiple = int(multiple)
        integer = integer or "multipleOf" in schema  # (a number's multiples of an integer are integers)
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
            node = Number(integer, lo, hi, digits, multiple)
            if node._feasible(False, "", None) or node._feasible(True, "", None):  # MAX_SIGNIFICANT
                return node
        if not between or multiple != 1:
            what = "integer" if integer else f"number of at most {MAX_SIGNIFICANT} fraction digits"
            what += f" multiple of {multiple}" if multiple != 1 else ""
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
        if "prefixItems" in schema:
            return self.tuple(schema, lo, hi, path)
        try:
            items = self.compile(schema["items"], f"{path}/items") if "items" in schema else self.any_value
        except Unsatisfiable:
            if lo > 0:
                raise
            return Literal([b"[]"])  # no item can be written: only the empty array
        return Array(items, lo, hi)

    def tuple(self, schema, lo, hi, path):
        """prefixItems: the first items each of its own schema, the others of `items`; built of
        sequences: `[` then item 1, then (`,` item 2, then (...) or the end) or the end, `]`."""
        prefix = []
        for i, s in enumerate(schema["prefixItems"]):
            if hi is not None and i >= hi:
                break
            try:
                prefix.append(self.compile(s, f"{path}/prefixItems/{i}"))
            except Unsatisfiable:
                if lo > i:
                    raise
                hi = i  # the array ends before the item no value satisfies
                break
        n, rest = len(prefix), None
        if n == len(schema["prefixItems"]) and (hi is None or hi > n):
            try:
                rest = self.compile(schema.get("items", True), f"{path}/items")
            except Unsatisfiable:
                pass
        if rest is None and lo > n:
            raise Unsatisfiable(f"minItems at {path or '/'} asks for more items than prefixItems and items allow",
                                f"{path}/minItems", "minItems")
        end = Literal([b""])
        after = end if rest is None else Repeat(Seq([_COMMA, rest]), max(0, lo - n), None if hi is None else hi - n)
        for i in range(n - 1, 0, -1):  # what follows item i (i items written)
            more = Seq([_COMMA, prefix[i], after])
            after = AnyOf([end, more]) if i >= lo else more
        body = Seq([prefix[0], after]) if n else after
        return Seq([Literal([b"["]), AnyOf([end, body]) if lo == 0 and n else body, Literal([b"]"])])

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
            return Object(*self.counted(schema, names, values, required, path))
        if schema.get("maxProperties") == 0:
            return Literal([b"{}"])
        for key in ("minProperties", "maxProperties"):
            if key in schema and (key == "maxProperties" or schema[key] > 0):
                # (distinct keys, which minProperties counts, are more than a grammar holds)
                raise SchemaError(f"'{key}' on an object without declared properties, at {path or '/'}, is not "
                                  "supported", f"{path}/{key}", key)
        try:
            values = self.compile(extra, f"{path}/additionalProperties") if isinstance(extra, dict) else self.any_value
        except Unsatisfiable:
            return Literal([b"{}"])  # no value of any key can be written: only the empty object
        return FreeObject(values)


    @staticmethod
    def counted(schema, names, values, required, path):
        """(names, values, required) of an object that minProperties and maxProperties leave:
        the first optional properties required, up to minProperties; the last ones never
        written, past maxProperties (a valid subset: the object is written in schema order)."""
        least, most = schema.get("minProperties", 0), schema.get("maxProperties")
        if least > len(names):
            raise SchemaError(f"'minProperties' at {path or '/'} asks for more properties than are declared, "
                              "which is not supported", f"{path}/minProperties", "minProperties")
        must = sum(name in required for name in names)
        required = [*required, *[name for name in names if name not in required][:max(0, least - must)]]
        if most is None:
            return names, values, required
        room = most - sum(name in required for name in names)  # optional ones that may still be written
        if room < 0:
            raise Unsatisfiable(f"'maxProperties' at {path or '/'} is less than the properties required",
                                f"{path}/maxProperties", "maxProperties")
        kept = []
        for name, value in zip(names, values):
            if name in required or room > 0:
                kept.append((name, value))
                room -= name not in required
        return [name for name, _ in kept], [value for _, value in kept], required


_VALUE_STARTS = b'"-0123456789[{ftn'  # the bytes a JSON value can begin with
_COMMA = Literal([b",", b", "])  # between items, as Array writes it


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

