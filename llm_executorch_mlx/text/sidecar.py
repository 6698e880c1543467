"""What the files beside a tokenizer say: its special tokens and chat template."""

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import TextError


@dataclass(frozen=True)
class Sidecar:
    """Special tokens and chat template found beside a tokenizer; empty when none are."""

    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None


def read_sidecar(directory: Path) -> Sidecar:
    """Read tokenizer_config.json, special_tokens_map.json, generation_config.json
    and chat_template.jinja / chat_template.json from ``directory``, where present."""
    config = _read_json(directory / "tokenizer_config.json")
    special = _read_json(directory / "special_tokens_map.json")
    generation = _read_json(directory / "generation_config.json")
    eos_ids = generation.get("eos_token_id")
    if isinstance(eos_ids, int):
        eos_ids = [eos_ids]
    bos_id = generation.get("bos_token_id")
    return Sidecar(
        bos_token=_token(config, "bos_token") or _token(special, "bos_token"),
        eos_token=_token(config, "eos_token") or _token(special, "eos_token"),
        bos_token_id=bos_id if isinstance(bos_id, int) else None,
        eos_token_ids=tuple(i for i in eos_ids or () if isinstance(i, int)),
        chat_template=_chat_template(directory, config),
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TextError(f"cannot read {path}: {e.strerror}") from e
    except ValueError as e:
        raise TextError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TextError(f"{path} is not a JSON object")
    return data


def _token(config: dict, key: str) -> str | None:
    # Saved either as the token's text or as a serialized AddedToken.
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(directory: Path, config: dict) -> str | None:
    # transformers lets a chat_template.jinja file override tokenizer_config.json.
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TextError(f"cannot read {jinja}: {e}") from e
    template = config.get("chat_template")
    if template is None:
        template = _read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
