"""resolve_template: "auto" renders as transformers' apply_chat_template does; the
built-ins reproduce the seed runner's wrap_turn and the model families' own templates."""

import pytest
from test_text_tokenizer import CHATML, build_byte_bpe, build_tiktoken, build_unigram, write_config

from llm_executorch_mlx.text import TextError, load_tokenizer, resolve_template

# Meta's Llama 3 instruct template.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Google's Gemma 3 template, text-only: system text opens the first user turn.
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
# Exercises what transformers' environment adds: tojson, strftime_now, namespace,
# loop controls, the {% generation %} block, trim/lstrip_blocks and an eos-closed turn.
FEATURES = """{%- set ns = namespace(count=0) -%}
{{ bos_token }}[date {{ strftime_now("%Y") | length }}]
{% for message in messages %}
    {%- if message['role'] == 'system' %}{% continue %}{% endif -%}
    {% set ns.count = ns.count + 1 %}
    [{{ ns.count }}] {{ message | tojson }}
    {% if message['role'] == 'assistant' -%}
        {% generation %}{{ message['content'] }}{% endgeneration %}{{ eos_token }}
    {%- endif %}
    {% if ns.count > 3 %}{% break %}{% endif %}
{% endfor %}
{% if tools is not none %}TOOLS{% endif %}
{% if add_generation_prompt %}[assistant]{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2? Say \"four\" <b>"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 😀 in 漢字?"},
    ],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two", "reasoning": None},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "five"},
    ],
]
SEED_SINGLE_TURN = {
    "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nP<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<bos><start_of_turn>user\nP<end_of_turn>\n<start_of_turn>model\n",
    "gemma4": "<bos><|turn>user\nP<turn|>\n<|turn>model\n",
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    build_byte_bpe(directory)
    return directory


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma")
    build_unigram(directory)
    return directory


def with_template(directory, template, bos="<|begin_of_text|>", eos="<|end_of_text|>"):
    """Our tokenizer and transformers' over ``directory`` with ``template`` as its chat template."""
    from transformers import AutoTokenizer

    write_config(directory, bos_token=bos, eos_token=eos, chat_template=template)
    return load_tokenizer(directory / "tokenizer.json"), AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("template", [CHATML, LLAMA3, FEATURES], ids=["chatml", "llama3", "features"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_auto_renders_as_transformers(llama_dir, template, generation_prompt):
    ours, ref = with_template(llama_dir, template)
    chat = resolve_template("auto", ours)
    assert chat.name == "auto" and not chat.is_raw
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert chat.render(messages, add_generation_prompt=generation_prompt) == expected


def test_llama3_matches_metas_template(llama_dir):
    ours, ref = with_template(llama_dir, LLAMA3)
    builtin = resolve_template("llama3", ours)
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert builtin.render(messages) == expected


def test_gemma_matches_googles_template(gemma_dir):
    ours, ref = with_template(gemma_dir, GEMMA3, bos="<bos>", eos="<eos>")
    builtin = resolve_template("gemma", ours)
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert builtin.render(messages) == expected


@pytest.mark.parametrize("name", sorted(SEED_SINGLE_TURN))
def test_builtins_reproduce_the_seed_wrap_turn(llama_dir, name):
    chat = resolve_template(name, load_tokenizer(llama_dir))
    assert chat.render([{"role": "user", "content": "P"}]) == SEED_SINGLE_TURN[name]


def test_gemma4_has_a_system_turn(llama_dir):
    chat = resolve_template("gemma4", load_tokenizer(llama_dir))
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ]
    assert chat.render(messages, add_generation_prompt=False) == (
        "<bos><|turn>system\nS<turn|>\n<|turn>user\nU<turn|>\n<|turn>model\nA<turn|>\n"
    )


def test_turn_ends_and_raw(llama_dir):
    tok = load_tokenizer(llama_dir)
    ends = {name: resolve_template(name, tok).turn_end for name in ("llama3", "gemma", "gemma4")}
    assert ends == {"llama3": "<|eot_id|>", "gemma": "<end_of_turn>", "gemma4": "<turn|>"}
    for name in ("none", "0", " NONE "):
        raw = resolve_template(name, tok)
        assert (raw.name, raw.is_raw, raw.turn_end) == ("none", True, None)
    with pytest.raises(TextError, match="does not render"):
        raw.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "template, turn_end",
    [(CHATML, "<|im_end|>"), (LLAMA3, "<|eot_id|>"), (GEMMA3, "<end_of_turn>"), (FEATURES, "<|end_of_text|>")],
)
def test_auto_detects_the_turn_end(llama_dir, template, turn_end):
    write_config(llama_dir, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", chat_template=template)
    assert resolve_template("auto", load_tokenizer(llama_dir)).turn_end == turn_end


def test_auto_without_a_template_picks_the_family_from_the_vocabulary(tmp_path):
    # Llama 3's tiktoken file has no chat template beside it; its tokens say llama3.
    assert resolve_template("auto", load_tokenizer(build_tiktoken(tmp_path / "tt"))).name == "llama3"
    assert resolve_template("auto", load_tokenizer(build_unigram(tmp_path / "g"))).name == "gemma"
    plain = load_tokenizer(build_byte_bpe(tmp_path / "p", specials=["<s>", "</s>"]))
    assert resolve_template("auto", plain).is_raw


def test_unknown_name(llama_dir):
    with pytest.raises(TextError) as info:
        resolve_template("chatml", load_tokenizer(llama_dir))
    assert str(info.value) == "unknown chat template 'chatml': use auto, llama3, gemma, gemma4 or none"


def test_template_errors_become_text_errors(llama_dir, gemma_dir):
    write_config(gemma_dir, bos_token="<bos>", chat_template=GEMMA3)
    ours = load_tokenizer(gemma_dir)
    chat = resolve_template("auto", ours)
    with pytest.raises(TextError, match="Conversation roles must alternate"):
        chat.render([{"role": "assistant", "content": "first"}])
    write_config(llama_dir, chat_template="{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}")
    with pytest.raises(TextError, match="chat template"):
        resolve_template("auto", load_tokenizer(llama_dir)).render([{"role": "user", "content": "x"}])
    write_config(llama_dir, chat_template="{% for m in messages %}")
    with pytest.raises(TextError, match="does not parse"):
        resolve_template("auto", load_tokenizer(llama_dir))


def test_sandbox_refuses_python_internals(llama_dir):
    write_config(llama_dir, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(TextError):
        resolve_template("auto", load_tokenizer(llama_dir)).render([{"role": "user", "content": "x"}])
    write_config(llama_dir, chat_template="{% set ns = namespace(_x=1) %}")
    with pytest.raises(TextError, match="_x"):
        resolve_template("auto", load_tokenizer(llama_dir)).render([])


def test_builtins_reject_unknown_roles(llama_dir):
    chat = resolve_template("llama3", load_tokenizer(llama_dir))
    with pytest.raises(TextError, match="has no role 'tool': use system, user or assistant"):
        chat.render([{"role": "tool", "content": "x"}])
