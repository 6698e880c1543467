"""Exporting Hugging Face models to MLX .pte files with ExecuTorch's exporter.

Needs the ``export`` extra (torch, executorch, transformers). Everything here
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

import importlib.util
import os
import pathlib
import subprocess
import sys

from .runtime.errors import PteError

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
