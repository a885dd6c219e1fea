"""Chat templates: the real SmolLM2 template against llama.cpp's rendering, HF's
environment (tojson, raise_exception, loop controls, generation blocks), errors,
and the documented fallbacks for models without a template."""

import gzip
import json

import pytest

from engine.chat_template import ChatTemplate, fallback_format
from engine.errors import ChatTemplateError

from conftest import DATA

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "21 °C."},
    {"role": "user", "content": "Thanks"},
]
TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "The weather now", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RESULT = '<tool_response>\n{"temp": 21}\n</tool_response>'


@pytest.fixture(scope="module")
def smollm2_template() -> ChatTemplate:
    with gzip.open(DATA / "tokenizer-meta.smollm2.json.gz") as f:
        meta = json.load(f)
    return ChatTemplate(meta["tokenizer.chat_template"], "<|im_start|>", "<|im_end|>")


def test_smollm2_identical_to_llama_cpp(smollm2_template):
    with open(DATA / "chat_template.smollm2.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert rows
    for row in rows:
        got = smollm2_template.render(row["messages"], add_generation_prompt=row["add_generation_prompt"])
        assert got == row["prompt"]
    assert not smollm2_template.supports_tools and not smollm2_template.is_fallback


def test_huggingface_environment():
    source = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}{{ m.content | tojson }}{% endgeneration %}|{% endfor %}"
        "{{ tools | tojson(indent=1) if tools }}{{ eos_token if add_generation_prompt }}"
        "{{ strftime_now('%Y') | length }}"
    )
    t = ChatTemplate(source, "<s>", "</s>")
    assert t.supports_tools
    msgs = [{"role": "user", "content": "héllo <b>&'"}, {"role": "skip", "content": "x"}]
    # tojson keeps non-ASCII and does not HTML-escape, unlike jinja's own filter.
    assert t.render(msgs, add_generation_prompt=False) == '<s>"héllo <b>&\'"|4'
    rendered = t.render(msgs, tools=[WEATHER_TOOL])
    assert '"type": "function",\n  "function": {\n   "name": "get_weather"' in rendered
    assert rendered.endswith("</s>4")


def test_template_errors_are_engine_errors():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", "", "")
    strict = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('must start with user') }}"
                          "{% endif %}ok", "", "")
    assert strict.render([{"role": "user", "content": "hi"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="must start with user"):
        strict.render([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}", "", "").render([{"role": "user", "content": "a"}])


def test_sandbox_refuses_unsafe_templates():
    evil = ChatTemplate("{{ messages.append(1) }}{{ ''.__class__.__mro__ }}", "", "")
    with pytest.raises(ChatTemplateError):
        evil.render([{"role": "user", "content": "hi"}])


def test_fallback_format_follows_the_vocabulary():
    assert fallback_format({"<|im_start|>": 1, "<|im_end|>": 2}) == "chatml"
    assert fallback_format(["<bos>", "<start_of_turn>", "<end_of_turn>"]) == "gemma"
    assert fallback_format([]) == "plain"


def test_chatml_fallback():
    t = ChatTemplate(None, "", "", vocab={"<|im_start|>", "<|im_end|>"})
    assert t.is_fallback and t.supports_tools and t.fallback_format == "chatml"
    assert t.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert t.render(TOOL_CONVERSATION, tools=[WEATHER_TOOL]) == (
        f"<|im_start|>system\nBe brief.\n\n{TOOLS_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL}<|im_end|>\n"
        f"<|im_start|>user\n{RESULT}<|im_end|>\n"
        "<|im_start|>assistant\n21 °C.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_gemma_fallback():
    t = ChatTemplate("", "<bos>", "<eos>", vocab=["<start_of_turn>", "<end_of_turn>"])
    assert t.fallback_format == "gemma"
    assert t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]) == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert t.render(TOOL_CONVERSATION, tools=[WEATHER_TOOL], add_generation_prompt=False) == (
        f"<start_of_turn>user\nBe brief.\n\n{TOOLS_SYSTEM}\n\nWeather in Paris?<end_of_turn>\n"
        f"<start_of_turn>model\n{CALL}<end_of_turn>\n"
        f"<start_of_turn>user\n{RESULT}<end_of_turn>\n"
        "<start_of_turn>model\n21 °C.<end_of_turn>\n"
        "<start_of_turn>user\nThanks<end_of_turn>\n")


def test_plain_fallback():
    t = ChatTemplate(None, "", "")
    assert t.fallback_format == "plain"
    text_call = {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": {}}},
    ]}
    assert t.render([{"role": "user", "content": "Hi"}, text_call]) == (
        "User: Hi\n\nAssistant: Let me check.\n"
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n\nAssistant:')


def test_leading_bos_dropped_when_the_tokenizer_adds_it():
    # As llama.cpp: the template's own "{{ bos_token }}" would give a second BOS.
    source = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}"
    msgs = [{"role": "user", "content": "Hi"}]
    assert ChatTemplate(source, "<bos>", "<eos>").render(msgs) == "<bos>Hi<eos>"
    assert ChatTemplate(source, "<bos>", "<eos>", add_bos=True).render(msgs) == "Hi<eos>"
    assert ChatTemplate(source, "<bos>", "<eos>", add_bos=True, add_eos=True).render(msgs) == "Hi"
