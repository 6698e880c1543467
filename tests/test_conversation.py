"""History -> ids (with generated replies spliced in) against transformers' chat template, and session choice, no model."""

import pytest
from models import make_tokenizer

from llm_executorch_mlx.text import load_tokenizer, resolve_template
from llm_executorch_mlx.text.conversation import encode_conversation
from llm_executorch_mlx.text.session import SessionPool, common_prefix


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_tokenizer(tmp_path_factory.mktemp("tok")))


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_generated_ids_are_spliced_where_the_reply_is(tmp_path):
    """The ids are transformers' for the history (its tokenizer and chat
    template) with the reply's generated ids in the reply's place."""
    import transformers

    tok = load_tokenizer(make_tokenizer(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    template = resolve_template("auto", tok)
    reply = "en"  # also occurs inside "<|end_header_id|>" and in "questions"
    generated_ids = [7, 7, 7]  # deliberately not how the tokenizer would encode it
    messages = [{"role": "user", "content": "Numbers and questions"},
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "and more"}]
    ids = encode_conversation(messages, template, tok, {reply: generated_ids})

    def hf_ids(ms):
        return hf.apply_chat_template(ms, add_generation_prompt=True, tokenize=True, return_dict=False)

    opening, last_turn = hf_ids(messages[:1]), hf_ids(messages[2:])  # each ends with the assistant header
    assert ids == opening + generated_ids + [hf.convert_tokens_to_ids("<|eot_id|>")] + last_turn[1:]  # one BOS
    # and without a generated reply, transformers' own ids for the whole history
    assert encode_conversation(messages, template, tok, {}) == hf_ids(messages)


def test_raw_mode_concatenates_messages_and_splices_replies(tok):
    raw = resolve_template("none", tok)
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "why"},
                {"role": "user", "content": "sky"}]
    ids = encode_conversation(messages, raw, tok, {"why": [5, 6]})
    assert ids == tok.encode("Hello there", add_special=True) + [5, 6] + tok.encode("sky")


class FakeProgram:
    """Stands in for a Program: sessions only need a cache and a forward."""

    def new_cache(self, **kw):
        class Cache:
            length = 0

            def rewind(self, n):
                return True

            def clear(self):
                pass

        return Cache()

    def load_method(self, name, cache):
        return None


def test_pool_keeps_conversations_apart_and_drops_the_least_recently_used():
    from llm_executorch_mlx.text.session import CachePolicy

    pool = SessionPool(max_sessions=2)
    policy = CachePolicy(capacity=64, dtype="fp32")
    a = pool.acquire("m", FakeProgram(), policy, [1, 2, 3, 4], None)
    a.tokens = [1, 2, 3, 4]
    b = pool.acquire("m", FakeProgram(), policy, [1, 2, 9, 9], None)  # shares only [1, 2]
    assert b is not a
    b.tokens = [1, 2, 9, 9]
    assert pool.acquire("m", FakeProgram(), policy, [1, 2, 3, 4, 5, 6], None) is a  # next turn
    assert pool.acquire("m", FakeProgram(), policy, [1, 2, 3], None) is a  # regenerate
    assert pool.acquire("m", FakeProgram(), policy, [1, 2, 3, 7, 8], 3) is a  # edited last reply
    other_policy = CachePolicy(capacity=64, dtype="bf16")
    c = pool.acquire("m", FakeProgram(), other_policy, [1, 2, 3, 4, 5], None)  # new cache options
    assert c is not a and len(pool) == 2
    assert pool.acquire("m", FakeProgram(), policy, [1, 2, 9, 9, 1], None) is not b  # b was dropped
