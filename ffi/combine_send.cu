// combine_send's kernels (the phase itself: combine_send.cuh) and their launch.
#include "combine_send.cuh"

namespace jmc {
namespace {

__global__ void combine_send_kernel(Context ctx, CombineSendArgs a) { combine_send_rows(ctx, a, true); }

// At most 128 registers (two blocks per SM, or one of kWideThreads under an SM budget): the pre-reduction waits on
// loads, so it wants warps to switch to. Wide: the kernel of kWideThreads blocks, whose warps take whole rows.
template <typename In, typename Partial, bool Wide = false>
__global__ void __launch_bounds__(kWideThreads, 1)
    combine_send_reduced_kernel(Context ctx, CombineSendArgs a) {
  combine_send_reduced<In, Partial, Wide>(ctx, a, true);
}

// The staged path's (Context::p2p false), as the other.
template <typename In, typename Partial>
__global__ void __launch_bounds__(kThreads, 2)
    combine_send_reduced_staged_kernel(Context ctx, CombineSendArgs a) {
  combine_send_reduced_staged<In, Partial>(ctx, a);
}

// The pre-reduced kernel's instantiation for (expert_y dtype, partial row dtype), of the NVLink or the staged path;
// wide: the NVLink path's for kWideThreads blocks.
void* reduced_kernel_for(int in_dtype, int partial_dtype, bool p2p, bool wide = false) {
  return with_row_type(in_dtype, [&](auto in) {
    return with_row_type(partial_dtype, [&](auto partial) {
      using In = decltype(in);
      using Partial = decltype(partial);
      if (!p2p) return reinterpret_cast<void*>(combine_send_reduced_staged_kernel<In, Partial>);
      return wide ? reinterpret_cast<void*>(combine_send_reduced_kernel<In, Partial, true>)
                  : reinterpret_cast<void*>(combine_send_reduced_kernel<In, Partial>);
    });
  });
}

}  // namespace

cudaError_t launch_combine_send(const Context& ctx, const CombineSendArgs& a, cudaStream_t stream) {
  if (windowed(ctx.s)) return cudaErrorNotSupported;  // rounds wait on the other half: the fused calls only
  if (a.topk_weights != nullptr) {  // pre-reduced: cooperative, at most one block per SM, a warp per segment
    Context c = ctx;
    CombineSendArgs args = a;
    void* params[] = {&c, &args};
    if (!ctx.p2p && ctx.s.world > kMaxNvlinkPeers) return cudaErrorNotSupported;  // PartialRuns' bound
    void* kernel = reduced_kernel_for(a.in_dtype, a.partial_dtype, ctx.p2p);
    int per_sm = 0;
    const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
    if (err != cudaSuccess) return err;
    const int wanted = combine_send_blocks(ctx.s, true);
    const int blocks = within_budget(ctx.s, wanted);
    // Under an SM budget that binds, blocks twice as wide where two fit an SM, as the fused combine's (combine.cu).
    const bool wide = ctx.p2p && blocks < wanted && per_sm >= 2;
    if (wide) kernel = reduced_kernel_for(a.in_dtype, a.partial_dtype, true, true);
    return cudaLaunchCooperativeKernel(kernel, blocks, wide ? kWideThreads : kThreads, params, 0, stream);
  }
  combine_send_kernel<<<within_budget(ctx.s, combine_send_blocks(ctx.s, false)), kThreads, 0, stream>>>(ctx, a);
  return cudaGetLastError();
}

}  // namespace jmc
