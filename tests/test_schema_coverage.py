"""JSON Schema coverage: formats, patterns and the keywords beyond the first subset.

The oracles are independent of the compiler: jsonschema's Draft 2020-12 validator with its
format checker, and for the formats it only checks with packages not installed here
(duration, hostname, uri: isoduration, fqdn, rfc3987), the standard library or a reading
of the RFC's grammar written here by hand, never the patterns formats.py compiles.
"""

import datetime
import ipaddress
import json
import re
import string
import uuid
from urllib.parse import urlsplit

import jsonschema
import numpy as np
import pytest

from engine.constrain import TokenIndex, compile_schema, json_constraint
from engine.constrain.regex import MAX_DFA_STATES, MAX_NFA_STATES, MAX_PATTERN_LENGTH
from engine.constrain.schema import MAX_PATTERN_STATES
from engine.errors import SchemaError, Unsatisfiable
from engine.tokenizer import Tokenizer
from tests.conftest import DATA
from tests.test_constrain import BYTES, _encode_exact, accepts, random_run
from tiny import load_tokenizer_meta

CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def valid(schema, value) -> bool:
    return jsonschema.Draft202012Validator(schema, format_checker=CHECKER).is_valid(value)


@pytest.fixture(scope="module")
def smollm2():
    tok = Tokenizer.from_metadata(load_tokenizer_meta(DATA / "tokenizer-meta.smollm2.json.gz"))
    return TokenIndex.of(tok)


def documents(schema, index, runs: int, max_tokens: int = 400) -> list:
    """The documents random-logit runs write under `schema`'s constraint (each must end)."""
    out = []
    for seed in range(runs):
        text, complete = random_run(json_constraint(schema, index), index.n_vocab, seed, max_tokens)
        assert complete, (seed, text)
        out.append(json.loads(text))
    return out


# -- formats: what the model writes is what the RFC and the readers accept ------------------------

def _digits(s: str, n: int | None = None) -> bool:
    return s.isascii() and s.isdigit() and (n is None or len(s) == n)


def rfc3339_duration(s: str) -> bool:
    """RFC 3339 appendix A's `duration`, read by hand: P, then weeks, or a date part in
    Y M D order (each after the one before it only), then a T part in H M S order."""
    if not s.startswith("P") or len(s) < 3:
        return False
    body = s[1:]
    if body.endswith("W"):
        return _digits(body[:-1])
    date, _, time = body.partition("T")
    if "T" in body and not time:
        return False

    def units(part, order):
        seen = []
        while part:
            k = 0
            while k < len(part) and part[k].isdigit():
                k += 1
            if k == 0 or k == len(part) or part[k] not in order:
                return None
            seen.append(part[k])
            part = part[k + 1:]
        return seen if seen == sorted(seen, key=order.index) and len(set(seen)) == len(seen) else None

    d, t = units(date, "YMD"), units(time, "HMS")
    if d is None or t is None or not (d or t):
        return False
    # the ABNF's chains: a unit is only followed by the next one (Y then M, never Y then D)
    return all(order.index(b) == order.index(a) + 1 for order, seq in (("YMD", d), ("HMS", t))
               for a, b in zip(seq, seq[1:]))


def rfc1123_hostname(s: str) -> bool:
    ok = set(string.ascii_letters + string.digits + "-")
    return len(s) <= 253 and all(
        1 <= len(label) <= 63 and set(label) <= ok and label[0] != "-" and label[-1] != "-" for label in s.split("."))


def rfc3986_uri(s: str) -> bool:
    allowed = set(string.ascii_letters + string.digits + "-._~:/?#[]@!$&'()*+,;=%")
    parts = urlsplit(s)
    return (set(s) <= allowed and bool(parts.scheme) and parts.scheme[0].isalpha() and bool(parts.hostname)
            and all(len(s[i + 1:i + 3]) == 2 and set(s[i + 1:i + 3]) <= set(string.hexdigits)
                    for i in range(len(s)) if s[i] == "%")
            and (parts.port is None or 0 <= parts.port <= 65535))


def email(s: str) -> bool:
    local, at, domain = s.rpartition("@")
    atext = set(string.ascii_letters + string.digits + "!#$%&'*+/=?^_`{|}~-")
    return (bool(at) and len(s) <= 254 and all(atom and set(atom) <= atext for atom in local.split("."))
            and "." in domain and rfc1123_hostname(domain))


def rfc3339_date_time(s: str) -> bool:
    """RFC 3339's date-time: ISO 8601 as the standard library reads it, with its "T" and an offset
    (fromisoformat alone takes any separator and a time without one)."""
    return s[10:11] in ("T", "t") and datetime.datetime.fromisoformat(s).tzinfo is not None


def rfc3339_time(s: str) -> bool:
    """RFC 3339's full-time: hh:mm:ss and an offset, which fromisoformat leaves optional."""
    return s[5:6] == ":" and datetime.time.fromisoformat(s).tzinfo is not None


STDLIB = {  # format -> an independent reader that raises or returns False on what it refuses
    "date-time": rfc3339_date_time,
    "date": datetime.date.fromisoformat,
    "time": rfc3339_time,
    "duration": rfc3339_duration,
    "email": email,
    "uuid": lambda s: str(uuid.UUID(s)) == s.lower(),
    "uri": rfc3986_uri,
    "ipv4": ipaddress.IPv4Address,
    "ipv6": ipaddress.IPv6Address,
    "hostname": rfc1123_hostname,
}


def stdlib_reads(fmt: str, s: str) -> bool:
    try:
        return STDLIB[fmt](s) is not False
    except ValueError:
        return False


@pytest.mark.parametrize("fmt", sorted(STDLIB))
def test_every_format_writes_what_its_rfc_and_the_standard_library_read(fmt):
    schema = {"type": "string", "format": fmt, "maxLength": 40}  # (a random model's strings end)
    written = documents(schema, BYTES, runs=40)
    assert len(set(written)) > 20, written  # many different ones, not one way through the DFA
    for s in written:
        assert valid(schema, s) and stdlib_reads(fmt, s), s


@pytest.mark.parametrize("fmt, good, bad", [
    ("date-time", ["2024-02-29T23:59:59Z", "0001-01-01T00:00:00.123456+14:00"],
     ["2023-02-29T00:00:00Z", "2024-04-31T00:00:00Z", "2024-01-01T24:00:00Z", "2024-01-01T00:00:60Z",
      "0000-01-01T00:00:00Z", "2024-01-01 00:00:00Z", "2024-01-01T00:00:00"]),
    ("date", ["2000-02-29", "1900-02-28"], ["1900-02-29", "2024-13-01", "24-01-01"]),
    ("time", ["23:59:59.5-08:00"], ["23:59:59", "12:00Z"]),
    ("duration", ["P1Y2M3DT4H5M6S", "PT1S", "P3W", "P1D"], ["P", "PT", "P1H", "P1S", "P1Y1D", "1D"]),
    ("email", ["a.b+c@example.com"], ["a..b@example.com", "ab@example", "@example.com"]),
    ("uuid", ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
    ("uri", ["https://user@example.com:8080/a/b?q=1#f", "urn://x"], ["example.com", "http://", "a b://c"]),
    ("ipv4", ["255.255.255.255", "0.0.0.0"], ["256.1.1.1", "01.1.1.1", "1.1.1"]),
    ("ipv6", ["::", "1::", "fe80::1:2", "1:2:3:4:5:6:7:8"], ["1:::", "1:2:3:4:5:6:7:8:9", "::1::"]),
    ("hostname", ["a-b.example", "x"], ["-a.example", "a_b", "a..b", "a" * 64]),
])
def test_a_format_accepts_what_its_readers_accept_and_refuses_what_they_refuse(fmt, good, bad):
    schema = {"type": "string", "format": fmt}
    for s in good:
        assert accepts(schema, json.dumps(s)), s
        assert valid(schema, s) and stdlib_reads(fmt, s), s
    for s in bad:
        assert not accepts(schema, json.dumps(s)), s
        assert not (valid(schema, s) and stdlib_reads(fmt, s)), s


def test_a_format_is_enforced_where_pydantic_puts_it_beside_lengths_and_types():
    # pydantic's HttpUrl, and Optional[datetime]
    schema = {"type": "object", "properties": {
        "url": {"format": "uri", "maxLength": 30, "minLength": 1, "type": "string"},
        "when": {"anyOf": [{"format": "date-time", "type": "string"}, {"type": "null"}]}},
        "required": ["url", "when"], "additionalProperties": False}
    for doc in documents(schema, BYTES, runs=20):
        assert valid(schema, doc) and len(doc["url"]) <= 30 and stdlib_reads("uri", doc["url"]), doc
        assert doc["when"] is None or stdlib_reads("date-time", doc["when"])


def test_an_unknown_format_is_refused_by_name_whatever_the_type():
    for schema in ({"type": "string", "format": "iri"}, {"type": "integer", "format": "int64"}):
        with pytest.raises(SchemaError) as e:
            compile_schema(schema)
        assert (e.value.keyword, e.value.path) == ("format", "/format") and "iri" in str(e.value) or "int64" in str(e.value)


# -- patterns ---------------------------------------------------------------------------------------

PATTERNS = [
    r"^[a-z]{2,4}-\d{3}$", r"^(?:\+\d{1,3} )?\(?\d{3}\)?[ -]?\d{3}-\d{4}$", r"ab+c", r"^[^@\s]+@[^@\s]+$",
    r"^(red|green|blue)$", r"^\w+(\.\w+)*$", r'^["\\]{1,3}$', r"^[\x41-\x43\u00e9]+$", r"^.?$", r"^\S{2}\s\D$",
    r"^(a|b)*c$", r"x{2}y{0,2}$", r"^\$\d+\.\d\d$", r"^[-+]?[0-9]*\.?[0-9]+$", r"^[A-Z][a-z]*( [A-Z][a-z]*)*$",
    r"^\t\n$", r"^[a-c]*$|^\d+$", r"^é+日?$",
]
ALPHABET = list("abcxyz019 -+.()@\\\"\t\nAZéü日$_") + ["\u2028", "😀", "\x00"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_accepts_exactly_the_strings_jsonschema_matches(pattern):
    schema = {"type": "string", "pattern": pattern}
    rng = np.random.default_rng(len(pattern))
    candidates = ["".join(rng.choice(ALPHABET, n)) for n in rng.integers(0, 7, 600)]
    candidates += documents({**schema, "maxLength": 12}, BYTES, runs=20)
    for s in candidates:
        accepted = accepts(schema, json.dumps(s, ensure_ascii=False))
        assert not accepted or valid(schema, s), s
        # where ECMA-262 (JSON Schema's) and Python (jsonschema's) agree, exactly what both match:
        # not where Python's $ matches before a last newline, nor Python's \w \d \s Unicode letters
        if not s.endswith("\n") and (s.isascii() or not re.search(r"\\[wWdDsS]|\.", pattern)):
            assert accepted == valid(schema, s) == bool(re.search(pattern, s)), s


def test_a_pattern_and_length_bounds_together_never_lead_to_a_dead_end(smollm2):
    for schema in ({"type": "string", "pattern": "^(ab)+$", "minLength": 3, "maxLength": 5},
                   {"type": "string", "pattern": "^(abc|d)+$", "minLength": 4, "maxLength": 4},
                   {"type": "string", "pattern": "[a-z]", "minLength": 2, "maxLength": 3}):
        for doc in documents(schema, smollm2, runs=10) + documents(schema, BYTES, runs=10):
            assert valid(schema, doc), (schema, doc)
    assert accepts({"type": "string", "pattern": "^(ab)+$", "minLength": 3, "maxLength": 5}, '"abab"')
    with pytest.raises(Unsatisfiable) as e:
        compile_schema({"type": "string", "pattern": "^(ab)+$", "minLength": 5, "maxLength": 5})
    assert e.value.keyword == "pattern"


def test_a_mask_inside_a_pattern_agrees_with_allows(smollm2):
    """Where many bytes may come (an unanchored pattern's tail, an e-mail address) a mask
    reads every plain token at once; where few may (a date-time's digits) it walks the trie;
    both decide as allows() does, within the length bounds too."""
    sample = np.random.default_rng(3).choice(smollm2.n_vocab, 4000, replace=False).tolist()
    specials = [i for i, data in enumerate(smollm2.token_bytes) if b'"' in data or b"\\" in data]
    for schema, prefix in (({"type": "string", "pattern": "ab"}, '"xxab'),
                           ({"type": "string", "pattern": "ab", "maxLength": 6}, '"xxab'),
                           ({"type": "string", "format": "date-time"}, '"2024-02-2'),
                           ({"type": "string", "pattern": "^[a-z ]+$", "minLength": 4, "maxLength": 8}, '"ab'),
                           ({"type": "string", "pattern": "^[a-z ]+$", "minLength": 5}, '"ab'),
                           ({"type": "string", "format": "email"}, '"ada.')):
        c = json_constraint(schema, smollm2)
        for t in _encode_exact(smollm2, prefix):
            c.advance(t)
        mask = c.mask()
        for t in sample + specials + sorted(smollm2.eos_ids):
            assert mask[t] == c.allows(t), (schema, t, smollm2.token_bytes[t])


@pytest.mark.parametrize("pattern, what", [
    ("(?=a)b", "lookaround"), ("(?<!a)b", "lookaround"), (r"(a)\1", r"\1"), (r"\bword", r"\b"),
    ("(?<name>a)", "named group"), ("(?i)a", "flag"), ("a^b", "'^'"), ("a$b", "'$'"), (r"\p{L}", r"\p"),
    ("[]a]", "class beginning"), ("a{,3}", "{,n}"), ("a**", "quantifier on a quantifier"), ("(a", "unclosed"),
    ("[a", "unclosed"), ("*a", "nothing to repeat"), (r"\k<n>", r"\k"), ("[[:alpha:]]", "POSIX"),
])
def test_a_pattern_outside_the_subset_is_refused_naming_pattern(pattern, what):
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}}
    with pytest.raises(SchemaError) as e:
        compile_schema(schema)
    assert (e.value.keyword, e.value.path) == ("pattern", "/properties/p/pattern") and what in str(e.value)


def test_a_pattern_past_a_bound_is_refused_naming_the_bound():
    for pattern, bound in (("a" * (MAX_PATTERN_LENGTH + 1), "MAX_PATTERN_LENGTH"),
                           ("(a{200}){200}", "MAX_NFA_STATES"),
                           ("(a|b)*a(a|b){12}", "MAX_DFA_STATES")):  # 2^13 states: which of the last 13 were a
        with pytest.raises(SchemaError) as e:
            compile_schema({"type": "string", "pattern": pattern})
        assert e.value.keyword == "pattern" and bound in str(e.value), str(e.value)
    assert MAX_NFA_STATES < 200 * 200 and MAX_DFA_STATES < 2 ** 13
    # ... and the patterns of a request together: each of 1,025 states, distinct
    many = {f"p{k}": {"type": "string", "pattern": f"^{k}(a|b)*a(a|b){{9}}$"} for k in range(5)}
    with pytest.raises(SchemaError) as e:
        compile_schema({"type": "object", "properties": many})
    assert e.value.keyword == "pattern" and "MAX_PATTERN_STATES" in str(e.value) and MAX_PATTERN_STATES < 5 * 1025


# -- the other keywords, with jsonschema as the oracle ---------------------------------------------

PET = {"$defs": {
    "Cat": {"type": "object", "properties": {"kind": {"const": "cat", "type": "string"},
                                              "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["kind", "lives"], "additionalProperties": False},
    "Dog": {"type": "object", "properties": {"kind": {"const": "dog", "type": "string"},
                                              "good": {"type": "boolean"}},
            "required": ["kind", "good"], "additionalProperties": False}},
    "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
    "discriminator": {"propertyName": "kind", "mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"}}}

KEYWORD_SCHEMAS = [
    PET,
    {"oneOf": [{"type": "string", "maxLength": 4}, {"type": "integer"}, {"type": "array", "maxItems": 2,
                                                                         "items": {"type": "null"}}]},
    {"oneOf": [{"const": 1}, {"const": "1"}, {"enum": [[1], {"a": None}]}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"]},
               {"properties": {"a": {"maximum": 5}, "b": {"type": "string", "maxLength": 3}}, "required": ["b"]}]},
    {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}},
                        "required": ["id"]}},
     "allOf": [{"$ref": "#/$defs/Base"}], "properties": {"n": {"type": "number", "exclusiveMaximum": 1}},
     "required": ["n"]},
    {"$defs": {"Short": {"type": "string", "maxLength": 8}}, "type": "object",
     "properties": {"s": {"$ref": "#/$defs/Short", "minLength": 2, "pattern": "^[a-z]+$"}}, "required": ["s"]},
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}], "minimum": 10, "maximum": 20},
    {"type": "integer", "multipleOf": 7, "minimum": -50, "maximum": 50},
    {"type": "number", "multipleOf": 5},
    {"type": "array", "prefixItems": [{"type": "integer", "maximum": 9}, {"type": "string", "maxLength": 3},
                                      {"type": "boolean"}], "minItems": 1, "items": False},
    {"type": "array", "prefixItems": [{"const": "x"}], "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 3, "maxItems": 5},
    {"type": "object", "properties": {k: {"type": "integer", "maximum": 9} for k in "abcde"},
     "minProperties": 2, "maxProperties": 3},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2}}, "required": ["a"],
     "additionalProperties": {"type": "integer"}},
    {"type": "object", "additionalProperties": {"type": "string", "format": "date", "maxLength": 10},
     "maxProperties": 0},
    {"enum": [{"a": [1, None]}, [True, 2.5], "s", None, -3]},
    {"const": {"nested": {"deep": ["x", 1]}}},
    {"type": ["string", "integer", "null"], "maxLength": 2, "minimum": 0, "maximum": 3},
    {"type": "string", "pattern": "^[A-Z]{3}$", "enum": ["ABC", "abc", "ABCD", "XYZ"]},
]


@pytest.mark.parametrize("schema", KEYWORD_SCHEMAS)
def test_what_the_model_writes_is_valid_for_jsonschema(schema, smollm2):
    written = documents(schema, BYTES, runs=15) + documents(schema, smollm2, runs=15)
    for doc in written:
        assert valid(schema, doc), doc


def test_a_discriminated_union_writes_both_alternatives():
    kinds = {doc["kind"] for doc in documents(PET, BYTES, runs=30)}
    assert kinds == {"cat", "dog"}


@pytest.mark.parametrize("schema, good, bad", [
    (PET, ['{"kind":"cat","lives":9}', '{"kind":"dog","good":true}'], ['{"kind":"cat","good":true}', '{}']),
    ({"type": "integer", "multipleOf": 7, "minimum": -50, "maximum": 50}, ["-49", "0", "49", "14"],
     ["50", "-50", "1", "-0", "56"]),
    ({"type": "number", "multipleOf": 5}, ["-10", "0", "123456789012345"], ["1", "5.0", "2.5"]),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
     ["[]", "[1]", '[1,"a"]', '[1, "a"]'], ['["a"]', '[1,"a",2]', "[1,2]"]),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "boolean"}, "minItems": 2},
     ["[1,true]", "[1,true,false]"], ["[1]", "[true,true]", "[1,2]"]),
    ({"type": "object", "properties": {k: {"type": "integer"} for k in "abc"}, "required": ["c"],
      "minProperties": 2, "maxProperties": 2},
     ['{"a":1,"c":3}'], ['{"c":3}', '{"b":1,"c":3}', '{"a":1,"b":2,"c":3}']),
    ({"type": "string", "nullable": True, "maxLength": 2}, ['"ab"', "null"], ['"abc"', "1"]),
    ({"$ref": "#/$defs/a", "maxLength": 3, "$defs": {"a": {"type": "string", "minLength": 2}}},
     ['"ab"', '"abc"'], ['"a"', '"abcd"']),
])
def test_documents_of_the_new_keywords_accepted_and_rejected(schema, good, bad):
    oracle = {k: v for k, v in schema.items() if k != "nullable"}
    if schema.get("nullable"):
        oracle["type"] = [oracle["type"], "null"]  # (OpenAPI's nullable, as a type list)
    for text in good:
        assert accepts(schema, text) and valid(oracle, json.loads(text)), text
    for text in bad:
        assert not accepts(schema, text), text


def test_a_recursive_model_with_refs_and_formats_writes_valid_trees():
    schema = {"$defs": {"Node": {"type": "object", "properties": {
        "at": {"type": "string", "format": "date"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2}},
        "required": ["at"], "additionalProperties": False}}, "$ref": "#/$defs/Node"}
    for doc in documents(schema, BYTES, runs=20, max_tokens=2000):
        assert valid(schema, doc)


@pytest.mark.parametrize("schema, keyword, path", [
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "/oneOf"),    # 1 is both
    ({"oneOf": [{"$ref": "#/$defs/a"}, {"type": "object"}], "$defs": {"a": {"type": "object"}}}, "oneOf", "/oneOf"),
    ({"allOf": [{"type": "object", "properties": {"a": {}}, "additionalProperties": False},
                {"properties": {"b": {}}}]}, "allOf", "/allOf"),
    ({"allOf": [{"format": "date"}, {"format": "time"}]}, "allOf", "/allOf"),
    ({"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a", "type": "string"}, "allOf", "/allOf"),
    ({"type": "number", "multipleOf": 0.01}, "multipleOf", "/multipleOf"),
    ({"type": "object", "minProperties": 1}, "minProperties", "/minProperties"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2}, "maxProperties",
     "/maxProperties"),
    ({"type": "object", "properties": {"a": {}}, "minProperties": 2}, "minProperties", "/minProperties"),
    ({"type": "string", "pattern": "a", "format": "date"}, "pattern", "/pattern"),
    ({"type": "string", "nullable": "yes"}, "nullable", "/nullable"),
])
def test_what_the_new_keywords_cannot_enforce_is_refused_by_name(schema, keyword, path):
    with pytest.raises(SchemaError) as e:
        compile_schema(schema)
    assert (e.value.keyword, e.value.path) == (keyword, path), str(e.value)
