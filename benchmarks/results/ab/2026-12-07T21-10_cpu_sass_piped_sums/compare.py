"""sm_90 SASS of two builds of the extension, function by function: compare.py A.so B.so (CUOBJDUMP: the
cuobjdump to use, e.g. from the nvidia-cuda-cuobjdump wheel). Functions that differ only in UMOV constants (relocated
shared-memory or function addresses) are counted apart."""

import os
import re
import subprocess
import sys

CUOBJDUMP = os.environ.get("CUOBJDUMP", "cuobjdump")


def functions(library: str) -> dict[str, list[str]]:
    """Each function's instructions, addresses and encodings left out; names shortened to file:function."""
    listing = subprocess.run([CUOBJDUMP, "-sass", library], capture_output=True, text=True, check=True).stdout
    found: dict[str, list[str]] = {}
    name, body = None, []
    for line in listing.splitlines():
        header = re.match(r"\s*Function : (\S+)", line)
        if header:
            if name:
                found[name] = body
            name, body = header.group(1), []
            parts = list(re.finditer(r"_\d+_([a-z_]+?)_cu_[0-9a-f]{8}_?\d+", name))
            if parts:
                name = parts[-1].group(1) + ".cu:" + name[parts[-1].end():]
            continue
        if name is None:
            continue
        text = re.sub(r"/\*[0-9a-f]{4}\*/|/\* 0x[0-9a-f]+ \*/", "", line).strip()
        if text:
            body.append(text)
    if name:
        found[name] = body
    return found


def without_umov_constants(body: list[str]) -> list[str]:
    return [re.sub(r"UMOV (UR\d+), 0x[0-9a-f]+", r"UMOV \1, X", text) for text in body]


def main() -> None:
    a, b = functions(sys.argv[1]), functions(sys.argv[2])
    same, relocated, differ = 0, 0, []
    for name in sorted(set(a) | set(b)):
        if a.get(name) == b.get(name):
            same += 1
        elif name in a and name in b and without_umov_constants(a[name]) == without_umov_constants(b[name]):
            relocated += 1
        else:
            differ.append(name)
    print("same", same, "relocated constants only", relocated, "differ", len(differ))
    for name in differ:
        print("  ", name[:100])


if __name__ == "__main__":
    main()
