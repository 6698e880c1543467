"""llm plugin for ExecuTorch .pte models exported for MLX.

llm imports every plugin on every command, so this module stays cheap:
the registry is a small JSON file, and mlx, the runtime and the text layer
are imported only when a model runs or a `llm pte` command needs them. The
runtime (``llm_executorch_mlx.runtime``) also works without llm installed.
"""

from .distributed import guard_stdin, launched

if launched():  # one rank of an mlx.launch group: llm must not wait on stdin
    guard_stdin()

try:
    from pluggy import HookimplMarker

    hookimpl = HookimplMarker("llm")
except ImportError:  # the runtime used on its own, without llm

    def hookimpl(function):
        return function


@hookimpl
def register_models(register):
    from .async_model import AsyncPteModel
    from .plugin import PteModel
    from .registry import load_entries

    for entry in load_entries().values():
        register(PteModel(entry), AsyncPteModel(entry), aliases=entry.aliases)


@hookimpl
def register_commands(cli):
    from .commands import register_commands as add

    add(cli)
    if launched():  # the llm command line on one rank of a group: rank 0 alone prints
        from .distributed import quiet_other_ranks

        quiet_other_ranks()
