"""The text layer's error type."""


class TextError(Exception):
    """A tokenizer, its side files or a chat template is unusable; the message says why."""
