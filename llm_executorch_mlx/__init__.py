"""llm plugin for ExecuTorch .pte models exported for MLX.

llm imports every plugin on every command, so this module stays cheap:
the registry is a small JSON file, and mlx, the runtime and the text layer
are imported only when a model runs or a `llm pte` command needs them.
"""

import llm

from .registry import load_entries


@llm.hookimpl
def register_models(register):
    from .plugin import PteModel

    for entry in load_entries().values():
        register(PteModel(entry), aliases=entry.aliases)


@llm.hookimpl
def register_commands(cli):
    from .commands import register_commands as add

    add(cli)
