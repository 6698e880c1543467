"""The other files a user hands us: tokenizers and their side files, chat
templates, the registry, and what ``llm pte register`` makes of them: never a
traceback, never a changed registry, never a tokenizer of another model."""

import json
import re

import pytest
from click.testing import CliRunner
from llm.cli import cli
from models import make_tokenizer
from test_text_tokenizer import build_byte_bpe, build_sentencepiece, build_tiktoken, write_config

import fuzzing
from llm_executorch_mlx.registry import registry_path
from llm_executorch_mlx.runtime.pte.metadata import ModelMetadata
from llm_executorch_mlx.text import TextError, load_tokenizer, resolve_template, templates
from llm_executorch_mlx.text.model_fit import mismatches


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))


# -- chat templates ----------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bpe")
    build_byte_bpe(directory)
    return directory


def _render(directory, template):
    write_config(directory, bos_token="<|begin_of_text|>", chat_template=template)
    return resolve_template("auto", load_tokenizer(directory / "tokenizer.json")).render(
        [{"role": "user", "content": "hi"}]
    )


@pytest.mark.parametrize("template, problem", [
    ("{{ 'x' * 100000000 }}", "more than 16777216 characters"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "more than 16777216 characters"),
    ("{% set ns = namespace(s=[1]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "more than 16777216 characters"),
    ("{% for i in range(20000) %}{{ messages[0]['content'] * 1000 }}{% endfor %}", "more than 16777216 characters"),
    ("{{ '%0999999999d' % 1 }}", "format field width is too large"),
    ("{{ '{:999999999}'.format(1) }}", "format field width is too large"),
    ("{{ 'x'.ljust(999999999) }}", "argument 999999999 is too large"),
    ("{{ 2 ** 100000000 }}", "power 100000000 is too large"),
])
def test_a_template_that_would_exhaust_memory_is_stopped(bpe_dir, template, problem):
    with pytest.raises(TextError, match=f"chat template: .*{problem}"):
        _render(bpe_dir, template)


@pytest.mark.parametrize("template", ["{{ " + "(" * 2000 + "1" + ")" * 2000 + " }}", "{{ " + "{'a': " * 1000 + "1" + "}" * 1000 + " }}"])
def test_a_template_nested_too_deeply_to_parse_is_refused(bpe_dir, template):
    """A RecursionError from jinja's parser (found by atheris, scripts/atheris_targets.py)."""
    with pytest.raises(TextError, match=r"the chat template of .*tokenizer\.json nests too deeply to parse"):
        _render(bpe_dir, template)


def test_a_template_that_would_run_for_ever_is_stopped(bpe_dir, monkeypatch):
    monkeypatch.setattr(templates, "RENDER_SECONDS", 0.5)  # the bound itself, made short
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}done"
    with pytest.raises(TextError, match=r"chat template: rendering took more than 0.5 s"):
        _render(bpe_dir, loops)


def test_the_bounds_leave_real_templates_alone(bpe_dir):
    """A loop, a namespace, string building: as jinja renders them unbounded."""
    import jinja2

    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                "{{ '<' ~ m['role'] ~ '>' + m['content'] * 2 }}{% endfor %}{{ ns.n }}{{ '%03d' % 7 }}"
                "{{ '{:>4}'.format('a') }}{% for i in range(3) %}{{ i }}{% endfor %}{{ 2 ** 10 }}")
    expected = jinja2.Environment().from_string(template).render(messages=[{"role": "user", "content": "hi"}])
    assert _render(bpe_dir, template) == expected == "<user>hihi1007   a0121024"


# -- tokenizer files ---------------------------------------------------------------


@pytest.mark.parametrize("builder", [build_byte_bpe, build_sentencepiece, build_tiktoken],
                         ids=["tokenizer.json", "sentencepiece", "tiktoken"])
def test_mutated_tokenizer_files_load_or_are_refused(tmp_path, builder):
    """200 seeded mutants of each format: a tokenizer that works, or a
    TextError (anything else fails the test as it happens)."""
    good = builder(tmp_path / "good")
    data = good.read_bytes()
    mutator = fuzzing.Mutator(data, seed=len(data))
    target = tmp_path / "bad" / good.name
    target.parent.mkdir()
    outcomes = set()
    for _ in range(200):
        target.write_bytes(mutator.mutate()[0])
        try:
            tok = load_tokenizer(target)
            tok.decode(tok.encode("Hello there <|eot_id|>"))
            resolve_template("auto", tok)
            outcomes.add("ok")
        except TextError:
            outcomes.add("refused")
    assert "refused" in outcomes


@pytest.mark.parametrize("side_file, content", [
    ("tokenizer_config.json", {"bos_token": 5, "eos_token": ["x"], "chat_template": 7}),
    ("tokenizer_config.json", {"chat_template": [{"name": 3}, "x", None]}),
    ("generation_config.json", {"bos_token_id": "1", "eos_token_id": ["2", None, {}]}),
    ("special_tokens_map.json", {"bos_token": {"content": 4}}),
])
def test_side_files_of_the_wrong_types_are_ignored_field_by_field(tmp_path, side_file, content):
    build_byte_bpe(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / side_file).write_text(json.dumps(content))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.chat_template is None
    assert tok.eos_ids == () and tok.bos_id is None


# -- a tokenizer that cannot belong to the model -------------------------------------


@pytest.fixture(scope="module")
def tok200(tmp_path_factory):
    return load_tokenizer(make_tokenizer(tmp_path_factory.mktemp("t200"), vocab_size=200))


def _meta(**facts):
    return ModelMetadata(**{"vocab_size": 256, **facts})


def test_a_vocabulary_a_bit_smaller_than_the_padded_embedding_fits(tok200):
    assert mismatches(_meta(vocab_size=256), tok200) == []  # 200 ids, logits padded to 256
    assert mismatches(_meta(vocab_size=tok200.vocab_size), tok200) == []


def test_a_vocabulary_far_smaller_or_larger_than_the_models_is_refused(tok200):
    assert mismatches(_meta(vocab_size=49152), tok200) == [
        f"the tokenizer has {tok200.vocab_size} tokens but the model 49152, far more than a padded vocabulary explains"
    ]
    assert mismatches(_meta(vocab_size=100), tok200) == [
        f"the tokenizer has {tok200.vocab_size} tokens but the model only 100"
    ]


def test_bos_and_eos_ids_the_file_publishes_must_be_the_tokenizers(tok200):
    bos, eos = tok200.bos_id, tok200.eos_ids[0]
    assert mismatches(_meta(bos_id=bos, eos_ids=[eos, 3]), tok200) == []
    assert mismatches(_meta(bos_id=bos + 1), tok200) == [f"the model's BOS id is {bos + 1}, the tokenizer's {bos}"]
    assert mismatches(_meta(eos_ids=[7, 9]), tok200) == [f"the model's EOS ids are [7, 9], the tokenizer's [{eos}]"]
    assert mismatches(_meta(vocab_size=256, eos_ids=[eos, 250]), tok200) == [
        f"the model's special ids [250] are not tokens of the tokenizer ({tok200.vocab_size} ids)"
    ]


def test_a_turn_end_past_the_models_ids_is_refused(tok200):
    template = resolve_template("auto", tok200)
    turn = tok200.token_to_id("<|eot_id|>")
    assert template.turn_end == "<|eot_id|>" and mismatches(_meta(), tok200, template) == []
    assert mismatches(_meta(vocab_size=turn), tok200, template)[-1] == (
        f"the chat template ends turns with <|eot_id|> (id {turn}), past the model's {turn} ids"
    )


# -- llm pte register ------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(exported):
    return exported(*fuzzing.KINDS["llama-fp32"])[1]


def _register(pte, tokenizer, *extra):
    return CliRunner().invoke(cli, ["pte", "register", str(pte), "--tokenizer", str(tokenizer), *extra])


def _registered_ok(llama, tmp_path):
    tok = make_tokenizer(tmp_path / "good")
    r = _register(llama, tok, "--name", "good")
    assert r.exit_code == 0, r.output
    return registry_path().read_bytes()


def _corrupt_pte(llama, tmp_path):
    data = bytearray(llama.read_bytes())
    at = data.index(b"MLX0")
    data[at + 12 : at + 20] = (1 << 62).to_bytes(8, "little")  # the payload's segment size
    bad = tmp_path / "bad.pte"
    bad.write_bytes(bytes(data))
    return bad, tmp_path / "good" / "tokenizer.json"


def _small_tokenizer(llama, tmp_path):
    return llama, make_tokenizer(tmp_path / "small", vocab_size=90)


def _bad_template(llama, tmp_path):
    tok = make_tokenizer(tmp_path / "tpl")
    config = json.loads((tmp_path / "tpl" / "tokenizer_config.json").read_text())
    (tmp_path / "tpl" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% for %}"}))
    return llama, tok


def _garbage_tokenizer(llama, tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "tokenizer.json").write_bytes(b'{"model": {"type": "BPE", "vocab": 5')
    return llama, tmp_path / "junk" / "tokenizer.json"


@pytest.mark.parametrize("make, problem", [
    (_corrupt_pte, r"bad\.pte: forward: MLX payload header points past the end of the payload"),
    (_small_tokenizer, r"cannot be this model's tokenizer: the tokenizer has \d+ tokens but the model 256, far more"),
    (_bad_template, r"does not parse"),
    (_garbage_tokenizer, r"is not valid JSON"),
])
def test_register_refuses_bad_input_in_one_line_and_changes_nothing(llama, tmp_path, make, problem):
    before = _registered_ok(llama, tmp_path)
    files = sorted(registry_path().parent.iterdir())
    pte, tokenizer = make(llama, tmp_path)
    r = _register(pte, tokenizer, "--name", "other")
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception  # click's own exit, no exception
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and re.search(problem, lines[0]), r.output
    assert registry_path().read_bytes() == before and sorted(registry_path().parent.iterdir()) == files


def test_a_damaged_registry_is_named_and_kept(llama, tmp_path):
    _registered_ok(llama, tmp_path)
    registry_path().write_text('{"models": {"good": [1, 2]')
    r = _register(llama, tmp_path / "good" / "tokenizer.json", "--name", "other")
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "is damaged" in r.output and "fix or delete it" in r.output
    assert registry_path().read_text() == '{"models": {"good": [1, 2]'
    listed = CliRunner().invoke(cli, ["models"])
    assert listed.exit_code == 0 and "Traceback" not in listed.output


def test_a_model_file_corrupted_after_registering_is_one_line_in_chat_and_prompt(llama, tmp_path):
    """llm's chat loop does not catch model errors: ours still end in one line."""
    import os
    import subprocess
    import sys

    copy = tmp_path / "m.pte"
    copy.write_bytes(llama.read_bytes())
    tok = make_tokenizer(tmp_path / "tok")
    assert _register(copy, tok, "--name", "m").exit_code == 0
    _corrupt_pte(copy, tmp_path)[0].replace(copy)
    env = {**os.environ, "LLM_USER_PATH": str(registry_path().parent)}
    for args in (["chat", "-m", "pte:m"], ["-m", "pte:m", "hi"]):
        p = subprocess.run([sys.executable, "-m", "llm", *args], input="hello\nquit\n", capture_output=True,
                           text=True, env=env)
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.strip().splitlines() == [
            f"Error: {copy}: forward: MLX payload header points past the end of the payload"
        ]


@pytest.mark.parametrize("entry", [
    {"path": 5, "tokenizer": None},
    {"path": "/x", "tokenizer": "/y", "aliases": "abc", "summary": []},
    {"path": "/x", "tokenizer": "/y", "aliases": [1]},
    3,
])
def test_a_registry_entry_of_the_wrong_types_is_skipped_listing_and_named_registering(llama, tmp_path, entry):
    registry_path().parent.mkdir(parents=True, exist_ok=True)
    saved = json.dumps({"models": {"a": entry}})
    registry_path().write_text(saved)
    for args in (["models"], ["pte", "models"], ["pte", "models", "--json"]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 0 and r.exception is None, (args, r.output)
        assert "pte:a" not in r.output
    r = _register(llama, make_tokenizer(tmp_path / "tok"), "--name", "b")
    assert r.exit_code == 1 and re.search(r"entry 'a' is damaged \(.*\): fix or delete it", r.output), r.output
    assert registry_path().read_text() == saved


# -- every pte command: one line for bad input, nothing changed on disk ---------------


def _tree(root):
    """Every path under ``root`` with its bytes (None for a directory)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def _registry_unwritable(tmp_path):
    """A registry that cannot be written: its lock's name taken by a directory
    (root writes anywhere), in a read-only user dir."""
    lock = registry_path().with_name(registry_path().name + ".lock")
    lock.unlink()
    lock.mkdir()
    registry_path().parent.chmod(0o555)


def _registry_a_directory(tmp_path):
    registry_path().unlink()
    registry_path().mkdir()


def _registry_damaged(tmp_path):
    registry_path().write_text('{"models": {"good": ')


def _states_dir_a_file(tmp_path):
    (registry_path().parent / "executorch-mlx-states").write_text("not a directory")


def _states_garbage(tmp_path):
    states = registry_path().parent / "executorch-mlx-states"
    states.mkdir()
    (states / "x.safetensors").write_bytes(b"\xff" * 100)
    (states / "y.safetensors").write_bytes(b"")


@pytest.mark.parametrize("setup, args, problem", [
    # register: bad paths, a bad tokenizer, bad names, a registry it cannot read or write
    (None, ["pte", "register", "{tmp}/nope.pte", "--tokenizer", "{tok}"], r"nope\.pte"),
    (None, ["pte", "register", "{pte}", "--tokenizer", "{tmp}/nope.json"], r"tokenizer file not found: .*nope\.json"),
    (None, ["pte", "register", "{pte}", "--tokenizer", "{pte}"], r"model\.pte"),
    (None, ["pte", "register", "{pte}", "--tokenizer", "{tok}", "--name", "../up"], r"invalid name '\.\./up'"),
    (None, ["pte", "register", "{pte}", "--tokenizer", "{tok}", "--alias", "a b"], r"invalid name 'a b'"),
    (None, ["pte", "register", "{pte}", "--tokenizer", "{tok}", "--name", "good"], r"'good' is already registered"),
    (_registry_damaged, ["pte", "register", "{pte}", "--tokenizer", "{tok}", "--name", "x"], r"is damaged .*fix or delete it"),
    (_registry_a_directory, ["pte", "register", "{pte}", "--tokenizer", "{tok}", "--name", "x"], r"cannot read .*executorch-mlx\.json: Is a directory"),
    (_registry_unwritable, ["pte", "register", "{pte}", "--tokenizer", "{tok}", "--name", "x"], r"cannot write the registry .*executorch-mlx\.json"),
    # remove
    (None, ["pte", "remove", "nope"], r"no registered model named 'nope'"),
    (_registry_damaged, ["pte", "remove", "good"], r"is damaged .*fix or delete it"),
    (_registry_unwritable, ["pte", "remove", "good"], r"cannot write the registry"),
    # export: refused before anything is exported or written
    (None, ["pte", "export", "{tmp}/nowhere", "-o", "{tmp}/out/m.pte"], r"no such directory: .*nowhere"),
    (None, ["pte", "export", "{tmp}", "-o", "{tmp}/out/m.pte"], r"has no config\.json"),
    (None, ["pte", "export", "{hf}", "-o", "{tmp}/out/m.pte", "--name", "no/slash"], r"invalid name 'no/slash'"),
    (None, ["pte", "export", "{hf}", "-o", "{tmp}/out/m.pte", "--name", "good"], r"'good' is already registered"),
    (_registry_damaged, ["pte", "export", "{hf}", "-o", "{tmp}/out/m.pte"], r"is damaged .*fix or delete it"),
    (None, ["pte", "export", "{hf}", "-o", "{pte}", "--no-register"], r"model\.pte exists: use --force"),
    (None, ["pte", "export", "{hf}", "-o", "{tmp}", "--no-register"], r"is a directory: pass the path of the \.pte"),
    (None, ["pte", "export", "{hf}", "-o", "{tok}/m.pte", "--no-register"], r"cannot make the output's directory .*tokenizer\.json"),
])
def test_a_refused_command_says_one_line_and_changes_nothing(llama, tmp_path, setup, args, problem):
    _registered_ok(llama, tmp_path)
    if setup is not None:
        setup(tmp_path)
    before = _tree(tmp_path)
    values = {"tmp": tmp_path, "pte": llama, "tok": tmp_path / "good" / "tokenizer.json", "hf": llama.parent / "hf"}
    try:
        r = CliRunner().invoke(cli, [a.format(**values) for a in args])
    finally:
        registry_path().parent.chmod(0o755)
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.exception, r.output)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and re.search(problem, lines[0]), r.output
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("setup", [_registry_damaged, _registry_a_directory, _states_dir_a_file])
def test_listing_commands_answer_whatever_is_on_disk_and_change_nothing(llama, tmp_path, setup):
    _registered_ok(llama, tmp_path)
    setup(tmp_path)
    before = _tree(tmp_path)
    for args in (["models"], ["pte", "models"], ["pte", "models", "--json"], ["pte", "cache"], ["pte", "cache", "clear"]):
        r = CliRunner().invoke(cli, args)
        if setup is _states_dir_a_file and args[:2] == ["pte", "cache"]:
            # our one-line error naming the path (test_saved_states.py checks its words)
            assert r.exit_code == 1 and r.output.startswith("Error: ") and r.output.count("\n") == 1, r.output
        else:
            assert r.exit_code == 0 and r.exception is None, (args, r.output)
    assert _tree(tmp_path) == before


def test_damaged_saved_states_are_named_when_listed_never_a_traceback(llama, tmp_path):
    _registered_ok(llama, tmp_path)
    _states_garbage(tmp_path)
    r = CliRunner().invoke(cli, ["pte", "cache"])
    assert r.exit_code == 0 and r.exception is None, r.output
    assert sorted(re.findall(r"ignored the saved cache state (\S+):", r.stderr)) == ["x.safetensors", "y.safetensors"]
    assert r.stdout.startswith("No saved cache states in ")


def test_a_refusal_in_a_real_llm_process_is_one_line_on_stderr(llama, tmp_path):
    """What a user sees: the llm executable's own output, no traceback."""
    import os
    import subprocess
    import sys

    _registered_ok(llama, tmp_path)
    _registry_damaged(tmp_path)
    before = _tree(tmp_path)
    env = {**os.environ, "LLM_USER_PATH": str(registry_path().parent)}
    for args in (["pte", "register", str(llama), "--tokenizer", str(tmp_path / "nope.json")],
                 ["pte", "remove", "good"]):
        p = subprocess.run([sys.executable, "-m", "llm", *args], capture_output=True, text=True, env=env)
        assert p.returncode == 1 and p.stdout == "", (args, p.stdout, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("Error: "), (args, p.stderr)
    assert _tree(tmp_path) == before
