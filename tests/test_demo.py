"""The demo model's build, at a reduced size: one module's docstrings, a
2-layer model, a few steps. Checks the pieces of the recipe, that the build
registers pte:demo and that it answers, and that a second run only registers."""

import json
import time

import llm
import pytest
from click.testing import CliRunner
from llm.cli import cli

from llm_executorch_mlx import demo
from llm_executorch_mlx.registry import load_entries
from llm_executorch_mlx.text import turn as turn_module

TINY = demo.Recipe(
    vocab_size=384, hidden_size=64, intermediate_size=128, layers=2, heads=2, kv_heads=1,
    context=64, batch_size=4, steps=4, warmup=2, prefill_chunk=32, modules=("json",),
)


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    turn_module.POOL.clear()
    yield tmp_path / "llm"
    turn_module.POOL.clear()


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_corpus_is_english_from_the_standard_library():
    docs = demo.collect_docstrings(("json",))
    names = {name for name, _, _ in docs}
    assert {"json", "json.dumps", "json.decoder.JSONDecoder"} <= names
    assert "json.encoder.JSONEncoder.encode" in names  # submodules, classes and methods
    text = " ".join(doc for _, _, doc in docs)
    assert "Serialize" in text and ">>>" not in text
    assert len({doc for _, _, doc in docs}) == len(docs)


def test_recipe_pieces_are_deterministic():
    docs = demo.collect_docstrings(("json",))
    texts = demo.training_texts(docs, seed=7)
    assert texts == demo.training_texts(docs, seed=7)
    chats = [t for t in texts if "<|start_header_id|>user" in t]
    assert chats and all(t.startswith("<|begin_of_text|>") and t.endswith("<|eot_id|>") for t in chats)
    assert any("<|start_header_id|>user<|end_header_id|>\n\nWhat does json.dumps do?" in t or "json.dumps" in t
               for t in chats)
    tok = demo.train_tokenizer(texts, 384)
    assert tok.to_str() == demo.train_tokenizer(texts, 384).to_str()
    assert [tok.token_to_id(t) for t in demo.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    sample = texts[0]
    assert tok.decode(tok.encode(sample).ids, skip_special_tokens=False) == sample
    stream = [i for t in texts for i in tok.encode(t).ids]
    recipe = demo.Recipe(**{**TINY.__dict__, "steps": 3})
    runs = [demo.train_model(stream, recipe, tok.get_vocab_size(), lambda m: None) for _ in range(2)]
    (a, losses_a), (b, losses_b) = runs
    assert losses_a == losses_b
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert pa.equal(pb), name


def test_demo_builds_registers_and_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "RECIPE", TINY)
    out = tmp_path / "demo"
    started = time.monotonic()
    r = invoke("pte", "demo", "--output-dir", out, "--steps", 3)
    assert r.exit_code == 0, r.output
    assert "Built the demo model" in r.stdout and "Registered pte:demo" in r.stdout
    for step in ("collecting", "tokenizer", "training", "step 3/3", "exporting", "lowering"):
        assert step in r.stderr
    for name in ("demo.pte", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "demo.json", "hf/config.json", "hf/model.safetensors"):
        assert (out / name).is_file(), name
    info = json.loads((out / "demo.json").read_text())
    assert info["recipe"]["steps"] == 3 and info["recipe"]["modules"] == ["json"]
    entry = load_entries()["demo"]
    assert entry.path == str(out / "demo.pte") and entry.chat == "auto"

    response = llm.get_model("pte:demo").prompt("The json module", max_tokens=4)
    response.text()
    j = response.response_json
    assert j["prompt_tokens"] > 5 and j["finish_reason"] in ("stop", "length")
    r = invoke("-m", "pte:demo", "What does json.dumps do?", "-o", "max_tokens", 4, "--no-log")
    assert r.exit_code == 0, r.output
    assert time.monotonic() - started < 60

    # built already: a second run only registers it again
    assert invoke("pte", "remove", "demo").exit_code == 0
    r = invoke("pte", "demo", "--output-dir", out)
    assert r.exit_code == 0, r.output
    assert "already built" in r.stdout and "Registered pte:demo" in r.stdout
    assert "training" not in r.stderr
    assert load_entries()["demo"].path == str(out / "demo.pte")


def test_default_directory_is_under_the_llm_user_dir(user_dir):
    assert demo.default_directory() == user_dir / "executorch-mlx" / "demo"
