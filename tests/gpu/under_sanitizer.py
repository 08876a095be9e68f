"""Runs a Python script under compute-sanitizer in this process's place (one sanitizer per rank):

    python -m jax_moe_comm.launch -n 2 -- tests/gpu/under_sanitizer.py tests/gpu/nvshmem_cases.py --only "fp32 K2"

The tool is memcheck unless SANITIZER_TOOL names another (racecheck, synccheck, initcheck).

The launcher's environment (coordinator, rank, visible GPU) carries over; the sanitizer does not follow the
launcher itself, only the worker it replaces.
"""

import os
import shutil
import sys

if __name__ == "__main__":
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        sys.exit("compute-sanitizer not found on PATH")
    check = os.environ.get("SANITIZER_TOOL", "memcheck")
    os.environ["JMC_UNDER_SANITIZER"] = check  # the script may leave out what would take too long under it
    os.execv(tool, [tool, "--tool", check, "--print-limit", "1000", sys.executable, *sys.argv[1:]])
