"""Run ExecuTorch .pte programs delegated to MLX, with an off-graph KV cache.

    from llm_executorch_mlx.runtime import load_program
    program = load_program("model.pte")
    program.prepare_cpu_kernels()  # optional: builds the CPU kernels once (~30 s)
    cache = program.new_cache(capacity=1024)
    forward = program.load_method("forward", cache=cache)
    logits = forward.execute([input_ids, cache_position])[0]

Knows .pte files and MLX, nothing of llm or chat. Imports neither torch nor
executorch. Folders, each importing only those below it:

- ``program.py``, ``cache.py``, ``steps.py``: the public objects;
- ``interp/``: the interpreter, its load-time rewrites and the op table;
- ``cpu/``: the BLAS behind MLX, native kernels and fast math for the CPU;
- ``pte/``: the .pte container, its metadata and the MLX graph's decoding;
- ``errors.py``, ``dtypes.py``: leaves every folder uses.
"""

# First: importing runtime.cpu binds MLX's BLAS, which must happen before
# mlx.core is first imported in the process (cpu/blas.py says why).
from . import cpu  # noqa: F401  (isort: skip)

from .cache import LayerGeometry, SequenceCache  # noqa: E402
from .errors import CacheFullError, PteError, UnsupportedNodeError  # noqa: E402
from .program import Method, Program, load_program  # noqa: E402
from .pte.metadata import ModelMetadata  # noqa: E402

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
