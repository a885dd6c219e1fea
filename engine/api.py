"""The contract between the server and the engine: the plain values they exchange.

A server (lmsp_min/, or any program) builds a `ChatRequest` (with its `SamplingParams`),
hands it to `model.prepare_chat`, which answers with a `PreparedChat` whose `counts`
(`TokenCounts`) it may read at any time, and reads the events of `model.generate_chat`:

    TextDelta(text)              message text (complete UTF-8, never a stop sequence)
    ReasoningDelta(text)         text between <think> and </think>, for models that reason
    ToolCall(index, name, arguments)   a whole tool call
    TokenLogprob(id, piece, logprob, top)   a generated token's log probability, when asked
                                 (SamplingParams.logprobs), before the text of its token
    Finished(reason, input_tokens, output_tokens, cached_tokens)   always last

Embeddings: `model.embed(token_lists, pooling, dimensions)` answers float32 vectors as
bytes (engine/embed.py), over the groups of inputs `embedding_groups` makes; `POOLINGS`
names the poolings, `model.pooling` is a model's default.

These are dataclasses of the standard library only, so that the protocol package,
which never imports numpy, imports them at the top of its modules. The errors the
engine raises on purpose are the other half of the contract: engine/errors.py, also
standard library only.

Next: engine/chat.py, which gives these values their meaning (how a request becomes
events); engine/sampling.py applies `SamplingParams`, engine/tools.py makes `ToolCall`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import tuning

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (llama-server's n_probs has none)
POOLINGS = ("mean", "cls", "last")  # of an embedding's hidden states (engine/embed.py)


def embedding_groups(lengths: list[int], budget: int = tuning.EMBED_BATCH_TOKENS) -> list[range]:
    """Inputs to embed (their token counts), by index, in consecutive groups of at most
    `budget` tokens together, one forward step each; an input longer is a group of its own."""
    groups, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and total + n > budget:
            groups.append(range(start, i))
            start, total = i, 0
        total += n
    if start < len(lengths):
        groups.append(range(start, len(lengths)))
    return groups


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0   # 0 -> greedy, deterministic
    top_k: int = 0             # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    # OpenAI's penalties, on the logits before temperature: a token already in the output
    # loses presence_penalty once and frequency_penalty × its count there
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value) pairs added to the logits
    logprobs: int | None = None  # report each token's log probability, and this many most likely ones

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if not (-2.0 <= self.presence_penalty <= 2.0 and -2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if any(not -100.0 <= value <= 100.0 for _, value in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")


@dataclass
class ChatRequest:
    messages: list[dict]      # HF chat-template messages (role, content, tool_calls, tool_call_id)
    max_tokens: int | None = None           # None -> until the context window is full
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    tools: list[dict] | None = None         # [{"name", "description", "parameters"}]
    tool_choice: str | dict = "auto"        # "auto" | "none" | "required" | {"name": str}
    parallel_tool_calls: bool = True        # False: one call at most
    allowed_tools: tuple[str, ...] | None = None  # calls name only these (all are still shown)
    json_schema: dict | None = None         # structured output


@dataclass(frozen=True)
class Continuation:
    """Where a generation goes on from that another process began (a task taken over): the output
    token ids it had generated, and the random numbers its sampler had drawn for them, so that a
    greedy or seeded generation goes on as it would have."""

    output_ids: tuple[int, ...]
    draws: int


@dataclass
class TokenCounts:
    """The tokens of one chat completion so far, which a consumer can read at any time:
    a response that ends before `Finished` (cancelled, failed) reports what they say then."""

    input_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0  # input tokens the prefix cache supplied (known at the first output token)
    output_ids: list[int] = field(default_factory=list)  # the output token ids (a Continuation's first)
    draws: int = 0  # the random numbers the sampler drew for them

    def update(self, generation) -> None:
        """Take the output counts of a `Generation` (engine/generate.py) as they stand."""
        self.output_tokens, self.cached_tokens = generation.n_generated, generation.cached_tokens
        self.output_ids, self.draws = generation.output_ids, generation.draws


@dataclass
class PreparedChat:
    request: ChatRequest
    prompt: str               # the rendered template
    prompt_ids: list[int]
    max_tokens: int           # resolved: never past the context window
    reasoning: bool           # <think> blocks in the output are reasoning (not with json_schema)
    starts_in_reasoning: bool  # the template's generation prompt opened a <think> block
    constraint: object = None  # engine/constrain/matcher.py GrammarConstraint for tools / json_schema
    tool_calls: bool = False   # split the output into text and tool calls
    continuation: Continuation | None = None  # the output another process generated, to go on from
    counts: TokenCounts = field(init=False)  # its tokens so far (a PreparedChat is generated once)

    def __post_init__(self):
        self.counts = TokenCounts(len(self.prompt_ids))

    @property
    def input_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    """A whole tool call of a response (engine/chat.py gives it out as an event as it is)."""

    index: int      # 0, 1, ... in the order of the response
    name: str
    arguments: str  # compact JSON, valid for the tool's parameters schema


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability under the model's own distribution: the
    log-softmax of the logits the model gave, before penalties, bias and temperature (what
    llama-server's n_probs and OpenAI report), and the `SamplingParams.logprobs` most likely
    tokens there, most likely first. `piece`: the token's bytes (a control token's text)."""

    id: int
    piece: bytes
    logprob: float | None  # None: the first token of a prompt, which nothing before it predicts
    top: tuple[tuple[int, bytes, float], ...] = ()  # (id, piece, logprob)


@dataclass(frozen=True)
class Finished:
    reason: str               # "stop" | "length"
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
