// combine_recv's kernel (the phase itself: combine_recv.cuh) and its launch.
#include "combine_recv.cuh"

namespace jmc {
namespace {

template <typename In, typename Out>
__global__ void combine_recv_kernel(Context ctx, CombineRecvArgs a) {
  if (begin_phase(ctx, kCombineRecv, a.status))
    receive_combined<In, Out>(ctx, a);
  else
    fill_nan<Out>(ctx, a.out, true);  // refused: no result
}

// The kernel instantiation for (row dtype in flight, output dtype).
void* kernel_for(int in_dtype, int out_dtype) {
  return with_row_type(in_dtype, [&](auto in) {
    return with_row_type(out_dtype, [](auto out) {
      return reinterpret_cast<void*>(combine_recv_kernel<decltype(in), decltype(out)>);
    });
  });
}

}  // namespace

cudaError_t launch_combine_recv(const Context& ctx, const CombineRecvArgs& a, cudaStream_t stream) {
  if (windowed(ctx.s)) return cudaErrorNotSupported;  // rounds wait on the other half: the fused calls only
  Context c = ctx;
  CombineRecvArgs args = a;
  void* params[] = {&c, &args};
  return cudaLaunchKernel(kernel_for(a.in_dtype, a.out_dtype), within_budget(ctx.s, combine_recv_blocks(ctx.s)),
                          kThreads, params, 0, stream);
}

}  // namespace jmc
