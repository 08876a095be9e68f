"""The CUDA extension's host API where it needs no GPU: launch_phase checks its arguments before any launch, the
constants and texts it shares with Python, and what the product build holds."""

import re
import shutil
import subprocess

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


# Symbols of the measurement instruments: the floor probe's handler, launcher and kernels, the kernel marks' reader.
INSTRUMENT_SYMBOL = re.compile(r"jmc_probe|launch_probe|probe_kernel|probe_flagged|take_kernel_marks|jmc::.*\bmarks?\b")
# Their names as the library's bytes hold them even when stripped (kernel registration, Python bindings).
INSTRUMENT_BYTES = (b"probe_kernel", b"probe_flagged", b"take_kernel_marks", b"launch_probe")


def defined_symbols(library: str) -> list[str]:
    """Its static symbols (none once stripped, as an installed wheel's are) and its exported ones, demangled."""
    symbols = []
    for table in ([], ["-D"]):
        out = subprocess.run(["nm", "-C", "--defined-only", *table, library], capture_output=True, text=True).stdout
        symbols += [line.split(" ", 2)[-1] for line in out.splitlines() if line.strip()]
    return symbols


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_the_product_build_holds_no_probe_or_mark():
    """The installed extension is the product: the floor probes and the kernel marks are the measurement build's
    (JAX_MOE_COMM_MEASUREMENT=ON), absent from its symbols, its bytes and its Python API."""
    if _native.ext.measurement_build():
        pytest.skip("this install is the measurement build")
    symbols = defined_symbols(_native.ext.__file__)
    assert any("jmc::find_context" in s for s in symbols), "nm found none of the library's functions: wrong file?"
    assert [s for s in symbols if INSTRUMENT_SYMBOL.search(s)] == []
    data = open(_native.ext.__file__, "rb").read()
    assert [name for name in INSTRUMENT_BYTES if name in data] == []
    assert not hasattr(_native.ext, "take_kernel_marks")
    assert "probe" not in _native.ext.handlers()
