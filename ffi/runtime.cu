// Host side of NVSHMEM: unique id, init/attach, finalize, and the symmetric buffers of each MoEComm.
// Everything here is collective across ranks where NVSHMEM says so (init, malloc, free, barrier); it runs from
// Python at setup time, never inside an XLA handler.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "runtime.h"

namespace jmc {

BuildInfo build_info() {
  int runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  return BuildInfo{NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION,
                   CUDART_VERSION, runtime};
}

std::string unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&id) != 0) return {};
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

int init(const std::string& uid, int rank, int nranks, int device) {
  if (uid.size() != sizeof(nvshmemx_uniqueid_t)) return -1;
  if (cudaSetDevice(device) != cudaSuccess) return -2;
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, uid.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr);
  // The body of nvshmemx_init_attr without its exit(-1) on failure. nvshmemi_init_thread lives in
  // libnvshmem_device.a, linked into this library, so this call also attaches this library's own device state
  // (a separately device-linked library has its own copy) when another module initialized the host library.
  nvshmemx_init_init_attr_ver_only(attr);
  nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                NVSHMEM_VENDOR_PATCH_VERSION};
  int provided = 0;
  return nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
}

int init_status() { return nvshmemx_init_status(); }
int my_pe() { return nvshmem_my_pe(); }
int n_pes() { return nvshmem_n_pes(); }
void finalize() { nvshmem_finalize(); }

std::tuple<int, int, int> host_version() {
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  return {major, minor, patch};
}

namespace {

struct Layout {  // byte sizes of each symmetric buffer, in allocation order
  size_t dispatch_staging, dispatch_slots, dispatch_ids, dispatch_ready, combine_staging, combine_slots,
      combine_words, sync, combine_weights, weights_ready, combine_partials, partials_ready, probe_ready, row_of, local;
  size_t total() const {
    return dispatch_staging + dispatch_slots + dispatch_ids + dispatch_ready + combine_staging + combine_slots +
           combine_words + sync + combine_weights + weights_ready + combine_partials + partials_ready + probe_ready +
           row_of + local;
  }
};

size_t round16(size_t n) { return (n + 15) / 16 * 16; }  // every buffer starts 16-byte aligned

Layout layout_of(const Sizes& s) {
  const size_t slots = static_cast<size_t>(s.world) * s.slots_per_source;
  const size_t world_words = round16(static_cast<size_t>(s.world) * sizeof(uint64_t));
  return Layout{
      static_cast<size_t>(s.max_tokens) * s.token_stride,
      slots * s.token_stride,
      round16(slots * s.experts_per_token * sizeof(int32_t)),
      world_words,
      static_cast<size_t>(s.capacity) * s.combine_stride,
      static_cast<size_t>(s.max_tokens) * s.experts_per_token * s.combine_stride,
      round16(static_cast<size_t>(s.max_tokens) * sizeof(uint64_t)),
      world_words,
      round16(slots * s.experts_per_token * sizeof(float)),
      world_words,
      static_cast<size_t>(s.world) * s.max_tokens * s.combine_stride,
      world_words,
      world_words,
      round16(static_cast<size_t>(s.num_dp) * s.max_tokens * s.experts_per_token * sizeof(int32_t)),
      kPhases * kStatusWords * sizeof(int32_t) + kPhases * sizeof(unsigned) + 16,
  };
}

}  // namespace

size_t symmetric_bytes(const Sizes& s) { return layout_of(s).total(); }

Context* create_context(const Sizes& sizes, std::string* error) {
  const Layout bytes = layout_of(sizes);
  // One allocation (collective: same size on every rank), carved into the buffers; zeroed once, after which
  // every counter is reset by the phase that consumed it.
  char* base = static_cast<char*>(nvshmem_malloc(bytes.total()));
  if (base == nullptr) {
    *error = "nvshmem_malloc of " + std::to_string(bytes.total()) +
             " bytes failed: the symmetric heap is too small; set NVSHMEM_SYMMETRIC_SIZE (before "
             "jax_moe_comm.initialize) to at least the sum of comm.symmetric_bytes of every MoEComm, plus margin";
    return nullptr;
  }
  // Zeroed on a stream of its own and waited for alone: a device-wide synchronisation would also wait for work
  // already queued by XLA, which may itself wait for a host callback.
  cudaStream_t zeroing = nullptr;
  const bool zeroed = cudaStreamCreateWithFlags(&zeroing, cudaStreamNonBlocking) == cudaSuccess &&
                      cudaMemsetAsync(base, 0, bytes.total(), zeroing) == cudaSuccess &&
                      cudaStreamSynchronize(zeroing) == cudaSuccess;
  if (zeroing != nullptr) cudaStreamDestroy(zeroing);
  if (!zeroed) {
    *error = "zeroing the symmetric buffers failed";
    nvshmem_free(base);
    return nullptr;
  }
  auto* ctx = new Context{};
  ctx->s = sizes;
  char* p = base;
  auto take = [&p](size_t n) { char* q = p; p += n; return q; };
  ctx->dispatch_staging = take(bytes.dispatch_staging);
  ctx->dispatch_slots = take(bytes.dispatch_slots);
  ctx->dispatch_ids = reinterpret_cast<int32_t*>(take(bytes.dispatch_ids));
  ctx->dispatch_ready = reinterpret_cast<uint64_t*>(take(bytes.dispatch_ready));
  ctx->combine_staging = take(bytes.combine_staging);
  ctx->combine_slots = take(bytes.combine_slots);
  ctx->combine_arrived = reinterpret_cast<uint64_t*>(take(bytes.combine_words));
  ctx->sync_flags = reinterpret_cast<uint64_t*>(take(bytes.sync));
  ctx->combine_weights = reinterpret_cast<float*>(take(bytes.combine_weights));
  ctx->weights_ready = reinterpret_cast<uint64_t*>(take(bytes.weights_ready));
  ctx->combine_partials = take(bytes.combine_partials);
  ctx->partials_ready = reinterpret_cast<uint64_t*>(take(bytes.partials_ready));
  ctx->probe_ready = reinterpret_cast<uint64_t*>(take(bytes.probe_ready));
  ctx->row_of = reinterpret_cast<int32_t*>(take(bytes.row_of));
  ctx->status_scratch = reinterpret_cast<int32_t*>(take(bytes.local));
  ctx->blocks_done = reinterpret_cast<unsigned*>(ctx->status_scratch + kPhases * kStatusWords);
  ctx->next_phase = reinterpret_cast<int32_t*>(ctx->blocks_done + kPhases);
  ctx->probe_epoch = reinterpret_cast<uint32_t*>(ctx->next_phase + 1);  // the local words' last 16 bytes:
  ctx->probe_blocks = reinterpret_cast<unsigned*>(ctx->probe_epoch + 1);  // next_phase, probe_epoch, probe_blocks
  // NVLink: every peer's heap is mapped here, at a fixed offset from ours (so for every buffer of this allocation).
  ctx->p2p = sizes.world <= kMaxNvlinkPeers;
  for (int pe = 0; pe < sizes.world && ctx->p2p; ++pe) {
    const char* peer = static_cast<const char*>(nvshmem_ptr(base, pe));
    ctx->p2p = peer != nullptr;
    if (ctx->p2p) ctx->peer_offset[pe] = peer - base;
  }
  if (std::getenv("JAX_MOE_COMM_STAGED")) ctx->p2p = false;  // force the staged puts (any transport)
  ctx->symmetric_bytes = bytes.total();
  // The ids-first dispatch and its per-block histograms (local device memory, read only by that kernel; never read
  // before written in the same call: no zeroing). Without them the fused dispatch sends first.
  const char* ids_first_min = std::getenv("JAX_MOE_COMM_IDS_FIRST_MIN_TOKENS");
  ctx->ids_first = ctx->p2p && sizes.dp_size == 1 &&
                   sizes.max_tokens >= (ids_first_min ? std::atoi(ids_first_min) : kIdsFirstMinTokens);
  const size_t count_bytes = static_cast<size_t>(sizes.local_experts) * sizes.num_dp * kMaxBlocksPerSm *
                             sizes.sm_count * sizeof(int32_t);
  if (ctx->ids_first && cudaMalloc(&ctx->block_counts, count_bytes) != cudaSuccess) {
    ctx->block_counts = nullptr;
    ctx->ids_first = false;
  }
  if (std::getenv("JAX_MOE_COMM_KERNEL_MARKS") != nullptr &&
      (cudaMalloc(&ctx->marks, kPhases * kMarks * sizeof(uint64_t)) != cudaSuccess ||
       cudaMemset(ctx->marks, 0, kPhases * kMarks * sizeof(uint64_t)) != cudaSuccess)) {
    ctx->marks = nullptr;  // no stamps: take_kernel_marks says so
  }
  nvshmem_barrier_all();  // every rank's buffers are zero before anyone may put into them
  return ctx;
}

std::vector<uint64_t> take_kernel_marks(Context* ctx) {
  std::vector<uint64_t> marks(kPhases * kMarks, 0);
  if (ctx->marks == nullptr) return {};
  const size_t bytes = marks.size() * sizeof(uint64_t);
  if (cudaMemcpy(marks.data(), ctx->marks, bytes, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemset(ctx->marks, 0, bytes) != cudaSuccess)
    return {};
  return marks;
}

void destroy_context(Context* ctx) {
  if (ctx->marks != nullptr) cudaFree(ctx->marks);
  if (ctx->block_counts != nullptr) cudaFree(ctx->block_counts);
  nvshmem_barrier_all();
  nvshmem_free(ctx->dispatch_staging);  // the start of the single allocation
  delete ctx;
}

int sm_count() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms;
}

}  // namespace jmc
