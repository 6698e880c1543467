"""Exporting Hugging Face models (or GGUF files) to MLX .pte files with ExecuTorch's exporter.

A GGUF source is first dequantized into a Hugging Face directory
(``gguf_source.py``), then exported like any other. Needs the ``export`` extra (torch, executorch, transformers). Everything here
imports them lazily, so importing this module is cheap.

The Linux executorch wheels ship the MLX backend's export code without its
generated serialization modules (``mlx_graph_schema.py``,
``_generated_serializers.py``), so ``import executorch.backends.mlx`` fails
until they exist. ``ensure_mlx_export_importable`` runs executorch's own
generator with executorch's own flatc to write them. Its last step renders a
C++ loader from a template the wheel lacks and fails; the Python modules are
written before that, so the failure is harmless and is ignored.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .runtime.errors import PteError

if TYPE_CHECKING:
    from .gguf_source import GgufSummary

_GENERATED = ("mlx_graph_schema.py", "_generated_serializers.py")


def _executorch_root() -> pathlib.Path:
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        raise PteError(
            "exporting needs executorch, torch and transformers: "
            "pip install 'llm-executorch-mlx[export]'"
        )
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def ensure_mlx_export_importable() -> bool:
    """Generate executorch's MLX serialization modules when missing.

    Returns True when it generated them, False when they were already there.
    """
    root = _executorch_root()
    serialization = root / "backends" / "mlx" / "serialization"
    if all((serialization / name).exists() for name in _GENERATED):
        return False
    flatc = root / "data" / "bin" / "flatc"
    generator = serialization / "generate.py"
    if not generator.exists() or not flatc.exists():
        raise PteError(
            f"this executorch ({root}) has no MLX backend export code to set up; "
            "install executorch==1.5.1"
        )
    result = subprocess.run(
        [sys.executable, str(generator), "--flatc", str(flatc)],
        capture_output=True,
        text=True,
        cwd=serialization,
    )
    missing = [name for name in _GENERATED if not (serialization / name).exists()]
    if missing:
        raise PteError(
            f"could not generate executorch's MLX serialization modules ({', '.join(missing)}): "
            + (result.stderr.strip().splitlines() or ["no output"])[-1]
        )
    return True


def export_hf_model(
    model_dir: str | os.PathLike,
    output: str | os.PathLike,
    *,
    dtype: str = "bf16",
    qlinear: str | None = None,
    qembedding: str | None = None,
    group_size: int | None = None,
    max_ctx_len: int = 1024,
    prefill_chunk: int | None = None,
) -> None:
    """Export a local Hugging Face causal LM with the off-graph cache.

    Produces the same program as ExecuTorch's
    ``export_llm_hf --use-offgraph-cache``.
    """
    ensure_mlx_export_importable()
    from executorch.backends.mlx.examples.llm.export_llm_hf import export_llama_hf

    export_llama_hf(
        model_id=str(model_dir),
        revision=None,
        output_path=str(output),
        max_ctx_len=max_ctx_len,
        dtype=dtype,
        qlinear=qlinear,
        qembedding=qembedding,
        use_offgraph_cache=True,
        qlinear_group_size=group_size,
        qembedding_group_size=group_size,
        prefill_chunk_size=prefill_chunk,
    )


# -- `llm pte export`: checks, progress, a verified file, tokenizer files ------

INSTALL_HINT = "pip install 'llm-executorch-mlx[export]'"
EXPORT_MODULES = ("torch", "transformers", "executorch")
GGUF_MODULES = ("gguf", "accelerate")  # transformers' GGUF reader
DTYPES = ("bf16", "fp16", "fp32")
QUANT_CONFIGS = ("4w", "8w")
GROUP_SIZES = (32, 64, 128)
DEFAULT_MAX_CTX_LEN = 1024
DEFAULT_PREFILL_CHUNK = 512  # export_llm_hf's default, clamped to the context and window
# The files the text layer reads beside a tokenizer (see text/sidecar.py).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
SIDECAR_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


class ExportError(Exception):
    """An export refused or failed; the message is one line saying why."""


def missing_export_modules() -> list[str]:
    return [name for name in EXPORT_MODULES if importlib.util.find_spec(name) is None]


def check_export_dependencies(gguf: bool = False) -> None:
    missing = missing_export_modules()
    if gguf:
        missing += [name for name in GGUF_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"exporting needs {', '.join(missing)}: {INSTALL_HINT}")


@dataclass
class SourceInfo:
    """What a Hugging Face model directory holds, read from config.json alone."""

    path: pathlib.Path
    model_type: str
    architecture: str
    layer_types: list[str]
    windows: list[int]  # per cache layer: sliding window, 0 = full attention
    tokenizer: pathlib.Path | None
    sidecars: list[pathlib.Path]

    @property
    def min_window(self) -> int | None:
        sliding = [w for w in self.windows if w > 0]
        return min(sliding) if sliding else None


def inspect_source(source: str | os.PathLike) -> SourceInfo:
    """Check that ``source`` is a local causal LM transformers can load."""
    path = pathlib.Path(source).expanduser().absolute()
    if not path.exists():
        raise ExportError(f"no such directory: {path}")
    if not path.is_dir():
        raise ExportError(
            f"{path} is neither a directory nor a GGUF file: pass a Hugging Face model directory "
            "(config.json + weights) or a .gguf file"
        )
    if not (path / "config.json").is_file():
        raise ExportError(f"{path} has no config.json: not a Hugging Face model directory")
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError, TypeError) as e:
        model_type = _json_field(path / "config.json", "model_type")
        if model_type is not None:
            raise ExportError(
                f"{path}: transformers {transformers.__version__} does not know the model type "
                f"{model_type!r}: not a causal language model it can load"
            ) from None
        raise ExportError(f"{path}/config.json is unusable: {_one_line(e)}") from None
    model_type = getattr(config, "model_type", None) or "?"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ExportError(
            f"{path} holds a {model_type!r} model, which is not a causal language model "
            "(transformers has no AutoModelForCausalLM class for it)"
        )
    weights = [p for p in path.iterdir() if p.suffix == ".safetensors" or p.name.startswith("pytorch_model")]
    if not weights:
        raise ExportError(f"{path} has no weights (*.safetensors or pytorch_model*.bin)")
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None)
    n_layers = getattr(text, "num_hidden_layers", None) or 0
    sliding_window = getattr(text, "sliding_window", None)
    if layer_types is None:
        # as executorch's resolve_hf_cache_layout: a window without layer types slides everywhere
        layer_types = ["sliding_attention" if sliding_window is not None else "full_attention"] * n_layers
    layer_types = list(layer_types)
    shared = getattr(text, "num_kv_shared_layers", None)
    if shared:
        layer_types = layer_types[:-shared]
    windows = [(sliding_window or 0) if t == "sliding_attention" else 0 for t in layer_types]
    architecture = (getattr(config, "architectures", None) or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]])[0]
    tokenizer = next((path / n for n in TOKENIZER_FILES if (path / n).is_file()), None)
    sidecars = [path / n for n in SIDECAR_FILES if (path / n).is_file()]
    return SourceInfo(path, model_type, architecture, layer_types, windows, tokenizer, sidecars)


def resolve_prefill_chunk(requested: int | None, max_ctx_len: int, window: int | None) -> int:
    """The largest step the export traces; as executorch's, with our wording.

    Left out, it is 512 clamped to the context and the narrowest sliding window.
    """
    if max_ctx_len < 1:
        raise ExportError(f"--max-ctx-len must be at least 1, not {max_ctx_len}")
    ceiling = min(max_ctx_len, window) if window else max_ctx_len
    if requested is None:
        return min(DEFAULT_PREFILL_CHUNK, ceiling)
    if requested < 1:
        raise ExportError(f"--prefill-chunk must be at least 1, not {requested}")
    if requested > max_ctx_len:
        raise ExportError(f"--prefill-chunk {requested} is larger than the context (--max-ctx-len {max_ctx_len})")
    if window and requested > window:
        raise ExportError(
            f"--prefill-chunk {requested} is larger than the model's sliding window ({window}): "
            f"use at most {window}"
        )
    return requested


@dataclass
class ExportResult:
    path: pathlib.Path
    file_bytes: int
    seconds: float
    architecture: str
    windows: list[int]
    max_context: int
    prefill_chunk: int
    dtype: str
    qlinear: str | None
    qembedding: str | None
    group_size: int | None
    tokenizer: pathlib.Path | None  # the copy beside the .pte
    copied: list[str] = field(default_factory=list)
    generated_modules: bool = False
    gguf: "GgufSummary | None" = None  # the GGUF file exported, when the source was one

    @property
    def gguf_note(self) -> str | None:
        """How the GGUF's stored weights became this file's, when they were quantized."""
        if self.gguf is None or not self.gguf.quantized_types:
            return None
        stored = "/".join(self.gguf.quantized_types)
        if self.qlinear or self.qembedding:
            return (f"its {stored} weights were dequantized, then re-quantized to {self.quantization}: "
                    f"close to, not the same as, the GGUF's own {stored} values")
        return f"its {stored} weights were dequantized: this {self.dtype} file holds their values at full width"

    @property
    def quantization(self) -> str:
        parts = []
        for what, q in (("linear", self.qlinear), ("embedding", self.qembedding)):
            if q:
                parts.append(f"{what} {q}" + (f" (group {self.group_size})" if self.group_size else ""))
        return ", ".join(parts) or "none"


def _make_directory(directory: pathlib.Path) -> list[pathlib.Path]:
    """Make ``directory`` and its missing parents; return those it made, deepest first."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot make the output's directory {directory}: {e.strerror} ({e.filename})") from None
    return missing


def _remove_directories(made: list[pathlib.Path]) -> None:
    """Undo ``_make_directory`` after a failed export (only directories left empty)."""
    for d in made:
        with contextlib.suppress(OSError):
            d.rmdir()


def plan_tokenizer_copies(info: SourceInfo, output: pathlib.Path, force: bool):
    """What to do beside ``output``: ``(copies, stale)``, the (source,
    destination) pairs of tokenizer files to copy there, and files there the
    source lacks, which the text layer would read as this model's. Both are
    refused unless ``force`` (then stale files are removed)."""
    own = ([info.tokenizer] if info.tokenizer else []) + info.sidecars
    pairs = [(f, output.parent / f.name) for f in own]
    for src, dst in pairs:
        if dst.exists() and not force and not _same_file_content(src, dst):
            raise ExportError(f"{dst} exists and differs from {src}: use --force to replace it, or another output directory")
    names = {f.name for f in own}
    stale = [output.parent / n for n in SIDECAR_FILES
             if n not in names and (output.parent / n).is_file()]
    if info.tokenizer is None:
        stale = []  # nothing of ours to pair them with: leave them alone
    if stale and not force:
        raise ExportError(
            f"{stale[0]} is beside the output but not in {info.path}, and would be read as this model's: "
            "use --force to remove it, or another output directory"
        )
    return [(s, d) for s, d in pairs if s.resolve() != d.resolve()], stale


def export_model(
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    dtype: str = "bf16",
    qlinear: str | None = None,
    qembedding: str | None = None,
    group_size: int | None = None,
    max_ctx_len: int = DEFAULT_MAX_CTX_LEN,
    prefill_chunk: int | None = None,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
    verbose: bool = False,
) -> ExportResult:
    """Export ``source`` (a local HF causal LM directory, or a GGUF file) to
    ``output``, checked, atomically.

    The program is executorch's ``export_llm_hf --use-offgraph-cache``; this adds
    the checks, progress, a load test of the result through our runtime, and
    the tokenizer files beside it. A GGUF file is dequantized into a temporary
    Hugging Face directory first. Raises ``ExportError`` with a one-line message;
    on any failure no file is left at ``output`` (nor a temporary one).
    """
    started = time.monotonic()

    def say(message: str) -> None:
        if progress is not None:
            progress(f"[{time.monotonic() - started:5.1f}s] {message}")

    from .gguf_source import is_gguf

    gguf = is_gguf(source)
    check_export_dependencies(gguf=gguf)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    for flag, q in (("--qlinear", qlinear), ("--qembedding", qembedding)):
        if q is not None and q not in QUANT_CONFIGS:
            raise ExportError(f"{flag} must be one of {', '.join(QUANT_CONFIGS)}, not {q!r}")
    if group_size is not None and group_size not in GROUP_SIZES:
        raise ExportError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, not {group_size}")
    output = pathlib.Path(output).expanduser().resolve()
    if output.is_dir():
        raise ExportError(f"{output} is a directory: pass the path of the .pte file to write")
    if output.exists() and not force:
        raise ExportError(f"{output} exists: use --force to replace it")
    if not gguf:
        return _export(source, output, dtype=dtype, qlinear=qlinear, qembedding=qembedding,
                       group_size=group_size, max_ctx_len=max_ctx_len, prefill_chunk=prefill_chunk,
                       force=force, say=say, verbose=verbose, started=started)
    from .gguf_source import GgufError, convert_to_hf, read_summary

    try:
        summary = read_summary(source)
        say(f"reading {summary.path.name}: {summary.architecture}, {summary.storage}")
        with tempfile.TemporaryDirectory(prefix="llm-pte-gguf-") as staging:
            say("dequantizing to a Hugging Face directory with transformers' GGUF reader")
            with quiet_libraries():
                convert_to_hf(summary.path, staging)
            result = _export(staging, output, dtype=dtype, qlinear=qlinear, qembedding=qembedding,
                             group_size=group_size, max_ctx_len=max_ctx_len, prefill_chunk=prefill_chunk,
                             force=force, say=say, verbose=verbose, started=started,
                             label=f"the dequantized {summary.path.name}")
    except GgufError as e:
        raise ExportError(str(e)) from None
    result.gguf = summary
    return result


def _export(source, output, *, dtype, qlinear, qembedding, group_size, max_ctx_len, prefill_chunk,
            force, say, verbose, started, label=None) -> ExportResult:
    """The export proper, from a Hugging Face directory; ``label`` names it in progress lines."""
    info = inspect_source(source)
    chunk = resolve_prefill_chunk(prefill_chunk, max_ctx_len, info.min_window)
    copies, stale = plan_tokenizer_copies(info, output, force)
    made = _make_directory(output.parent)

    try:
        generated = ensure_mlx_export_importable()
    except PteError as e:
        raise ExportError(str(e)) from None
    if generated:
        say(
            "set up executorch's MLX exporter: generated its missing serialization modules "
            f"({', '.join(_GENERATED)}) with its own flatc, once for this install"
        )
    say(f"loading {info.architecture} from {label or info.path} as {dtype}")
    try:
        fd, tmp_name = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".partial")
    except OSError as e:
        _remove_directories(made)
        raise ExportError(f"cannot write in {output.parent}: {e.strerror}") from None
    os.close(fd)
    tmp = pathlib.Path(tmp_name)
    capture = _ExporterLog(say, dtype=dtype, chunk=chunk)
    done = False
    try:
        try:
            with capture.active(verbose):
                export_hf_model(
                    info.path, tmp, dtype=dtype, qlinear=qlinear, qembedding=qembedding,
                    group_size=group_size, max_ctx_len=max_ctx_len, prefill_chunk=chunk,
                )
        except (ExportError, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001  torch, transformers and executorch raise anything
            raise ExportError(capture.failure(info, e)) from None
        say("checking the program loads and runs here")
        metadata = _verify(tmp, capture, info)
        make_readable(tmp)
        for path in stale:
            path.unlink()
        for src, dst in copies:
            shutil.copyfile(src, dst)
        os.replace(tmp, output)
        done = True
    finally:
        tmp.unlink(missing_ok=True)
        if not done:
            _remove_directories(made)
    tokenizer = output.parent / info.tokenizer.name if info.tokenizer else None
    return ExportResult(
        path=output,
        file_bytes=output.stat().st_size,
        seconds=time.monotonic() - started,
        architecture=info.architecture,
        windows=list(metadata.windows),
        max_context=metadata.max_context or max_ctx_len,
        prefill_chunk=metadata.prefill_chunk or chunk,
        dtype=dtype,
        qlinear=qlinear,
        qembedding=qembedding,
        group_size=group_size,
        tokenizer=tokenizer,
        copied=[dst.name for _, dst in copies],
        generated_modules=generated,
    )


def _verify(path: pathlib.Path, capture: "_ExporterLog", info: SourceInfo):
    """Load the new file with our runtime: one MLX delegate using the off-graph cache."""
    from .runtime import load_program

    try:
        program = load_program(path)
        plan = program._plan("forward")
        if plan.kernel_calls or len(plan.delegates) != 1:
            if capture.unsupported:
                raise ExportError(capture.not_delegated(info))
            raise ExportError(
                f"the MLX partitioner left {plan.kernel_calls} operator calls of {info.architecture} "
                f"outside MLX ({len(plan.delegates)} delegates): this runtime runs fully delegated programs"
            )
        if _cache_ops(plan) == 0 or not program.metadata.has_offgraph_cache:
            raise ExportError(
                f"{info.architecture}'s attention was not replaced by the off-graph KV cache op "
                "(kvcache::update_and_attend): it does not go through transformers' attention "
                "interface, so it cannot be exported this way"
            )
        program.load_method("forward", cache=program.new_cache(capacity=1))
        return program.metadata
    except PteError as e:
        if capture.unsupported:
            raise ExportError(capture.not_delegated(info)) from None
        raise ExportError(f"the exported {info.architecture} does not run here: {_one_line(e)}") from None


def _cache_ops(plan) -> int:
    """How many UpdateAndAttend nodes the MLX program holds."""
    from .runtime.pte.graph import decode_graph, node_name

    return sum(
        node_name(i) == "UpdateAndAttendNode"
        for d in plan.delegates
        if d.backend_id == "MLXBackend"
        for chain in decode_graph(d.payload).instructionChains
        for i in chain.instructions or []
    )


class _ExporterLog(logging.Handler):
    """Turns executorch's exporter log into progress lines and remembers what
    the MLX partitioner could not delegate; keeps the rest off the terminal."""

    STEPS = (
        ("Exporting model with torch.export", "exporting the graph with torch.export (steps of 1..{chunk} tokens)"),
        ("Delegating to MLX backend", "lowering to MLX (partitioning and serializing the MLX graph)"),
        ("Exporting to ExecuTorch", "writing the ExecuTorch program"),
    )
    UNSUPPORTED = re.compile(r"\[UNSUPPORTED x(\d+)\]\s+(.+)")
    EDGE_OP = re.compile(r"<EdgeOpOverload: ([^>\s]+)>")
    QUANTIZING = re.compile(r"Applying (\S+) (linear|embedding) quantization \(group_size=(\d+)")

    def __init__(self, say: Callable[[str], None], dtype: str, chunk: int):
        super().__init__(logging.DEBUG)
        self.say = say
        self.chunk = chunk
        self.unsupported: dict[str, tuple[int, str]] = {}
        self._last_target: str | None = None
        self._stdout = ""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._line(record.getMessage())
        except Exception:  # noqa: BLE001  a log line must never break the export
            pass

    def _line(self, message: str) -> None:
        for marker, text in self.STEPS:
            if marker in message:
                self.say(text.format(chunk=self.chunk))
                return
        m = self.UNSUPPORTED.search(message)
        if m:
            target = m.group(2).strip()
            edge = self.EDGE_OP.search(target)
            target = edge.group(1) if edge else target.split()[0]
            self._last_target = target
            self.unsupported[target] = (int(m.group(1)), "")
            return
        if self._last_target and message.strip().startswith("Reason:"):
            count, _ = self.unsupported[self._last_target]
            self.unsupported[self._last_target] = (count, message.strip()[len("Reason:"):].strip())
            self._last_target = None
            return
        m = self.QUANTIZING.search(message)
        if m:
            self.say(f"quantizing {m.group(2)} layers to {m.group(1)} (group size {m.group(3)})")

    # print() from executorch's quantizer goes through here too
    def write(self, text: str) -> int:
        self._stdout += text
        *lines, self._stdout = self._stdout.split("\n")
        for line in lines:
            self._line(line)
        return len(text)

    def flush(self) -> None:
        pass

    @contextlib.contextmanager
    def active(self, verbose: bool):
        if verbose:  # let executorch set up its own log handler before we add ours
            importlib.import_module("executorch.backends.mlx._logging")
        loggers = [logging.getLogger(), logging.getLogger("executorch.backends.mlx")]
        saved = [(lg, lg.handlers[:], lg.level) for lg in loggers]
        try:
            for lg in loggers:
                lg.handlers = (lg.handlers if verbose else []) + [self]
            logging.getLogger("executorch.backends.mlx").setLevel(logging.INFO)
            with contextlib.ExitStack() as stack:
                if not verbose:
                    stack.enter_context(quiet_libraries())
                    stack.enter_context(contextlib.redirect_stdout(self))
                yield
        finally:
            for lg, handlers, level in saved:
                lg.handlers = handlers
                lg.setLevel(level)

    def not_delegated(self, info: SourceInfo) -> str:
        ops = ", ".join(
            f"{target} x{count}" + (f" ({reason})" if reason and reason != "No handler registered" else "")
            for target, (count, reason) in sorted(self.unsupported.items())
        )
        return f"the MLX partitioner could not delegate every operator of {info.architecture}: {ops}"

    def failure(self, info: SourceInfo, e: BaseException) -> str:
        if self.unsupported:
            return self.not_delegated(info) + f"; then: {_one_line(e)}"
        return f"could not export {info.architecture}: {type(e).__name__}: {_one_line(e)}"


@contextlib.contextmanager
def quiet_libraries():
    """Keep torch's, torchao's and transformers' warnings (some at import time)
    and progress bars off the terminal; restores everything after."""
    import torch  # noqa: F401  importing torch resets the "torch" logger's level
    from transformers.utils import logging as hf_logging

    saved = [(lg, lg.level) for lg in map(logging.getLogger, ("torch", "torchao", "transformers", "executorch"))]
    bars = hf_logging.is_progress_bar_enabled()
    try:
        hf_logging.disable_progress_bar()
        for lg, _ in saved:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in saved:
            lg.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


def make_readable(path) -> None:
    """Give a file made by ``mkstemp`` (private) the permissions a plain
    ``open`` would have given it under this umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _json_field(path: pathlib.Path, key: str):
    try:
        value = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _same_file_content(a: pathlib.Path, b: pathlib.Path) -> bool:
    try:
        return a.read_bytes() == b.read_bytes()
    except OSError:
        return False
