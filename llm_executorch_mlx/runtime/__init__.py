"""Run ExecuTorch .pte programs delegated to MLX, with an off-graph KV cache.

    from llm_executorch_mlx.runtime import load_program
    program = load_program("model.pte")
    cache = program.new_cache(capacity=1024)
    forward = program.load_method("forward", cache=cache)
    logits = forward.execute([input_ids, cache_position])[0]

Knows .pte files and MLX, nothing of llm or chat. Imports neither torch nor
executorch.
"""

from .blas import load_fast_blas

load_fast_blas()  # before anything imports mlx.core: see blas.py

from .cache import LayerGeometry, SequenceCache
from .errors import CacheFullError, PteError, UnsupportedNodeError
from .metadata import ModelMetadata
from .program import Method, Program, load_program

__all__ = [
    "CacheFullError",
    "LayerGeometry",
    "Method",
    "ModelMetadata",
    "Program",
    "PteError",
    "SequenceCache",
    "UnsupportedNodeError",
    "load_program",
]
