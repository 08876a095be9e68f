// Host API of the extension (plain C++: included by the nanobind bindings, which the host compiler builds).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "context.h"

namespace jmc {

struct BuildInfo {
  int nvshmem_major, nvshmem_minor, nvshmem_patch;  // NVSHMEM headers/device library at build time
  int cudart_build, cudart_runtime;
};

BuildInfo build_info();
std::string unique_id();                                      // 128 bytes; empty on failure
int init(const std::string& uid, int rank, int nranks, int device);  // 0 on success; attaches if already initialized
int init_status();
int my_pe();
int n_pes();
void finalize();
std::tuple<int, int, int> host_version();  // NVSHMEM version of the loaded libnvshmem_host

// The symmetric allocation's layout, computed by jax_moe_comm (nvshmem_backend.symmetric_layout): buffer name ->
// (offset, bytes).
using Layout = std::map<std::string, std::pair<size_t, size_t>>;

// Collective over every PE of the job: true when, on every PE, each PE of its EP group (pe_of_rank) is reachable by
// loads and stores (NVLink) and the group fits a Context's peer offsets. On failure false with *error set.
bool job_on_nvlink(const std::vector<int32_t>& pe_of_rank, std::string* error);

// Collective: one MoEComm's symmetric buffers. `staged`: send through symmetric staging and puts even where NVLink
// stores would reach every peer; `ids_first_min_tokens`: from that max_tokens on (NVLink, one replica per DP group)
// the fused dispatch sends its ids first (Context::ids_first). `node_of_rank` (tests; empty: none): a node per rank
// of the group, the ranks on other nodes than this one reached by puts as if off NVLink (Context::direct).
Context* create_context(const Sizes& sizes, const Layout& layout, const std::vector<int32_t>& pe_of_rank, bool staged,
                        int ids_first_min_tokens, const std::vector<int32_t>& node_of_rank, std::string* error);

// Not collective: a context of another config (`sizes`: same EP group, routing and token count) on `owner`'s
// buffers and protocol state, for round trips that run strictly in turn with the owner's (an fp8 layer's backward
// round trips in their gradient dtype): one epoch sequence, one phase order, one failure state for both. `layout`
// is the owner's, with each buffer large enough for either config (checked). Destroyed before its owner; resetting
// either resets both.
Context* share_context(Context* owner, const Sizes& sizes, const Layout& layout, int ids_first_min_tokens,
                       std::string* error);

// Contexts by id, the handlers' `context` attribute (ids are never reused: a compiled program names its context,
// and a cached program must never reach another one). register_context returns the new id.
int64_t register_context(Context* ctx);
Context* find_context(int64_t id);  // null for an unknown (destroyed) id
void unregister_context(int64_t id);
void destroy_context(Context* ctx, bool collective = true);  // collective unless told otherwise (a failed creation)
std::string zero_context(Context* ctx);  // every buffer and word as created; empty on success
// Collective: after a failure, the context as created (every rank's kernels must have ended). Empty on success.
std::string reset_context(Context* ctx);
// The first failure the device has told the host of and not yet cleared (HostWords::failure; code 0: none), read
// with no synchronisation.
std::vector<int32_t> host_failure(Context* ctx);
// The failure has been raised: a routing error is cleared (raised once), a protocol failure stays (every check raises
// it until reset) and counts as raised.
void failure_raised(Context* ctx);
// A failure no check has raised yet (code 0: none), once this device has finished its queued work (waits for it).
std::vector<int32_t> unraised_failure(Context* ctx);

#ifdef JMC_MEASUREMENT
// The kernel marks of the context's last round trip ([phase][Mark] globaltimer ns, 0 = not stamped), cleared.
// Synchronous (a device-to-host copy). Measurement builds only (JAX_MOE_COMM_MEASUREMENT).
std::vector<uint64_t> take_kernel_marks(Context* ctx);
// What the context sent by NVSHMEM since the last call (traffic_words: [phase][rank] {puts, bytes}, then [rank]
// signals), cleared. Synchronous; measurement builds only.
std::vector<uint64_t> take_traffic(Context* ctx);
#endif
int sm_count();

// One phase's kernel without XLA (raw_launch.cu): device pointers and the handlers' attributes by name, on a CUDA
// stream (0: the legacy default stream). Returns the launch's CUDA error, empty if none.
std::string launch_phase(Context* ctx, const std::string& phase, const std::map<std::string, int64_t>& args,
                         intptr_t stream);

}  // namespace jmc
