"""Tokenizers built from a GGUF file's `tokenizer.*` metadata, as llama.cpp builds them.

Three tokenizer models are supported, chosen by `tokenizer.ggml.model`:

- ``gpt2``: byte-level BPE. The text is first cut into words by the pre-tokenizer
  regexes that `tokenizer.ggml.pre` names (applied one after another, each one
  splitting the pieces of the previous; the text between matches stays a piece of
  its own), each word's UTF-8 bytes are mapped to printable characters (GPT-2's
  byte<->unicode table), then adjacent symbols are merged by the rank of the pair
  in `tokenizer.ggml.merges`, lowest rank first, leftmost on a tie.
- ``llama``: SentencePiece-style. Spaces become U+2581, and adjacent symbols are
  merged while the merged text is a token, highest `tokenizer.ggml.scores` first,
  leftmost on a tie. A character that ends up in no token is written as its UTF-8
  bytes with the `<0xXX>` byte tokens.
- ``bert``: WordPiece, as llama.cpp's WPM tokenizer. The text is NFD-normalized,
  lowercased (unless the vocabulary has upper-case tokens: a cased model, which
  llama.cpp lowercases too), cut into words at whitespace, each punctuation
  character, ASCII symbol and CJK character a word of its own, control characters
  dropped; each word, behind U+2581 (llama.cpp's converter writes a word-initial
  piece "x" as "▁x" and a "##x" continuation as "x"), is matched greedily, longest
  piece first; a word with a part no piece matches is the unknown token. The ids
  are framed as [CLS] ... [SEP].

Before either runs, the text is partitioned around special tokens (llama.cpp's
`tokenizer_st_partition`): every token that is not a normal token, longest first,
is searched for in the text and cut out as a token of its own. With
``parse_special=False`` control and unknown tokens are skipped, but user-defined
tokens (Gemma's `<html>`, runs of spaces or newlines, ...) are still cut out:
Hugging Face's tokenizers do the same with their "added tokens". The spans given as
``literal_spans`` are partitioned as without ``parse_special`` even when it is on:
that is how a chat prompt keeps its template's control tokens and a client's text
apart (engine/chat.py).

Decoding: `decode(ids)` is llama.cpp's `llama_detokenize(..., remove_special=false,
unparse_special=false)`: control and unknown tokens render as nothing (so the text
is what a user should see), user-defined tokens as their text, and the space
clean-up some BPE pre-tokenizers ask for (``clean_spaces``) is applied.
`decode(ids, special=True)` renders control tokens as their text, like
llama-server's ``/detokenize`` does (it pastes `common_token_to_piece(..., special
= true)` pieces together, without the space clean-up).
`token_bytes(id)` is the raw bytes one token adds to generated text (b"" for
control tokens); `IncrementalDecoder` turns a stream of ids into text that never
ends in half a UTF-8 character.

End of generation: `eos_ids` is llama.cpp's set of end-of-generation tokens: the
EOS, EOT and EOM ids of the metadata, the tokens whose text marks the end of a turn
(`<|im_end|>`, `<end_of_turn>`, `<|eot_id|>`, `<|endoftext|>`, ...), and the
fill-in-the-middle pad / repo / file-separator tokens. Like llama.cpp, all of them
(and the other fill-in-the-middle tokens) are treated as control tokens.

Speed: BPE results are cached per pre-token word. SentencePiece merges run over a
whole text fragment in llama.cpp; here the fragment is cut before every U+2581
that follows another character, unless a token of the vocabulary could span the
cut (see `SpmTokenizer._words`), so the result is the same and words are cached too.

Not implemented (llama.cpp sets them from the model name, which the tokenizer
metadata does not carry): the per-token lstrip/rstrip attributes of a few models
(phi-3, jina). Other tokenizer models (t5, rwkv, ...) raise
UnsupportedModelError.

Known difference: the pre-tokenizer regexes know the characters of the `regex`
module's Unicode version (17.0 in regex 2026.5), llama.cpp's of its own tables
(15.1). A letter or digit added in Unicode 16 or 17 is unassigned to llama.cpp, a
character its gpt2 split groups with punctuation, so a BPE text holding one can be
cut into other words (U+13583 then "'ve": "'ve" is a contraction here, not there).
"""

from __future__ import annotations

import abc
import codecs
import heapq
import re
import unicodedata
from typing import Sequence

import regex

from engine import tuning
from engine.errors import ModelFileError, UnsupportedModelError


class Attr:
    """Token attribute bits, as llama.cpp's llama_token_attr (GGUF token_type maps onto them).

    Plain ints, not an enum.IntFlag: they are combined for every token of a 262k vocabulary.
    """

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


# GGUF `tokenizer.ggml.token_type` values -> attributes.
_TOKEN_TYPE_ATTR = {
    0: Attr.UNDEFINED,
    1: Attr.NORMAL,
    2: Attr.UNKNOWN,
    3: Attr.CONTROL,
    4: Attr.USER_DEFINED,
    5: Attr.UNUSED,
    6: Attr.BYTE,
}

# Texts llama.cpp recognizes as end-of-generation tokens (llama-vocab.cpp, "special_eog_ids").
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
# Fill-in-the-middle pad / repo / file-separator tokens: llama.cpp also ends generation on them.
_FIM_EOG_TEXTS = frozenset({
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>",
})
# Other fill-in-the-middle tokens; llama.cpp forces them (like the above) to be control tokens.
_FIM_TEXTS = frozenset({
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
    "<|code_prefix|>", "<|prefix|>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
    "<|code_suffix|>", "<|suffix|>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
    "<|code_middle|>", "<|middle|>",
})

# Pre-tokenizer regexes, as llama.cpp's llm_tokenizer_bpe has them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.json has \p{M} in both letter classes; llama.cpp's split matches no mark with
# them (a mark is cut from the word, so "e\u0301's" has no "'s" contraction), and so do we.
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}]*[\p{Ll}\p{Lm}\p{Lo}]+"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}]+[\p{Ll}\p{Lm}\p{Lo}]*"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


class _Pre:
    """How one `tokenizer.ggml.pre` value tokenizes and detokenizes."""

    def __init__(self, regexes, *, clean_spaces=True, ignore_merges=False, add_bos=False):
        self.regexes = tuple(regex.compile(r) for r in regexes)
        self.clean_spaces = clean_spaces    # detokenize removes " ," " ." " 's" ... spaces
        self.ignore_merges = ignore_merges  # a word that is a token is taken whole (llama 3)
        self.add_bos = add_bos              # default of add_bos when the metadata is silent


_PRE_TOKENIZERS: dict[str, _Pre] = {}


def _register(names, pre):
    for name in names.split():
        _PRE_TOKENIZERS[name] = pre


_register("default", _Pre(_DEFAULT))
_register("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
          _Pre([_LLAMA3], ignore_merges=True, add_bos=True))
_register("dbrx smaug-bpe", _Pre([_LLAMA3]))
_register("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de mellum modern-bert "
          "mpt olmo jais exaone4", _Pre([_GPT2]))
_register("trillion granite-docling", _Pre([_GPT2], clean_spaces=False))
_register("starcoder refact codeshell exaone minerva-7b", _Pre([r"\p{N}", _GPT2]))
_register("smollm command-r", _Pre([r"\p{N}", _GPT2], clean_spaces=False))
_register("qwen2 deepseek-r1-qwen", _Pre([_QWEN2], clean_spaces=False))
_register("stablelm2 megrez", _Pre([_QWEN2]))
_register("gpt-4o llama4", _Pre([_GPT4O], clean_spaces=False))
_register("falcon", _Pre([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]))
_register("poro-chat", _Pre([r" ?[^(\s|.,!?…。，、।۔،)]+"], clean_spaces=False))
_register("bloom gpt3-finnish", _Pre([r" ?[^(\s|.,!?…。，、।۔،)]+"]))


def _bytes_to_unicode() -> list[str]:
    """GPT-2's table: each byte -> a printable character (printable bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = [""] * 256
    n = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
# Byte-encoding and decoding through latin-1 text and str.translate, which are fast:
# bytes -> latin-1 str -> byte characters, and byte characters -> latin-1 str -> bytes
# (a character below 256 outside the table stands for its own UTF-8 bytes).
_LATIN1_TO_BYTE_CHAR = {b: c for b, c in enumerate(_BYTE_TO_CHAR)}
_BYTE_CHAR_TO_LATIN1 = {c: chr(c).encode().decode("latin-1") for c in range(256)} | {
    ord(c): chr(b) for c, b in _CHAR_TO_BYTE.items()}

_SPACE = "\u2581"  # SentencePiece's visible space
_WORD_START = regex.compile("(?<=[^\u2581])\u2581")   # where an SPM text may be cut into words
_SPANS_WORDS = regex.compile("[^\u2581]\u2581")       # a token that could span such a cut


def _split(pieces: list[str], pattern: regex.Pattern) -> list[str]:
    """Cut each piece at the pattern's matches; the text between matches stays a piece."""
    out = []
    for piece in pieces:
        start = 0
        for m in pattern.finditer(piece):
            a, b = m.span()
            if a == b:
                continue
            if a > start:
                out.append(piece[start:a])
            out.append(piece[a:b])
            start = b
        if start < len(piece):
            out.append(piece[start:])
    return out


def _remember(cache: dict, word: str, ids: tuple[int, ...]) -> None:
    """Cache a word's ids; long words seldom repeat, and the cache is bounded."""
    if len(word) <= tuning.WORD_CACHE_MAX_CHARS:
        if len(cache) >= tuning.WORD_CACHE:
            cache.clear()
        cache[word] = ids


def _merge(chars: str, priority) -> list[str]:
    """The merge loop of both tokenizer models (llama.cpp's llm_tokenizer_{bpe,spm}_session).

    Start from one symbol per character; repeatedly merge the adjacent pair with the
    lowest `priority(left, right)` (None: never merge these two), the leftmost pair on
    a tie, until no pair can merge. A heap holds the candidate pairs; a pair whose
    sides have changed since it was pushed is outdated and skipped.
    """
    syms = list(chars)                      # "" once merged into the left neighbour
    nxt = list(range(1, len(syms))) + [-1]  # linked list of the live symbols
    prv = list(range(-1, len(syms) - 1))

    def candidate(left, right):
        if left < 0 or right < 0:
            return None
        key = priority(syms[left], syms[right])
        return None if key is None else (key, left, right, len(syms[left]) + len(syms[right]))

    heap = [c for c in map(candidate, range(len(syms) - 1), range(1, len(syms))) if c]
    heapq.heapify(heap)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
            continue
        syms[left] += syms[right]
        syms[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        for c in candidate(prv[left], left), candidate(left, nxt[left]):
            if c:
                heapq.heappush(heap, c)
    return [s for s in syms if s]


class Tokenizer(abc.ABC):
    """Shared part: vocabulary, special tokens, decoding. Subclasses do the text -> ids step."""

    def __init__(self, meta: dict, *, default_bos: int | None, default_eos: int | None,
                 default_unk: int | None, add_bos: bool, add_space_prefix: bool, clean_spaces: bool):
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFileError("the tokenizer metadata has no tokenizer.ggml.tokens")
        n = len(tokens)
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = meta.get("tokenizer.ggml.token_type")
        if types is not None and len(types) < n:
            raise ModelFileError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        self.tokens: list[str] = tokens
        self.n_vocab = n
        self.attrs: list[int] = (
            [_TOKEN_TYPE_ATTR.get(t, Attr.UNDEFINED) for t in types[:n]] if types is not None
            else [Attr.NORMAL] * n
        )
        self.token_to_id: dict[str, int] = dict(zip(tokens, range(n)))
        if len(self.token_to_id) != n:
            seen: dict[str, int] = {}
            for i, t in enumerate(tokens):
                if seen.setdefault(t, i) != i:
                    raise ModelFileError(f"duplicate token in vocabulary: {t!r} has ids {seen[t]} and {i}")

        def special_id(key, default):
            value = meta.get(f"tokenizer.ggml.{key}")
            if value is not None and 0 <= int(value) < n:
                return int(value)
            return default if default is not None and 0 <= default < n else None

        self.bos_id = special_id("bos_token_id", default_bos)
        self.eos_id = special_id("eos_token_id", default_eos)
        self.unk_id = special_id("unknown_token_id", default_unk)
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        self.add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", add_space_prefix))
        self.clean_spaces = clean_spaces
        if self.add_bos and self.bos_id is None:
            raise ModelFileError("tokenizer.ggml.add_bos_token is true, but there is no BOS token")
        if self.add_eos and self.eos_id is None:
            raise ModelFileError("tokenizer.ggml.add_eos_token is true, but there is no EOS token")

        # End-of-generation tokens, found by id and by text as llama.cpp does. The tokens
        # found by their text are control tokens, whatever the file says.
        by_text = {self.token_to_id.get(t) for t in _EOG_TEXTS | _FIM_EOG_TEXTS | _FIM_TEXTS} - {None}
        for i in by_text:
            self.attrs[i] |= Attr.CONTROL
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):   # gpt-oss shows these
            if text in self.token_to_id:
                self.attrs[self.token_to_id[text]] = Attr.USER_DEFINED
        eog = {special_id(k, None) for k in ("eos_token_id", "eot_token_id", "eom_token_id",
                                             "fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id")}
        eog |= {i for i in by_text if tokens[i] in _EOG_TEXTS or tokens[i] in _FIM_EOG_TEXTS}
        eog.discard(None)
        eog_texts = {tokens[i]: i for i in eog}
        if {"<|return|>", "<|call|>", "<|end|>"} <= eog_texts.keys() or \
                {"<|calls|>", "<|flush|>", "<|end|>"} <= eog_texts.keys():
            end = eog_texts["<|end|>"]   # harmony, solar-open: <|end|> ends a message, not generation
            eog.discard(end)
            self.attrs[end] = Attr.USER_DEFINED
        if "<|tool_response>" in eog_texts and "</s>" in eog_texts:
            s_id = eog_texts["</s>"]     # gemma 4: </s> is plain text there
            eog.discard(s_id)
            self.attrs[s_id] = Attr.NORMAL
        self.eos_ids: frozenset[int] = frozenset(eog)

        # Tokens cut out of the text before tokenizing, longest first (tokenizer_st_partition).
        special = [i for i, a in enumerate(self.attrs)
                   if a & (Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN)]
        special.sort(key=lambda i: (-len(tokens[i]), i))
        self._special_all = [(i, tokens[i]) for i in special]
        self._special_user = [(i, tokens[i]) for i in special
                              if not self.attrs[i] & (Attr.CONTROL | Attr.UNKNOWN)]
        # Finds any text that only parse_special turns into a token: one regex search, where
        # a partition tries thousands of tokens (Gemma's <unusedN>) one by one. Literal
        # alternatives need no `regex` features, and the standard library compiles Gemma's
        # 6,250 of them in 0.09 s where `regex` took 0.3 s (half its tokenizer's start).
        self._control_text = re.compile("|".join(
            re.escape(tokens[i]) for i in special if self.attrs[i] & (Attr.CONTROL | Attr.UNKNOWN)) or "(?!)")

        # The bytes each token writes (special=True rendering); control ones are blanked on use.
        self._pieces: list[bytes] = self._all_pieces()
        self._silent = bytearray(1 if a & (Attr.CONTROL | Attr.UNKNOWN) else 0 for a in self.attrs)

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, meta: dict) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes (meta: GGUF key -> plain Python value)."""
        model = meta.get("tokenizer.ggml.model")
        if model == "gpt2":
            return BpeTokenizer(meta)
        if model == "llama":
            return SpmTokenizer(meta)
        if model == "bert":
            return WpmTokenizer(meta)
        if model is None:
            raise ModelFileError("the file has no tokenizer (tokenizer.ggml.model is missing)")
        raise UnsupportedModelError(f"tokenizer model {model!r} is not supported (only 'gpt2', 'llama' and 'bert')")

    def _all_pieces(self) -> list[bytes]:
        """llama.cpp's token_to_piece(special=True) of every token: special tokens write
        their text, normal tokens the bytes their text stands for, <0xXX> its byte."""
        shown_as_text = Attr.UNKNOWN | Attr.CONTROL | Attr.USER_DEFINED
        normal_piece = self._normal_piece
        pieces = [
            text.encode() if a & shown_as_text else normal_piece(text) if a & Attr.NORMAL else b""
            for text, a in zip(self.tokens, self.attrs)
        ]
        for i, a in enumerate(self.attrs):
            if a & Attr.BYTE and not a & (shown_as_text | Attr.NORMAL):
                try:
                    pieces[i] = bytes([int(self.tokens[i][3:5], 16)])
                except ValueError:
                    raise ModelFileError(f"byte token {i} is {self.tokens[i]!r}, not <0xXX>") from None
        return pieces

    @abc.abstractmethod
    def _normal_piece(self, text: str) -> bytes:
        """The bytes a normal token's text stands for (the two models escape them differently)."""

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False,
               literal_spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Text -> token ids, as llama.cpp's llama_tokenize(text, add_special, parse_special).

        `literal_spans`, ascending (start, end) character ranges of `text`, are read as
        with parse_special False: what they spell is text, never a control token.
        """
        try:
            text.encode()
        except UnicodeEncodeError:   # lone surrogates: keep the valid text, replace the rest
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        if parse_special and literal_spans:
            fragments = self._partition_spans(text, literal_spans)
        else:
            fragments = self._partition(text, parse_special) if text else []
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self.bos_id)
        self._encode_fragments(fragments, ids)
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    @abc.abstractmethod
    def _encode_fragments(self, fragments: list[str | int], ids: list[int]) -> None:
        """Append the ids of text fragments (token ids among them are appended as they are)."""

    def special_text_parts(self, text: str) -> list[tuple[str, bool]]:
        """`text` cut into (part, True) for the text of a token that parse_special makes of
        it and nothing else would (control and unknown tokens), (part, False) for the rest;
        the parts concatenate to `text`."""
        if not self._control_text.search(text):  # (nearly every string a client writes)
            return [(text, False)]
        parts: list[tuple[str, bool]] = []
        for fragment in self._partition(text, True):
            special = isinstance(fragment, int) and not self.attrs[fragment] & Attr.USER_DEFINED
            part = self.tokens[fragment] if isinstance(fragment, int) else fragment
            if not special and parts and not parts[-1][1]:
                parts[-1] = (parts[-1][0] + part, False)
            else:
                parts.append((part, special))
        return parts

    @staticmethod
    def _specials_in(text: str, specials: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """The special tokens (in their order) that occur in `text`."""
        if len(specials) > 64 and len(text) > 64:
            # Thousands of special tokens (Gemma's <unusedN>): look only for those whose
            # first three characters occur in the text at all.
            trigrams = {text[i:i + 3] for i in range(len(text) - 2)}
            specials = [(tid, tok) for tid, tok in specials if len(tok) < 3 or tok[:3] in trigrams]
        return [(tid, tok) for tid, tok in specials if tok in text]

    def _partition(self, text: str, parse_special: bool,
                   specials: list[tuple[int, str]] | None = None) -> list[str | int]:
        """Cut special tokens out of the text: a list of text fragments and token ids.
        `specials`: the tokens to look for, when already narrowed down (else all that apply)."""
        fragments: list[str | int] = [text]
        if specials is None:
            specials = self._specials_in(text, self._special_all if parse_special else self._special_user)
        for tid, tok in specials:
            out: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or tok not in frag:
                    out.append(frag)
                    continue
                for k, part in enumerate(frag.split(tok)):
                    if k:
                        out.append(tid)
                    if part:
                        out.append(part)
            fragments = out
        return fragments

    def _partition_spans(self, text: str, literal_spans: Sequence[tuple[int, int]]) -> list[str | int]:
        """_partition with parse_special, except in `literal_spans`, parsed as without it.
        Text on both sides of a span's edge is one fragment, tokenized as if no edge were there."""
        edges = [0, *(i for span in literal_spans for i in span), len(text)]
        # the special tokens of the whole text, found once (a part can hold no other): each
        # part searched for all of them was 121 ms for 1,000 marked occurrences in Gemma 3
        found = self._specials_in(text, self._special_all)
        user = [(tid, tok) for tid, tok in found if not self.attrs[tid] & (Attr.CONTROL | Attr.UNKNOWN)]
        fragments: list[str | int] = []
        for k in range(len(edges) - 1):
            part = text[edges[k]: edges[k + 1]]
            for fragment in self._partition(part, k % 2 == 0, found if k % 2 == 0 else user) if part else []:
                if isinstance(fragment, str) and fragments and isinstance(fragments[-1], str):
                    fragments[-1] += fragment
                else:
                    fragments.append(fragment)
        return fragments

    # -- decoding ---------------------------------------------------------------------------

    def is_control(self, token_id: int) -> bool:
        return bool(self.attrs[token_id] & Attr.CONTROL)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token adds to generated text (b"" for control and unknown tokens)."""
        return b"" if self._silent[token_id] else self._pieces[token_id]

    def piece(self, token_id: int) -> bytes:
        """The token as llama.cpp's token_to_piece(special=True) writes it: its bytes, a
        control token's text (what a token's log probability is reported under)."""
        return self._pieces[token_id]

    def decode(self, ids, special: bool = False) -> str:
        """Token ids -> text; see the module docstring for how special tokens render.

        special=False is llama_detokenize(remove_special=False, unparse_special=False);
        special=True is llama-server's /detokenize: the pieces as they are, control
        tokens as their text.
        """
        pieces = self._pieces
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.n_vocab:
                raise ValueError(f"token id {i} is out of range (vocabulary of {self.n_vocab})")
            out.append(pieces[i] if special or not self._silent[i] else b"")
        if not special:
            if self.add_space_prefix and out and out[0].startswith(b" "):
                out[0] = out[0][1:]   # the space the tokenizer put before the text
            data = b"".join(out)
            if self.clean_spaces:
                data = _clean_spaces(data)
        else:
            data = b"".join(out)
        return data.decode("utf-8", "replace")


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's detokenize clean-up: " ?" " !" " ." " ," lose the space, " ' " loses both,
    " 's" " 'm" " 're" " 've" lose the space."""
    text = regex.sub(rb" ([?!.,])", rb"\1", text)
    text = text.replace(b" ' ", b"'")
    return regex.sub(rb" '(?=s|m|re|ve)", rb"'", text)


class BpeTokenizer(Tokenizer):
    """Byte-level BPE (`tokenizer.ggml.model` = "gpt2")."""

    def __init__(self, meta: dict):
        pre_name = meta.get("tokenizer.ggml.pre") or "default"
        pre = _PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise UnsupportedModelError(f"BPE pre-tokenizer {pre_name!r} is not supported")
        self.pre_name = pre_name
        self._pre = pre
        merges = meta.get("tokenizer.ggml.merges")
        if merges is None:
            raise ModelFileError("a gpt2 tokenizer needs tokenizer.ggml.merges")
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            cut = merge.find(" ", 1)   # the first space after the first character separates the pair
            if cut > 0:
                self._ranks.setdefault((merge[:cut], merge[cut + 1:]), rank)
        super().__init__(meta, default_bos=11, default_eos=11, default_unk=None,
                         add_bos=pre.add_bos, add_space_prefix=False, clean_spaces=pre.clean_spaces)
        self._cache: dict[str, tuple[int, ...]] = {}

    def _normal_piece(self, text: str) -> bytes:
        try:
            return text.translate(_BYTE_CHAR_TO_LATIN1).encode("latin-1")
        except UnicodeEncodeError:   # a character outside the byte table stands for itself
            return b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE else c.encode() for c in text)

    def pre_tokenize(self, text: str) -> list[str]:
        """Cut text into the words BPE runs on: each regex splits the pieces of the one before."""
        words = [text]
        for pattern in self._pre.regexes:
            words = _split(words, pattern)
        return words

    def _encode_fragments(self, fragments, ids):
        cache = self._cache
        for frag in fragments:
            if isinstance(frag, int):
                ids.append(frag)
                continue
            for word in self.pre_tokenize(frag):
                got = cache.get(word)
                if got is None:
                    got = self._bpe(word)
                    _remember(cache, word, got)
                ids.extend(got)

    def _bpe(self, word: str) -> tuple[int, ...]:
        """One pre-token word -> ids: merge the lowest-ranked adjacent pair until none is left."""
        encoded = word.encode().decode("latin-1").translate(_LATIN1_TO_BYTE_CHAR)
        vocab = self.token_to_id
        if self._pre.ignore_merges and encoded in vocab:
            return (vocab[encoded],)
        ranks = self._ranks
        syms = _merge(encoded, lambda left, right: ranks.get((left, right)))
        out = []
        for s in syms:
            tid = vocab.get(s)
            if tid is not None:
                out.append(tid)
            else:   # not a token (a vocabulary without all 256 byte characters): per character
                out.extend(vocab[c] for c in s if c in vocab)
        return tuple(out)


class SpmTokenizer(Tokenizer):
    """SentencePiece-style BPE by token score (`tokenizer.ggml.model` = "llama")."""

    def __init__(self, meta: dict):
        super().__init__(meta, default_bos=1, default_eos=2, default_unk=0,
                         add_bos=True, add_space_prefix=True, clean_spaces=False)
        scores = meta.get("tokenizer.ggml.scores")
        if scores is not None and len(scores) < self.n_vocab:
            raise ModelFileError(f"tokenizer.ggml.scores has {len(scores)} entries for {self.n_vocab} tokens")
        self._scores = scores if scores is not None else [0.0] * self.n_vocab
        spanning = [t for t in self.tokens if _SPACE in t[1:] and _SPANS_WORDS.search(t)]
        self._spanning: list[str] | None = spanning if len(spanning) <= 256 else None
        self._cache: dict[str, tuple[int, ...]] = {}
        self._byte_ids = [self.token_to_id.get(f"<0x{b:02X}>", self.token_to_id.get(chr(b)) if b < 128 else None)
                          for b in range(256)]

    def _normal_piece(self, text: str) -> bytes:
        return text.replace(_SPACE, " ").encode()

    def _encode_fragments(self, fragments, ids):
        prev_special = True
        for frag in fragments:
            if isinstance(frag, int):
                ids.append(frag)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                frag = " " + frag
            for word in self._words(frag.replace(" ", _SPACE)):
                got = self._cache.get(word)
                if got is None:
                    got = self._spm(word)
                    _remember(self._cache, word, got)
                ids.extend(got)
            prev_special = False

    def _words(self, text: str) -> list[str]:
        """Cut text before each U+2581 that follows another character, where no token can
        span the cut: merging each word alone then gives exactly the ids of the whole.

        A token spans a cut only if it has a character then U+2581 inside it (Gemma has
        one, ">▁</"); cuts inside the text's occurrences of such tokens are not made.
        """
        if self._spanning is None:
            return [text]
        cuts = [m.start() for m in _WORD_START.finditer(text)]
        if not cuts:
            return [text]
        blocked = set()
        for tok in self._spanning:
            at = text.find(tok)
            while at >= 0:
                blocked.update(range(at + 1, at + len(tok)))
                at = text.find(tok, at + 1)
        words, start = [], 0
        for cut in cuts:
            if cut not in blocked:
                words.append(text[start:cut])
                start = cut
        words.append(text[start:])
        return words

    def _spm(self, text: str) -> tuple[int, ...]:
        """Merge adjacent symbols into the highest-scoring token they form, leftmost on a tie."""
        vocab = self.token_to_id
        scores = self._scores

        def priority(left, right):
            tid = vocab.get(left + right)
            return None if tid is None else -scores[tid]

        syms = _merge(text, priority)
        ids = []
        for s in syms:
            tid = vocab.get(s)
            if tid is not None:
                ids.append(tid)
                continue
            for byte in s.encode():   # byte fallback: <0xXX> tokens
                tid = self._byte_ids[byte]
                ids.append(tid if tid is not None else self.unk_id)
        return tuple(ids)


# llama.cpp's whitespace (unicode.cpp's is_whitespace): what cuts a WordPiece text into words
_WPM_SPACES = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | \
    frozenset(map(chr, range(0x2000, 0x200B)))
# BERT's "Chinese characters" (the CJK ideograph blocks): each one is a word of its own
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _stands_alone(ch: str) -> bool:
    """Whether a character is a WordPiece word by itself: punctuation, an ASCII symbol, CJK."""
    category, cp = unicodedata.category(ch), ord(ch)
    return category[0] == "P" or (category[0] == "S" and cp < 0x7F) or any(a <= cp <= b for a, b in _CJK)


class WpmTokenizer(Tokenizer):
    """WordPiece (`tokenizer.ggml.model` = "bert"), as llama.cpp's WPM tokenizer."""

    def __init__(self, meta: dict):
        # the converter writes [CLS] as the BOS token and [SEP] as the EOS and separator tokens
        super().__init__(meta, default_bos=101, default_eos=102, default_unk=100, add_bos=True,
                         add_space_prefix=True, clean_spaces=True)
        sep = meta.get("tokenizer.ggml.seperator_token_id", 102)  # (sic: the GGUF key's spelling)
        self.sep_id = int(sep) if 0 <= int(sep) < self.n_vocab else None
        self.add_sep = bool(meta.get("tokenizer.ggml.add_sep_token", True)) and self.sep_id is not None
        if self.unk_id is None:
            raise ModelFileError("a bert tokenizer needs an unknown token")
        pieces = [t for t, a in zip(self.tokens, self.attrs) if a & Attr.NORMAL]
        cased = sum(t != t.lower() for t in pieces)
        # an uncased vocabulary still holds a few pieces with capitals (U+2160 "Ⅰ"), a cased
        # one thousands ("The", "New", ...): a twentieth of them tells the two apart
        self._lowercase = cased < len(pieces) / 20
        self._longest = max(map(len, pieces), default=1)
        self._cache: dict[str, tuple[int, ...]] = {}

    def _normal_piece(self, text: str) -> bytes:
        return text.replace(_SPACE, " ").encode()

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False,
               literal_spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        ids = super().encode(text, add_special, parse_special, literal_spans)
        if add_special and self.add_sep:
            ids.append(self.sep_id)
        return ids

    def _encode_fragments(self, fragments, ids):
        for frag in fragments:
            if isinstance(frag, int):
                ids.append(frag)
                continue
            for word in self.words(frag):
                got = self._cache.get(word)
                if got is None:
                    got = self._wordpiece(_SPACE + word)
                    _remember(self._cache, word, got)
                ids.extend(got)

    def words(self, text: str) -> list[str]:
        """llama.cpp's WPM preprocess: normalized, (lowercased,) cut into words."""
        words, word = [], []
        for ch in unicodedata.normalize("NFD", text):
            if ch in _WPM_SPACES:
                if word:
                    words.append("".join(word))
                    word = []
            elif ch in "\0\ufffd" or unicodedata.category(ch) in ("Cc", "Cf", "Co", "Cs"):
                continue
            else:
                low = ch.lower() if self._lowercase else ch
                ch = low if len(low) == 1 else ch  # (one code point to one, as unicode_tolower)
                if _stands_alone(ch):
                    if word:
                        words.append("".join(word))
                        word = []
                    words.append(ch)
                else:
                    word.append(ch)
        if word:
            words.append("".join(word))
        return words

    def _wordpiece(self, word: str) -> tuple[int, ...]:
        """The longest pieces that spell `word` from its start; the unknown token if a part has none."""
        vocab, ids, i = self.token_to_id, [], 0
        while i < len(word):
            for j in range(min(len(word), i + self._longest), i, -1):
                tid = vocab.get(word[i:j])
                if tid is not None:
                    ids.append(tid)
                    i = j
                    break
            else:
                return (self.unk_id,)
        return tuple(ids)


class IncrementalDecoder:
    """Feed token ids one at a time; get back only text made of complete UTF-8 characters.

    Bytes of a character split across tokens (an emoji written as four <0xXX> byte
    tokens, a CJK character cut by BPE) are held until the character is complete.
    `flush()` returns what is still held at the end (invalid bytes as U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token_id: int) -> str:
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
