"""The text layer: tokenizers, chat templates, sampling, stops, and the chat turn that uses them."""

from .. import runtime  # noqa: F401  (binds a fast CPU BLAS before mlx.core loads)

from .detokenize import StreamDecoder
from .errors import TextError
from .sampling import Sampler
from .stops import StopMatcher
from .templates import TEMPLATE_NAMES, ChatTemplate, resolve_template
from .tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "TEMPLATE_NAMES",
    "ChatTemplate",
    "Sampler",
    "StopMatcher",
    "StreamDecoder",
    "TextError",
    "Tokenizer",
    "load_tokenizer",
    "resolve_template",
]
