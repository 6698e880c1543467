"""Reasoning: ``<think>`` text streamed as llm's reasoning, apart from the
answer, in any chunking; ``-o reasoning`` as the template's enable_thinking;
history rendered as transformers renders Qwen3's template."""

import pytest
from click.testing import CliRunner
from llm.cli import cli
from test_tools import (
    QWEN3,
    SMOLLM3,
    TEMPLATES,
    qwen3_tools,
    register,
    script_ids,
    scripted_sampler,
    smollm3_tools,
    tiny_llama,
    tokenizers,
    user_dir,
)

from llm_executorch_mlx.text import TextError, resolve_template, store
from llm_executorch_mlx.text.conversation import encode_conversation, message_key
from llm_executorch_mlx.text.reasoning import opens_reasoning, think_tags, thinking_context
from llm_executorch_mlx.text.reply_parts import ReplySplitter, split_reply

__all__ = ["qwen3_tools", "smollm3_tools", "tiny_llama", "user_dir"]  # fixtures, shared with test_tools

THINK = think_tags(QWEN3)
# What Qwen3 writes in thinking mode: its reasoning, then the answer.
OUTPUT = "<think>\nThe user greets me.\n\nI greet back.\n</think>\n\nHello! How can I help?"


def test_qwen3s_template_declares_think_tags_and_a_switch():
    assert THINK == ("<think>", "</think>")
    assert thinking_context(QWEN3, False) == {"enable_thinking": False}
    assert thinking_context(QWEN3, None) == {}


def test_reasoning_is_split_from_the_answer_in_any_chunking(tmp_path):
    whole = split_reply(OUTPUT, THINK, False, None)
    assert (whole.reasoning, whole.content) == ("The user greets me.\n\nI greet back.", "Hello! How can I help?")
    for size in range(1, 12):  # tags split across chunks
        splitter = ReplySplitter(THINK, False, None)
        events = [e for i in range(0, len(OUTPUT), size) for e in splitter.feed(OUTPUT[i:i + size])]
        events += splitter.finish()
        kinds = [k for k, _ in events]
        assert kinds == sorted(kinds, key=["reasoning", "text"].index)  # reasoning first, then the answer
        assert splitter.parts == whole
    # and token by token, as the tokenizer splits it
    ours, _ = tokenizers(tmp_path, QWEN3)
    splitter = ReplySplitter(THINK, False, None)
    for i in ours.encode(OUTPUT):
        splitter.feed(ours.decode([i]))
    splitter.finish()
    assert splitter.parts == whole


def test_a_reply_without_reasoning_is_all_answer():
    parts = split_reply("Just the answer.", THINK, False, None)
    assert (parts.reasoning, parts.content) == ("", "Just the answer.")


def test_a_generation_prompt_that_opens_the_reasoning_starts_the_reply_inside_it(tmp_path):
    source = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    ours, _ = tokenizers(tmp_path, source)
    prompt = resolve_template("auto", ours).render([{"role": "user", "content": "Hi"}])
    assert opens_reasoning(prompt, think_tags(source))
    parts = split_reply("Greeting.\n</think>\n\nHello!", think_tags(source), True, None)
    assert (parts.reasoning, parts.content) == ("Greeting.", "Hello!")
    assert not opens_reasoning(resolve_template("auto", ours).render([{"role": "user", "content": "Hi"}]), None)


@pytest.mark.parametrize("thinking", [True, False])
def test_the_reasoning_option_renders_as_enable_thinking(tmp_path, thinking):
    ours, ref = tokenizers(tmp_path, QWEN3)
    template = resolve_template("auto", ours).bound(**thinking_context(QWEN3, thinking))
    messages = [{"role": "user", "content": "Hi"}]
    assert template.render(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)


def test_a_template_without_the_switch_refuses_reasoning_false():
    from test_text_tokenizer import CHATML

    with pytest.raises(TextError, match="no switch for reasoning"):
        thinking_context(CHATML, False)
    assert thinking_context(CHATML, True) == {}


def test_history_drops_earlier_reasoning_as_qwen3s_template_does(tmp_path):
    ours, ref = tokenizers(tmp_path, QWEN3)
    template = resolve_template("auto", ours)
    reply = {"role": "assistant", "content": "Hello! How can I help?", "reasoning_content": "The user greets me."}
    messages = [{"role": "user", "content": "Hi"}, reply, {"role": "user", "content": "Bye"}]
    generated = {message_key(reply): ours.encode(OUTPUT)}  # what the model wrote, reasoning included
    expected = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert encode_conversation(messages, template, ours, generated) == expected
    assert "greets" not in ref.decode(expected)  # the template left the reasoning out


def test_reasoning_streams_as_llms_reasoning_and_the_next_turn_renders_as_transformers(
        qwen3_tools, user_dir, monkeypatch):
    import llm
    import transformers

    pte, tok_dir = qwen3_tools
    register(pte, tok_dir, "thinker")
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    im_end = ref.convert_tokens_to_ids("<|im_end|>")
    script = scripted_sampler(monkeypatch)
    script["ids"] = script_ids(ref, OUTPUT) + [im_end]
    conversation = llm.get_model("pte:thinker").conversation()
    first = conversation.prompt("Hi", kv_disk_mb=0)
    events = list(first.stream_events())
    assert "".join(e.chunk for e in events if e.type == "reasoning") == "The user greets me.\n\nI greet back."
    assert first.text() == "Hello! How can I help?"
    script["ids"] = script_ids(ref, "Goodbye!") + [im_end]
    second = conversation.prompt("Bye", kv_disk_mb=0)
    assert second.text() == "Goodbye!"
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello! How can I help?",
                "reasoning_content": "The user greets me.\n\nI greet back."},
               {"role": "user", "content": "Bye"}]
    expected = ref.apply_chat_template(history, tokenize=True, add_generation_prompt=True, return_dict=False)
    (session,) = [s for _, s in store.POOL._sessions.values()]
    assert session.tokens[: len(expected)] == expected
    # the template drops the first reply's reasoning: the cache is kept up to that reply
    opening = ref.apply_chat_template(history[:1], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert second.response_json["cache_path"] == "trim"
    assert second.response_json["cached_tokens"] == len(opening)


def test_reasoning_false_prompts_without_thinking(qwen3_tools, user_dir, monkeypatch):
    import transformers

    pte, tok_dir = qwen3_tools
    register(pte, tok_dir, "thinker")
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    script = scripted_sampler(monkeypatch)
    script["ids"] = script_ids(ref, "Hello!") + [ref.convert_tokens_to_ids("<|im_end|>")]
    r = CliRunner().invoke(cli, ["-m", "pte:thinker", "Hi", "-o", "reasoning", "false", "-o", "kv_disk_mb", "0"],
                           catch_exceptions=False)
    assert r.output.strip() == "Hello!"
    (session,) = [s for _, s in store.POOL._sessions.values()]
    expected = ref.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True,
                                       add_generation_prompt=True, return_dict=False, enable_thinking=False)
    assert session.tokens[: len(expected)] == expected


def test_reasoning_false_on_a_template_without_the_switch_is_one_line(tiny_llama, user_dir):
    register(*tiny_llama, "plain")
    r = CliRunner().invoke(cli, ["-m", "pte:plain", "Hi", "-o", "reasoning", "false"])
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [
        ("Error: -o reasoning false: this model's chat template has no switch for reasoning "
        "(enable_thinking); leave the option out")]


# -- SmolLM3: enable_thinking picks /think or /no_think; /no_think closes an empty <think> itself --


@pytest.mark.parametrize("thinking", [True, False])
def test_smollm3s_switch_renders_as_transformers_and_never_opens_the_reasoning(tmp_path, thinking):
    ours, ref = tokenizers(tmp_path, SMOLLM3)
    assert think_tags(SMOLLM3) == THINK and thinking_context(SMOLLM3, thinking) == {"enable_thinking": thinking}
    template = resolve_template("auto", ours).bound(**thinking_context(SMOLLM3, thinking))
    messages = [{"role": "user", "content": "Hi"}]
    prompt = template.render(messages)
    assert prompt == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=thinking)
    assert ("Reasoning Mode: /think" in prompt) == thinking
    assert not opens_reasoning(prompt, THINK)  # /think: the model opens it; /no_think: the prompt closed it


def test_smollm3s_reasoning_streams_as_reasoning_and_the_next_turn_renders_as_transformers(
        smollm3_tools, user_dir, monkeypatch):
    import llm
    import transformers

    pte, tok_dir = smollm3_tools
    register(pte, tok_dir, "smol3")
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    im_end = ref.convert_tokens_to_ids("<|im_end|>")
    script = scripted_sampler(monkeypatch)
    script["ids"] = script_ids(ref, "<think>\nThe user greets me.\n</think>\nHello!") + [im_end]
    conversation = llm.get_model("pte:smol3").conversation()
    first = conversation.prompt("Hi", kv_disk_mb=0)
    events = list(first.stream_events())
    assert "".join(e.chunk for e in events if e.type == "reasoning") == "The user greets me."
    assert first.text() == "Hello!"
    script["ids"] = script_ids(ref, "Goodbye!") + [im_end]
    assert conversation.prompt("Bye", kv_disk_mb=0).text() == "Goodbye!"
    # SmolLM3's template renders an assistant turn's content alone: the reasoning is not in it
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
               {"role": "user", "content": "Bye"}]
    expected = ref.apply_chat_template(history, tokenize=True, add_generation_prompt=True, return_dict=False)
    (session,) = [s for _, s in store.POOL._sessions.values()]
    assert session.tokens[: len(expected)] == expected


def test_smollm3_without_reasoning_answers_and_its_next_turn_is_a_cache_hit(smollm3_tools, user_dir, monkeypatch):
    import llm
    import transformers

    pte, tok_dir = smollm3_tools
    register(pte, tok_dir, "smol3")
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    im_end = ref.convert_tokens_to_ids("<|im_end|>")
    script = scripted_sampler(monkeypatch)
    script["ids"] = script_ids(ref, "Hello!") + [im_end]
    conversation = llm.get_model("pte:smol3").conversation()
    first = conversation.prompt("Hi", reasoning=False, kv_disk_mb=0)
    assert first.text() == "Hello!" and not [e for e in first.stream_events() if e.type == "reasoning"]
    script["ids"] = script_ids(ref, "Goodbye!") + [im_end]
    second = conversation.prompt("Bye", reasoning=False, kv_disk_mb=0)
    assert second.text() == "Goodbye!"
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
               {"role": "user", "content": "Bye"}]
    expected = ref.apply_chat_template(history, tokenize=True, add_generation_prompt=True, return_dict=False,
                                       enable_thinking=False)
    (session,) = [s for _, s in store.POOL._sessions.values()]
    assert session.tokens[: len(expected)] == expected
    # the template writes the empty <think> block back where the prompt had it: nothing to re-prefill
    assert second.response_json["cache_path"] == "hit"
    assert second.response_json["cached_tokens"] == first.response_json["prompt_tokens"] + first.output_tokens + 1
