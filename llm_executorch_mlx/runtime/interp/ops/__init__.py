"""The MLX node kinds the interpreter runs, one module per family of ops.

Importing the package fills ``BUILDERS`` (``table.py``): each module
registers its builders with ``@op``.
"""

from . import attention, control, creation, elementwise, nn, quant, reduce, scalar, shape  # noqa: F401
from .table import BUILDERS

__all__ = ["BUILDERS"]
