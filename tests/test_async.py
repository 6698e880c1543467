"""The async model (``llm.get_async_model``): the same replies as the sync
model, streamed without blocking the event loop, and concurrent
conversations that never disturb each other. The reference is the sync
model answering the same prompts in this process, one conversation at a
time."""

import asyncio

import llm
import pytest
from click.testing import CliRunner
from llm.cli import cli
from models import make_tokenizer

from llm_executorch_mlx.text import store

QUESTIONS = (["Why is the sky blue?", "Tell me a story."], ["Hello there, how are you?", "Numbers like 42?"])


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    store.POOL.clear()
    store.REPLIES.clear()
    yield tmp_path / "llm"


@pytest.fixture
def registered(exported, tmp_path):
    _, pte = exported("llama", trained=True)
    make_tokenizer(tmp_path / "tok")
    r = CliRunner().invoke(cli, ["pte", "register", str(pte), "--tokenizer", str(tmp_path / "tok" / "tokenizer.json"),
                                 "--name", "tiny"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return "pte:tiny"


def sync_conversation(model_id, questions, **options):
    conversation = llm.get_model(model_id).conversation()
    return [conversation.prompt(q, **options).text() for q in questions]


def test_an_async_prompt_streams_the_sync_reply_without_blocking_the_loop(registered):
    expected = llm.get_model(registered).prompt("Why is the sky blue?", max_tokens=12).text()

    async def main():
        ticks = 0
        before_first_chunk = None

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                # a short sleep, not 0: a loop that never sleeps holds the GIL
                # the generating thread needs, and slows it a hundredfold
                await asyncio.sleep(0.0001)

        task = asyncio.create_task(ticker())
        chunks = []
        async for chunk in llm.get_async_model(registered).prompt("Why is the sky blue?", max_tokens=12):
            if before_first_chunk is None:
                before_first_chunk = ticks
            chunks.append(chunk)
        task.cancel()
        return "".join(chunks), before_first_chunk

    text, before_first_chunk = asyncio.run(main())
    assert text == expected
    assert before_first_chunk > 1  # the loop ran other tasks while the prompt was prefilled


def test_two_concurrent_async_conversations_equal_the_sync_ones(registered):
    expected = [sync_conversation(registered, qs, max_tokens=10, kv_disk_mb=0) for qs in QUESTIONS]
    store.POOL.clear()
    store.REPLIES.clear()
    model = llm.get_async_model(registered)

    async def converse(questions):
        conversation = model.conversation()
        replies = []
        for q in questions:
            response = conversation.prompt(q, max_tokens=10, kv_disk_mb=0)
            replies.append(await response.text())
            replies.append((await response.json())["cache_path"])
        return replies

    async def main():
        return await asyncio.gather(*(converse(qs) for qs in QUESTIONS))

    for got, want in zip(asyncio.run(main()), expected):
        assert got[0::2] == want
        assert got[1::2] == ["cold", "hit"]  # each conversation kept its own cache


def test_an_async_error_is_our_one_line_error(registered):
    async def main():
        return await llm.get_async_model(registered).prompt("x", schema={"type": "integer"}, stop="1").text()

    with pytest.raises(llm.ModelError, match="^-o stop cannot be used with a schema: "):
        asyncio.run(main())
