"""What runs a program's work on a GPU beyond MLX's own ops: ``decode.py``'s kernels for a decode step."""
