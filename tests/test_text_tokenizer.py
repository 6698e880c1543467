"""load_tokenizer against independent references: transformers for tokenizer.json,
sentencepiece and pytorch_tokenizers' C++ loaders for .model files, tiktoken itself.

The ``build_*`` helpers train tiny tokenizers; the other text tests use them too.
"""

import base64
import json
import subprocess
import sys

import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from llm_executorch_mlx.text import TextError, load_tokenizer

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers split text into pieces; models read the pieces.",
    "Numbers like 12345 and symbols like #, @ and % show up too.",
    "café naïve résumé — and 你好世界, then an emoji 😀 or 🎉.",
] * 10
# Text beyond the training data: emoji, CJK and accents the vocabularies lack.
SAMPLES = [
    "Hello world",
    " leading space and  double  spaces ",
    "Emoji 😀🎉👍🏽 and CJK 漢字かな交じり文 mixed with café ☕",
    "line one\nline two\n\ttabbed",
]
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
GEMMA_SPECIALS = ["<unk>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_config(directory, **config):
    """tokenizer_config.json beside a tokenizer, as transformers saves it."""
    config = {"clean_up_tokenization_spaces": False, "tokenizer_class": "PreTrainedTokenizerFast", **config}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def build_byte_bpe(directory, specials=LLAMA3_SPECIALS, chat_template=None):
    """A GPT-2 style byte-level BPE (Llama 3's kind) that adds a BOS."""
    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = specials[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": specials[1]}
    if chat_template is not None:
        config["chat_template"] = chat_template
    write_config(directory, **config)
    return directory / "tokenizer.json"


def build_unigram(directory, chat_template=None):
    """A sentencepiece-like Unigram model over Metaspace ("▁") pieces, Gemma's specials."""
    tok = HfTokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=200, special_tokens=GEMMA_SPECIALS, unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    write_config(directory, **config)
    return directory / "tokenizer.json"


def build_byte_fallback_bpe(directory):
    """A Llama 2 / Gemma style tokenizer.json: "▁" pieces, <0xNN> byte fallback, Strip decoder."""
    tok = HfTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"].update(byte_fallback=True, fuse_unk=True)
    tok = HfTokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    write_config(directory, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return directory / "tokenizer.json"


def build_sentencepiece(directory, name="tokenizer.model"):
    """A sentencepiece BPE model with byte fallback (Llama 2's kind)."""
    import sentencepiece as spm

    directory.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_prefix=str(directory / "sp"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
    )
    path = directory / name
    (directory / "sp.model").rename(path)
    return path


def build_tiktoken(directory, name="tokenizer.model"):
    """A tiktoken file ("<base64 bytes> <rank>" lines), ranks learned by tiktoken's own trainer."""
    from pytorch_tokenizers.constants import CL100K_PAT_STR
    from tiktoken._educational import bpe_train

    ranks = bpe_train(" ".join(CORPUS[:5]) * 4, 300, CL100K_PAT_STR, visualise=None)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    lines = (base64.b64encode(token) + b" %d" % rank for token, rank in by_rank)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


HF_BUILDERS = {"byte_bpe": build_byte_bpe, "unigram": build_unigram, "byte_fallback": build_byte_fallback_bpe}


@pytest.fixture(scope="module", params=sorted(HF_BUILDERS))
def hf_pair(request, tmp_path_factory):
    """(our tokenizer, transformers' AutoTokenizer) over the same tokenizer.json."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp(request.param)
    HF_BUILDERS[request.param](directory)
    return load_tokenizer(directory / "tokenizer.json"), AutoTokenizer.from_pretrained(directory)


def test_hf_encode_decode_match_transformers(hf_pair):
    ours, ref = hf_pair
    assert ours.kind == "huggingface"
    for text in SAMPLES + [f"{ref.bos_token}Hi{ref.eos_token} there"]:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special=True) == ref.encode(text, add_special_tokens=True)
        ids = ours.encode(text, add_special=True)
        assert ours.decode(ids) == ref.decode(ids)


def test_hf_vocab_and_specials_match_transformers(hf_pair):
    ours, ref = hf_pair
    assert ours.vocab_size == len(ref)
    assert (ours.bos_token, ours.bos_id) == (ref.bos_token, ref.bos_token_id)
    assert (ours.eos_token, ours.eos_ids) == (ref.eos_token, (ref.eos_token_id,))
    for token_id in (0, 5, ours.vocab_size - 1):
        token = ref.convert_ids_to_tokens(token_id)
        assert ours.id_to_token(token_id) == token
        assert ours.token_to_id(token) == token_id
    assert ours.token_to_id("definitely not one token") is None
    assert ours.id_to_token(-1) is None and ours.id_to_token(ours.vocab_size) is None


def test_chat_template_and_generation_config_read_from_side_files(tmp_path):
    build_byte_bpe(tmp_path, chat_template=CHATML)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 4]}))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.chat_template == CHATML
    assert tok.token_to_id("<|end_of_text|>") == 1 and tok.token_to_id("<|eot_id|>") == 4
    assert tok.eos_ids == (1, 4)  # eos_token's id first, then generation_config's, once each
    assert tok.bos_id == 0


def test_special_tokens_map_and_template_variants(tmp_path):
    build_unigram(tmp_path)
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    write_config(tmp_path, chat_template=templates)
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": {"content": "<bos>", "lstrip": False}, "eos_token": "<end_of_turn>"})
    )
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.chat_template == "D"
    assert (tok.bos_token, tok.bos_id) == ("<bos>", 1)
    assert (tok.eos_token, tok.eos_ids) == ("<end_of_turn>", (4,))
    (tmp_path / "chat_template.jinja").write_text("J")  # overrides tokenizer_config, as in transformers
    assert load_tokenizer(tmp_path / "tokenizer.json").chat_template == "J"


def test_no_side_files_means_no_specials(tmp_path):
    build_byte_bpe(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    tok = load_tokenizer(tmp_path)  # a directory: its tokenizer.json
    assert (tok.bos_token, tok.bos_id, tok.eos_token, tok.eos_ids) == (None, None, None, ())
    assert tok.chat_template is None


def test_detects_format_by_content_not_name(tmp_path):
    json_path = build_byte_bpe(tmp_path / "a")
    json_path.rename(tmp_path / "a" / "weights.bin")
    assert load_tokenizer(tmp_path / "a" / "weights.bin").kind == "huggingface"
    assert load_tokenizer(build_sentencepiece(tmp_path / "b", name="tok.json")).kind == "sentencepiece"
    assert load_tokenizer(build_tiktoken(tmp_path / "c", name="tokenizer.model")).kind == "tiktoken"


def test_sentencepiece_matches_sentencepiece_and_cpp_loader(tmp_path):
    import sentencepiece as spm
    from pytorch_tokenizers import CppSPTokenizer

    path = build_sentencepiece(tmp_path)
    ours = load_tokenizer(path)
    ref = spm.SentencePieceProcessor(model_file=str(path))
    cpp = CppSPTokenizer()
    cpp.load(str(path))
    assert ours.vocab_size == ref.vocab_size() == cpp.vocab_size()
    assert (ours.bos_id, ours.eos_ids) == (cpp.bos_tok(), (cpp.eos_tok(),))
    assert (ours.bos_token, ours.eos_token) == ("<s>", "</s>")
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ids == ref.encode(text) == cpp.encode(text, 0, 0)
        assert ours.encode(text, add_special=True) == cpp.encode(text, 1, 0)
        assert ours.decode(ids) == ref.decode(ids)
    assert ours.token_to_id("<0xF0>") == ref.piece_to_id("<0xF0>")
    assert ours.id_to_token(ours.token_to_id("▁the")) == "▁the"
    assert ours.token_to_id("no such piece") is None
    assert ours.id_to_token(ours.vocab_size) is None


def test_tiktoken_matches_cpp_loader_and_tiktoken(tmp_path):
    import tiktoken
    from pytorch_tokenizers import CppTiktoken
    from pytorch_tokenizers.constants import CL100K_PAT_STR, LLAMA_SPECIAL_TOKENS
    from tiktoken.load import load_tiktoken_bpe

    path = build_tiktoken(tmp_path)
    ours = load_tokenizer(path)
    cpp = CppTiktoken()
    cpp.load(str(path))
    ranks = load_tiktoken_bpe(str(path))
    specials = {token: len(ranks) + i for i, token in enumerate(LLAMA_SPECIAL_TOKENS)}
    ref = tiktoken.Encoding("ref", pat_str=CL100K_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    assert ours.vocab_size == cpp.vocab_size() == len(ranks) + 256
    assert (ours.bos_id, ours.eos_ids) == (cpp.bos_tok(), (cpp.eos_tok(),))
    assert (ours.bos_token, ours.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    for text in SAMPLES + ["<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text, allowed_special="all")
        assert ours.encode(text, add_special=True) == [ours.bos_id, *ids]
        assert ours.decode(ids) == ref.decode(ids)
        # The C++ loader's regex has no lookahead, so a run of spaces before a
        # word ("a  b") splits differently there; elsewhere it agrees.
        if "  " not in text:
            assert ids == cpp.encode(text, 0, 0)
            assert ours.encode(text, add_special=True) == cpp.encode(text, 1, 0)
    assert ours.token_to_id("<|eot_id|>") == specials["<|eot_id|>"]
    assert ours.id_to_token(specials["<|eot_id|>"]) == "<|eot_id|>"
    assert ours.token_to_id("no such token") is None
    assert ours.id_to_token(-1) is None and ours.id_to_token(10**6) is None


@pytest.mark.parametrize(
    "setup, problem",
    [
        (lambda d: d / "missing.json", "tokenizer file not found"),
        (lambda d: d, "no tokenizer.json or tokenizer.model in"),
        (lambda d: _write(d / "t.json", b'{"bos_token": "<s>"}'), "is JSON but not a tokenizer.json"),
        (lambda d: _write(d / "t.json", b'{"model": '), "is not valid JSON"),
        (lambda d: _write(d / "t.json", b'{"model": {"type": "Nope"}}'), "does not load as a tokenizer.json"),
        (lambda d: _write(d / "t.bin", b"\x00\x01 definitely not a model"), "is not a tokenizer"),
    ],
)
def test_errors_name_the_file_and_problem(tmp_path, setup, problem):
    path = setup(tmp_path)
    with pytest.raises(TextError) as info:
        load_tokenizer(path)
    message = str(info.value)
    assert problem in message and str(path) in message and "\n" not in message


def test_bad_side_file_is_named(tmp_path):
    build_byte_bpe(tmp_path)
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(TextError, match="generation_config.json is not valid JSON"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_unreadable_file_is_named(tmp_path, monkeypatch):
    path = build_byte_bpe(tmp_path)

    def refuse(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(path), "read_bytes", refuse)
    with pytest.raises(TextError, match=f"cannot read tokenizer {path}: Permission denied"):
        load_tokenizer(path)


def test_importing_text_layer_stays_light():
    code = "import sys, llm_executorch_mlx.text; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_loading_a_model_file_keeps_stderr_clean(tmp_path):
    # pytorch_tokenizers' C++ extension logs a line on import; a CLI must not show it.
    path = build_tiktoken(tmp_path)
    code = f"from llm_executorch_mlx.text import load_tokenizer; load_tokenizer({str(path)!r}); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert (out.stdout, out.stderr) == ("ok\n", "")


def _write(path, data):
    path.write_bytes(data)
    return path
