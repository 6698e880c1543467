"""What a process keeps between turns, per model file.

Programs and tokenizers are loaded once and reused while their file is
unchanged (same path, modification time and size). Per loaded program the
process also keeps its sessions (caches), as a model and as a draft, the
ids of the replies it generated and the cuts truncation made; when the file
changes, it is loaded again and all that the old program held is freed.
"""

from __future__ import annotations

import os

from .. import distributed
from ..runtime import load_program
from .conversation import ReplyMemory
from .session import SessionPool
from .tokenizer import load_tokenizer
from .truncation import Truncation

POOL = SessionPool()
DRAFTS = SessionPool()  # draft models' sessions (-o draft MODEL), apart from the models they draft for
REPLIES = ReplyMemory()
TRUNCATIONS = Truncation()
_programs: dict = {}
_tokenizers: dict = {}


def file_key(path: str) -> tuple:
    st = os.stat(path)
    return (os.path.abspath(path), st.st_mtime_ns, st.st_size)


def get_program(path: str, compute: str = "auto", int8_activations: bool = True, bf16_activations: bool = True):
    """(key, program) for ``path``: the loaded program, reused while the file is unchanged."""
    key = file_key(path) + (compute, int8_activations, bf16_activations)
    if key not in _programs:
        for old in [k for k in _programs if k[0] == key[0]]:
            # the file changed: free the old program and all that refers to it
            del _programs[old]
            POOL.drop(old)
            DRAFTS.drop(old)
            REPLIES.drop(old)
            TRUNCATIONS.drop(old)
        program = load_program(path, compute=compute, int8_activations=int8_activations,
                               bf16_activations=bf16_activations)
        program.prepare_cpu_kernels()  # builds them at the first generation, before a method loads
        group = distributed.group()
        if group is not None:  # one rank of an mlx.launch group: its share only
            program = distributed.share(program, group)
        _programs[key] = program
    return key, _programs[key]


def get_tokenizer(path: str):
    """The tokenizer of ``path``, reused while the file is unchanged."""
    key = file_key(path)
    if key not in _tokenizers:
        _tokenizers[key] = load_tokenizer(path)
    return _tokenizers[key]
