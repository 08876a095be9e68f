"""The model-style example (jax_moe_comm/examples/moe_block.py): an equinox transformer block with its own mesh
("data": 2, "expert": 4), each router variant and a shared expert, trained a few jitted optax steps on the reference
backend; every step's loss and gradients and the trained block's output agree with the dense block."""

from __future__ import annotations

import pytest

from jax_moe_comm.examples import moe_block


@pytest.mark.parametrize("router,extra", [("softmax", []), ("softmax_renorm", ["--custom-vjp"]),
                                          ("sigmoid_group", []), ("softmax_input", ["--custom-vjp"])])
def test_the_moe_block_trains_as_its_dense_twin(router, extra):
    worst = moe_block.main(["--router", router, "--steps", "2", *extra])
    assert worst < 1e-4
