"""The CUDA extension's host API where it needs no GPU: launch_phase checks its arguments before any launch."""

import pytest

from jax_moe_comm import _native

pytestmark = pytest.mark.skipif(_native.ext is None, reason="CPU-only install: the CUDA extension was not built")


def test_launch_phase_rejects_an_unknown_phase():
    with pytest.raises(ValueError, match="unknown phase dispatch_all"):
        _native.ext.launch_phase(0, "dispatch_all", {}, 0)


@pytest.mark.parametrize("phase, first_missing", [
    ("dispatch_send", "x"), ("dispatch_recv", "expert_x"), ("combine_send", "expert_y"), ("combine_recv", "topk_ids"),
    ("dispatch", "x"), ("combine", "expert_y"),  # the fused halves
])
def test_launch_phase_names_a_missing_argument_before_launching(phase, first_missing):
    with pytest.raises(ValueError, match=f"missing argument {first_missing}"):
        _native.ext.launch_phase(0, phase, {}, 0)


def test_the_kernels_constants_are_errors_py_s():
    from jax_moe_comm import errors

    errors.give_texts_to(_native.ext)  # raises if the constants differ
    constants = _native.ext.constants()
    assert constants["status_words"] == errors.STATUS_WORDS and constants["fatal_codes"] == errors.FATAL


@pytest.mark.parametrize("words", [
    [1, 0, 3, 5, 99, 7, 0, 0],                     # a bad id found by rank 3's dispatch_send
    [2, 0, 0, 1, 3, 1, 0, 0],                      # a repeated id
    [4, 1, 1, 37, 32, 2, 0, 0],                    # overflow on rank 1: 37 rows, capacity 32
    [8, 1, 0, 1, 0, 4, 0, 0],                      # rank 0 timed out waiting for rank 1
    [16, 0, 2, 2, 0, 1, 0, 0],                     # dispatch_send ran while combine_send was expected
    [1 | 2, 0, 0, 4, 9, 1, 0, 0],                  # two routing errors at once
])
def test_the_check_handler_raises_the_same_text_as_python(words):
    """The kernels' check handler formats a failure from errors.py's templates: the same text as errors.describe."""
    from jax_moe_comm import errors

    errors.give_texts_to(_native.ext)
    assert _native.ext.describe_failure(words) == errors.describe(words)
