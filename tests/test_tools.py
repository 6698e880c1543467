"""Tools: rendered through each family's real chat template as transformers
renders them, calls read from what those models write, and a whole tool
chain through llm's Python API reusing the cache each round.

The templates are the real ones (tests/templates/README.md says where each
comes from); transformers' ``apply_chat_template(..., tools=...)`` is the
reference for every rendering and every prompt id.
"""

import json
import pathlib
import string

import llm
import pytest
from click.testing import CliRunner
from llm.cli import cli

from llm_executorch_mlx.text import TextError, load_tokenizer, resolve_template, store
from llm_executorch_mlx.text.conversation import calls_as_text, encode_conversation, messages_from_llm
from llm_executorch_mlx.text.reasoning import think_tags
from llm_executorch_mlx.text.reply_parts import ReplySplitter, split_reply
from llm_executorch_mlx.text.tool_calls import ToolCall, tool_definitions, tool_format

TEMPLATES = pathlib.Path(__file__).parent / "templates"
QWEN25 = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
LLAMA31 = (TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
LLAMA32 = (TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text()
# HuggingFaceTB/SmolLM3-3B's chat_template.jinja, as johnmai-dev/Jinja's tests keep it (templates/README.md)
SMOLLM3 = (TEMPLATES / "HuggingFaceTB-SmolLM3-3B.jinja").read_text()
FAMILIES = {"qwen2.5": QWEN25, "qwen3": QWEN3, "llama3.1": LLAMA31, "llama3.2": LLAMA32}

SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
            "<think>", "</think>", "<tool_response>", "</tool_response>",
            "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]
CORPUS = [  # the text of tool prompts, calls and results, so they take few tokens
    'Multiply two integers. {"name": "multiply", "arguments": {"a": 6, "b": 7}} The answer is 42.',
    ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n"),
    ("For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"),
    ('{"type": "function", "function": {"name": "llm_time", "description": "Returns the current time, as local '
    'time and UTC", "parameters": {"properties": {}, "type": "object"}}}'),
    ('{\n  "utc_time": "2026-12-02 04:05:13 UTC",\n  "utc_time_iso": "2026-12-02T04:05:13.004164+00:00",\n  '
    '"local_timezone": "UTC",\n  "local_time": "2026-12-02 04:05:13",\n  "timezone_offset": "UTC+00:00",\n  '
    '"is_dst": false\n}'),
    "Given the following functions, please respond with a JSON for a function call.",
]


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


MULTIPLY = llm.Tool.function(multiply)
# What a chat template's tools= takes for it: written out, OpenAI's function form.
MULTIPLY_SPEC = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "type": "object"}}}


def make_chat_tokenizer(directory: pathlib.Path, template: str, eos: str = "<|im_end|>",
                        specials=SPECIALS) -> pathlib.Path:
    """A byte-level BPE (Qwen's kind) over printable ASCII (so JSON encodes
    without unknowns) with ChatML's and Llama 3's special tokens (``specials``), small enough
    for the test models' 256 ids, and ``template`` as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    printable = "".join(c for c in string.printable if c not in "\x0b\x0c\r")
    tok.train_from_iterator([printable] + CORPUS * 4, trainers.BpeTrainer(
        vocab_size=250, special_tokens=specials, show_progress=False))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": eos, "chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }))
    return directory / "tokenizer.json"


def tokenizers(directory, template):
    """Ours and transformers' over the same files."""
    import transformers

    make_chat_tokenizer(directory, template)
    return load_tokenizer(directory / "tokenizer.json"), transformers.AutoTokenizer.from_pretrained(directory)


def call_message(content="", reasoning=None, **arguments):
    message = {"role": "assistant", "content": content,
               "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": arguments}}]}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


CONVERSATIONS = [
    [{"role": "user", "content": "What is six times seven?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is six times seven?"},
        call_message(a=6, b=7),
        {"role": "tool", "content": "42", "name": "multiply"},
    ],
    [
        {"role": "user", "content": "What is six times seven?"},
        call_message(a=6, b=7),
        {"role": "tool", "content": "42", "name": "multiply"},
        {"role": "assistant", "content": "It is 42."},
        {"role": "user", "content": "And 2 times 3?"},
    ],
]


# -- rendering: ours against transformers, text and ids ---------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_tools_and_results_render_as_transformers_renders_them(tmp_path, family):
    ours, ref = tokenizers(tmp_path, FAMILIES[family])
    template = resolve_template("auto", ours).bound(tools=[MULTIPLY_SPEC])
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, tools=[MULTIPLY_SPEC], tokenize=False, add_generation_prompt=True)
        assert "multiply" in expected and template.render(messages) == expected
        expected_ids = ref.apply_chat_template(messages, tools=[MULTIPLY_SPEC], tokenize=True,
                                               add_generation_prompt=True, return_dict=False)
        assert encode_conversation(messages, template, ours, {}) == expected_ids


def test_llms_tools_become_the_templates_function_specs():
    assert tool_definitions([MULTIPLY]) == [MULTIPLY_SPEC]


def test_llms_messages_become_template_messages():
    from llm.parts import Message, ReasoningPart, TextPart, ToolCallPart, ToolResultPart

    messages = messages_from_llm([
        Message("user", [TextPart("What is six times seven?")]),
        Message("assistant", [ReasoningPart("Multiply."), ToolCallPart("multiply", {"a": 6, "b": 7}, "tc_1")]),
        Message("tool", [ToolResultPart("multiply", "42", "tc_1"), ToolResultPart("multiply", "6", "tc_2")]),
    ])
    assert messages == [
        {"role": "user", "content": "What is six times seven?"},
        call_message(reasoning="Multiply.", a=6, b=7),
        {"role": "tool", "content": "42", "name": "multiply"},
        {"role": "tool", "content": "6", "name": "multiply"},
    ]


# -- which format a template asks for ---------------------------------------


def test_each_family_is_read_from_its_template():
    assert {name: tool_format(source).family for name, source in {**FAMILIES, "smollm3": SMOLLM3}.items()} == {
        "qwen2.5": "hermes", "qwen3": "hermes", "llama3.1": "llama3_json", "llama3.2": "llama3_json",
        "smollm3": "smollm3"}
    # SmolLM3's template reads xml_tools and renders no tool_calls: its calls go back as text
    smol = tool_format(SMOLLM3)
    assert (smol.tools_key, smol.calls_in_content) == ("xml_tools", True)
    assert not any(tool_format(source).calls_in_content for source in FAMILIES.values())


def test_a_template_without_tools_is_refused_not_guessed():
    from test_text_templates import GEMMA3, LLAMA3
    from test_text_tokenizer import CHATML

    for source in (GEMMA3, LLAMA3, CHATML, None):
        with pytest.raises(TextError, match="tools are not supported for this model's chat template"):
            tool_format(source)


# -- reading calls from what the models write ---------------------------------

HERMES = tool_format(QWEN25)
LLAMA = tool_format(LLAMA32)
# Outputs in each family's documented form (Qwen's function-calling guide,
# Meta's Llama 3.1/3.2 model cards), with the text around them models add.
KNOWN_OUTPUTS = [
    (HERMES, ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
             '</tool_call>'), "", [ToolCall("get_current_temperature", {"location": "San Francisco, CA, USA"})]),
    (HERMES, ('Let me check both.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
             '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'),
     "Let me check both.", [ToolCall("a", {"x": 1}), ToolCall("b", {})]),
    (HERMES, '<tool_call>{"name": "echo", "arguments": {"text": "a </tool_call> b"}}</tool_call>', "",
     [ToolCall("echo", {"text": "a </tool_call> b"})]),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"q\\": 2}"}</tool_call>', "", [ToolCall("f", {"q": 2})]),
    (HERMES, 'lead <tool_call>{bad json}</tool_call> tail', "lead <tool_call>{bad json}</tool_call> tail", []),
    (HERMES, 'unclosed <tool_call>{"name": "f", "arguments": {}}', 'unclosed <tool_call>{"name": "f", "arguments": {}}',
     []),
    (HERMES, "No tools needed: it is 42.", "No tools needed: it is 42.", []),
    (LLAMA, '{"name": "get_weather", "parameters": {"location": "Paris"}}', "", [ToolCall("get_weather", {"location": "Paris"})]),
    (LLAMA, '<|python_tag|>{"name": "f", "parameters": {"n": 3}}', "", [ToolCall("f", {"n": 3})]),
    (LLAMA, "{this is not a call}", "{this is not a call}", []),
    (LLAMA, "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
]


@pytest.mark.parametrize("fmt, output, content, calls", KNOWN_OUTPUTS)
def test_calls_are_read_from_known_outputs_in_any_chunking(fmt, output, content, calls):
    whole = split_reply(output, None, False, fmt)
    assert (whole.content, whole.calls) == (content, calls)
    for size in (1, 2, 3, 5, 11):  # the tags split across chunks, as across tokens
        splitter = ReplySplitter(None, False, fmt)
        events = [e for i in range(0, len(output), size) for e in splitter.feed(output[i:i + size])]
        events += splitter.finish()
        assert "".join(t for _, t in events) == content and splitter.parts.calls == calls


def test_call_markup_is_never_streamed_as_text():
    splitter = ReplySplitter(None, False, HERMES)
    shown = "".join(t for c in ["Sure", ".", "\n", "<tool", "_call>", '{"name": "f",', ' "arguments": {}}', "</tool_call>"]
                    for _, t in splitter.feed(c))
    assert shown == "Sure." and "".join(t for _, t in splitter.finish()) == ""


# -- a whole chain through llm's Python API ------------------------------------


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    store.POOL.clear()
    store.REPLIES.clear()
    store.TRUNCATIONS.clear()
    yield tmp_path / "llm"


@pytest.fixture(scope="module")
def qwen3_tools(fixture_root, tmp_path_factory):
    """A tiny random Qwen3 model with Qwen3's real template: (pte, tokenizer dir).
    Its context is 512: a prompt offering a tool takes ~300 of these tokens."""
    from models import make_fixture

    _, pte = make_fixture(fixture_root, "qwen3", False, "fp32", None, max_ctx_len=512)
    tok_dir = tmp_path_factory.mktemp("qwen3-tok")
    make_chat_tokenizer(tok_dir, QWEN3)
    return pte, tok_dir


def register(pte, tok_dir, name):
    r = CliRunner().invoke(cli, ["pte", "register", str(pte), "--tokenizer", str(tok_dir / "tokenizer.json"),
                                 "--name", name], catch_exceptions=False)
    assert r.exit_code == 0, r.output


def scripted_sampler(monkeypatch, pick=None) -> dict:
    """Make the sampler pick the tokens of ``script["ids"]`` (or of
    ``pick(history)``) instead of the random model's choice: no tools-trained
    weights can be had here, and a random model never writes a call, so the
    test scripts what a trained one writes, then checks what the plugin does
    with it. The sampler continues the longest start of the script that the
    history ends with."""
    import mlx.core as mx

    from llm_executorch_mlx.text import sampling

    script = {"ids": []}

    def sample_next(self, logits, history):
        ids = pick(history) if pick else script["ids"]
        k = next(k for k in range(len(ids) - 1, -1, -1) if k == 0 or history[-k:] == ids[:k])
        return mx.array(ids[k], dtype=mx.uint32)

    monkeypatch.setattr(sampling.Sampler, "sample_next", sample_next)
    return script


def test_a_tool_chain_renders_calls_and_results_and_reuses_the_cache(qwen3_tools, user_dir, monkeypatch):
    import transformers

    pte, tok_dir = qwen3_tools
    register(pte, tok_dir, "toolsy")
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    im_end = ref.convert_tokens_to_ids("<|im_end|>")
    call_text = ('<think>\nSix times seven: multiply.\n</think>\n\n'
                 '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>')
    answer = "The answer is 42."
    script = scripted_sampler(monkeypatch)
    script["ids"] = ref.encode(call_text, add_special_tokens=False) + [im_end]
    seen = []

    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        seen.append((a, b))
        script["ids"] = ref.encode(answer, add_special_tokens=False) + [im_end]  # the next round answers
        return a * b

    model = llm.get_model("pte:toolsy")
    chain = model.chain("What is six times seven?", tools=[multiply], options={"kv_disk_mb": 0})
    first, second = list(chain.responses())
    assert second.text() == answer
    assert seen == [(6, 7)]
    assert [(c.name, c.arguments) for c in first.tool_calls()] == [("multiply", {"a": 6, "b": 7})]
    (message,) = first.messages()
    assert [type(p).__name__ for p in message.parts] == ["ReasoningPart", "ToolCallPart"]
    assert message.parts[0].text == "Six times seven: multiply." and first.text() == ""

    # Each round's prompt is transformers' rendering of the conversation so far.
    user = {"role": "user", "content": "What is six times seven?"}
    round1 = ref.apply_chat_template([user], tools=[MULTIPLY_SPEC], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    history = [user, call_message(reasoning="Six times seven: multiply.", a=6, b=7),
               {"role": "tool", "content": "42", "name": "multiply"}]
    round2 = ref.apply_chat_template(history, tools=[MULTIPLY_SPEC], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    (session,) = [s for _, s in store.POOL._sessions.values()]
    assert session.tokens[: len(round2)] == round2
    one, two = first.response_json, second.response_json
    assert one["prompt_tokens"] == len(round1) and one["cache_path"] == "cold"
    # the second round prefills only the tool result and the new turn's opening
    assert two["prompt_tokens"] == len(round2) and two["cache_path"] == "hit"
    assert two["cached_tokens"] == len(round1) + len(script_ids(ref, call_text)) + 1

    assert [e.type for e in first.stream_events()][:1] == ["reasoning"]


def script_ids(ref, text):
    return ref.encode(text, add_special_tokens=False)


def test_llm_T_runs_a_tool_and_answers_from_its_result(qwen3_tools, user_dir, monkeypatch):
    import transformers

    pte, tok_dir = qwen3_tools
    register(pte, tok_dir, "toolsy")
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    im_end, response = ref.convert_tokens_to_ids(["<|im_end|>", "<tool_response>"])
    call = script_ids(ref, '<tool_call>\n{"name": "llm_time", "arguments": {}}\n</tool_call>') + [im_end]
    answer = script_ids(ref, "It is the time the tool said.") + [im_end]
    # a tool result in the prompt: the model has called, it answers now
    scripted_sampler(monkeypatch, lambda history: answer if response in history else call)
    r = CliRunner().invoke(cli, ["-m", "pte:toolsy", "-T", "llm_time", "what time is it?", "--td"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "Tool call: llm_time({})" in r.output and "utc_time" in r.output
    assert r.output.rstrip().endswith("It is the time the tool said.")


def test_tools_on_a_template_without_them_is_one_line_naming_the_families(tiny_llama, user_dir):
    pte, tok_dir = tiny_llama
    register(pte, tok_dir, "plain")
    r = CliRunner().invoke(cli, ["-m", "pte:plain", "-T", "llm_time", "what time is it?"])
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [
        ("Error: tools are not supported for this model's chat template: it does not render tools in a format "
        "we read (Qwen2.5/Qwen3/Hermes/SmolLM3 <tool_call> JSON, Llama 3.1/3.2 JSON)")]


@pytest.fixture(scope="module")
def tiny_llama(exported, tmp_path_factory):
    from models import make_tokenizer

    _, pte = exported("llama")
    tok_dir = tmp_path_factory.mktemp("tok")
    make_tokenizer(tok_dir)
    return pte, tok_dir


def test_llm_models_lists_tools_and_the_reasoning_option(qwen3_tools, user_dir):
    register(*qwen3_tools, "toolsy")
    out = CliRunner().invoke(cli, ["models", "--options", "-m", "pte:toolsy"]).output
    assert "- tools" in out.split("Features:")[1]
    assert "reasoning: boolean" in out and "enable_thinking" in out


# -- forced calls (-o tool_choice): a random model made to write a valid call ----

BOUNDED = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                            "b": {"type": "integer", "minimum": 0, "maximum": 99}},
           "required": ["a", "b"]}
NO_ARGUMENTS = {"type": "object", "properties": {}}
# Bounded arguments, so any call closes within a few tokens whatever the weights pick.
FORCED_SPECS = [
    {"type": "function", "function": {"name": "multiply", "description": "Multiply.", "parameters": BOUNDED}},
    {"type": "function", "function": {"name": "llm_time", "description": "The time.", "parameters": NO_ARGUMENTS}},
]


def random_call(fmt, specs, tok, end_id, seed) -> str:
    """The text of one call sampled uniformly among the tokens the forced
    grammar allows at each step, up to the end token it must reach."""
    import mlx.core as mx
    import numpy as np

    from llm_executorch_mlx.text.constrained import Constraint

    constraint = Constraint(None, tok, tok.vocab_size, [end_id], call=(fmt, specs))
    rng, ids = np.random.default_rng(seed), []
    for _ in range(200):
        allowed = np.flatnonzero(np.isfinite(np.array(constraint.apply(mx.zeros(tok.vocab_size)))))
        token = int(rng.choice(allowed))
        if token == end_id:
            return tok.decode(ids)
        constraint.advance(token)
        ids.append(token)
    raise AssertionError(f"no end after 200 tokens: {tok.decode(ids)!r}")


@pytest.mark.parametrize("family", ["qwen2.5", "smollm3", "llama3.2"])
@pytest.mark.parametrize("tags", ["special", "text"])
def test_a_forced_call_is_a_valid_call_of_an_offered_tool_whatever_tokens_are_picked(tmp_path, family, tags):
    import jsonschema

    source, eos = {"qwen2.5": (QWEN25, "<|im_end|>"), "smollm3": (SMOLLM3, "<|im_end|>"),
                   "llama3.2": (LLAMA32, "<|eot_id|>")}[family]
    specials = SPECIALS if tags == "special" else [s for s in SPECIALS if "tool_call" not in s]
    make_chat_tokenizer(tmp_path, source, eos, specials)
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    added = {t["content"] for t in json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"]}
    assert ("<tool_call>" in added) == (tags == "special")
    fmt = tool_format(source)
    schemas = {s["function"]["name"]: s["function"]["parameters"] for s in FORCED_SPECS}
    for seed in range(8):
        text = random_call(fmt, FORCED_SPECS, tok, tok.token_to_id(eos), seed)
        if fmt.opening:  # the family's own framing, exactly
            assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        parts = split_reply(text, None, False, fmt)
        (call,) = parts.calls
        assert parts.content == "" and call.name in schemas
        jsonschema.validate(call.arguments, schemas[call.name])
        key = "arguments" if fmt.opening else "parameters"
        assert json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")) == {
            "name": call.name, key: call.arguments}


def test_a_tool_named_by_tool_choice_is_the_one_called(tmp_path):
    make_chat_tokenizer(tmp_path, QWEN25)
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    specs = [s for s in FORCED_SPECS if s["function"]["name"] == "llm_time"]
    for seed in range(4):
        assert random_call(HERMES, specs, tok, tok.token_to_id("<|im_end|>"), seed) == (
            '<tool_call>\n{"name": "llm_time", "arguments": {}}\n</tool_call>')


def forced_tools(seen):
    def multiply(a, b):
        seen.append(("multiply", a, b))
        return a * b

    def llm_time():
        seen.append(("llm_time",))
        return "12:00"

    return [llm.Tool(name=s["function"]["name"], description=s["function"]["description"],
                     input_schema=s["function"]["parameters"], implementation=f)
            for s, f in zip(FORCED_SPECS, (multiply, llm_time))]


@pytest.mark.parametrize("family", ["qwen3", "smollm3"])
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 1), (0.8, 2), (1.5, 3)])
def test_a_forced_chain_calls_runs_the_tool_and_answers_from_the_cache(request, user_dir, family, temperature, seed):
    import jsonschema
    import transformers

    pte, tok_dir = request.getfixturevalue(f"{family}_tools")
    register(pte, tok_dir, "toolsy")
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    seen = []
    options = {"kv_disk_mb": 0, "tool_choice": "required", "max_tokens": 48, "temperature": temperature,
               "seed": seed}
    chain = llm.get_model("pte:toolsy").chain("What is six times seven?", tools=forced_tools(seen), options=options)
    first, second = list(chain.responses())[:2]
    (call,) = first.tool_calls()
    (spec,) = [s["function"] for s in FORCED_SPECS if s["function"]["name"] == call.name]
    jsonschema.validate(call.arguments, spec["parameters"])
    assert seen == [(call.name, *call.arguments.values())] and first.text() == ""

    # the second round: a cache hit on the prompt transformers renders with the call and its result
    result = str(call.arguments["a"] * call.arguments["b"]) if call.name == "multiply" else "12:00"
    written = {"name": call.name, "arguments": call.arguments}
    if family == "qwen3":
        turn = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": written}]}
        tools = {"tools": FORCED_SPECS}
    else:  # SmolLM3's template renders no tool_calls: the call goes back as the text its syntax writes
        turn = {"role": "assistant", "content": "<tool_call>\n" + json.dumps(written) + "\n</tool_call>"}
        tools = {"xml_tools": [s["function"] for s in FORCED_SPECS]}
    history = [{"role": "user", "content": "What is six times seven?"}, turn,
               {"role": "tool", "content": result, "name": call.name}]
    rendered = ref.apply_chat_template(history, add_generation_prompt=True, tokenize=False, **tools)
    (session,) = [s for _, s in store.POOL._sessions.values()]
    assert ref.decode(session.tokens).startswith(rendered)
    one, two = first.response_json, second.response_json
    assert two["cache_path"] == "hit" and two["cached_tokens"] == one["prompt_tokens"] + first.output_tokens + 1


@pytest.mark.parametrize("family", ["qwen3", "smollm3"])
def test_llm_T_with_tool_choice_required_calls_the_tool_on_random_weights(request, user_dir, family):
    register(*request.getfixturevalue(f"{family}_tools"), "toolsy")
    r = CliRunner().invoke(cli, ["-m", "pte:toolsy", "-T", "llm_time", "what time is it?", "--td",
                                 "-o", "tool_choice", "required", "-o", "max_tokens", "32"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "Tool call: llm_time({})" in r.output and "utc_time" in r.output


@pytest.mark.parametrize("args, error", [
    (["-o", "tool_choice", "required"],
     "Error: -o tool_choice required needs tools to call: offer some with -T/--tool or --functions"),
    (["-T", "llm_time", "-o", "tool_choice", "none"],
     "Error: tool_choice must be auto, required or the name of a tool offered (llm_time), got 'none'"),
    (["-T", "llm_time", "-o", "tool_choice", "required", "--schema", "name, age int"],
     "Error: -o tool_choice cannot be used with a schema: the reply is either a document or a call"),
])
def test_tool_choice_misuse_is_one_line_naming_the_fix(qwen3_tools, user_dir, args, error):
    register(*qwen3_tools, "toolsy")
    r = CliRunner().invoke(cli, ["-m", "pte:toolsy", "what time is it?", *args])
    assert r.exit_code == 1 and r.output.strip().splitlines() == [error]


def test_a_call_is_not_forced_inside_reasoning_the_template_opens(qwen3_tools, user_dir, tmp_path):
    # Qwen3's template with the generation prompt opening the reasoning, as its Thinking-2507 ones do
    opened = QWEN3.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    assert opened != QWEN3
    pte, _ = qwen3_tools
    make_chat_tokenizer(tmp_path / "tok", opened)
    register(pte, tmp_path / "tok", "thinker")
    r = CliRunner().invoke(cli, ["-m", "pte:thinker", "-T", "llm_time", "what time is it?",
                                 "-o", "tool_choice", "required"])
    assert r.exit_code == 1 and r.output.strip().splitlines() == [
        "Error: -o tool_choice required cannot force a call inside the reasoning the template opens: "
        "add -o reasoning false"]
    r = CliRunner().invoke(cli, ["-m", "pte:thinker", "-T", "llm_time", "what time is it?", "--td", "-o",
                                 "tool_choice", "required", "-o", "reasoning", "false", "-o", "max_tokens", "32"])
    assert r.exit_code == 0 and "Tool call: llm_time({})" in r.output  # the fix it names works


# -- SmolLM3: tools as xml_tools=, a turn that called goes back as its text ----

SMOL = tool_format(SMOLLM3)
THINK = think_tags(SMOLLM3)
# xml_tools takes each function bare, as SmolLM3's model card passes them.
SMOL_TOOLS = [MULTIPLY_SPEC["function"]]
# A call as SmolLM3's template tells the model to write one, after reasoning in its tags.
SMOL_CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
SMOL_THOUGHT = "<think>\nSix times seven: multiply.\n</think>\n"


def smol_conversations():
    """Conversations as llm hands them back (calls as tool_calls), each with
    what transformers is given for it: the calls written in the turn's content."""
    user = {"role": "user", "content": "What is six times seven?"}
    result = {"role": "tool", "content": "42", "name": "multiply"}
    system = {"role": "system", "content": "You are terse."}
    return [
        ([user], [user]),
        ([system, user, call_message(a=6, b=7), result],
         [system, user, {"role": "assistant", "content": SMOL_CALL}, result]),
        ([user, call_message("Let me compute.", "Six times seven: multiply.", a=6, b=7), result,
          {"role": "assistant", "content": "It is 42."}, {"role": "user", "content": "And 2 times 3?"}],
         [user, {"role": "assistant", "content": SMOL_THOUGHT + "Let me compute.\n" + SMOL_CALL}, result,
          {"role": "assistant", "content": "It is 42."}, {"role": "user", "content": "And 2 times 3?"}]),
    ]


@pytest.mark.parametrize("thinking", [True, False])
def test_smollm3s_tools_calls_and_results_render_as_transformers_renders_them(tmp_path, thinking):
    ours, ref = tokenizers(tmp_path, SMOLLM3)
    context = {**SMOL.template_context([MULTIPLY_SPEC]), "enable_thinking": thinking}
    template = resolve_template("auto", ours).bound(**context)
    kwargs = {"xml_tools": SMOL_TOOLS, "enable_thinking": thinking, "add_generation_prompt": True}
    for from_llm, written in smol_conversations():
        messages = calls_as_text(from_llm, SMOL, THINK, ours, {})
        expected = ref.apply_chat_template(written, tokenize=False, **kwargs)
        assert "### Tools" in expected and "'name': 'multiply'" in expected
        assert template.render(messages) == expected
        expected_ids = ref.apply_chat_template(written, tokenize=True, return_dict=False, **kwargs)
        assert encode_conversation(messages, template, ours, {}) == expected_ids


def test_smollm3s_reasoning_and_calls_are_read_in_any_chunking():
    output = SMOL_THOUGHT + "Let me compute.\n" + SMOL_CALL
    whole = split_reply(output, THINK, False, SMOL)
    assert (whole.reasoning, whole.content, whole.calls) == (
        "Six times seven: multiply.", "Let me compute.", [ToolCall("multiply", {"a": 6, "b": 7})])
    for size in (1, 2, 3, 5, 11):
        splitter = ReplySplitter(THINK, False, SMOL)
        for i in range(0, len(output), size):
            splitter.feed(output[i:i + size])
        splitter.finish()
        assert splitter.parts == whole


@pytest.fixture(scope="module")
def smollm3_tools(fixture_root, tmp_path_factory):
    """A tiny random Qwen3 model with SmolLM3's real template: (pte, tokenizer dir).
    Its context is 2048: SmolLM3's default system prompt takes ~1,000 of these tokens."""
    from models import make_fixture

    _, pte = make_fixture(fixture_root, "qwen3", False, "fp32", None, max_ctx_len=2048)
    tok_dir = tmp_path_factory.mktemp("smollm3-tok")
    make_chat_tokenizer(tok_dir, SMOLLM3)
    return pte, tok_dir


def test_a_smollm3_tool_chain_sends_back_the_text_it_wrote_and_reuses_the_cache(smollm3_tools, user_dir,
                                                                                  monkeypatch):
    import transformers

    pte, tok_dir = smollm3_tools
    register(pte, tok_dir, "smol3")
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    im_end = ref.convert_tokens_to_ids("<|im_end|>")
    call_text = SMOL_THOUGHT + SMOL_CALL
    script = scripted_sampler(monkeypatch)
    script["ids"] = script_ids(ref, call_text) + [im_end]
    seen = []

    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        seen.append((a, b))
        script["ids"] = script_ids(ref, "The answer is 42.") + [im_end]
        return a * b

    conversation = llm.get_model("pte:smol3").conversation()
    chain = conversation.chain("What is six times seven?", tools=[multiply], options={"kv_disk_mb": 0})
    first, second = list(chain.responses())
    assert second.text() == "The answer is 42." and seen == [(6, 7)]
    assert [(c.name, c.arguments) for c in first.tool_calls()] == [("multiply", {"a": 6, "b": 7})]
    (message,) = first.messages()
    assert [type(p).__name__ for p in message.parts] == ["ReasoningPart", "ToolCallPart"] and first.text() == ""

    # Each round's prompt is transformers' rendering, the call turn as the model wrote it.
    user = {"role": "user", "content": "What is six times seven?"}
    kwargs = {"xml_tools": SMOL_TOOLS, "add_generation_prompt": True, "tokenize": True, "return_dict": False}
    round1 = ref.apply_chat_template([user], **kwargs)
    round2 = ref.apply_chat_template(
        [user, {"role": "assistant", "content": call_text}, {"role": "tool", "content": "42"}], **kwargs)
    (session,) = [s for _, s in store.POOL._sessions.values()]
    assert session.tokens[: len(round2)] == round2
    one, two = first.response_json, second.response_json
    assert one["prompt_tokens"] == len(round1) and one["cache_path"] == "cold"
    assert two["prompt_tokens"] == len(round2) and two["cache_path"] == "hit"
    assert two["cached_tokens"] == len(round1) + len(script_ids(ref, call_text)) + 1

    # a later turn without tools still sends the call back
    script["ids"] = script_ids(ref, "Bye.") + [im_end]
    assert conversation.prompt("Thanks", kv_disk_mb=0).text() == "Bye."
    round3 = ref.apply_chat_template(
        [user, {"role": "assistant", "content": call_text}, {"role": "tool", "content": "42"},
         {"role": "assistant", "content": "The answer is 42."}, {"role": "user", "content": "Thanks"}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert any(s.tokens[: len(round3)] == round3 for _, s in store.POOL._sessions.values())
