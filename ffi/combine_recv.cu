// combine_recv's kernel (the phase itself: combine_recv.cuh) and its launch.
#include "combine_recv.cuh"

namespace jmc {
namespace {

// StagedPartials: the staged path's pre-reduced rows (Context::p2p false, a.reduced); dynamic shared memory:
// sum_staged_partial_rows'. Bounded to 128 registers so that a kWideThreads-thread block fits an SM: an SM budget
// that binds launches such blocks (launch_combine_recv).
template <typename In, typename Out, bool StagedPartials>
__global__ void __launch_bounds__(kWideThreads, 1) combine_recv_kernel(Context ctx, CombineRecvArgs a) {
  if (begin_phase(ctx, kCombineRecv, a.status))
    receive_combined<In, Out, StagedPartials, true>(ctx, a);
  else
    fill_nan<Out>(ctx, a.out, true);  // refused: no result
}

// The kernel instantiation for (row dtype in flight, output dtype), of the staged pre-reduced rows or the others.
void* kernel_for(int in_dtype, int out_dtype, bool staged_partials) {
  return with_row_type(in_dtype, [&](auto in) {
    return with_row_type(out_dtype, [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      return staged_partials ? reinterpret_cast<void*>(combine_recv_kernel<In, Out, true>)
                             : reinterpret_cast<void*>(combine_recv_kernel<In, Out, false>);
    });
  });
}

}  // namespace

cudaError_t launch_combine_recv(const Context& ctx, const CombineRecvArgs& a, cudaStream_t stream) {
  if (windowed(ctx.s)) return cudaErrorNotSupported;  // rounds wait on the other half: the fused calls only
  Context c = ctx;
  CombineRecvArgs args = a;
  void* params[] = {&c, &args};
  const bool staged_partials = a.reduced && !ctx.p2p;
  void* kernel = kernel_for(a.in_dtype, a.out_dtype, staged_partials);
  const int wanted = combine_recv_blocks(ctx.s);
  const int blocks = within_budget(ctx.s, wanted);
  int threads = kThreads;
  if (ctx.p2p && blocks < wanted) {  // an SM budget that binds: kWideThreads blocks where one fits an SM
    int per_sm = 0;
    const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWideThreads, 0);
    if (err != cudaSuccess) return err;
    if (per_sm >= 1) threads = kWideThreads;
  }
  return cudaLaunchKernel(kernel, blocks, threads, params,
                          staged_partials ? sizeof(int) * ctx.s.dp_size * ctx.s.world : 0, stream);
}

}  // namespace jmc
