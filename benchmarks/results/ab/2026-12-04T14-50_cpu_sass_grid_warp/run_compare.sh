#!/bin/bash
# Reproduces the comparison (paths as used for this record; compare.py is the 7f33f4b record's).
CU=/tmp/cutools/nvidia/cu13/bin
CMP="$(dirname "$0")/../2026-12-03T11-49_cpu_sass_7f33f4b/compare.py"
python3 "$CMP" --cuobjdump $CU/cuobjdump --nvdisasm $CU/nvdisasm --old /tmp/b_old2/CMakeFiles/_nvshmem_ext.dir/ffi \
  --new /tmp/b_new2/CMakeFiles/_nvshmem_ext.dir/ffi --out "${OUT:-/tmp/cmp2}" \
  runtime.cu handlers.cu raw_launch.cu dispatch_send.cu dispatch_recv.cu combine_send.cu combine_recv.cu dispatch.cu combine.cu
python3 "$CMP" --cuobjdump $CU/cuobjdump --nvdisasm $CU/nvdisasm --old /tmp/bm2_old/CMakeFiles/_nvshmem_ext.dir/ffi \
  --new /tmp/bm2_new/CMakeFiles/_nvshmem_ext.dir/ffi --out "${OUT:-/tmp/cmp2}_probe" probe.cu
