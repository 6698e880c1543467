"""flatc readers for the .pte and MLX program schemas (generated: see README)."""
