// Host API of the extension (plain C++: included by the nanobind bindings, which the host compiler builds).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
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

size_t symmetric_bytes(const Sizes& sizes);
Context* create_context(const Sizes& sizes, std::string* error);  // collective
void destroy_context(Context* ctx);                                // collective
// The kernel marks of the context's last round trip ([phase][Mark] globaltimer ns, 0 = not stamped), cleared; empty
// unless JAX_MOE_COMM_KERNEL_MARKS was set when it was created. Synchronous (a device-to-host copy).
std::vector<uint64_t> take_kernel_marks(Context* ctx);
int sm_count();

// One phase's kernel without XLA (raw_launch.cu): device pointers and the handlers' attributes by name, on a CUDA
// stream (0: the legacy default stream). Returns the launch's CUDA error, empty if none.
std::string launch_phase(Context* ctx, const std::string& phase, const std::map<std::string, int64_t>& args,
                         intptr_t stream);

}  // namespace jmc
