"""Int32 bounds of the program's scalar ints (a leaf: the interpreter and the ops both use it)."""

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def clamp_int32(v: int) -> int:
    """Literal ints are int64 on the wire; like ExecuTorch, clamp them to int32
    (INT64_MAX is the usual "to the end" sentinel of a slice)."""
    return INT32_MAX if v >= INT32_MAX else INT32_MIN if v <= INT32_MIN else int(v)
