// dispatch_recv's kernel (the phase itself: dispatch_recv.cuh) and its launch.
#include "dispatch_recv.cuh"

namespace jmc {
namespace {

// Two blocks per SM (at most 128 registers), as dispatch_recv_blocks plans. Routed: the staged path's rows
// (FromRoutedSlots), where a source packed them.
template <bool Routed>
__global__ void __launch_bounds__(kThreads, 2) dispatch_recv_kernel(Context ctx, DispatchRecvArgs a) {
  if (begin_phase(ctx, kDispatchRecv, a.status))
    receive_tokens<Routed>(ctx, a);
  else
    receive_nothing(ctx, a);
}

}  // namespace

cudaError_t launch_dispatch_recv(const Context& ctx, const DispatchRecvArgs& a, cudaStream_t stream) {
  if (windowed(ctx.s)) return cudaErrorNotSupported;  // rounds wait on the other half: the fused calls only
  const size_t shared = dispatch_recv_shared_bytes(ctx.s);
  void* kernel = ctx.p2p ? reinterpret_cast<void*>(dispatch_recv_kernel<false>)
                         : reinterpret_cast<void*>(dispatch_recv_kernel<true>);
  if (shared > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
    if (err != cudaSuccess) return err;
  }
  const int blocks = within_budget(ctx.s, dispatch_recv_blocks(ctx.s));
  Context c = ctx;
  DispatchRecvArgs args = a;
  void* params[] = {&c, &args};
  return cudaLaunchKernel(kernel, blocks, kThreads, params, shared, stream);
}

}  // namespace jmc
