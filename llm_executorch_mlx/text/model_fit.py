"""Whether a tokenizer can belong to a model: what both sides publish agrees.

A wrong tokenizer registers silently and every prompt prints junk, so
``llm pte register`` refuses clear disagreements: a vocabulary larger than
the model's logits, or far smaller than a padded embedding explains (real
models pad to a multiple of 64..1024 ids, or reserve a few percent; less
than half is another model's tokenizer), BOS/EOS ids the file publishes that
the tokenizer does not share, and a chat template whose turn end is not a
token the model can emit.
"""

from __future__ import annotations


def mismatches(metadata, tokenizer, template=None) -> list[str]:
    """What disagrees between a program's ``ModelMetadata`` and a tokenizer
    (and its resolved chat template); empty when they can belong together."""
    found = []
    model_vocab, tok_vocab = metadata.vocab_size, tokenizer.vocab_size
    if model_vocab is not None:
        if tok_vocab > model_vocab:
            found.append(f"the tokenizer has {tok_vocab} tokens but the model only {model_vocab}")
        elif tok_vocab * 2 < model_vocab:
            found.append(
                f"the tokenizer has {tok_vocab} tokens but the model {model_vocab}, "
                "far more than a padded vocabulary explains"
            )
    if metadata.bos_id is not None and tokenizer.bos_id is not None and metadata.bos_id != tokenizer.bos_id:
        found.append(f"the model's BOS id is {metadata.bos_id}, the tokenizer's {tokenizer.bos_id}")
    model_eos, tok_eos = set(metadata.eos_ids), set(tokenizer.eos_ids)
    if model_eos and tok_eos and not model_eos & tok_eos:
        found.append(f"the model's EOS ids are {sorted(model_eos)}, the tokenizer's {sorted(tok_eos)}")
    beyond = sorted(i for i in model_eos | {metadata.bos_id} if i is not None and i >= tok_vocab)
    if beyond:
        found.append(f"the model's special ids {beyond} are not tokens of the tokenizer ({tok_vocab} ids)")
    turn_end = getattr(template, "turn_end", None)
    if turn_end is not None and model_vocab is not None:
        turn_id = tokenizer.token_to_id(turn_end)
        if turn_id is not None and turn_id >= model_vocab:
            found.append(f"the chat template ends turns with {turn_end} (id {turn_id}), past the model's {model_vocab} ids")
    return found
