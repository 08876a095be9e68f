#!/bin/bash
# Reproduces the comparison (run from anywhere; paths as used for this record).
CU=/tmp/cutools/nvidia/cu13/bin
python3 "$(dirname "$0")/compare.py" --cuobjdump $CU/cuobjdump --nvdisasm $CU/nvdisasm \
  --old /tmp/b_old/CMakeFiles/_nvshmem_ext.dir/ffi --new /tmp/b_new/CMakeFiles/_nvshmem_ext.dir/ffi \
  --out "${OUT:-/tmp/cmp_out}" \
  --rename '(__nv_static_N__TU__ZN3jmcN_GLOBAL__N__TU)19combine_recv_kernelI(.+)EEvNS_7ContextENS_15CombineRecvArgsE=\g<1>19combine_recv_kernelI\g<2>Lb0EEEvNS_7ContextENS_15CombineRecvArgsE' \
  --rename '(__nv_static_N__TU__ZN3jmcN_GLOBAL__N__TU)26combine_recv_staged_kernelI(.+)EEvNS_7ContextENS_15CombineRecvArgsE=\g<1>19combine_recv_kernelI\g<2>Lb1EEEvNS_7ContextENS_15CombineRecvArgsE' \
  runtime.cu handlers.cu raw_launch.cu dispatch_send.cu dispatch_recv.cu combine_send.cu combine_recv.cu dispatch.cu combine.cu probe.cu
