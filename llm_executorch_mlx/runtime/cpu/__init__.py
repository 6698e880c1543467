"""What runs a program's work on the CPU: the BLAS behind MLX, native kernels, fast math.

- ``blas.py`` binds an optimized BLAS for MLX, behind ``sgemm_route.c``
  (one-row products to sgemv) where it can be built;
- ``extension.py`` builds and loads the C++ extension: fused attention
  (``attention.cpp``) and the GEMV shared with the host thread (``gemv.cpp``);
- ``selection.py``'s ``kernels()`` says which of them this machine offers
  (a program's plan, ``runtime/plan.py``, picks from them);
- ``extension_ops.py`` wraps the extension's ops as drop-ins for MLX's, each
  handing what its kernel does not take to a fallback;
- ``native.py`` compiles native code into the cache; ``fastmath.py`` holds
  MLX-op versions of exp, attention and SwiGLU that the CPU runs fast.

Importing this package binds the BLAS, before the modules below import
mlx.core: it must precede the process's first ``import mlx.core``
(``blas.py`` says why it is done at import).
"""

from .blas import load_fast_blas

load_fast_blas()  # first: the imports below load mlx.core

from .selection import (  # noqa: E402
    ATTENTION_FLAG, KERNELS_FLAG, PRODUCTS_FLAG, CpuKernels, Limits, Use, kernels,
)

__all__ = ["ATTENTION_FLAG", "KERNELS_FLAG", "PRODUCTS_FLAG", "CpuKernels", "Limits", "Use", "kernels",
           "load_fast_blas"]
