"""POST /v1/embeddings: OpenAI's embeddings, computed by the engine's `Model.embed`.

The request, as OpenAI's API takes it (and the openai SDKs, LangChain, LlamaIndex,
litellm and Open WebUI send it):

    model            a served model's id (any model embeds: engine/embed.py)
    input            a string, a list of strings, a list of token ids, or a list of
                     such lists; at most MAX_INPUTS inputs, none empty; text is
                     tokenized as the model's tokenizer does with its special tokens
                     (BOS, or BERT's [CLS] ... [SEP]); token ids are used as they are
    encoding_format  "float" (the default: JSON numbers) or "base64" (the float32
                     little-endian bytes, what the openai SDK asks for and decodes)
    dimensions       keep the first k components, at unit length again (OpenAI's
                     shortened vectors); 1 to the model's width, else 400
    user             accepted, unused

The answer: `{"object": "list", "data": [{"object": "embedding", "index": i,
"embedding": ...}], "model": id, "usage": {"prompt_tokens": n, "total_tokens": n}}`.
Each vector is pooled from the model's final hidden states as `serve --pooling` says,
else as the model's file does (engine/embed.py: mean, cls or last), and scaled to unit
length, as llama-server's /v1/embeddings answers.

Refused with a 400 before any work: an unknown parameter, an empty or malformed input,
more than MAX_INPUTS inputs, a token id outside the vocabulary, an input longer than
the context window (`context_length_exceeded`), a bad `encoding_format` or `dimensions`.
The request is then admitted like a generation (lmsp_min/admission.py: 429 past the
queue; its turn when a slot frees) and its inputs embedded in groups of a forward step
each (engine/api.py `embedding_groups`), each group in a worker thread: the trio loop
never waits on a forward, and the scheduler's decode steps run between the groups.
"""

import array
import base64
import sys

import trio

from engine.api import embedding_groups
from engine.errors import ContextLengthExceeded
from lmsp_min.http import Request, Response, json_response
from lmsp_min.problems import Problem, clipped, quoted, shutting_down
from lmsp_min.registry import rate_limited
from lmsp_min.routing import read_json_body
from lmsp_min.validate import invalid

MAX_INPUTS = 2048  # OpenAI's bound on an embeddings request's inputs
PARAMETERS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
# Text this long is tokenized in a worker thread: below it, tokenizing takes well under a
# millisecond, less than the trip to a thread and back (generation.py's INLINE_PREPARE_CHARS)
INLINE_TOKENIZE_CHARS = 1024
LITTLE_ENDIAN = sys.byteorder == "little"  # array('f') holds the machine's byte order


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def create_embeddings(request: Request, service) -> Response:
    body = await read_json_body(request)
    inputs, encoding, dimensions = _read(body)
    entry = await service.registry.find(body["model"], param="model")
    model = await entry.load(service.log)
    if entry.full_for(request.principal):
        raise rate_limited()
    if dimensions is not None and dimensions > model.info.n_embd:
        raise invalid("dimensions", f"'dimensions' must be at most {model.info.n_embd}, the model's width")
    token_lists = await _tokens(model, inputs)
    pooling = service.config.pooling or model.pooling
    request.cancel_on_disconnect()  # nobody left to read the vectors: stop computing them
    with entry.admit(request.principal) as admission:
        vectors = await _embedded(model, token_lists, pooling, dimensions, admission, service)
    n_tokens = sum(map(len, token_lists))
    request.log_note = f"tokens={n_tokens}"
    return json_response({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding)}
                 for i, v in enumerate(vectors)],
        "model": entry.id,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    })


def _read(body: dict) -> tuple[list, str, int | None]:
    """The request's inputs (strings, or lists of token ids), encoding and dimensions, or a 400."""
    for name in body:
        if name not in PARAMETERS:
            raise invalid(clipped(name), f"Unknown parameter: {quoted(name)}.")
    if not isinstance(body.get("model"), str):
        raise invalid("model", "'model' is required: the id of a served model")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise invalid("encoding_format", "'encoding_format' must be 'float' or 'base64'")
    dimensions = body.get("dimensions")
    if dimensions is not None and not (_is_int(dimensions) and dimensions >= 1):
        raise invalid("dimensions", "'dimensions' must be a positive integer")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise invalid("user", "'user' must be a string")
    return _inputs(body.get("input")), encoding, dimensions


def _inputs(value) -> list:
    """`input` as a list of strings or of token-id lists (the four shapes OpenAI accepts)."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(map(_is_int, value))):
        value = [value]  # one text, or one list of token ids
    if not isinstance(value, list) or not value:
        raise invalid("input", "'input' must be a string, a list of strings, a list of token ids, "
                               "or a list of lists of token ids, and not empty")
    if len(value) > MAX_INPUTS:
        raise invalid("input", f"'input' holds {len(value)} inputs; at most {MAX_INPUTS} are accepted")
    for i, item in enumerate(value):
        is_tokens = isinstance(item, list) and all(map(_is_int, item))
        if not (isinstance(item, str) or is_tokens):
            raise invalid(f"input[{i}]", "each input must be a string or a list of token ids")
        if not item:
            raise invalid(f"input[{i}]", "an input cannot be empty")
    return value


async def _tokens(model, inputs: list) -> list[list[int]]:
    """Every input as token ids (text tokenized, in a worker thread when long), checked
    against the vocabulary and the context window."""
    size = sum(len(item) for item in inputs if isinstance(item, str))
    if size <= INLINE_TOKENIZE_CHARS:
        token_lists = _tokenized(model, inputs)
    else:
        token_lists = await trio.to_thread.run_sync(_tokenized, model, inputs)
    n_vocab, n_ctx = model.info.n_vocab, model.info.context_length
    for i, ids in enumerate(token_lists):
        if isinstance(inputs[i], list) and not all(0 <= t < n_vocab for t in ids):
            raise invalid(f"input[{i}]", f"a token id is outside the model's vocabulary (0 to {n_vocab - 1})")
        if len(ids) > n_ctx:
            raise Problem("context_length_exceeded", f"input {i} is {len(ids)} tokens, more than the model's "
                          f"context window of {n_ctx}", param=f"input[{i}]")
    return token_lists


def _tokenized(model, inputs: list) -> list[list[int]]:
    return [model.tokenize(item) if isinstance(item, str) else item for item in inputs]


async def _embedded(model, token_lists: list[list[int]], pooling: str, dimensions: int | None,
                    admission, service) -> list[bytes]:
    """The vectors, a group of inputs per worker-thread call, once the admission's turn
    has come; a stopping service ends the wait (503, as a generation's)."""
    vectors: list[bytes] = []
    with service.generations.engine_wait() as wait:
        await admission.turn()
        for group in embedding_groups([len(ids) for ids in token_lists]):
            chunk = [token_lists[i] for i in group]
            try:
                vectors += await trio.to_thread.run_sync(model.embed, chunk, pooling, dimensions)
            except ContextLengthExceeded as exc:  # (checked above: the window cannot shrink meanwhile)
                raise Problem("context_length_exceeded", str(exc), param="input") from None
    if wait.cancelled_caught:
        raise shutting_down()
    return vectors


def _encoded(vector: bytes, encoding: str):
    """A float32 little-endian vector as base64, or as JSON numbers of 9 significant digits
    (as many as tell float32 values apart: the JSON reads back to the very same floats)."""
    if encoding == "base64":
        return base64.b64encode(vector).decode("ascii")
    values = array.array("f", vector)
    if not LITTLE_ENDIAN:
        values.byteswap()
    return [float(f"{v:.9g}") for v in values]
