"""`llm pte export`: tiny random models in, registered models out.

Three architectures (llama, qwen3, and gemma3 with sliding-window layers)
exported at fp32 must answer through the plugin exactly as transformers'
eager greedy generation does; a 4-bit export (linears and embedding) must
give transformers' logits on the same weights quantized the same way. Bad inputs are
one-line errors that leave no file behind. Exports take 15-30 s each here,
so each one is made once per module and shared.
"""

import json
import pathlib
import shutil

import llm
import models
import pytest
import test_parity as parity
import torch
import transformers
from click.testing import CliRunner
from llm.cli import cli
from models import build_config, build_model, make_tokenizer

from llm_executorch_mlx import export as export_module
from llm_executorch_mlx.registry import Entry, load_entries, registry_path, save_entries
from llm_executorch_mlx.text import store

CONTEXT = 128
CHUNK = {"llama": 32, "qwen3": 32, "gemma3": 16}  # gemma3's window is 16
PROMPT = "Tell me a story about a cat who learns to read books in the old library"


@pytest.fixture(scope="module", autouse=True)
def user_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_USER_PATH", str(directory))
        store.POOL.clear()
        store.REPLIES.clear()
        yield directory
        store.POOL.clear()


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def make_source(directory, arch):
    """A Hugging Face model directory: random weights, a small BPE tokenizer
    with a Llama 3 chat template, and a generation config naming its turn end."""
    build_model(arch, trained=False).save_pretrained(directory)
    make_tokenizer(directory)
    vocab = json.loads((directory / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": ids["<|eot_id|>"]}))
    return directory


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = make_source(tmp_path_factory.mktemp(f"src-{arch}"), arch)
        return made[arch]

    return get


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    """``exported(arch, name, *flags)`` -> (source dir, .pte path, CLI result), made once."""
    made = {}

    def get(arch, name, *flags):
        key = (arch, name, flags)
        if key not in made:
            out = tmp_path_factory.mktemp(f"out-{name}") / f"{name}.pte"
            result = invoke("pte", "export", source(arch), "--output", out, "--max-ctx-len", CONTEXT,
                            "--prefill-chunk", CHUNK[arch], "--name", name, *flags)
            made[key] = (source(arch), out, result)
        return made[key]

    return get


def hf_greedy(model_dir, prompt, max_new_tokens):
    """Transformers' own template, tokens and eager greedy continuation."""
    ids, text = models.hf_greedy(model_dir, model_dir, [{"role": "user", "content": prompt}], max_new_tokens)
    return len(ids), text


def only_files(directory):
    return sorted(p.name for p in directory.iterdir())


# -- exports that work ----------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_fp32_export_registers_and_matches_transformers_greedy(exported, arch):
    src, pte, r = exported(arch, arch, "--dtype", "fp32")
    assert r.exit_code == 0, r.output
    # progress on stderr, the summary and the registration on stdout
    for step in ("loading", "exporting", "lowering", "writing", "checking"):
        assert step in r.stderr
    assert f"Exported {pte} (" in r.stdout
    layers = "3 layers: 1 flat + 2 ring(window 16)" if arch == "gemma3" else "2 layers: 2 flat"
    assert layers in r.stdout
    assert f"context:      {CONTEXT} tokens, prefill chunk {CHUNK[arch]}" in r.stdout
    assert "dtype:        fp32, quantization: none" in r.stdout
    assert f"Registered pte:{arch}" in r.stdout
    # the tokenizer files sit beside the .pte, and nothing else does
    copied = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert only_files(pte.parent) == sorted(copied + [pte.name])
    for name in copied:
        assert (pte.parent / name).read_bytes() == (src / name).read_bytes()
    entry = load_entries()[arch]
    assert (entry.path, entry.tokenizer, entry.chat) == (str(pte), str(pte.parent / "tokenizer.json"), "auto")
    assert entry.summary["max_context"] == CONTEXT and entry.summary["prefill_chunk"] == CHUNK[arch]
    # the plugin's greedy answer is transformers' (gemma3: the prompt outruns the window)
    n_prompt, expected = hf_greedy(src, PROMPT, 16)
    if arch == "gemma3":
        assert n_prompt > 16
    out = invoke("-m", f"pte:{arch}", PROMPT, "-o", "max_tokens", 16, "--no-log")
    assert out.exit_code == 0, out.output
    assert out.stdout.rstrip("\n") == expected


def test_4bit_export_matches_torchao_quantized_transformers_and_registers_by_hand(exported, monkeypatch):
    _, fp32, _ = exported("qwen3", "qwen3", "--dtype", "fp32")
    src, pte, r = exported("qwen3", "q4", "--dtype", "fp32", "--qlinear", "4w", "--qembedding", "4w",
                           "--group-size", 32, "--no-register")
    assert r.exit_code == 0, r.output
    assert "quantization: linear 4w (group 32), embedding 4w (group 32)" in r.stdout
    assert "quantizing linear layers to 4w" in r.stderr and "quantizing embedding layers to 4w" in r.stderr
    assert pte.stat().st_size < fp32.stat().st_size / 2
    assert "q4" not in load_entries() and "Registered" not in r.stdout
    assert invoke("pte", "register", pte, "--tokenizer", pte.parent / "tokenizer.json").exit_code == 0
    response = llm.get_model("pte:q4").prompt(PROMPT, max_tokens=8)
    response.text()
    assert response.response_json["prompt_tokens"] > 0
    assert response.response_json["finish_reason"] in ("stop", "length")
    # its values: transformers on the same source, its linears and embedding
    # quantized by torchao as the exporter does, at every prompt and decode position
    tokens, ours = parity.greedy(pte, parity.prompt_for(3), parity.NEW_TOKENS, kv_dtype="fp32",
                                 int8_activations=False)  # the route within 2^-16 of the activations
    reference = models.reference_model(src, qlinear="4w", qembedding="4w", group_size=32)
    with torch.no_grad():
        ref = reference(input_ids=torch.tensor([tokens[:-1]])).logits[0].numpy()
    parity.assert_close_where_decisive(tokens, ours[:-1], ref, parity.Q4_REL_TOL)


def test_generated_serialization_modules_are_announced(source, tmp_path, monkeypatch):
    """When the wheel lacks executorch's generated MLX modules, the export says it made them."""
    real = export_module.ensure_mlx_export_importable
    monkeypatch.setattr(export_module, "ensure_mlx_export_importable", lambda: real() or True)
    # a stop right after the announcement: the rest of the export is tested above
    monkeypatch.setattr(export_module, "export_hf_model", _raise(RuntimeError("stop here")))
    r = invoke("pte", "export", source("llama"), "-o", tmp_path / "m.pte", "--no-register")
    assert "generated its missing serialization modules" in r.stderr
    _assert_refused(r, "could not export LlamaForCausalLM: RuntimeError: stop here", after_progress=True)
    assert only_files(tmp_path) == []


def test_ensure_mlx_export_importable_generates_the_missing_modules(tmp_path, monkeypatch):
    root = export_module._executorch_root()
    fake = tmp_path / "executorch"
    serialization = fake / "backends" / "mlx" / "serialization"
    shutil.copytree(root / "backends" / "mlx" / "serialization", serialization,
                    ignore=shutil.ignore_patterns("_generated*", "mlx_graph_schema.py", "__pycache__"))
    (fake / "data" / "bin").mkdir(parents=True)
    (fake / "data" / "bin" / "flatc").symlink_to(root / "data" / "bin" / "flatc")
    monkeypatch.setattr(export_module, "_executorch_root", lambda: fake)
    assert not (serialization / "mlx_graph_schema.py").exists()
    assert export_module.ensure_mlx_export_importable() is True
    assert (serialization / "mlx_graph_schema.py").exists()
    assert (serialization / "_generated_serializers.py").exists()
    assert export_module.ensure_mlx_export_importable() is False


def _raise(error):
    def f(*args, **kwargs):
        raise error

    return f


# -- bad input --------------------------------------------------------------------


def _t5_config(d):
    transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=64).save_pretrained(d)


def _unknown_type(d):
    (d / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))


def _no_weights(d):
    build_config("llama").save_pretrained(d)


def _no_tokenizer(d):
    build_model("llama", trained=False).save_pretrained(d)


BAD_SOURCES = [
    ("missing", None, "no such directory"),
    ("a-file", lambda d: None, "is neither a directory nor a GGUF file"),
    ("empty", lambda d: d.mkdir(), "has no config.json"),
    ("t5", _t5_config, "not a causal language model"),
    ("unknown", _unknown_type, "does not know the model type 'no-such-model'"),
    ("no-weights", _no_weights, "has no weights"),
    ("no-tokenizer", _no_tokenizer, "no tokenizer.json or tokenizer.model"),
]


@pytest.mark.parametrize("kind,make,message", BAD_SOURCES, ids=[b[0] for b in BAD_SOURCES])
def test_bad_sources_are_one_line_errors(tmp_path, kind, make, message):
    src = tmp_path / kind
    if kind == "a-file":
        src.write_text("not a model")
    elif make is not None:
        if kind != "empty":
            src.mkdir()
        make(src)
    out = tmp_path / "out"
    out.mkdir()
    before = registry_path().read_bytes() if registry_path().exists() else None
    r = invoke("pte", "export", src, "--output", out / "m.pte")
    _assert_refused(r, message)
    assert only_files(out) == []
    assert (registry_path().read_bytes() if registry_path().exists() else None) == before


def _assert_refused(r, message, after_progress=False):
    """A one-line error; refusals before any work print nothing else."""
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    lines = r.output.strip().splitlines()
    assert lines[-1].startswith("Error: ") and message in lines[-1], r.output
    if after_progress:
        assert all(line.startswith("[") for line in lines[:-1]), r.output
    else:
        assert len(lines) == 1, r.output


def test_bad_options_are_refused_before_exporting(source, tmp_path, monkeypatch):
    # a refusal must come before any export work: exporting would fail the test
    monkeypatch.setattr(export_module, "export_hf_model", _raise(AssertionError("exported")))
    llama, gemma = source("llama"), source("gemma3")
    out = tmp_path / "out"
    out.mkdir()
    (out / "exists.pte").write_bytes(b"keep me")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text("{}")
    save_entries({**load_entries(), "taken": Entry(name="taken", path="/x.pte", tokenizer="/t.json")})
    cases = [
        ([llama, "-o", out / "exists.pte"], "exists: use --force"),
        ([llama, "-o", out / "m.pte", "--max-ctx-len", 64, "--prefill-chunk", 128],
         "--prefill-chunk 128 is larger than the context (--max-ctx-len 64)"),
        ([gemma, "-o", out / "m.pte", "--prefill-chunk", 32],
         "--prefill-chunk 32 is larger than the model's sliding window (16)"),
        ([llama, "-o", tmp_path / "other" / "m.pte"], "tokenizer.json exists and differs"),
        ([llama, "-o", out / "m.pte", "--name", "taken"], "'taken' is already registered"),
        ([llama, "-o", out / "m.pte", "--name", "no spaces"], "invalid name 'no spaces'"),
        ([llama, "-o", out], "is a directory"),
    ]
    for args, message in cases:
        _assert_refused(invoke("pte", "export", *args), message)
    assert only_files(out) == ["exists.pte"] and (out / "exists.pte").read_bytes() == b"keep me"
    assert only_files(tmp_path / "other") == ["tokenizer.json"]


def test_missing_export_dependencies_say_how_to_get_them(source, tmp_path, monkeypatch):
    monkeypatch.setattr(export_module, "missing_export_modules", lambda: ["torch", "transformers"])
    r = invoke("pte", "export", source("llama"), "-o", tmp_path / "m.pte")
    _assert_refused(r, "exporting needs torch, transformers: pip install 'llm-executorch-mlx[export]'")
    assert only_files(tmp_path) == []


def test_operators_the_partitioner_cannot_delegate_are_named(source, tmp_path, monkeypatch):
    """An architecture with an operator MLX lacks, simulated: the partitioner
    refuses aten.neg (RoPE's rotate_half). No file is left behind."""
    export_module.ensure_mlx_export_importable()
    from executorch.backends.mlx import partitioner

    supported = partitioner.MLXOperatorSupport.is_node_supported

    def refuse_neg(self, submodules, node):
        if node.op == "call_function" and "aten.neg" in str(node.target):
            return False
        return supported(self, submodules, node)

    monkeypatch.setattr(partitioner.MLXOperatorSupport, "is_node_supported", refuse_neg)
    out = tmp_path / "out"
    out.mkdir()
    r = invoke("pte", "export", source("llama"), "-o", out / "m.pte", "--dtype", "fp32",
               "--max-ctx-len", 64, "--no-register")
    _assert_refused(r, "the MLX partitioner could not delegate every operator of LlamaForCausalLM: aten.neg",
                    after_progress=True)
    assert r.output.rstrip().endswith("x4")  # two layers, q and k
    assert only_files(out) == []


def test_cached_test_fixtures_are_keyed_by_the_export_code(tmp_path, monkeypatch):
    """The suite's exported fixtures (tests/models.py) are cached by a key
    that covers the project's export code: a change there exports anew."""
    code = models.export_code()
    package = pathlib.Path(export_module.__file__).parent
    assert {package / "export.py", package / "runtime" / "errors.py"} <= set(code)
    before = models.spec_key(arch="llama", trained=False)
    changed = tmp_path / "export.py"
    changed.write_text((package / "export.py").read_text() + "\n# an edit\n")
    monkeypatch.setattr(models, "export_code", lambda: [changed if p.name == "export.py" else p for p in code])
    assert models.spec_key(arch="llama", trained=False) != before
    monkeypatch.setattr(models, "export_code", lambda: code)
    assert models.spec_key(arch="llama", trained=False) == before
