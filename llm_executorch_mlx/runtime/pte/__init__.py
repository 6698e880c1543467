"""The .pte file: its container (``container.py``), the LLM metadata it
publishes (``metadata.py``) and the MLX delegate's program (``graph.py``),
read with flatc's generated readers (``_schema/``)."""
