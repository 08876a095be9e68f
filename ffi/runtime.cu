// Host side of NVSHMEM: unique id, init/attach, finalize, and the symmetric buffers of each MoEComm.
// Everything here is collective across ranks where NVSHMEM says so (init, malloc, free, barrier); it runs from
// Python at setup time, never inside an XLA handler.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
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

// The layout's entry (offset, bytes) of buffer `name`, or null (jax_moe_comm computes the layout: name -> (offset,
// bytes), every offset 16-byte aligned).
const Layout::mapped_type* entry(const Layout& layout, const char* name) {
  auto it = layout.find(name);
  return it == layout.end() ? nullptr : &it->second;
}

// A buffer the layout may leave out (null then), carved out of the symmetric allocation by its name.
template <typename T>
T* optional_region(char* base, const Layout& layout, const char* name) {
  const auto* at = entry(layout, name);
  return at == nullptr ? nullptr : reinterpret_cast<T*>(base + at->first);
}

// A buffer every layout has: its name goes to `missing` when this one lacks it.
template <typename T>
T* region(char* base, const Layout& layout, const char* name, std::string* missing) {
  T* buffer = optional_region<T>(base, layout, name);
  if (buffer == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return buffer;
}

// The bytes of the layout's buffer `name` (0 when it has none).
size_t region_bytes(const Layout& layout, const char* name) {
  const auto* at = entry(layout, name);
  return at == nullptr ? 0 : at->second;
}

size_t layout_bytes(const Layout& layout) {
  size_t end = 0;
  for (const auto& [name, at] : layout) end = std::max(end, at.first + at.second);
  return end;
}

// The ids-first dispatch and the windowed one, and their per-block histograms (local device memory, read only by
// those kernels; never read before written in the same call: no zeroing). Without them the fused dispatch sends
// first, and a windowed dispatch fails at its launch (an allocation that failed on one rank must not fail a
// collective creation on that rank alone).
void choose_dispatch_order(Context* ctx, int ids_first_min_tokens) {
  const Sizes& s = ctx->s;
  ctx->block_counts = nullptr;
  ctx->ids_first = ctx->p2p && s.dp_size == 1 && s.max_tokens >= ids_first_min_tokens && !windowed(s);
  const size_t count_bytes = static_cast<size_t>(s.local_experts) * s.num_dp * kMaxBlocksPerSm * s.sm_count *
                             sizeof(int32_t);
  if ((ctx->ids_first || windowed(s)) && cudaMalloc(&ctx->block_counts, count_bytes) != cudaSuccess) {
    ctx->block_counts = nullptr;
    ctx->ids_first = false;
  }
}

// The low-latency path (Context::flagged) where the layout holds its buffers (a low-latency MoEComm's), large enough
// for this context's sizes, on NVLink, unwindowed, with rows of whole flagged pairs and combine chunks of 8 columns
// (jax_moe_comm decides the same before it sizes the layout).
bool takes_flagged_path(const Context& ctx, const Layout& layout) {
  const Sizes& s = ctx.s;
  const size_t slots = static_cast<size_t>(s.world) * s.slots_per_source;
  return ctx.p2p && !windowed(s) && s.payload_bytes % 8 == 0 && s.scale_cols % 2 == 0 && s.hidden % 8 == 0 &&
         region_bytes(layout, "flagged_rows") >= slots * flagged_row_words(s) * 8 &&
         region_bytes(layout, "flagged_ids") >= slots * s.experts_per_token * 8 &&
         region_bytes(layout, "flagged_combine") >=
             static_cast<size_t>(s.max_tokens) * s.experts_per_token * flagged_combine_words(s) * 8;
}

// The context's copy in device memory (Context::on_device), for the kernels' failure paths.
std::string copy_to_device(Context* ctx) {
  Context* on_device = nullptr;
  if (cudaMalloc(&on_device, sizeof(Context)) != cudaSuccess) return "copying a context to the device failed";
  ctx->on_device = on_device;
  if (cudaMemcpy(on_device, ctx, sizeof(Context), cudaMemcpyHostToDevice) != cudaSuccess)
    return "copying a context to the device failed";
  return {};
}

}  // namespace

// Thread t puts this PE's answer (1 + reached) into slot my_pe of PE t's words; quiet: landed when the kernel ends.
__global__ void publish_reach(int32_t* words, int32_t answer, int n_pes, int my_pe) {
  for (int pe = threadIdx.x; pe < n_pes; pe += blockDim.x) nvshmem_int_p(words + my_pe, answer, pe);
  nvshmem_quiet();
}

bool job_on_nvlink(const std::vector<int32_t>& pe_of_rank, std::string* error) {
  // Symmetric words, one per PE of the job: each PE puts its answer into every PE's slot of it, then each ANDs what
  // landed. Device puts and host barriers only: NVSHMEM's on-stream reductions refuse PEs that share a GPU.
  const int n_pes = nvshmem_n_pes(), me = nvshmem_my_pe();
  auto* words = static_cast<int32_t*>(nvshmem_malloc(n_pes * sizeof(int32_t)));
  if (words == nullptr) {
    *error = "nvshmem_malloc of the job's NVLink answers failed";
    return false;
  }
  bool reached = pe_of_rank.size() <= static_cast<size_t>(kMaxNvlinkPeers);
  for (int32_t pe : pe_of_rank) reached = reached && pe >= 0 && pe < n_pes && nvshmem_ptr(words, pe) != nullptr;
  // On a stream of its own, waited for alone (as zero_context: not the work XLA has queued).
  std::vector<int32_t> answers(n_pes, 0);
  cudaStream_t stream = nullptr;
  bool ok = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
            cudaMemsetAsync(words, 0, n_pes * sizeof(int32_t), stream) == cudaSuccess &&
            cudaStreamSynchronize(stream) == cudaSuccess;
  nvshmem_barrier_all();  // every PE's words are zero before anyone puts into them
  if (ok) {
    publish_reach<<<1, 256, 0, stream>>>(words, reached ? 2 : 1, n_pes, me);
    ok = cudaGetLastError() == cudaSuccess && cudaStreamSynchronize(stream) == cudaSuccess;
  }
  nvshmem_barrier_all();  // every PE's puts have landed
  ok = ok && cudaMemcpyAsync(answers.data(), words, n_pes * sizeof(int32_t), cudaMemcpyDeviceToHost, stream) ==
                 cudaSuccess && cudaStreamSynchronize(stream) == cudaSuccess;
  if (stream != nullptr) cudaStreamDestroy(stream);
  nvshmem_free(words);
  if (!ok) {
    *error = "agreeing on the job's NVLink reach failed";
    return false;
  }
  return std::all_of(answers.begin(), answers.end(), [](int32_t a) { return a == 2; });
}

Context* create_context(const Sizes& sizes, const Layout& layout, const std::vector<int32_t>& pe_of_rank, bool staged,
                        int ids_first_min_tokens, const std::vector<int32_t>& node_of_rank, std::string* error) {
  // The EP group: `world` distinct PEs of the job, this PE at position `rank`.
  bool group_ok = pe_of_rank.size() == static_cast<size_t>(sizes.world) && sizes.rank >= 0 &&
                  sizes.rank < sizes.world && pe_of_rank[sizes.rank] == nvshmem_my_pe();
  std::vector<int32_t> sorted(pe_of_rank);
  std::sort(sorted.begin(), sorted.end());
  group_ok = group_ok && std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end() && !sorted.empty() &&
             sorted.front() >= 0 && sorted.back() < nvshmem_n_pes();
  if (!group_ok) {
    *error = "the EP group's PEs must be world distinct PEs of the job, this PE at position rank";
    return nullptr;
  }
  if (!node_of_rank.empty() && node_of_rank.size() != static_cast<size_t>(sizes.world)) {
    *error = "node_of_rank must name a node for each rank of the EP group";
    return nullptr;
  }
  const size_t total = layout_bytes(layout);
  // One allocation (collective: same size on every rank), carved into the buffers; zeroed once. No word is ever
  // reset: every word a rank waits for carries the round trip's epoch.
  char* base = static_cast<char*>(nvshmem_malloc(total));
  if (base == nullptr) {
    *error = "nvshmem_malloc of " + std::to_string(total) +
             " bytes failed: the symmetric heap is too small; set NVSHMEM_SYMMETRIC_SIZE (before "
             "jax_moe_comm.initialize) to at least the sum of comm.symmetric_bytes of every MoEComm, plus margin";
    return nullptr;
  }
  auto* ctx = new Context{};
  ctx->s = sizes;
  ctx->base = base;
  ctx->symmetric_bytes = total;
  std::string missing;
  ctx->dispatch_staging = optional_region<char>(base, layout, "dispatch_staging");
  ctx->dispatch_slots = region<char>(base, layout, "dispatch_slots", &missing);
  ctx->dispatch_ids = region<int32_t>(base, layout, "dispatch_ids", &missing);
  ctx->dispatch_ready = region<uint64_t>(base, layout, "dispatch_ready", &missing);
  ctx->dispatch_routes = optional_region<int32_t>(base, layout, "dispatch_routes");
  ctx->dispatch_counts = optional_region<int32_t>(base, layout, "dispatch_counts");
  ctx->dest_rows = optional_region<int32_t>(base, layout, "dest_rows");
  ctx->group_routes = optional_region<int32_t>(base, layout, "group_routes");
  ctx->group_counts = optional_region<int32_t>(base, layout, "group_counts");
  ctx->combine_staging = optional_region<char>(base, layout, "combine_staging");
  ctx->combine_slots = region<char>(base, layout, "combine_rows", &missing);
  ctx->combine_flags = region<uint64_t>(base, layout, "combine_flags", &missing);
  ctx->sync_flags = region<uint64_t>(base, layout, "sync_flags", &missing);
  ctx->combine_weights = region<float>(base, layout, "combine_weights", &missing);
  ctx->weights_ready = region<uint64_t>(base, layout, "weights_ready", &missing);
  ctx->combine_partials = ctx->combine_slots;
  ctx->partials_ready = region<uint64_t>(base, layout, "partials_ready", &missing);
  ctx->window_ready = region<uint64_t>(base, layout, "window_ready", &missing);
  ctx->dispatch_window_free = region<uint64_t>(base, layout, "dispatch_window_free", &missing);
  ctx->combine_window_free = region<uint64_t>(base, layout, "combine_window_free", &missing);
#ifdef JMC_MEASUREMENT
  ctx->probe_ready = region<uint64_t>(base, layout, "probe_ready", &missing);
#endif
  ctx->round_failures = region<int32_t>(base, layout, "round_failures", &missing);
  ctx->fatal_failures = region<int32_t>(base, layout, "fatal_failures", &missing);
  ctx->abort_word = region<uint64_t>(base, layout, "abort_word", &missing);
  ctx->row_of = region<int32_t>(base, layout, "row_of", &missing);
  ctx->expert_tally = region<int32_t>(base, layout, "expert_tally", &missing);
  ctx->flagged_rows = optional_region<uint64_t>(base, layout, "flagged_rows");
  ctx->flagged_ids = optional_region<uint64_t>(base, layout, "flagged_ids");
  ctx->flagged_combine = optional_region<uint64_t>(base, layout, "flagged_combine");
  void* host = nullptr;
  const size_t map_bytes = pe_of_rank.size() * sizeof(int32_t);
  const bool ok = missing.empty() && cudaMalloc(&ctx->local, sizeof(LocalWords)) == cudaSuccess &&
                  cudaMalloc(&ctx->pe_of_rank, map_bytes) == cudaSuccess &&
                  cudaMemcpy(ctx->pe_of_rank, pe_of_rank.data(), map_bytes, cudaMemcpyHostToDevice) == cudaSuccess &&
                  cudaHostAlloc(&host, sizeof(HostWords), cudaHostAllocMapped) == cudaSuccess &&
                  cudaHostGetDevicePointer(reinterpret_cast<void**>(&ctx->host_words), host, 0) == cudaSuccess;
  ctx->host_view = static_cast<HostWords*>(host);
  ctx->host_state = new HostState{};
  ctx->side = new SideStream{};
  int least = 0, greatest = 0;
  const bool side_ok =
      cudaDeviceGetStreamPriorityRange(&least, &greatest) == cudaSuccess &&
      cudaStreamCreateWithPriority(&ctx->side->stream, cudaStreamNonBlocking, greatest) == cudaSuccess &&
      cudaEventCreateWithFlags(&ctx->side->inputs, cudaEventDisableTiming) == cudaSuccess &&
      cudaEventCreateWithFlags(&ctx->side->sent, cudaEventDisableTiming) == cudaSuccess;
  if (!ok || !side_ok) {
    *error = !missing.empty() ? "the layout lacks " + missing
             : ok             ? "creating a context's send stream failed"
                              : "allocating a context's local words failed";
    destroy_context(ctx, /*collective=*/false);
    return nullptr;
  }
  // A direct peer's heap is mapped here, at a fixed offset from ours (so for every buffer of this allocation). Every
  // peer direct: the NVLink path; else the staged path, which stores into the direct ones and puts to the others.
  ctx->p2p = !staged && sizes.world <= kMaxNvlinkPeers;
  for (int r = 0; r < sizes.world && r < kMaxNvlinkPeers && !staged; ++r) {
    const char* peer = static_cast<const char*>(nvshmem_ptr(base, pe_of_rank[r]));
    const bool same_node = node_of_rank.empty() || node_of_rank[r] == node_of_rank[sizes.rank];
    ctx->direct[r] = peer != nullptr && same_node;
    if (ctx->direct[r]) ctx->peer_offset[r] = peer - base;
  }
  for (int r = 0; r < sizes.world && ctx->p2p; ++r) ctx->p2p = ctx->direct[r];
  if (!ctx->p2p && (ctx->dispatch_staging == nullptr || ctx->combine_staging == nullptr ||
                    ctx->dispatch_routes == nullptr || ctx->dispatch_counts == nullptr || ctx->dest_rows == nullptr ||
                    ctx->group_routes == nullptr || ctx->group_counts == nullptr)) {
    *error = "the layout has no staging buffers, but this EP group sends through them (staged, or a peer off NVLink)";
    destroy_context(ctx, /*collective=*/false);
    return nullptr;
  }
  ctx->flagged = takes_flagged_path(*ctx, layout);
  choose_dispatch_order(ctx, ids_first_min_tokens);
#ifdef JMC_MEASUREMENT
  if (cudaMalloc(&ctx->marks, kPhases * kMarks * sizeof(uint64_t)) != cudaSuccess ||
      cudaMemset(ctx->marks, 0, kPhases * kMarks * sizeof(uint64_t)) != cudaSuccess) {
    ctx->marks = nullptr;  // no stamps: take_kernel_marks says so
  }
  const size_t traffic_bytes = traffic_words(sizes.world) * sizeof(uint64_t);
  if (cudaMalloc(&ctx->traffic, traffic_bytes) != cudaSuccess ||
      cudaMemset(ctx->traffic, 0, traffic_bytes) != cudaSuccess) {
    ctx->traffic = nullptr;  // no counts: take_traffic says so
  }
#endif
  *error = zero_context(ctx);
  if (error->empty()) *error = copy_to_device(ctx);
  if (!error->empty()) {
    destroy_context(ctx, false);
    return nullptr;
  }
  nvshmem_barrier_all();  // every rank's buffers are zero before anyone may put into them
  return ctx;
}

Context* share_context(Context* owner, const Sizes& sizes, const Layout& layout, int ids_first_min_tokens,
                       std::string* error) {
  const Sizes& o = owner->s;
  if (owner->owner != nullptr || sizes.rank != o.rank || sizes.world != o.world || sizes.dp_size != o.dp_size ||
      sizes.max_tokens != o.max_tokens || sizes.experts_per_token != o.experts_per_token ||
      sizes.num_experts != o.num_experts) {
    *error = "a shared context needs its owner's EP group, routing and token count";
    return nullptr;
  }
  // Every buffer whose size depends on the payload or the capacity holds this config's too.
  const size_t window = static_cast<size_t>(sizes.world) * sizes.window_slots;
  const size_t combine_tokens = std::min(sizes.max_tokens, window_tokens(sizes));
  const bool fits =
      layout_bytes(layout) == owner->symmetric_bytes &&
      region_bytes(layout, "dispatch_slots") >= window * sizes.token_stride &&
      region_bytes(layout, "combine_rows") >= combine_tokens * sizes.experts_per_token * sizes.combine_stride &&
      (owner->dispatch_staging == nullptr ||
       region_bytes(layout, "dispatch_staging") >= static_cast<size_t>(sizes.max_tokens) *
                                                       (std::min(sizes.experts_per_token, sizes.world) + 1) *
                                                       sizes.token_stride) &&
      (owner->combine_staging == nullptr ||
       region_bytes(layout, "combine_staging") >=
           static_cast<size_t>(std::max(sizes.capacity, sizes.world * sizes.slots_per_source)) * sizes.combine_stride);
  if (!fits) {
    *error = "the owner's buffers are too small for the shared context's config";
    return nullptr;
  }
  auto* ctx = new Context(*owner);  // the owner's buffers, words, host state and NVLink offsets
  ctx->s = sizes;
  ctx->symmetric_bytes = 0;
  ctx->owner = owner;
  ctx->on_device = nullptr;
#ifdef JMC_MEASUREMENT
  ctx->marks = nullptr;  // the owner's stamps only
  ctx->traffic = nullptr;  // and the owner's counts
#endif
  ctx->flagged = owner->flagged && takes_flagged_path(*ctx, layout);
  choose_dispatch_order(ctx, ids_first_min_tokens);
  *error = copy_to_device(ctx);
  if (!error->empty()) {
    destroy_context(ctx, false);
    return nullptr;
  }
  return ctx;
}

// Zeroes the symmetric buffers, the local words (the first round trip's epoch is 1) and the host words. On a
// stream of its own, waited for alone: a device-wide synchronisation would also wait for work already queued by
// XLA, which may itself wait for a host callback.
std::string zero_context(Context* ctx) {
  cudaStream_t stream = nullptr;
  LocalWords first{};
  first.epoch = 1;
  const bool ok = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
                  cudaMemsetAsync(ctx->base, 0, ctx->symmetric_bytes, stream) == cudaSuccess &&
                  cudaMemcpyAsync(ctx->local, &first, sizeof(first), cudaMemcpyHostToDevice, stream) == cudaSuccess &&
                  cudaStreamSynchronize(stream) == cudaSuccess;
  if (stream != nullptr) cudaStreamDestroy(stream);
  std::memset(ctx->host_view, 0, sizeof(HostWords));
  *ctx->host_state = HostState{};
  return ok ? std::string() : std::string("zeroing a context's buffers failed");
}

std::string reset_context(Context* ctx) {
  if (ctx->owner != nullptr) return reset_context(ctx->owner);  // one state for both
  // Every rank's kernels have ended (this device's, then the barrier: every rank's) before any buffer is zeroed, and
  // every rank's are zero before any rank's next kernel can write into a peer's.
  if (cudaDeviceSynchronize() != cudaSuccess) return "waiting for the device failed";
  nvshmem_barrier_all();
  std::string error = zero_context(ctx);
  nvshmem_barrier_all();
  return error;
}

namespace {
// A protocol failure as every rank raises it: the entry of the lowest rank that published one (fatal_failures),
// this rank's epoch kept. Two ranks may each time out before the other's abort reaches them; each rank's host then
// holds its own first failure, and without this the processes of one job would raise different texts. Cold path:
// reads device memory on a stream of its own (as zero_context); the publishing ranks completed their puts before
// their kernels ended.
std::vector<int32_t> settled_protocol_failure(Context* ctx, const std::vector<int32_t>& own) {
  std::vector<int32_t> entries(static_cast<size_t>(ctx->s.world) * kStatusWords);
  cudaStream_t stream = nullptr;
  const bool ok = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
                  cudaMemcpyAsync(entries.data(), ctx->fatal_failures, entries.size() * sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, stream) == cudaSuccess &&
                  cudaStreamSynchronize(stream) == cudaSuccess;
  if (stream != nullptr) cudaStreamDestroy(stream);
  if (!ok) return own;
  for (int rank = 0; rank < ctx->s.world; ++rank) {
    const int32_t* entry = entries.data() + static_cast<size_t>(rank) * kStatusWords;
    if (!(entry[kCode] & kFatalCodes)) continue;
    std::vector<int32_t> settled(entry, entry + kStatusWords);
    settled[kEpochWord] = own[kEpochWord];
    return settled;
  }
  return own;
}
}  // namespace

std::vector<int32_t> host_failure(Context* ctx) {
  const volatile int32_t* words = ctx->host_view->failure;
  std::vector<int32_t> out(kStatusWords);
  for (int i = kStatusWords - 1; i >= 0; --i) out[i] = words[i];  // the code word is written last: read it first
  if (out[kCode] & kFatalCodes) return settled_protocol_failure(ctx, out);
  return out;
}

void failure_raised(Context* ctx) {
  if (host_failure(ctx)[kCode] & kFatalCodes)
    ctx->host_state->raised = true;
  else
    reinterpret_cast<volatile int32_t*>(ctx->host_view->failure)[kCode] = 0;
}

std::vector<int32_t> unraised_failure(Context* ctx) {
  cudaDeviceSynchronize();  // a failed wait still leaves what the device reported
  std::vector<int32_t> failure = host_failure(ctx);
  if (failure[kCode] == 0 || ((failure[kCode] & kFatalCodes) && ctx->host_state->raised))
    return std::vector<int32_t>(kStatusWords, 0);
  return failure;
}

#ifdef JMC_MEASUREMENT
namespace {
// `count` device words, read and cleared; empty when they were never allocated or a copy failed.
std::vector<uint64_t> take_device_words(uint64_t* device, size_t count) {
  if (device == nullptr) return {};
  std::vector<uint64_t> words(count, 0);
  const size_t bytes = count * sizeof(uint64_t);
  if (cudaMemcpy(words.data(), device, bytes, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemset(device, 0, bytes) != cudaSuccess)
    return {};
  return words;
}
}  // namespace

std::vector<uint64_t> take_kernel_marks(Context* ctx) { return take_device_words(ctx->marks, kPhases * kMarks); }

std::vector<uint64_t> take_traffic(Context* ctx) {
  return take_device_words(ctx->traffic, traffic_words(ctx->s.world));
}
#endif

namespace {
std::mutex registry_mutex;
std::map<int64_t, Context*>& registry() {
  static std::map<int64_t, Context*> contexts;
  return contexts;
}
int64_t next_context_id = 1;
}  // namespace

int64_t register_context(Context* ctx) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[next_context_id] = ctx;
  return next_context_id++;
}

Context* find_context(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(id);
  return it == registry().end() ? nullptr : it->second;
}

void unregister_context(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().erase(id);
}

void destroy_context(Context* ctx, bool collective) {
  if (ctx->owner != nullptr) {  // what it holds of its own
    if (ctx->block_counts != nullptr) cudaFree(ctx->block_counts);
    if (ctx->on_device != nullptr) cudaFree(const_cast<Context*>(ctx->on_device));
    delete ctx;
    return;
  }
#ifdef JMC_MEASUREMENT
  if (ctx->marks != nullptr) cudaFree(ctx->marks);
  if (ctx->traffic != nullptr) cudaFree(ctx->traffic);
#endif
  if (ctx->block_counts != nullptr) cudaFree(ctx->block_counts);
  if (ctx->local != nullptr) cudaFree(ctx->local);
  if (ctx->pe_of_rank != nullptr) cudaFree(ctx->pe_of_rank);
  if (ctx->on_device != nullptr) cudaFree(const_cast<Context*>(ctx->on_device));
  if (ctx->host_view != nullptr) cudaFreeHost(ctx->host_view);
  delete ctx->host_state;
  if (ctx->side != nullptr) {  // its last send has ended before the buffers it wrote go
    if (ctx->side->stream != nullptr) cudaStreamSynchronize(ctx->side->stream);
    if (ctx->side->inputs != nullptr) cudaEventDestroy(ctx->side->inputs);
    if (ctx->side->sent != nullptr) cudaEventDestroy(ctx->side->sent);
    if (ctx->side->stream != nullptr) cudaStreamDestroy(ctx->side->stream);
    delete ctx->side;
  }
  if (collective) nvshmem_barrier_all();
  nvshmem_free(ctx->base);
  delete ctx;
}

int sm_count() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms;
}

}  // namespace jmc
