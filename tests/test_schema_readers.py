"""The committed flatbuffer readers are what the installed executorch's schemas compile to."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_committed_readers_match_the_installed_executorch_schemas():
    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts" / "generate_schema_readers.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for module, source in gen.generate(gen.OUT).items():
        committed = (gen.OUT / module).read_text()
        assert committed == source, (
            f"{module} is stale: run python scripts/generate_schema_readers.py"
        )
