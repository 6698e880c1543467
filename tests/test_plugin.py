"""The llm plugin end to end: CLI commands, prompting, chat sessions.

References are independent of our text layer: transformers' tokenizer and
``apply_chat_template`` make the prompt ids, the Hugging Face model's eager
greedy ``generate`` makes the expected continuation.
"""

import importlib.metadata
import json
import os
import platform
import subprocess
import sys

import llm
import pytest
import transformers
from click.testing import CliRunner
from llm.cli import cli
import models
from models import make_tokenizer

from llm_executorch_mlx.registry import registry_path
from llm_executorch_mlx.runtime import cpu
from llm_executorch_mlx.runtime.cpu import blas
from llm_executorch_mlx.text import store


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    store.POOL.clear()
    store.DRAFTS.clear()
    store.REPLIES.clear()
    store.TRUNCATIONS.clear()
    yield tmp_path / "llm"


@pytest.fixture(scope="module")
def tiny(exported, tmp_path_factory):
    """A registered-ready (pte, tokenizer dir, hf dir) triple: llama fp32."""
    model_dir, pte = exported("llama")
    tok_dir = tmp_path_factory.mktemp("tok")
    make_tokenizer(tok_dir)
    return pte, tok_dir, model_dir


def invoke(*args, input=None):
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def register(tiny, name="tiny", *extra):
    pte, tok_dir, _ = tiny
    r = invoke("pte", "register", str(pte), "--tokenizer", str(tok_dir / "tokenizer.json"), "--name", name, *extra)
    assert r.exit_code == 0, r.output
    return r


def hf_greedy(tiny, messages, max_new_tokens):
    _, tok_dir, model_dir = tiny
    return models.hf_greedy(tok_dir, model_dir, messages, max_new_tokens)


# -- commands -------------------------------------------------------------


def test_register_list_info_remove(tiny, compiler):
    r = register(tiny, "tiny", "--alias", "t1")
    assert "Registered pte:tiny" in r.output
    r = invoke("models")
    assert "pte:tiny" in r.output
    listed = json.loads(invoke("pte", "models", "--json").output)
    assert listed[0]["model_id"] == "pte:tiny" and listed[0]["aliases"] == ["t1"]
    assert listed[0]["max_context"] == 128 and listed[0]["prefill_chunk"] == 32
    info = invoke("pte", "info", "tiny").output
    assert "2 layers: 2 flat" in info and "max context:      128" in info
    info_json = json.loads(invoke("pte", "info", "t1", "--json").output)
    # 2 layers x (K+V) x 2 kv heads x head dim 16, at 4 bytes per fp32 value
    assert info_json["kv_bytes_per_token"]["fp32"] == 2 * 2 * 2 * 16 * 4
    assert set(info_json["kv_bytes_per_token"]) == {"bf16", "fp16", "fp32"}  # no group of 32 in a head of 16
    # the tiny fp32 model's cache: fp16 by default (half the bytes of its compute dtype)
    assert info_json["kv_storage_dtype"] == "fp16" and "(fp16 unless -o kv_storage_dtype" in info
    # where it would run here: the CPU, the BLAS bound at import, the kernels
    # (without a compiler: MLX ops and BLAS, saying why)
    backend = f"mlx {importlib.metadata.version('mlx')} with mlx-cpu {importlib.metadata.version('mlx-cpu')} (CPU)"
    assert f"[runtime] {backend}, on the cpu" in info
    assert info_json["runtime"]["blas"]["library"] == blas.load_fast_blas().library
    assert "decode steps: the ops between two layers' attention replayed as one compiled call" in info
    if compiler:
        assert "attention: compiled kernel" in info and info_json["runtime"]["attention"].startswith("compiled kernel")
        assert "cache write and its q and k RoPE in the same op" in info
        assert "decode products: the compiled kernel's products" in info
        # int8 activations for the widths this CPU's integer dot products take (8 bits need VNNI)
        if platform.machine() in ("x86_64", "AMD64"):
            assert "quantized products: 4/8-bit weights: int8 activations and integer dot products" in info
            assert "-o int8_activations false: activations within 2^-16" in info
        else:
            assert "(no integer dot products here)" in info
        # how many rows of an fp32 chunk it takes before BLAS's sgemm, as measured here (crossover.py)
        rows = cpu.kernels().fp32_rows
        assert (f"fp32 chunk products: the compiled kernel's products up to {rows} rows, BLAS's sgemm above" if rows
                else "fp32 chunk products: the compiled kernel's products or BLAS's sgemm, as measured on the first "
                "prompt") in info
    else:
        assert "attention: MLX ops (no C++ compiler)" in info
        assert "decode products: BLAS (no C++ compiler)" in info
        assert "quantized products: MLX's quantized_matmul (up to 4 rows)" in info
        assert "fp32 chunk products" not in info
    assert invoke("pte", "remove", "tiny").exit_code == 0
    assert json.loads(invoke("pte", "models", "--json").output) == []


def test_info_says_when_attention_runs_as_mlx_ops(tiny, monkeypatch, compiler):
    register(tiny, "tiny")
    monkeypatch.setenv("LLM_PTE_CPU_ATTENTION", "0")
    info = invoke("pte", "info", "tiny").output
    assert "attention: MLX ops (LLM_PTE_CPU_ATTENTION=0)" in info
    # its own flag
    assert ("decode products: the compiled kernel's products" if compiler
            else "decode products: BLAS (no C++ compiler)") in info
    monkeypatch.setenv("LLM_PTE_CPU_PRODUCTS", "0")
    info = invoke("pte", "info", "tiny").output
    assert "attention: MLX ops (LLM_PTE_CPU_ATTENTION=0)" in info and "decode products: BLAS" in info
    assert "quantized products: MLX's quantized_matmul (up to 4 rows)" in info


def test_registrations_at_once_keep_every_entry(tiny, user_dir):
    """Four `llm pte register` processes at once, each reading the registry,
    validating for a second or more, then writing it: none loses another's
    entry (the write re-reads under a lock), and `remove` the same."""
    pte, tok_dir, _ = tiny
    env = dict(os.environ, LLM_USER_PATH=str(user_dir))
    names = [f"m{i}" for i in range(4)]

    def all_at_once(commands):
        procs = [subprocess.Popen([sys.executable, "-m", "llm", "pte", *c], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err

    all_at_once([["register", str(pte), "--tokenizer", str(tok_dir / "tokenizer.json"), "--name", n] for n in names])
    assert sorted(e["name"] for e in json.loads(invoke("pte", "models", "--json").output)) == names
    all_at_once([["remove", n] for n in names[:3]])
    assert [e["name"] for e in json.loads(invoke("pte", "models", "--json").output)] == names[3:]


def test_refused_registrations_leave_the_registry_unchanged(tiny, tmp_path):
    register(tiny, "tiny")
    before = registry_path().read_bytes()
    pte, tok_dir, _ = tiny
    bad = tmp_path / "bad.pte"
    bad.write_bytes(b"not a program at all")
    big_tok = make_tokenizer(tmp_path / "bigtok", extra_tokens=100)
    cases = [
        (["pte", "register", str(pte), "--tokenizer", str(tok_dir / "tokenizer.json"), "--name", "tiny"], "already registered"),
        (["pte", "register", str(tmp_path / "missing.pte"), "--tokenizer", str(tok_dir / "tokenizer.json")], "no such file"),
        (["pte", "register", str(bad), "--tokenizer", str(tok_dir / "tokenizer.json")], "not an ExecuTorch"),
        (["pte", "register", str(pte), "--tokenizer", str(big_tok), "--name", "x"], "tokenizer has"),
        (["pte", "register", str(pte), "--tokenizer", str(tok_dir / "tokenizer.json"), "--name", "y", "--chat", "chatml"], "unknown chat template"),
    ]
    for args, message in cases:
        r = invoke(*args)
        assert r.exit_code == 1, r.output
        assert message in r.output
        assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
        assert registry_path().read_bytes() == before


def test_models_lists_even_when_a_file_went_missing(tiny, tmp_path):
    pte, tok_dir, _ = tiny
    copy = tmp_path / "copy.pte"
    copy.write_bytes(pte.read_bytes())
    r = invoke("pte", "register", str(copy), "--tokenizer", str(tok_dir / "tokenizer.json"))
    assert r.exit_code == 0
    copy.unlink()
    assert "pte:copy" in invoke("models").output
    assert "MISSING" in invoke("pte", "models").output
    r = invoke("-m", "pte:copy", "hi", "--no-log")
    assert r.exit_code == 1 and "missing" in r.output


# -- prompting ----------------------------------------------------------------


def test_prompt_output_equals_transformers_greedy(tiny):
    register(tiny)
    ids, expected = hf_greedy(tiny, [{"role": "user", "content": "Why is the sky blue?"}], 12)
    r = invoke("-m", "pte:tiny", "Why is the sky blue?", "-o", "max_tokens", "12", "--no-log")
    assert r.exit_code == 0, r.output
    assert r.stdout.rstrip("\n") == expected
    r2 = invoke("-m", "pte:tiny", "Why is the sky blue?", "-o", "max_tokens", "12", "--no-stream", "--no-log")
    assert r2.stdout == r.stdout


def test_system_prompt_goes_through_the_template(tiny):
    register(tiny)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    ids, expected = hf_greedy(tiny, messages, 10)
    response = llm.get_model("pte:tiny").prompt("Tell me a story", system="Be brief.", max_tokens=10)
    assert response.text() == expected
    assert response.input_tokens == len(ids)
    assert response.output_tokens <= 10


def test_usage_and_response_json(tiny):
    register(tiny)
    response = llm.get_model("pte:tiny").prompt("Hello there", max_tokens=6)
    response.text()
    j = response.response_json
    assert j["cache_path"] == "cold" and j["cached_tokens"] == 0
    assert j["prefilled_tokens"] == response.input_tokens
    assert j["finish_reason"] in ("stop", "length")
    assert j["cache_capacity"] == 128 and j["cache_length"] > 0
    # 2 layers x K,V x 2 heads x 16 dims x 2 bytes: an fp32-computing model's cache is fp16
    assert j["kv_bytes_in_use"] == j["cache_length"] * 2 * 2 * 2 * 16 * 2
    assert response.token_details == {"cached": 0}


# -- conversations ------------------------------------------------------------


def run_cold(messages, max_tokens, forget_generated=False):
    """A fresh session over the whole history: the reference a cached turn must
    equal. Replies this process generated are still spliced in as their ids
    unless ``forget_generated`` (as in a new process, which re-tokenizes)."""
    store.POOL.clear()
    if forget_generated:
        store.REPLIES.clear()
    model = llm.get_model("pte:tiny")
    *history, last = messages
    r = model.prompt(last["content"], messages=[
        llm.user(m["content"]) if m["role"] == "user" else llm.assistant(m["content"]) for m in history
    ], max_tokens=max_tokens)
    return r.text()


def hf_turns(tiny, user_turns, max_new_tokens):
    _, tok_dir, model_dir = tiny
    return models.hf_turns(tok_dir, model_dir, user_turns, max_new_tokens)


def test_turn_by_turn_equals_transformers_on_the_history_and_prefills_only_new_tokens(tiny):
    """Each turn's reply is transformers' on the whole history with the ids
    generated before in it; each sends forward only the tokens the cache lacks."""
    register(tiny)
    conversation = llm.get_model("pte:tiny").conversation()
    user_turns = ["Hello there", "Tell me a story about a cat", "Why is the sky blue?"]
    reference = hf_turns(tiny, user_turns, 8)
    stats = []
    for text, (ids, reply_ids, expected) in zip(user_turns, reference):
        r = conversation.prompt(text, max_tokens=8)
        assert r.text() == expected
        assert r.input_tokens == len(ids) and r.output_tokens == len(reply_ids) + (len(reply_ids) < 8)
        stats.append(r.response_json)
    assert [s["cache_path"] for s in stats] == ["cold", "hit", "hit"]
    for (ids, reply_ids, _), previous, s in zip(reference, stats, stats[1:]):
        # everything in the cache after the previous turn is reused: its
        # prompt and reply, less a reply's last token when max_tokens cut it
        # (sampled, never fed) ...
        held = len(ids) + len(reply_ids) + (1 if previous["finish_reason"] == "stop" else -1)
        assert previous["cache_length"] == s["cached_tokens"] == held
        # ... and only the rest of the history is sent to forward
        assert s["prefilled_tokens"] == s["prompt_tokens"] - held


def test_interleaved_conversations_keep_their_own_sessions(tiny):
    register(tiny)
    model = llm.get_model("pte:tiny")
    a, b = model.conversation(), model.conversation()
    ref_a = hf_turns(tiny, ["Hello there", "Tell me a story"], 6)
    ref_b = hf_turns(tiny, ["Numbers like 42", "and questions"], 6)
    assert a.prompt("Hello there", max_tokens=6).text() == ref_a[0][2]
    assert b.prompt("Numbers like 42", max_tokens=6).text() == ref_b[0][2]
    ra = a.prompt("Tell me a story", max_tokens=6)
    rb = b.prompt("and questions", max_tokens=6)
    assert ra.text() == ref_a[1][2] and rb.text() == ref_b[1][2]
    assert ra.response_json["cache_path"] == "hit" and rb.response_json["cache_path"] == "hit"


def test_continue_and_a_regenerated_turn_equal_transformers_on_the_history(tiny):
    """`llm -c` in the same process reuses the cache and the generated ids;
    asking the last turn again (the same history, as a regenerate does)
    rewinds the cache to that history and answers the same, both equal to
    transformers on that history."""
    register(tiny)
    user_turns = ["Hello there", "Tell me a story about a cat", "Why is the sky blue?"]
    reference = hf_turns(tiny, user_turns, 8)
    r = invoke("-m", "pte:tiny", user_turns[0], "-o", "max_tokens", "8")
    assert r.exit_code == 0 and r.stdout.rstrip("\n") == reference[0][2]
    for text, (ids, _, expected) in zip(user_turns[1:], reference[1:]):
        r = invoke("-c", text, "-o", "max_tokens", "8")
        assert r.exit_code == 0, r.output
        assert r.stdout.rstrip("\n") == expected
    logged = json.loads(invoke("logs", "-n", "3", "--json").output)
    assert [e["response_json"]["cache_path"] for e in logged] == ["cold", "hit", "hit"]
    assert [e["input_tokens"] for e in logged] == [len(ids) for ids, _, _ in reference]
    # the second turn again, on the history it had
    replies = [e["response"] for e in logged]
    again = llm.get_model("pte:tiny").prompt(user_turns[1], max_tokens=8,
                                             messages=[llm.user(user_turns[0]), llm.assistant(replies[0])])
    assert again.text() == reference[1][2]
    assert again.response_json["cache_path"] == "trim"
    # all of it reused but its last token, fed again for the first reply token's logits
    assert again.input_tokens == len(reference[1][0]) and again.response_json["cached_tokens"] == len(reference[1][0]) - 1


def test_slow_blas_advice_is_said_once(tiny, user_dir, tmp_path):
    """A CPU user left on MLX's reference BLAS hears how to fix it once, not
    on every prompt (here: a BLAS named in LLM_PTE_BLAS that is missing)."""
    register(tiny)
    missing = tmp_path / "libmissing.so"
    env = dict(os.environ, LLM_USER_PATH=str(user_dir), LLM_PTE_BLAS=str(missing))
    llm_bin = [sys.executable, "-m", "llm", "-m", "pte:tiny", "-o", "max_tokens", "2"]
    runs = [subprocess.run(llm_bin + [f"Hello {i}"], capture_output=True, text=True, env=env, check=True)
            for i in range(2)]
    assert f"note: LLM_PTE_BLAS={missing} could not be opened" in runs[0].stderr
    assert "note:" not in runs[1].stderr
    assert runs[0].stdout.strip() and runs[1].stdout.strip()


def test_half_precision_models_compute_in_fp32_on_a_cpu_unless_told(exported, tiny):
    _, tok_dir, _ = tiny
    _, pte = exported("llama", trained=True, dtype="bf16")
    r = invoke("pte", "register", str(pte), "--tokenizer", str(tok_dir / "tokenizer.json"), "--name", "half")
    assert r.exit_code == 0, r.output
    model = llm.get_model("pte:half")
    widened = model.prompt("Hello", max_tokens=3)
    widened.text()
    native = model.prompt("Hello", max_tokens=3, compute_dtype="native")
    native.text()
    assert widened.response_json["compute_dtype"] == "fp32"
    assert widened.response_json["kv_storage_dtype"] == "fp16"  # half the bytes of the fp32 compute
    assert native.response_json["compute_dtype"] == "bf16"
    assert native.response_json["kv_storage_dtype"] == "bf16"


# -- other model files: fp16, 8-bit, a sentencepiece tokenizer --------------


@pytest.mark.parametrize("dtype, qlinear", [("fp16", None), ("fp32", "8w")], ids=["fp16", "8w-linears"])
def test_other_weight_formats_answer_as_transformers_on_the_same_weights(exported, tiny, dtype, qlinear):
    """An fp16 file (widened to fp32 on a CPU) and 8-bit linears, against
    transformers on the fp16-rounded weights or with torchao's same 8-bit
    quantization, computing in fp32 (activations within 2^-16:
    ``-o int8_activations false``; the int8 route has its own contract,
    test_parity.py)."""
    _, tok_dir, _ = tiny
    model_dir, pte = exported("llama", trained=True, dtype=dtype, qlinear=qlinear)
    r = invoke("pte", "register", str(pte), "--tokenizer", str(tok_dir / "tokenizer.json"), "--name", "other")
    assert r.exit_code == 0, r.output
    info = json.loads(invoke("pte", "info", "other", "--json").output)
    assert (info["metadata"]["activation_dtype"], info["compute_dtype"]) == (dtype, "fp32")
    for prompt in ("Why is the sky blue?", "Tell me a story"):
        ids, expected = models.hf_greedy(tok_dir, model_dir, [{"role": "user", "content": prompt}], 12,
                                         dtype=dtype, qlinear=qlinear)
        r = invoke("-m", "pte:other", prompt, "-o", "max_tokens", "12", "-o", "int8_activations", "false", "--no-log")
        assert r.exit_code == 0, r.output
        assert r.stdout.rstrip("\n") == expected
    response = llm.get_model("pte:other").prompt("Tell me a story", max_tokens=12, int8_activations=False)
    assert response.text() == expected
    assert response.response_json["compute_dtype"] == "fp32" and response.output_tokens >= 4


def test_a_quantized_cache_on_heads_its_groups_do_not_divide_is_one_line_naming_the_fix(tiny):
    register(tiny, "tiny")
    r = invoke("-m", "pte:tiny", "hi", "-o", "kv_value_dtype", "int4", "--no-log")
    assert (r.exit_code, r.output) == (1, "Error: a KV cache in int4 quantizes groups of 64 or 32 values along each "
                                          "head, and this model's head size is 16: store keys and values in bf16, "
                                          "fp16 or fp32\n")


def test_a_sentencepiece_model_file_answers_as_transformers_with_sentencepiece(exported, tmp_path):
    """A ``.model`` tokenizer (no chat template: the prompt is raw text after
    BOS), against sentencepiece's own ids and text and transformers' greedy
    ids (the trained fp16 model: clear winners)."""
    import sentencepiece as spm

    model_dir, pte = exported("llama", trained=True, dtype="fp16")
    (tmp_path / "sp").mkdir()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(models.CORPUS * 4), model_prefix=str(tmp_path / "sp" / "sp"),
                                   vocab_size=models.VOCAB, model_type="bpe", character_coverage=1.0, minloglevel=2)
    path = tmp_path / "sp" / "tokenizer.model"
    (tmp_path / "sp" / "sp.model").rename(path)
    r = invoke("pte", "register", str(pte), "--tokenizer", str(path), "--name", "sp")
    assert r.exit_code == 0, r.output
    sp = spm.SentencePieceProcessor(model_file=str(path))
    reference = models.reference_model(model_dir, dtype="fp16")
    for prompt in ("Tell me a story about a cat", "Why is the sky blue?"):
        ids = [sp.bos_id()] + sp.encode(prompt)
        new = models.greedy_ids(reference, ids, 10, sp.eos_id())
        expected = sp.decode(ids + new)[len(sp.decode(ids)):]  # what the reply adds to the prompt's text
        assert len(new) >= 4 and expected.strip()
        response = llm.get_model("pte:sp").prompt(prompt, max_tokens=10)
        assert response.text() == expected
        assert response.input_tokens == len(ids) and response.output_tokens == len(new) + (len(new) < 10)
        out = invoke("-m", "pte:sp", prompt, "-o", "max_tokens", "10", "--no-log").stdout
        assert out.rstrip("\n") == expected


# -- options and bad option values ----------------------------------------------


def test_sampling_is_reproducible_with_a_seed(tiny):
    register(tiny)
    model = llm.get_model("pte:tiny")
    texts = [model.prompt("Hello", temperature=1.5, seed=7, max_tokens=10).text() for _ in range(2)]
    assert texts[0] == texts[1]
    other = model.prompt("Hello", temperature=1.5, seed=8, max_tokens=10).text()
    greedy = model.prompt("Hello", max_tokens=10).text()
    assert len({texts[0], other, greedy}) > 1


def test_stop_string_cuts_the_reply(tiny):
    register(tiny)
    model = llm.get_model("pte:tiny")
    full = model.prompt("Hello there", max_tokens=12).text()
    assert len(full) > 4
    stop = full[2:4]
    cut = model.prompt("Hello there", max_tokens=12, stop=stop).text()
    assert cut == full[: full.index(stop)]


def test_small_capacity_clamps_generation_and_overflow_modes(tiny):
    register(tiny)
    model = llm.get_model("pte:tiny")
    r = model.prompt("Hello there", max_tokens=100, kv_max_capacity=40, chat="none")
    r.text()
    assert r.response_json["finish_reason"] in ("capacity", "stop")
    assert r.response_json["cache_capacity"] == 40
    long_prompt = "Tell me a story about a cat who learns to read. " * 8
    with pytest.raises(llm.ModelError, match="cache holds 40"):
        model.prompt(long_prompt, kv_max_capacity=40, kv_overflow="error").text()


@pytest.mark.parametrize("option,value,message", [
    ("kv_storage_dtype", "int3", "bf16, fp16, fp32, int8, int4"),
    ("kv_overflow", "drop", "truncate, error"),
    ("kv_windows", "8,x", "comma-separated"),
    ("chat", "chatml", "auto, llama3"),
    ("compute_dtype", "fp64", "auto, native, fp32"),
    ("temperature", "-1", "temperature must be >= 0"),
    ("kv_max_capacity", "0", "kv_max_capacity must be >= 1"),
])
def test_invalid_option_values_are_one_line_errors(tiny, option, value, message):
    register(tiny)
    r = invoke("-m", "pte:tiny", "hi", "-o", option, value, "--no-log")
    assert r.exit_code == 1
    assert message in r.output and "Traceback" not in r.output


def test_cache_options_change_the_cache_and_rebuild_it_between_turns(tiny):
    register(tiny)
    model = llm.get_model("pte:tiny")
    conversation = model.conversation()
    r1 = conversation.prompt("Hello there", max_tokens=4, kv_storage_dtype="bf16", kv_initial_capacity=8)
    r1.text()
    j1 = r1.response_json
    assert j1["kv_storage_dtype"] == "bf16"
    # 2 layers x K,V x 2 heads x 16 dims x 2 bytes x slots (doubled from 8 to fit the turn)
    assert j1["kv_bytes_allocated"] == 2 * 2 * 2 * 16 * 2 * 32
    r2 = conversation.prompt("Tell me a story", max_tokens=4, kv_windows="8")
    r2.text()
    j2 = r2.response_json
    assert j2["kv_windows"] == [8, 8] and j2["kv_storage_dtype"] == "fp16"  # the default for fp32 compute
    assert j2["cache_path"] == "cold" and j2["prefilled_tokens"] == j2["prompt_tokens"]


def test_sessions_are_bounded_least_recently_used_first(tiny):
    register(tiny)
    model = llm.get_model("pte:tiny")
    pool = store.POOL
    openers = ["Hello there", "Tell me a story", "Why is the sky blue?", "The quick brown fox", "Numbers and questions"]
    conversations = [model.conversation() for _ in range(pool.max_sessions + 1)]
    first_prompts = []
    for opener, c in zip(openers, conversations):
        r = c.prompt(opener, max_tokens=2)
        r.text()
        first_prompts.append(r.response_json["prompt_tokens"])
    assert len(pool) == pool.max_sessions
    # the most recent conversations kept their sessions: their first turn is reused ...
    for c, n in list(zip(conversations, first_prompts))[:0:-1]:
        r = c.prompt("and more", max_tokens=2)
        r.text()
        assert r.response_json["cached_tokens"] >= n
    # ... the least recently used one's was dropped, and comes back from its saved state
    r = conversations[0].prompt("and more", max_tokens=2)
    r.text()
    assert r.response_json["cache_path"] == "disk" and r.response_json["cached_tokens"] >= first_prompts[0]
    assert len(pool) == pool.max_sessions


def test_edited_last_turn_trims_the_cache_and_equals_transformers(tiny):
    register(tiny)
    model = llm.get_model("pte:tiny")
    conversation = model.conversation()
    first = conversation.prompt("Hello there", max_tokens=6).text()
    conversation.prompt("Tell me a story about a cat", max_tokens=6).text()
    history = [llm.user("Hello there"), llm.assistant(first)]
    edited = model.prompt("Tell me a story about a dog", messages=history, max_tokens=6)
    edited_text = edited.text()
    assert edited.response_json["cache_path"] == "trim"
    assert 0 < edited.response_json["cached_tokens"] < edited.response_json["prompt_tokens"]
    reference = hf_turns(tiny, ["Hello there", "Tell me a story about a dog"], 6)
    assert first == reference[0][2] and edited_text == reference[1][2]
    assert edited.input_tokens == len(reference[1][0])


def test_a_new_conversation_gets_its_own_session(tiny):
    register(tiny)
    model = llm.get_model("pte:tiny")
    model.prompt("Hello there", max_tokens=4).text()
    other = model.prompt("Tell me a story", max_tokens=4)
    other.text()
    assert other.response_json["cache_path"] == "cold"
    assert len(store.POOL) == 2


@pytest.mark.parametrize("draft", ["none", "ngram", "itself", "other"])
def test_ring_layers_past_their_window_across_turns(exported, tmp_path, draft):
    """gemma3's sliding layers (window 16) drop history; each turn still
    equals transformers on the whole history, with speculative decoding's
    rewinds too (a draft model's, in its own ring-layered cache, as well:
    the model itself, whose proposals are all kept, or another gemma3)."""
    model_dir, pte = exported("gemma3")
    tok = make_tokenizer(tmp_path / "tok")
    for name, path in (("tiny", pte), ("itself", pte), ("other", exported("gemma3", trained=True, dtype="bf16")[1])):
        assert invoke("pte", "register", str(path), "--tokenizer", str(tok), "--name", name).exit_code == 0
    conversation = llm.get_model("pte:tiny").conversation()
    user_turns = ["Hello there", "Tell me a story about a cat", "Why is the sky blue?"]
    paths = []
    for text, (ids, _, expected) in zip(user_turns, models.hf_turns(tok.parent, model_dir, user_turns, 10)):
        r = conversation.prompt(text, max_tokens=10, draft=draft, draft_tokens=3)
        assert r.text() == expected and r.input_tokens == len(ids)
        paths.append(r.response_json["cache_path"])
        assert r.response_json["cache_length"] > 16  # well past the window
        if draft != "other":  # all kept; prompt lookup finds no repeats here
            assert (r.response_json["accepted_tokens"] > 0) == (draft == "itself")
    assert paths == ["cold", "hit", "hit"]  # each turn reuses the ring-layered cache


def test_interrupted_turn_leaves_the_session_consistent(tiny):
    from llm_executorch_mlx.text.turn import Turn, TurnOptions

    register(tiny)
    _, tok_dir, _ = tiny
    pte = tiny[0]
    messages = [{"role": "user", "content": "Tell me a story about a cat"}]
    stream = iter(Turn(str(pte), str(tok_dir / "tokenizer.json"), messages, TurnOptions(max_tokens=30, chat="none")))
    next(stream)
    next(stream)
    stream.close()  # what Ctrl-C or a closed pipe does to the generator
    (session,) = [s for _, s in store.POOL._sessions.values()]
    assert session.cache.length == len(session.tokens)
    # the next turn works and equals a cold run of the same history
    again = Turn(str(pte), str(tok_dir / "tokenizer.json"), messages, TurnOptions(max_tokens=5, chat="none"))
    text = "".join(again)
    assert again.result.cache_path in ("hit", "trim")
    store.POOL.clear()
    cold = Turn(str(pte), str(tok_dir / "tokenizer.json"), messages, TurnOptions(max_tokens=5, chat="none"))
    assert "".join(cold) == text


# -- Ctrl-C and streaming ---------------------------------------------------


LONG_PROMPT = "Tell me a story about a cat who learns to read books in the old library, and why the sky is blue."


@pytest.fixture
def interrupt(monkeypatch, compiler):
    """``interrupt(where, at)``: a KeyboardInterrupt at the ``at``-th time the
    runtime reaches ``where``: "forward" (a layer's cache write inside a
    forward call, after others wrote theirs), or "submit"/"wait" (a step
    queued, or awaited, with the host thread helping run it)."""
    from llm_executorch_mlx.runtime import cache as cache_module
    from llm_executorch_mlx.runtime import plan as plan_module
    from llm_executorch_mlx.runtime import steps as steps_module

    armed = {}

    def reached(where):
        if where in armed:
            armed[where] -= 1
            if armed[where] == 0:
                del armed[where]
                raise KeyboardInterrupt

    # a layer's step reaches the cache through either door: a ring layer's
    # (or any without the CPU kernels) update_and_fetch, a flat layer's
    # update_in_op (its write and attention one extension op)
    for door in ("update_and_fetch", "update_in_op"):
        def entered(self, layer, *args, real=getattr(cache_module.SequenceCache, door)):
            if layer == 1:  # layer 0 has written this call's keys and values
                reached("forward")
            return real(self, layer, *args)

        monkeypatch.setattr(cache_module.SequenceCache, door, entered)
    real_steps = plan_module.Plan.steps

    def steps(plan):
        plain = real_steps.fget(plan)
        assert (plain is not steps_module.PLAIN) == compiler  # the helped steps where the extension is

        def submit(*arrays):
            plain.submit(*arrays)
            reached("submit")

        def wait(array):
            reached("wait")  # the step still queued: the stream thread finishes it alone
            plain.wait(array)

        return steps_module.Steps(submit, wait)

    monkeypatch.setattr(plan_module.Plan, "steps", property(steps))

    def arm(where, at):
        armed[where] = at
        return armed

    return arm


@pytest.mark.parametrize("arch, where, at", [
    ("llama", "forward", 2), ("llama", "forward", 6), ("gemma3", "forward", 8),
    ("llama", "submit", 4), ("llama", "wait", 3),
], ids=["prefill", "decode", "decode-past-a-ring-window", "submitted-step", "awaited-step"])
def test_ctrl_c_leaves_the_cache_as_transformers_would_continue_it(tiny, exported, interrupt, arch, where, at):
    """Ctrl-C in a forward call (the second prefill chunk, a decode step,
    one whose ring layer overwrote a cell before the interruption) or while
    a step is queued or awaited: the prompt raises KeyboardInterrupt, and the
    next prompts, reusing what the cache kept, answer as transformers does
    on the history."""
    pte, tok_dir, model_dir = tiny
    if arch != "llama":
        model_dir, pte = exported(arch)
        tiny = (pte, tok_dir, model_dir)
    register(tiny)
    model = llm.get_model("pte:tiny")
    armed = interrupt(where, at)
    with pytest.raises(KeyboardInterrupt):
        model.prompt(LONG_PROMPT, max_tokens=10).text()
    assert not armed  # it was reached
    (session,) = [s for _, s in store.POOL._sessions.values()]
    assert session.cache.length == len(session.tokens) > 0
    user_turns = [LONG_PROMPT, "Why is the sky blue?"]
    reference = hf_turns(tiny, user_turns, 10)
    conversation = model.conversation()
    for text, (_, _, expected) in zip(user_turns, reference):
        r = conversation.prompt(text, max_tokens=10)
        assert r.text() == expected
    first = conversation.responses[0].response_json
    assert first["cache_path"] in ("hit", "trim") and first["cached_tokens"] > 0  # the interrupted cache, reused


def test_replies_stream_as_they_are_generated(tiny, monkeypatch):
    """`llm` prints a reply as it comes and `llm chat` each turn's: the model
    yields more than one chunk, each before the next forward call is made,
    and stdout holds them all, equal to transformers' replies."""
    from llm_executorch_mlx.runtime import program as program_module

    register(tiny)
    calls, chunks = [0], []
    real_execute = program_module.Method.execute

    def execute(self, *args, **kwargs):
        calls[0] += 1
        return real_execute(self, *args, **kwargs)

    monkeypatch.setattr(program_module.Method, "execute", execute)
    real_model_execute = type(llm.get_model("pte:tiny")).execute

    def model_execute(self, prompt, stream, response, conversation):
        assert stream
        chunks.append([])
        for chunk in real_model_execute(self, prompt, stream, response, conversation):
            chunks[-1].append((chunk, calls[0]))
            yield chunk

    monkeypatch.setattr(type(llm.get_model("pte:tiny")), "execute", model_execute)

    def streamed(turn):
        assert len(turn) > 1
        counts = [n for _, n in turn]
        assert counts == sorted(counts) and counts[0] < counts[-1]  # chunk by chunk, as forward runs
        return "".join(c for c, _ in turn)

    prompt = "Why is the sky blue?"
    _, expected = hf_greedy(tiny, [{"role": "user", "content": prompt}], 12)
    r = invoke("-m", "pte:tiny", prompt, "-o", "max_tokens", "12", "--no-log")
    assert r.exit_code == 0, r.output
    assert r.stdout == streamed(chunks[0]) + "\n" and streamed(chunks[0]) == expected
    chunks.clear()
    user_turns = ["Hello there", "Tell me a story about a cat"]
    r = invoke("chat", "-m", "pte:tiny", "-o", "max_tokens", "12", input="\n".join(user_turns) + "\nquit\n")
    assert r.exit_code == 0, r.output
    replies = [streamed(turn) for turn in chunks]
    assert replies == [expected for _, _, expected in hf_turns(tiny, user_turns, 12)]
    assert f"> {user_turns[0]}\n{replies[0]}\n> {user_turns[1]}\n{replies[1]}\n> quit" in r.output


def test_truncate_drops_oldest_turns_with_a_notice(tiny, capsys):
    register(tiny)
    model = llm.get_model("pte:tiny")
    history = []
    for text in ["Hello there, how are you today?", "Tell me a story about a cat", "Numbers like 42"]:
        history += [llm.user(text), llm.assistant("Because air scatters short blue wavelengths")]
    r = model.prompt("Why is the sky blue?", messages=history, system="Be brief.", kv_max_capacity=80, max_tokens=4)
    r.text()
    err = capsys.readouterr().err
    assert "left out its" in err and "oldest messages" in err
    assert r.response_json["prompt_tokens"] < 80


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"models": {"x": {"path": 1, "bogus": 2}}}'])
def test_a_damaged_registry_never_breaks_llm_models_and_is_never_overwritten(tiny, damage):
    registry_path().parent.mkdir(parents=True, exist_ok=True)
    registry_path().write_text(damage)
    assert invoke("models").exit_code == 0
    pte, tok_dir, _ = tiny
    r = invoke("pte", "register", str(pte), "--tokenizer", str(tok_dir / "tokenizer.json"))
    assert r.exit_code == 1 and "damaged" in r.output
    assert registry_path().read_text() == damage


def test_a_name_cannot_shadow_another_models_alias(tiny):
    register(tiny, "tiny", "--alias", "t1")
    pte, tok_dir, _ = tiny
    r = invoke("pte", "register", str(pte), "--tokenizer", str(tok_dir / "tokenizer.json"), "--name", "t1")
    assert r.exit_code == 1 and "already used by pte:tiny" in r.output


def test_fragments_are_part_of_the_prompt(tiny, tmp_path):
    register(tiny)
    fragment = tmp_path / "frag.txt"
    fragment.write_text("Why is the sky blue?")
    with_fragment = invoke("-m", "pte:tiny", "-f", str(fragment), "-o", "max_tokens", "6", "--no-log").output
    _, expected = hf_greedy(tiny, [{"role": "user", "content": "Why is the sky blue?"}], 6)
    assert with_fragment.rstrip("\n") == expected


def test_after_truncation_later_turns_hit_the_cache_again(tiny, capsys):
    register(tiny)
    conversation = llm.get_model("pte:tiny").conversation()
    paths, notices = [], 0
    for text in ["Hello there", "Tell me a story about a cat", "Why is the sky blue?", "The quick brown fox",
                 "Numbers like 42", "How are you today?"]:
        r = conversation.prompt(text, max_tokens=16)
        r.text()
        paths.append(r.response_json["cache_path"])
        notices += "oldest messages" in capsys.readouterr().err
    first_drop = paths.index("cold", 1)  # the turn whose history no longer fit
    assert notices >= 1
    assert paths[first_drop + 1] == "hit"


def test_sampling_filters_change_what_is_sampled(tiny):
    register(tiny)
    model = llm.get_model("pte:tiny")
    greedy = model.prompt("Hello there", max_tokens=10).text()
    # top_k=1 keeps only the argmax, whatever the temperature
    assert model.prompt("Hello there", max_tokens=10, temperature=2.0, top_k=1, seed=3).text() == greedy
    # a strong repetition penalty steers greedy decoding away from its repeats
    penalised = model.prompt("Hello there", max_tokens=10, repetition_penalty=50.0).text()
    assert penalised != greedy


def test_a_remembered_cut_applies_only_where_the_history_overflows(tiny, capsys):
    register(tiny)
    model = llm.get_model("pte:tiny")
    history = []
    for text in ["Hello there, how are you today?", "Tell me a story about a cat"]:
        history += [llm.user(text), llm.assistant("Because air scatters")]
    small = model.prompt("Why is the sky blue?", messages=history, kv_max_capacity=60, max_tokens=2)
    small.text()
    assert "left out" in capsys.readouterr().err
    # the same history in a cache it fits: nothing left out, nothing printed
    big = model.prompt("Why is the sky blue?", messages=history, max_tokens=2)
    big.text()
    assert big.response_json["prompt_tokens"] > 60 and capsys.readouterr().err == ""
    with pytest.raises(llm.ModelError, match="cache holds 60"):
        model.prompt("Why is the sky blue?", messages=history, kv_max_capacity=60, kv_overflow="error").text()


def test_repetition_penalty_sees_the_whole_history_on_a_cache_hit(tiny):
    register(tiny)
    conversation = llm.get_model("pte:tiny").conversation()
    first = conversation.prompt("Hello there", max_tokens=8, repetition_penalty=3.0).text()
    second = conversation.prompt("Tell me a story", max_tokens=8, repetition_penalty=3.0)
    text = second.text()
    assert second.response_json["cache_path"] == "hit"
    cold = llm.get_model("pte:tiny")
    store.POOL.clear()
    again = cold.prompt("Tell me a story", messages=[llm.user("Hello there"), llm.assistant(first)],
                        max_tokens=8, repetition_penalty=3.0).text()
    assert again == text


def test_an_empty_prompt_is_a_one_line_error(tiny):
    register(tiny)
    r = invoke("-m", "pte:tiny", "", "-o", "chat", "none", "--no-log")
    assert r.exit_code == 1 and "no tokens" in r.output and "Traceback" not in r.output
