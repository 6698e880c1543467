"""A method's values reach its MLX delegate call by value index (``delegate_call.py``)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import torch

import executorch_suite as suite
from llm_executorch_mlx.runtime import load_program


class PassThrough(torch.nn.Module):
    """The delegate reads only y; x is returned untouched, beside two constants."""

    def forward(self, x, y):
        return y * 2.0, x, torch.full((2, 3), 7.0), torch.zeros(3, dtype=torch.int32)


def test_a_method_returning_its_input_and_constants_matches_torch_eager(tmp_path):
    model, inputs = PassThrough(), (torch.randn(2, 3), torch.randn(4))
    pte = tmp_path / "model.pte"
    suite.import_suite().export_model_to_pte(model, inputs, pte)
    outputs = load_program(pte).load_method("forward").execute(list(inputs))
    assert all(isinstance(o, mx.array) for o in outputs)
    for got, want in zip(outputs, model(*inputs)):
        np.testing.assert_array_equal(np.array(got), want.numpy())
