"""The engine's exceptions: every failure a caller can act on has its own class.

A caller (the server, a script) never sees a bare numpy or IndexError traceback
for a bad file or a bad request: it sees one of these, with a message that names
the file or the field and the problem.
"""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelFileError(EngineError):
    """The GGUF file is missing, truncated, corrupt or inconsistent."""


class UnsupportedModelError(EngineError):
    """The file is valid GGUF but uses an architecture, tokenizer or tensor type we do not run."""


class ContextLengthExceeded(EngineError):
    """The prompt (plus the requested output) does not fit the context window."""

    def __init__(self, n_prompt: int, n_requested: int, n_ctx: int):
        self.n_prompt = n_prompt
        self.n_requested = n_requested
        self.n_ctx = n_ctx
        super().__init__(
            f"the input is {n_prompt} tokens and {n_requested} more were requested, "
            f"but the context window is {n_ctx} tokens"
        )


class SchemaError(EngineError):
    """A JSON Schema (structured output or tool parameters) that we cannot enforce.

    `path` is a JSON-pointer-like path inside the schema, `keyword` the offending
    keyword when there is one, `field` the chat request's field the schema is in
    ("tools" or "json_schema"), which the compiler does not know: engine/tools.py and
    engine/chat.py set it.
    """

    def __init__(self, message: str, path: str = "", keyword: str | None = None):
        self.path = path
        self.keyword = keyword
        self.field: str | None = None
        super().__init__(message)


class Unsatisfiable(SchemaError):
    """A (sub)schema that no value we can write satisfies: where it is optional (a
    property not required, one of several alternatives, the items of an array that
    may be empty) it is left out; elsewhere the whole schema is refused."""


class QueueFull(EngineError):
    """The model's request queue is full: try again after `retry_after` seconds."""

    def __init__(self, queued: int, retry_after: int = 1):
        self.queued = queued
        self.retry_after = retry_after
        super().__init__(f"{queued} requests are already waiting for this model; retry in {retry_after} s")


class ModelClosed(EngineError):
    """The model was closed (`Model.close`): it generates nothing more."""

    def __init__(self):
        super().__init__("the model is closed")


class PromptError(EngineError):
    """A raw prompt (engine/chat.py `prepare_text`) that cannot be generated from: it has no
    token, or names a token outside the model's vocabulary."""


class ChatTemplateError(EngineError):
    """The model's chat template does not compile, or cannot render these messages
    (the template called raise_exception, e.g. "roles must alternate user/assistant")."""


class OutputBudgetTooSmall(EngineError):
    """A constrained output (a JSON schema, tool calls) needs more tokens than the request's
    limit allows even for its shortest valid answer: refused before any token."""

    def __init__(self, needed: int, max_tokens: int):
        self.needed = needed
        self.max_tokens = max_tokens
        super().__init__(f"the shortest output the schema allows takes {needed} tokens, "
                         f"but at most {max_tokens} were requested")
