"""What the benchmarks share, so each script keeps only what is its own.

- ``cli``: the command-line flags several scripts take;
- ``models``: seeded random Llamas and our exports of them, cached;
- ``machine``: the BLAS bound into MLX, and what the numbers depend on;
- ``engines``: ours, mlx-lm and llama.cpp on the same weights;
- ``timing``: one timing of a generation for every engine;
- ``report``: median [min–max] of figures and per-repetition ratios, tables.

Nothing here imports mlx when imported: a script lets the runtime bind MLX's
BLAS first (``machine.bind_blas_and_import_mlx``).
"""
