"""Runs an MLX delegate program: the interpreter (``interpreter.py``), the
load-time rewrites it applies (``fusion.py``, ``pairs.py``; ``layout.py``
for the weights' strides) and the op table (``ops/``)."""
