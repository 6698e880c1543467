"""Schemas (``--schema``): every reply is a document the schema accepts.

The reference is jsonschema validating what was streamed, decoded by the
tokenizer library itself; the models are random-weight ones that would
never write JSON unconstrained, sampled over seeds and temperatures. Bounded
schemas (string lengths, integer ranges, enums) let a grammar always close
within ``max_tokens``.
"""

import json

import jsonschema
import llm
import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from llm.cli import cli
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as tokenizer_models

import models
import test_text_tokenizer as tokenizers_built
from llm_executorch_mlx.text import load_tokenizer, store
from llm_executorch_mlx.text.constrained import Constraint, closed_objects
from llm_executorch_mlx.text.errors import TextError

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "good": {"type": "boolean"},
        "kind": {"enum": ["dog", "cat", "fox"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "good", "kind"],
}
MAX_TOKENS = 100  # more than the longest PET document has bytes (~95, its name escaped), within the cache
JSON_CORPUS = models.CORPUS + [
    '{"name": "Rex", "age": 3, "good": true, "kind": "dog", "tags": ["a", "b"]}',
    '{"items": [{"x": 1.5, "y": -2}, {"x": 0, "y": null}], "ok": false}',
    'Escapes like \\" and \\\\ and \\n, braces {} and brackets [] with colons: here.',
]


def json_tokenizer(directory, corpus=JSON_CORPUS):
    """A byte-level BPE (SmolLM2's kind) of 200 ids over ``corpus``'s bytes,
    with the Llama 3 specials and chat template the test models use."""
    tok = Tokenizer(tokenizer_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus * 4, trainers.BpeTrainer(vocab_size=200, special_tokens=models.LLAMA3_SPECIALS,
                                                            show_progress=False))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": models.LLAMA3_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    return directory / "tokenizer.json"


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    store.POOL.clear()
    yield tmp_path / "llm"


@pytest.fixture(scope="module")
def tiny(exported, tmp_path_factory):
    """(pte, tokenizer.json): the random llama fp32 model and a JSON-capable tokenizer."""
    _, pte = exported("llama")
    return pte, json_tokenizer(tmp_path_factory.mktemp("jsontok"))


def register(pte, tokenizer, name="tiny"):
    r = CliRunner().invoke(cli, ["pte", "register", str(pte), "--tokenizer", str(tokenizer), "--name", name],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_replies_validate_at_every_seed_and_temperature(tiny, temperature):
    register(*tiny)
    model = llm.get_model("pte:tiny")
    for seed in range(10):
        r = model.prompt("Invent a pet.", schema=PET, temperature=temperature, seed=seed, max_tokens=MAX_TOKENS)
        jsonschema.validate(json.loads(r.text()), PET)
        assert r.json()["finish_reason"] == "stop"


def test_a_conversation_with_schemas_keeps_its_cache(tiny):
    register(*tiny)
    short = {"type": "object", "properties": {"kind": PET["properties"]["kind"], "good": {"type": "boolean"}},
             "required": ["kind", "good"]}  # two turns fit the test model's 128-token cache
    conversation = llm.get_model("pte:tiny").conversation()
    first = conversation.prompt("Invent a pet.", schema=short, max_tokens=40)
    jsonschema.validate(json.loads(first.text()), short)
    second = conversation.prompt("Another one.", schema=short, temperature=1.0, seed=3, max_tokens=40)
    jsonschema.validate(json.loads(second.text()), short)
    assert second.json()["cache_path"] == "hit"


def test_the_cli_prints_a_valid_document(tiny):
    register(*tiny)
    r = CliRunner().invoke(cli, ["-m", "pte:tiny", "--schema", json.dumps(PET), "Invent a pet.",
                                 "-o", "max_tokens", str(MAX_TOKENS), "-o", "temperature", "1", "-o", "seed", "5"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    jsonschema.validate(json.loads(r.output), PET)


def test_max_tokens_that_cut_a_document_is_an_error_naming_the_fix(tiny):
    register(*tiny)
    r = llm.get_model("pte:tiny").prompt("Invent a pet.", schema=PET, max_tokens=4)
    with pytest.raises(llm.ModelError, match="^max_tokens 4 ended the reply before its JSON document was "
                                             "complete: raise -o max_tokens$"):
        r.text()


def test_a_tokenizer_without_the_characters_json_needs_is_refused(exported, tmp_path):
    # no "{" in its corpus, so no token can start an object
    _, pte = exported("llama")
    register(pte, json_tokenizer(tmp_path / "tok", corpus=models.CORPUS))
    r = llm.get_model("pte:tiny").prompt("Invent a pet.", schema=PET)
    with pytest.raises(llm.ModelError, match=r'^no token of the tokenizer tokenizer.json can continue the '
                                             r'JSON "" as the schema requires: this tokenizer cannot write '
                                             r'that schema$'):
        r.text()


def test_bad_schemas_and_stop_strings_get_one_line_errors(tiny):
    register(*tiny)
    model = llm.get_model("pte:tiny")
    with pytest.raises(llm.ModelError, match="^the schema is not usable: "):
        model.prompt("x", schema={"type": "integer", "minimum": 5, "maximum": 1}).text()
    with pytest.raises(llm.ModelError, match="^-o stop cannot be used with a schema: "):
        model.prompt("x", schema=PET, stop="}").text()


def test_a_tokenizer_llguidance_cannot_read_is_named(tmp_path):
    tok = load_tokenizer(tokenizers_built.build_unigram(tmp_path))  # a Metaspace decoder
    with pytest.raises(TextError, match=f"^schemas and forced tool calls cannot use the tokenizer {tok.path}: "
                                        "llguidance cannot read it"):
        Constraint(PET, tok, tok.vocab_size, tok.eos_ids)


BUILDERS = {
    "byte_bpe": tokenizers_built.build_byte_bpe,
    "byte_fallback": tokenizers_built.build_byte_fallback_bpe,
    "sentencepiece": tokenizers_built.build_sentencepiece,
    "tiktoken": tokenizers_built.build_tiktoken,
}


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_masked_random_sampling_writes_valid_documents_with_every_tokenizer_kind(kind, tmp_path):
    """Each kind's token table is right: tokens drawn at random among those
    the mask allows, decoded by the tokenizer library, always validate."""
    tok = load_tokenizer(BUILDERS[kind](tmp_path))
    end = tok.eos_ids or (tok.vocab_size - 1,)
    rng = np.random.default_rng(0)
    for seed in range(5):
        constraint = Constraint(PET, tok, tok.vocab_size + 7, end)  # a padded logits row
        ids = []
        for _ in range(MAX_TOKENS):
            logits = constraint.apply(mx.array(rng.standard_normal(tok.vocab_size + 7).astype(np.float32)))
            token = int(mx.random.categorical(logits, key=mx.random.key(seed * 1000 + len(ids))).item())
            constraint.advance(token)
            if token in end:
                break
            ids.append(token)
        assert token in end and constraint.complete
        jsonschema.validate(json.loads(tok.decode(ids)), PET)


def test_closed_objects_only_closes_objects_that_say_nothing_of_other_keys():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"type": "object", "properties": {}, "additionalProperties": True},
                                               "c": {"enum": [{"properties": {}}]}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["additionalProperties"] is True
    assert closed["properties"]["c"] == {"enum": [{"properties": {}}]}


def test_llm_models_lists_schemas_and_async(tiny):
    register(*tiny)
    r = CliRunner().invoke(cli, ["models", "list", "--options", "-q", "pte:tiny"], catch_exceptions=False)
    assert "  Features:\n  - streaming\n  - schemas\n  - tools\n  - async\n" in r.output
