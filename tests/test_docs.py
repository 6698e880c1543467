"""The docs against the code: the README's options and environment tables,
and the options, flags and commands README.md and docs/*.md name.

Cheap: reads text and options.py, loads no model and imports no mlx.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from llm_executorch_mlx.options import OPTIONS

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
PACKAGE_SOURCES = sorted((ROOT / "llm_executorch_mlx").rglob("*.py"))


def table_after(text: str, heading: str) -> list[list[str]]:
    """The body rows of the first Markdown table under ``heading``, each a
    list of cells (``\\|`` read as ``|``)."""
    start = text.index(f"\n{heading}\n")
    rows, seen = [], False
    for line in text[start:].splitlines()[2:]:
        if line.startswith("## "):
            break
        if not line.startswith("|"):
            if seen:
                break
            continue
        seen = True
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if not set("".join(cells)) <= set("-: "):  # the header's separator row
            rows.append(cells)
    return rows[1:]  # the header row


def code(cell: str) -> list[str]:
    """The `code` spans in a cell."""
    return re.findall(r"`([^`]+)`", cell)


def options_table(text: str) -> dict[str, list[str]]:
    rows = table_after(text, "## Options")
    names = [code(r[0])[0] for r in rows]
    assert len(names) == len(set(names)), "an option is listed twice"
    return dict(zip(names, rows))


def type_name(t) -> str:
    return t.__name__ if isinstance(t, type) else str(t)


def default_matches(cell: str, default) -> bool:
    """A default in code (`...`) is the value; one in words is decided when
    the turn runs, which the code says with None."""
    if default is None:
        return not cell.startswith("`")
    if not cell.startswith("`"):
        return False
    written = code(cell)[0]
    if isinstance(default, bool):
        return written == json.dumps(default)
    if isinstance(default, (int, float)):
        try:
            return float(written) == default
        except ValueError:
            return False
    if isinstance(default, (tuple, list)):
        try:
            return json.loads(written) == list(default)
        except ValueError:
            return False
    return written == default


def test_the_readme_options_table_lists_every_option_with_its_type_and_default():
    table = options_table(README.read_text())
    assert list(table) == list(OPTIONS), "the table must list options.py's options, in its order"
    for name, option in OPTIONS.items():
        _, typ, default, what = table[name]
        assert code(typ) == [type_name(option.type)], f"{name}: type {typ!r}, options.py says {type_name(option.type)}"
        assert default_matches(default, option.default), f"{name}: default {default!r}, options.py says {option.default!r}"
        allowed = set(option.choices) | set(option.aliases)
        missing = allowed - set(code(what))
        assert not missing, f"{name}: the table does not name its values {sorted(missing)}"


def test_every_o_option_the_docs_name_exists():
    for path in DOCS:
        for name in re.findall(r"(?<![\w-])-o ([a-z][a-z0-9_]*)(?=[\s`])", path.read_text()):
            assert name in OPTIONS, f"{path.name} names -o {name}, which options.py does not define"


def quoted_in(sources: list[pathlib.Path], name: str) -> bool:
    pattern = re.compile(rf"""["']{re.escape(name)}["']""")
    return any(pattern.search(p.read_text()) for p in sources)


def env_table() -> list[str]:
    rows = table_after(README.read_text(), "## Environment variables")
    return [name for r in rows for name in code(r[0])]


def test_every_environment_variable_in_the_readme_table_is_read_by_the_code():
    names = env_table()
    assert names
    for name in names:
        assert quoted_in(PACKAGE_SOURCES, name), f"README names {name}, which no package source spells as a string"


def test_every_llm_pte_flag_the_code_reads_is_in_the_readme_table():
    read = {m for p in PACKAGE_SOURCES for m in re.findall(r"""["'](LLM_PTE_[A-Z0-9_]+)["']""", p.read_text())}
    assert read
    assert read <= set(env_table()), f"not in the README's table: {sorted(read - set(env_table()))}"


def test_every_llm_pte_flag_the_docs_name_is_in_the_readme_table():
    table = set(env_table())
    for path in DOCS:
        for name in set(re.findall(r"\bLLM_PTE_[A-Z0-9_]+", path.read_text())):
            assert name in table, f"{path.name} names {name}, which the README's table does not list"


def commands(text: str) -> list[str]:
    """Each line of a fenced block, and each inline code span (whitespace
    joined), in ``text``."""
    found = []
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    for block in blocks:
        found += block.splitlines()
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", rest)]
    return found


def flags_after(command: str, start: int) -> list[str]:
    """The ``--flags`` of the command that begins at ``start``, up to a
    shell operator."""
    tail = re.split(r"&&|;|\|(?!\|)|\)", command[start:])[0]
    return [t.split("=")[0] for t in tail.split() if t.startswith("--") and len(t) > 2]


@pytest.mark.parametrize("folder", ["benchmarks", "scripts"])
def test_every_script_the_docs_run_exists_and_takes_the_flags_given(folder):
    sources = sorted((ROOT / folder).glob("*.py"))
    checked = 0
    for path in DOCS:
        for command in commands(path.read_text()):
            for m in re.finditer(rf"\b{folder}/(\w+\.py)", command):
                assert (ROOT / folder / m.group(1)).is_file(), f"{path.name}: {folder}/{m.group(1)} does not exist"
                for flag in flags_after(command, m.end()):
                    assert quoted_in(sources, flag), f"{path.name}: {m.group(1)} takes no {flag} (`{command}`)"
                    checked += 1
    assert checked or folder == "scripts"


def test_every_llm_pte_command_the_docs_run_takes_the_flags_given():
    sources = [ROOT / "llm_executorch_mlx" / name for name in ("commands.py", "export_command.py")]
    text = "".join(p.read_text() for p in sources)
    for path in DOCS:
        for command in commands(path.read_text()):
            for m in re.finditer(r"\bllm pte (\w+)", command):
                assert re.search(rf"""name=["']{m.group(1)}["']""", text), f"{path.name}: no `llm pte {m.group(1)}`"
                for flag in flags_after(command, m.end()):
                    assert re.search(rf"""["/]{re.escape(flag)}["/]""", text), \
                        f"{path.name}: llm pte {m.group(1)} takes no {flag} (`{command}`)"
