"""Kernel source as MLX is handed it.

MLX builds a custom kernel's whole source (header, signature, body) and
hashes it at every call, not once per kernel, so each byte of it costs the
host time at every launch of a decode step. The source in this package is
written for its readers; what MLX gets is the same code without its
comments and indentation.
"""

from __future__ import annotations


def compact(source: str) -> str:
    """``source`` without ``//`` comments, indentation and blank lines (a
    line at a time: preprocessor lines stay lines). The kernels' sources
    hold no ``//`` inside a string literal."""
    lines = (line.split("//", 1)[0].strip() for line in source.splitlines())
    return "\n".join(line for line in lines if line)
