r"""Chat templates: messages -> prompt text, the way Hugging Face's apply_chat_template does it.

A GGUF file carries its model's Jinja template in `tokenizer.chat_template`. It is
rendered in jinja2's ImmutableSandboxedEnvironment (a template is data from a
file, so it may not touch Python internals or mutate its inputs) with the same
set-up as transformers: `trim_blocks`, `lstrip_blocks`, the `loopcontrols`
extension, a no-op `{% generation %}` block, `raise_exception(message)`,
`strftime_now(format)`, and a `tojson` filter that is plain `json.dumps` (no HTML
escaping, non-ASCII kept, `indent`/`separators`/`sort_keys` allowed). Variables:
`messages`, `add_generation_prompt`, `tools`, `bos_token`, `eos_token`.

The rendered text then loses a leading `bos_token` when the tokenizer adds BOS
itself (`add_bos`), and a trailing `eos_token` when it adds EOS (`add_eos`), as
llama.cpp's common/chat.cpp does: many templates start with `{{ bos_token }}`, and
tokenizing that text with add_special would otherwise give two BOS tokens. So
`render` returns what llama.cpp's chat rendering returns for the same model.

Tools are given to templates in the shape they expect,
`{"type": "function", "function": {"name", "description", "parameters"}}`; a bare
`{"name", "description", "parameters"}` dict is wrapped into it. Tool calls in
assistant messages are `{"id", "type": "function", "function": {"name",
"arguments": dict}}` and tool results are `{"role": "tool", "content",
"tool_call_id"}`, as in transformers.

A model without a template gets a fallback, chosen by its vocabulary, which shows
tools, calls and results in the Hermes `<tool_call>` format. (A template that never
mentions `tools` renders what it renders; engine/tools.py writes tools, calls and
results into the messages for it.)

- ChatML when the vocabulary has `<|im_start|>` and `<|im_end|>`::

      <|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n

- the Gemma turn format when it has `<start_of_turn>` and `<end_of_turn>` (no system
  role: the system text opens the first user turn, the assistant is `model`)::

      <start_of_turn>user\n{system}\n\n{text}<end_of_turn>\n<start_of_turn>model\n

- otherwise plain text::

      System: {system}\n\nUser: {text}\n\nAssistant: {text}\n\nUser: {text}\n\nAssistant:

In all three, tools are described in the system text (Hermes / Qwen 2.5 style):
the tools as JSON lines inside `<tools></tools>`, and the instruction to answer
with `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. An assistant
message's tool calls are rendered in that same form after its text, and a tool
result is a user turn (a `Tool:` paragraph in the plain format) holding
`<tool_response>\n{content}\n</tool_response>`. The fallbacks never write the BOS
token: the tokenizer adds it when the model asks for it.
"""

from __future__ import annotations

import json
from collections.abc import Container
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import ChatTemplateError


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: json.dumps as is (jinja's own escapes <, >, & and ')."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks
    in transformers; for rendering it is just its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller):
        return caller()


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# The fallback, one template for three formats: `turn` holds each role's opening
# text, `end` closes a turn, `system_turn` says whether system text has a turn of its
# own (else it opens the first user turn).
_FALLBACK = r"""
{%- set ns = namespace(system='', first_user=true) -%}
{%- set rest = messages -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set ns.system = messages[0].content or '' -%}
  {%- set rest = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
  {%- set ns.system = (ns.system ~ '\n\n' if ns.system else '') ~ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -%}
  {%- for tool in tools -%}
    {%- set ns.system = ns.system ~ '\n' ~ (tool | tojson) -%}
  {%- endfor -%}
  {%- set ns.system = ns.system ~ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -%}
{%- endif -%}
{%- if ns.system and system_turn -%}
  {{- turn.system ~ ns.system ~ end -}}
{%- endif -%}
{%- for message in rest -%}
  {%- if message.role == 'tool' -%}
    {{- turn.tool ~ '<tool_response>\n' ~ (message.content or '') ~ '\n</tool_response>' ~ end -}}
  {%- elif message.role == 'assistant' -%}
    {{- turn.assistant ~ (message.content or '') -}}
    {%- for tool_call in message.tool_calls or [] -%}
      {%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
      {{- ('\n' if loop.first and message.content else '') ~ '<tool_call>\n{"name": ' ~ (call.name | tojson) ~ ', "arguments": ' -}}
      {{- (call.arguments if call.arguments is string else call.arguments | tojson) ~ '}\n</tool_call>' ~ ('\n' if not loop.last else '') -}}
    {%- endfor -%}
    {{- end -}}
  {%- else -%}
    {{- turn[message.role] if message.role in turn else turn.user -}}
    {%- if ns.system and not system_turn and ns.first_user -%}
      {{- ns.system ~ '\n\n' -}}
    {%- endif -%}
    {%- set ns.first_user = false -%}
    {{- (message.content or '') ~ end -}}
  {%- endif -%}
{%- endfor -%}
{%- if ns.system and not system_turn and ns.first_user -%}
  {{- turn.user ~ ns.system ~ end -}}
{%- endif -%}
{%- if add_generation_prompt -%}
  {{- generation_prompt -}}
{%- endif -%}
"""

_FALLBACK_FORMATS = {
    "chatml": dict(
        turn={r: f"<|im_start|>{r}\n" for r in ("system", "user", "assistant")} | {"tool": "<|im_start|>user\n"},
        end="<|im_end|>\n", system_turn=True, generation_prompt="<|im_start|>assistant\n"),
    "gemma": dict(
        turn={"user": "<start_of_turn>user\n", "assistant": "<start_of_turn>model\n",
              "tool": "<start_of_turn>user\n"},
        end="<end_of_turn>\n", system_turn=False, generation_prompt="<start_of_turn>model\n"),
    "plain": dict(
        turn={"system": "System: ", "user": "User: ", "assistant": "Assistant: ", "tool": "Tool: "},
        end="\n\n", system_turn=True, generation_prompt="Assistant:"),
}


_FALLBACK_TEMPLATE = _environment().from_string(_FALLBACK)


def fallback_format(vocab: Container[str]) -> str:
    """Which fallback a model without a template gets: "chatml", "gemma" or "plain"."""
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:
        return "chatml"
    if "<start_of_turn>" in vocab and "<end_of_turn>" in vocab:
        return "gemma"
    return "plain"


def _normalize_tools(tools):
    """Tools in the shape templates expect: {"type": "function", "function": {...}}."""
    if not tools:
        return tools
    return [t if "function" in t or "name" not in t else {"type": "function", "function": t} for t in tools]


class ChatTemplate:
    """A model's chat template, compiled once, rendered per request.

    `template_source` None (or empty) means the model has no template: the fallback
    chosen from `vocab` (the model's token texts) is used and `is_fallback` is true.
    `supports_tools` says whether the template in use mentions `tools` (engine/tools.py
    shows tools to one that does not through the messages).
    """

    def __init__(self, template_source: str | None, bos_token: str = "", eos_token: str = "",
                 *, vocab: Container[str] = (), add_bos: bool = False, add_eos: bool = False):
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.is_fallback = not template_source
        self.fallback_format = fallback_format(vocab)
        self._fallback_variables = _FALLBACK_FORMATS[self.fallback_format]
        if self.is_fallback:
            self.source = _FALLBACK
            self._template = _FALLBACK_TEMPLATE
            self.supports_tools = True
        else:
            self.source = template_source
            env = _environment()
            try:
                self._template = env.from_string(template_source)
                variables = jinja2.meta.find_undeclared_variables(env.parse(template_source))
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(
                    f"the model's chat template does not compile: {e.message} (line {e.lineno})") from e
            self.supports_tools = "tools" in variables

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """The prompt text for these messages (special tokens as text, to be parsed)."""
        variables = self._fallback_variables if self.is_fallback else {}
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=_normalize_tools(tools),
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template cannot render these messages: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(
                f"the chat template failed on these messages ({type(e).__name__}: {e})") from e
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if self.add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[:-len(self.eos_token)]
        return text
