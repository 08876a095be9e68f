// The fused dispatch (NVLink path, Context::p2p): dispatch_send and dispatch_recv in one kernel, for the fused
// `dispatch` call (no work to overlap between the halves). Each block sends its tokens, then receives. The ready
// words a block waits for are SET by the last block of each source's send, this rank's included, so every block
// must be resident: a cooperative launch, its grid capped at co-residency. One launch, one start and one close
// instead of two; the device code is the phases' own (dispatch_send.cuh, dispatch_recv.cuh), hence the same
// layout and rows, bit for bit.
#include <algorithm>

#include "dispatch_recv.cuh"
#include "dispatch_send.cuh"

namespace jmc {
namespace {

__global__ void dispatch_kernel(Context ctx, DispatchSendArgs send, DispatchRecvArgs recv) {
  if (!dispatch_send_p2p(ctx, send, false)) {  // out of protocol order: the send status says so; nothing is received
    if (blockIdx.x == 0 && threadIdx.x < kStatusWords) recv.status[threadIdx.x] = 0;
    receive_nothing(ctx, recv);
    return;
  }
  mark(ctx, kDispatchRecv, kStart);  // no second order check: the receive's end moves the protocol past both
  receive_tokens(ctx, recv, true);
}

}  // namespace

cudaError_t launch_dispatch(const Context& ctx, const DispatchSendArgs& send, const DispatchRecvArgs& recv,
                            cudaStream_t stream) {
  if (!ctx.p2p) return cudaErrorNotSupported;  // the staged send is cooperative on its own: two kernels there
  const size_t shared = dispatch_recv_shared_bytes(ctx.s);
  if (shared > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(dispatch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(shared));
    if (err != cudaSuccess) return err;
  }
  int per_sm = 0;
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, dispatch_kernel, kThreads, shared);
  if (err != cudaSuccess) return err;
  const int blocks = std::min(std::max(dispatch_send_blocks(ctx.s), dispatch_recv_blocks(ctx.s)),
                              std::max(per_sm, 1) * ctx.s.sm_count);
  Context c = ctx;
  DispatchSendArgs send_args = send;
  DispatchRecvArgs recv_args = recv;
  void* params[] = {&c, &send_args, &recv_args};
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(dispatch_kernel), blocks, kThreads, params, shared,
                                     stream);
}

}  // namespace jmc
