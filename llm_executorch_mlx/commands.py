"""`llm pte ...`: register, list, inspect and remove .pte models."""

from __future__ import annotations

import contextlib
import datetime
import json
import pathlib

import click

from .export_command import add_export_commands
from .mlx_backend import require_for_command
from .options import OPTIONS
from .registry import (
    MODEL_PREFIX, NAME_RE, Entry, RegistryError, editing, find_entry, layers_text, load_entries,
)



def _load(path: str):
    require_for_command()
    from .runtime import PteError, load_program

    try:
        return load_program(path)
    except PteError as e:
        raise click.ClickException(str(e)) from None


def _kv_bytes_per_token(kv_heads: list[int], head_dims: list[int]) -> dict[str, int]:
    """K+V bytes a token takes in every storage this model's heads allow
    (``-o kv_storage_dtype``), and with int8 keys and int4 values."""
    from .runtime.errors import PteError
    from .runtime.kv_storage import STORAGES

    def per_token(keys: str, values: str) -> int:
        return round(sum(h * d * (STORAGES[keys].bytes_per_value(d) + STORAGES[values].bytes_per_value(d))
                         for h, d in zip(kv_heads, head_dims)))

    found = {}
    for keys, values in [(name, name) for name in STORAGES] + [("int8", "int4")]:
        try:
            found[keys if keys == values else f"{keys}/{values}"] = per_token(keys, values)
        except PteError:  # a quantized storage whose groups do not divide the heads
            pass
    return found


def _runtime_facts() -> dict:
    """Where this machine runs a program: MLX's device and, on a CPU, the
    BLAS bound and the plan a program loaded now would follow
    (``runtime/plan.py``, with the options' defaults; builds nothing)."""
    import mlx.core as mx

    from .mlx_backend import describe
    from .runtime import cpu
    from .runtime.dtypes import on_cpu
    from .runtime.plan import Plan

    facts = {"mlx": describe(), "device": mx.default_device().type.name}
    if on_cpu():
        k = cpu.kernels()
        facts["blas"] = {"library": k.blas.library, "reason": k.blas.reason}
        facts.update(Plan(True, k).summary())
    facts["decode_steps"] = ("the ops between two layers' attention replayed as one compiled call"
                             if Plan(on_cpu()).compiles_steps else
                             "every op built from Python (LLM_PTE_COMPILED_STEPS=0)")
    return facts


def _summary(program) -> dict:
    m = program.metadata
    return {
        "max_context": m.max_context,
        "prefill_chunk": m.prefill_chunk,
        "vocab_size": m.vocab_size,
        "activation_dtype": m.activation_dtype,
        "layers": m.n_caches,
        "windows": m.windows,
    }


def _strict_entries() -> dict[str, Entry]:
    """The registry, read in full before it is rewritten."""
    try:
        return load_entries(strict=True)
    except RegistryError as e:
        raise click.ClickException(str(e)) from None


@contextlib.contextmanager
def _editing():
    """``registry.editing()``, its refusal as a one-line error."""
    try:
        with editing() as entries:
            yield entries
    except RegistryError as e:
        raise click.ClickException(str(e)) from None


def _check_names(entries: dict[str, Entry], name: str, aliases, force: bool) -> None:
    if name in entries and not force:
        raise click.ClickException(f"a model named {name!r} is already registered: use --force to replace it")
    taken = {a: e.name for e in entries.values() if e.name != name for a in (e.name, *e.aliases)}
    for a in (name, *aliases):
        if a in taken:
            raise click.ClickException(f"the name {a!r} is already used by {MODEL_PREFIX}{taken[a]}")


def register_commands(cli):
    @cli.group(name="pte")
    def pte():
        "Manage ExecuTorch .pte models exported for MLX"

    @pte.command(name="register")
    @click.argument("path", type=click.Path(dir_okay=False))
    @click.option("--tokenizer", "tokenizer_path", required=True, type=click.Path(dir_okay=False),
                  help="tokenizer.json, tiktoken or sentencepiece file")
    @click.option("--name", help="Model name (default: the file's stem); use it as pte:NAME")
    @click.option("--alias", "aliases", multiple=True, help="Extra name for the model (repeatable)")
    @click.option("--chat", default=OPTIONS["chat"].default, show_default=True,
                  help=OPTIONS["chat"].description + "; -o chat overrides it per prompt")
    @click.option("--force", is_flag=True, help="Replace a model registered under the same name")
    def register(path, tokenizer_path, name, aliases, chat, force):
        "Register a .pte model and its tokenizer as pte:NAME"
        require_for_command()
        from .text import TextError, load_tokenizer, resolve_template
        from .text.model_fit import mismatches

        path = str(pathlib.Path(path).resolve())
        tokenizer_path = str(pathlib.Path(tokenizer_path).resolve())
        name = name or pathlib.Path(path).stem
        for n in (name, *aliases):
            if not NAME_RE.match(n):
                raise click.ClickException(
                    f"invalid name {n!r}: use letters, digits, '.', '_' and '-'"
                )
        _check_names(_strict_entries(), name, aliases, force)  # before the slow checks; again when writing

        program = _load(path)
        m = program.metadata
        if "forward" not in program.method_names:
            raise click.ClickException(f"{path} has no forward method: not a language model")
        if not m.has_offgraph_cache:
            raise click.ClickException(
                f"{path} has no off-graph KV cache: re-export it with --use-offgraph-cache "
                "(or `llm pte export`)"
            )
        try:
            program.load_method("forward", cache=program.new_cache(capacity=1))
            tokenizer = load_tokenizer(tokenizer_path)
            template = resolve_template(chat, tokenizer)
        except TextError as e:
            raise click.ClickException(str(e)) from None
        except Exception as e:  # PteError from the program
            raise click.ClickException(str(e)) from None
        disagree = mismatches(m, tokenizer, template)
        if disagree:
            raise click.ClickException(
                f"{tokenizer_path} cannot be this model's tokenizer: {'; '.join(disagree)}"
            )
        with _editing() as entries:
            _check_names(entries, name, aliases, force)
            entries[name] = Entry(name=name, path=path, tokenizer=tokenizer_path, chat=chat,
                                  aliases=list(aliases), summary=_summary(program))
        click.echo(f"Registered {MODEL_PREFIX}{name}")

    @pte.command(name="models")
    @click.option("--json", "as_json", is_flag=True, help="Output as JSON")
    def models(as_json):
        "List registered .pte models"
        entries = load_entries()
        if as_json:
            click.echo(json.dumps([
                {"model_id": e.model_id, "name": e.name, "aliases": e.aliases, "path": e.path,
                 "tokenizer": e.tokenizer, "chat": e.chat, **e.summary}
                for e in entries.values()
            ], indent=2))
            return
        if not entries:
            click.echo("No models registered: llm pte register model.pte --tokenizer tokenizer.json")
            return
        for e in entries.values():
            s = e.summary
            missing = [f for f in (e.path, e.tokenizer) if not pathlib.Path(f).is_file()]
            click.echo(e.model_id + (f" (aliases: {', '.join(e.aliases)})" if e.aliases else ""))
            click.echo(f"  path:      {e.path}")
            click.echo(f"  tokenizer: {e.tokenizer}")
            click.echo(f"  chat:      {e.chat}")
            if s:
                click.echo(f"  context:   {s.get('max_context')} tokens, prefill chunk {s.get('prefill_chunk')}, "
                           f"{layers_text(s.get('windows') or [])}")
            for f in missing:
                click.echo(f"  MISSING:   {f}")

    @pte.command(name="remove")
    @click.argument("name")
    def remove(name):
        "Unregister a model (its files are left alone)"
        _strict_entries()  # a damaged registry is named, not read as empty
        entry = find_entry(name)
        if entry is None:
            raise click.ClickException(f"no registered model named {name!r}: see llm pte models")
        with _editing() as entries:
            entries.pop(entry.name, None)
        click.echo(f"Removed {entry.model_id}")

    @pte.command(name="info")
    @click.argument("name_or_path")
    @click.option("--json", "as_json", is_flag=True, help="Output as JSON")
    def info(name_or_path, as_json):
        "Show what a .pte file publishes (methods, metadata, cache geometry, sizes) and how this machine runs it"
        entry = find_entry(name_or_path)
        path = entry.path if entry else name_or_path
        program = _load(path)
        m = program.metadata
        facts = {
            "path": str(pathlib.Path(path).resolve()),
            "file_bytes": pathlib.Path(path).stat().st_size,
            "methods": sorted(program.method_names),
            "weight_bytes": program.weight_bytes(as_stored=True),
            "compute_dtype": program.compute_dtype,
            "weight_bytes_in_memory": program.weight_bytes(),
            "metadata": {k: v for k, v in m.as_dict().items() if not k.startswith(("get_", "use_", "enable_"))},
            "constant_methods": m.raw,
        }
        if m.has_offgraph_cache:
            facts["kv_bytes_per_token"] = _kv_bytes_per_token(m.kv_heads, m.head_dims)
            facts["kv_storage_dtype"] = program.kv_dtype
        facts["runtime"] = _runtime_facts()
        if as_json:
            click.echo(json.dumps(facts, indent=2, default=str))
            return
        click.echo(f"{facts['path']} ({facts['file_bytes'] / 1e6:.1f} MB, weights {facts['weight_bytes'] / 1e6:.1f} MB)")
        click.echo(f"methods:          {', '.join(facts['methods'])}")
        click.echo(f"max context:      {m.max_context}")
        click.echo(f"prefill chunk:    {m.prefill_chunk}")
        click.echo(f"vocab size:       {m.vocab_size}")
        click.echo(f"activation dtype: {m.activation_dtype}")
        if program.compute_dtype != m.activation_dtype:
            click.echo(f"computes in:      {program.compute_dtype} on this CPU "
                       f"(weights {facts['weight_bytes_in_memory'] / 1e6:.1f} MB in memory; -o compute_dtype native keeps {m.activation_dtype})")
        click.echo(f"logits mode:      {m.logits_mode}")
        click.echo(f"bos / eos ids:    {m.bos_id} / {m.eos_ids or '-'}")
        if m.has_offgraph_cache:
            click.echo(f"[cache] off-graph seq | {layers_text(m.windows)}")
            click.echo(f"        kv heads {m.kv_heads}, head dims {m.head_dims}")
            click.echo("        KV bytes/token: " + ", ".join(
                f"{dt} {n:,}" for dt, n in facts["kv_bytes_per_token"].items())
                + f" ({program.kv_dtype} unless -o kv_storage_dtype says otherwise)")
        else:
            click.echo("[cache] none published (in-graph or not an LLM)")
        runtime = facts["runtime"]
        click.echo(f"[runtime] {runtime['mlx']}, on the {runtime['device']}")
        if "blas" in runtime:
            blas = runtime["blas"]
            click.echo(f"        BLAS: {blas['library'] or 'MLX reference BLAS (slow)'} ({blas['reason']})")
            click.echo(f"        attention: {runtime['attention']}")
            click.echo(f"        decode products: {runtime['decode_products']}")
            if "fp32_chunk_products" in runtime:
                click.echo(f"        fp32 chunk products: {runtime['fp32_chunk_products']}")
            click.echo(f"        quantized products: {runtime['quantized_products']}")
            if "bf16_products" in runtime:
                click.echo(f"        bf16 products: {runtime['bf16_products']}")
        click.echo(f"        decode steps: {runtime['decode_steps']}")
    add_export_commands(pte)  # llm pte export, llm pte demo
    add_cache_commands(pte)  # llm pte cache, llm pte cache clear


def add_cache_commands(pte):
    from .plugin import saved_states_dir

    def listed(what: str):
        """``StateStore``'s ``all`` or ``clear``; a states path it cannot read is our one-line error."""
        from .text.saved_states import StateDirError, StateStore  # the text package loads mlx

        store = StateStore(saved_states_dir(), 0, lambda msg: click.echo(msg, err=True))
        try:
            return getattr(store, what)()
        except StateDirError as e:
            raise click.ClickException(str(e)) from None

    @pte.group(name="cache", invoke_without_command=True)
    @click.pass_context
    def cache(ctx):
        "List the KV cache states saved on disk (llm pte cache clear removes them)"
        if ctx.invoked_subcommand is not None:
            return
        states = listed("all")
        if not states:
            click.echo(f"No saved cache states in {saved_states_dir()}")
            return
        for s in states:
            model = s.header["model"]
            used = datetime.datetime.fromtimestamp(s.used).strftime("%Y-%m-%d %H:%M:%S")
            click.echo(f"{s.path.name}  {s.size / 1e6:7.2f} MB  {len(s.ids):5d} tokens  "
                       f"{s.header['policy']['dtype']}  used {used}  {model['path']}")
        total = sum(s.size for s in states)
        click.echo(f"{len(states)} states, {total / 1e6:.2f} MB in {saved_states_dir()} "
                   f"(budget: -o kv_disk_mb, default {OPTIONS['kv_disk_mb'].default} MB)")

    @cache.command(name="clear")
    def clear():
        "Delete every saved KV cache state"
        count, size = listed("clear")
        click.echo(f"Deleted {count} saved cache states ({size / 1e6:.2f} MB)")
