"""Options are declared once (options.py): llm's Options class, ``llm models
--options``, the text layer's defaults and the checks of bad values all come
from that declaration, and the runtime takes the same names."""

import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner
from llm.cli import cli

from llm_executorch_mlx.options import DEFAULTS, OPTIONS
from llm_executorch_mlx.plugin import PteModel
from llm_executorch_mlx.runtime.cache import DEFAULT_INITIAL_CAPACITY
from llm_executorch_mlx.runtime.dtypes import COMPUTE_ROUTES
from llm_executorch_mlx.runtime.kv_storage import STORAGES
from llm_executorch_mlx.text import templates
from llm_executorch_mlx.text.sampling import Sampler
from llm_executorch_mlx.text.turn import TurnOptions


@pytest.fixture
def registered(tmp_path, monkeypatch):
    """A model entry whose files are missing: enough for llm to list it and validate options."""
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    entry = {"path": str(tmp_path / "gone.pte"), "tokenizer": str(tmp_path / "gone.json")}
    (tmp_path / "executorch-mlx.json").write_text(json.dumps({"models": {"gone": entry}}))
    return "pte:gone"


def words(text: str) -> str:
    return " ".join(text.split())


def test_llms_options_class_has_every_declared_option_in_order_with_its_description():
    fields = PteModel.Options.model_fields
    assert list(fields) == list(OPTIONS)
    for name, option in OPTIONS.items():
        assert fields[name].default is None  # not given: the declared default applies in the turn
        assert fields[name].description == option.help


def test_llm_models_options_shows_the_declared_descriptions(registered):
    out = CliRunner().invoke(cli, ["models", "list", "--options", "-m", registered]).output
    for name, option in OPTIONS.items():
        assert f"    {name}: " in out
        assert words(option.help) in words(out)


def test_the_text_layer_defaults_are_the_declared_ones():
    turn = TurnOptions()
    assert {name: getattr(turn, name) for name in OPTIONS} == DEFAULTS
    sampler = Sampler()
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        assert getattr(sampler, name) == DEFAULTS[name]
    assert templates.TEMPLATE_NAMES == OPTIONS["chat"].choices


def test_every_declared_default_passes_its_own_check():
    for option in OPTIONS.values():
        assert option.check(option.default) == option.default


def test_every_choice_is_named_in_its_description():
    for option in OPTIONS.values():
        for value in (*option.choices, *option.aliases):
            assert re.search(rf"\b{re.escape(value)}\b", option.description), (option.name, value)


def test_the_runtime_and_the_templates_take_the_declared_names():
    assert set(OPTIONS["kv_storage_dtype"].choices) == set(OPTIONS["kv_value_dtype"].choices) == set(STORAGES)
    assert set(OPTIONS["compute_dtype"].choices) == set(COMPUTE_ROUTES)
    assert set(OPTIONS["chat"].choices) == {"auto", "none", *templates._BUILTINS}
    assert set(OPTIONS["chat"].aliases.values()) <= set(OPTIONS["chat"].choices)
    assert f"default {DEFAULT_INITIAL_CAPACITY})" in OPTIONS["kv_initial_capacity"].description


@pytest.mark.parametrize("option, value, typed, message", [
    ("top_p", 2.0, "2", "top_p must be in (0, 1] (1 disables), got 2.0"),
    ("temperature", -1.0, "-1", "temperature must be >= 0 (0 is greedy), got -1.0"),
    ("seed", -1, "-1", "seed must be an integer in [0, 2**64) or None, got -1"),
])
def test_llm_and_the_sampler_refuse_a_bad_value_with_the_same_message(registered, option, value, typed, message):
    r = CliRunner().invoke(cli, ["-m", registered, "hi", "-o", option, typed, "--no-log"])
    assert r.exit_code == 1
    assert r.output == f"Error: {option}\n  Value error, {message}\n"  # llm's shape: the option, then our line
    with pytest.raises(ValueError) as refused:
        Sampler(**{option: value})
    assert str(refused.value) == message


@pytest.mark.parametrize("option, typed, message", [
    ("kv_storage_dtype", "int3", "kv_storage_dtype must be one of bf16, fp16, fp32, int8, int4, got 'int3'"),
    ("chat", "chatml", "chat must be one of auto, llama3, gemma, gemma4, none (0 for none), got 'chatml'"),
    ("kv_windows", "8,x", "kv_windows must be comma-separated non-negative integers, e.g. 512 or 512,0, got '8,x'"),
    ("stop", "[1", "stop must be a string or a JSON list of strings"),
    ("stop", '["a", ""]', "stop must be a string or a JSON list of non-empty strings, got ['a', '']"),
])
def test_a_bad_value_names_what_would_do(registered, option, typed, message):
    r = CliRunner().invoke(cli, ["-m", registered, "hi", "-o", option, typed, "--no-log"])
    assert (r.exit_code, r.output) == (1, f"Error: {option}\n  Value error, {message}\n")


def test_good_values_pass_as_typed_and_a_json_stop_list_is_parsed():
    options = PteModel.Options(chat="0", stop='["a", "b"]', kv_windows="512,0", min_p=1)
    assert (options.chat, options.stop, options.kv_windows, options.min_p) == ("0", ["a", "b"], "512,0", 1.0)


def test_importing_the_plugin_and_its_options_loads_no_mlx():
    code = ("import sys, llm_executorch_mlx.plugin; "
            "print([m for m in ('mlx', 'mlx.core', 'torch', 'executorch', 'jinja2') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
