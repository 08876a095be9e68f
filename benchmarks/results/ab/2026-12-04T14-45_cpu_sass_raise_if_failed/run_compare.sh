#!/bin/bash
# Reproduces the comparison (paths as used for this record; compare.py is the 7f33f4b record's).
CU=/tmp/cutools/nvidia/cu13/bin
python3 "$(dirname "$0")/../2026-12-03T11-49_cpu_sass_7f33f4b/compare.py" --cuobjdump $CU/cuobjdump \
  --nvdisasm $CU/nvdisasm --old /tmp/b_old/CMakeFiles/_nvshmem_ext.dir/ffi \
  --new /tmp/b_new/CMakeFiles/_nvshmem_ext.dir/ffi --out "${OUT:-/tmp/cmp_out}" handlers.cu
