"""Validation of a parsed document against the supported subset, with JSON Schema's meaning.

The compiler uses it to keep the values of an enum or const that the keywords beside it
allow; it also checks any client-supplied document (not only the compact ones the matcher
writes). Also here: the two readings of a schema the compiler shares with it.
"""

from __future__ import annotations

import math
from urllib.parse import unquote

from .formats import FORMATS
from .regex import compile_regex, matches


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def pointer_keys(ref: str) -> list[str]:
    """The keys a local $ref walks ("#/$defs/a%20b" -> ["$defs", "a b"]): a URI fragment,
    %-encoded, holding a JSON pointer (in which ~1 is "/" and ~0 is "~")."""
    if ref == "#":
        return []
    return [unquote(part).replace("~1", "/").replace("~0", "~") for part in ref[2:].split("/")]


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
        return is_number(value)
    if t == "integer":
        return is_number(value) and float(value).is_integer()
    return False


def equal(a, b) -> bool:
    """JSON equality: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return type(a) in (int, float) and type(b) in (int, float) and a == b or (
        type(a) is type(b) and a == b)


def validate(value, schema, root=None, path: str = "") -> str | None:
    """None if `value` (parsed JSON) is valid for `schema`, else a message naming where it is not.

    Covers the keywords compile_schema accepts, with JSON Schema's meaning (not only the
    compact subset the matcher writes), so it can check any client-supplied document too;
    but a format as the compiler writes it (formats.py: a subset of each) and OpenAPI's
    `nullable` not at all (as a JSON Schema validator reads it: an unknown keyword).
    """
    root = schema if root is None else root
    if schema is True:
        return None
    if schema is False:
        return f"{path or '/'}: no value is allowed"
    at = path or "/"
    if "$ref" in schema:
        target = root
        for part in pointer_keys(schema["$ref"]):
            target = target[part]
        err = validate(value, target, root, path)
        if err:
            return err
    if "anyOf" in schema and all(validate(value, s, root, path) for s in schema["anyOf"]):
        return f"{at}: matches none of anyOf"
    if "oneOf" in schema and sum(validate(value, s, root, path) is None for s in schema["oneOf"]) != 1:
        return f"{at}: does not match exactly one of oneOf"
    for part in schema.get("allOf", []):
        err = validate(value, part, root, path)
        if err:
            return err
    if "const" in schema and not equal(value, schema["const"]):
        return f"{at}: is not the const value"
    if "enum" in schema and not any(equal(value, v) for v in schema["enum"]):
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
        if "pattern" in schema and not matches(compile_regex(schema["pattern"]), value):
            return f"{at}: does not match the pattern"
        if "format" in schema and not matches(compile_regex(FORMATS[schema["format"]][0], search=False), value):
            return f"{at}: is not a {schema['format']} as the compiler writes one"
    if is_number(value):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{at}: below minimum"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{at}: above maximum"
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            return f"{at}: not above exclusiveMinimum"
        if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
            return f"{at}: not below exclusiveMaximum"
        if "multipleOf" in schema and not (value / schema["multipleOf"]).is_integer():
            return f"{at}: not a multiple of multipleOf"
    if isinstance(value, list):
        n = len(value)
        if n < schema.get("minItems", 0) or n > schema.get("maxItems", n):
            return f"{at}: {n} items is out of bounds"
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            sub = prefix[i] if i < len(prefix) else schema.get("items", True)
            err = validate(item, sub, root, f"{path}/{i}")
            if err:
                return err
    if isinstance(value, dict):
        n = len(value)
        if n < schema.get("minProperties", 0) or n > schema.get("maxProperties", n):
            return f"{at}: {n} properties is out of bounds"
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
