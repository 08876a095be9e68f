// nanobind module jax_moe_comm._nvshmem_ext: the host API of runtime.h and the FFI handler capsules.
// The collective calls (init, finalize, create/destroy_context) wait for the other ranks and for the GPU: they
// release the GIL, so a JAX host callback (which needs it) can still run meanwhile.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/string.h>

#include <map>
#include <stdexcept>
#include <string>

#include "handlers.h"
#include "runtime.h"

namespace nb = nanobind;

namespace {

int field(const std::map<std::string, int64_t>& sizes, const char* name) {
  auto it = sizes.find(name);
  if (it == sizes.end()) throw std::invalid_argument(std::string("missing size field ") + name);
  return static_cast<int>(it->second);
}

// The context with this id; a ValueError (nanobind) for an unknown one.
jmc::Context* context(int64_t id) {
  jmc::Context* ctx = jmc::find_context(id);
  if (ctx == nullptr) throw std::invalid_argument("jax_moe_comm: no context " + std::to_string(id) + " (closed?)");
  return ctx;
}

jmc::Sizes sizes_from(const std::map<std::string, int64_t>& d) {
  jmc::Sizes s{};
#define JMC_FIELD(name) s.name = field(d, #name)
  JMC_FIELD(rank); JMC_FIELD(world); JMC_FIELD(dp_size); JMC_FIELD(num_dp);
  JMC_FIELD(max_tokens); JMC_FIELD(experts_per_token); JMC_FIELD(hidden); JMC_FIELD(num_experts);
  JMC_FIELD(local_experts); JMC_FIELD(capacity); JMC_FIELD(align); JMC_FIELD(payload_bytes);
  JMC_FIELD(scale_cols); JMC_FIELD(token_stride); JMC_FIELD(slots_per_source); JMC_FIELD(window_slots);
  JMC_FIELD(combine_stride); JMC_FIELD(sm_count); JMC_FIELD(max_blocks); JMC_FIELD(drop_overflow);
  JMC_FIELD(expert_capacity);
#undef JMC_FIELD
  s.timeout_ns = d.at("timeout_ns");
  return s;
}

}  // namespace

NB_MODULE(_nvshmem_ext, m) {
  m.doc() = "NVSHMEM host API and XLA FFI handlers of jax_moe_comm";

  m.def("build_info", [] {
    const jmc::BuildInfo b = jmc::build_info();
    return std::map<std::string, std::string>{
        {"nvshmem", std::to_string(b.nvshmem_major) + "." + std::to_string(b.nvshmem_minor) + "." +
                        std::to_string(b.nvshmem_patch)},
        {"cudart_build", std::to_string(b.cudart_build)},
        {"cudart_runtime", std::to_string(b.cudart_runtime)}};
  }, "NVSHMEM headers and CUDA runtime versions this extension was built with / runs on.");
  m.def("unique_id", [] { std::string id = jmc::unique_id(); return nb::bytes(id.data(), id.size()); },
        "A fresh NVSHMEM unique id (128 bytes), to be shared with every rank.");
  m.def("init", [](nb::bytes uid, int rank, int nranks, int device) {
    const std::string id(uid.c_str(), uid.size());
    nb::gil_scoped_release released;
    return jmc::init(id, rank, nranks, device);
  }, nb::arg("uid"), nb::arg("rank"), nb::arg("nranks"), nb::arg("device"),
        "Initialize NVSHMEM from a unique id (or attach this library's device state if already initialized). "
        "Returns 0 on success.");
  m.def("init_status", &jmc::init_status);
  m.def("my_pe", &jmc::my_pe);
  m.def("n_pes", &jmc::n_pes);
  m.def("finalize", &jmc::finalize, nb::call_guard<nb::gil_scoped_release>());
  m.def("host_version", &jmc::host_version, "(major, minor, patch) of the loaded libnvshmem_host.");
  m.def("sm_count", &jmc::sm_count);
  m.def("constants", [] {
    return std::map<std::string, int>{{"status_words", jmc::kStatusWords},
                                      {"max_experts_per_token", jmc::kMaxExpertsPerToken},
                                      {"max_nvlink_peers", jmc::kMaxNvlinkPeers},
                                      {"fatal_codes", jmc::kFatalCodes}, {"refused", jmc::kRefused},
                                      {"bfloat16", jmc::kBf16}, {"float16", jmc::kF16}, {"float32", jmc::kF32}};
  }, "The kernels' constants: status words, error codes (errors.py checks its own against them) and the RowType "
     "code of each combine dtype (the handlers' integer dtype attributes).");
  m.def("measurement_build", [] {
#ifdef JMC_MEASUREMENT
    return true;
#else
    return false;
#endif
  }, "Whether this build has the measurement instruments (kernel marks, the bench's floor probes).");
  m.def("set_messages", &jmc::set_messages,
        "The texts of failures raised by the check handler (from jax_moe_comm/errors.py).");
  m.def("describe_failure", &jmc::describe_failure, "A failure's text, as the check handler raises it.");
  m.def("create_context", [](const std::map<std::string, int64_t>& sizes,
                             const std::map<std::string, std::pair<size_t, size_t>>& layout,
                             const std::vector<int32_t>& pe_of_rank, bool staged, int ids_first_min_tokens,
                             const std::vector<int32_t>& node_of_rank) {
    std::string error;
    jmc::Context* ctx;
    {
      nb::gil_scoped_release released;
      ctx = jmc::create_context(sizes_from(sizes), layout, pe_of_rank, staged, ids_first_min_tokens, node_of_rank,
                                &error);
    }
    if (ctx == nullptr) throw std::runtime_error("jax_moe_comm: " + error);
    return jmc::register_context(ctx);
  }, nb::arg("sizes"), nb::arg("layout"), nb::arg("pe_of_rank"), nb::arg("staged"), nb::arg("ids_first_min_tokens"),
        nb::arg("node_of_rank") = std::vector<int32_t>(),
        "Collective: allocate one MoEComm's symmetric buffers (layout: name -> (offset, bytes)) for an EP group "
        "(pe_of_rank: the NVSHMEM PE of each of its ranks; node_of_rank, for tests: ranks on another node than this "
        "one are reached by puts); returns the context's id, the handlers' `context` attribute.");
  m.def("share_context", [](int64_t owner, const std::map<std::string, int64_t>& sizes,
                            const std::map<std::string, std::pair<size_t, size_t>>& layout, int ids_first_min_tokens) {
    std::string error;
    jmc::Context* ctx = jmc::share_context(context(owner), sizes_from(sizes), layout, ids_first_min_tokens, &error);
    if (ctx == nullptr) throw std::runtime_error("jax_moe_comm: " + error);
    return jmc::register_context(ctx);
  }, nb::arg("owner"), nb::arg("sizes"), nb::arg("layout"), nb::arg("ids_first_min_tokens"),
        "A context of another config on the owner's buffers and protocol state (not collective); returns its id. "
        "Destroy it before its owner.");
  m.def("destroy_context", [](int64_t id) {
    jmc::Context* ctx = context(id);
    jmc::unregister_context(id);
    nb::gil_scoped_release released;
    jmc::destroy_context(ctx);
  }, "Collective: free a context's symmetric buffers.");
  m.def("reset_context", [](int64_t id) {
    jmc::Context* ctx = context(id);
    std::string error;
    {
      nb::gil_scoped_release released;
      error = jmc::reset_context(ctx);
    }
    if (!error.empty()) throw std::runtime_error("jax_moe_comm: reset: " + error);
  }, "Collective: after a failure, the context as created (waits for this device first).");
  m.def("host_failure", [](int64_t id) { return jmc::host_failure(context(id)); },
        "The first failure the device has told the host of and not yet cleared (status words; code 0: none).");
  m.def("failure_raised", [](int64_t id) { jmc::failure_raised(context(id)); },
        "The failure has been raised: a routing error is cleared, a protocol failure stays (until reset).");
  m.def("unraised_failure", [](int64_t id) {
    jmc::Context* ctx = context(id);
    nb::gil_scoped_release released;
    return jmc::unraised_failure(ctx);
  }, "A failure no check has raised yet (status words; code 0: none), once this device is idle (waits for it).");
  m.def("job_on_nvlink", [](const std::vector<int32_t>& pe_of_rank) {
    std::string error;
    bool on_nvlink;
    {
      nb::gil_scoped_release released;
      on_nvlink = jmc::job_on_nvlink(pe_of_rank, &error);
    }
    if (!error.empty()) throw std::runtime_error("jax_moe_comm: " + error);
    return on_nvlink;
  }, nb::arg("pe_of_rank"),
        "Collective (every PE of the job): whether on every PE each peer of its EP group (pe_of_rank) is reachable "
        "by NVLink stores. Decides whether a context needs staging buffers (one size on every PE).");
  m.def("context_bytes", [](int64_t id) { return context(id)->symmetric_bytes; },
        "Bytes of symmetric heap the context allocated on this PE.");
  m.def("context_p2p", [](int64_t id) { return context(id)->p2p; },
        "True when the context stores straight into every peer's buffers (NVLink): combine can pre-reduce.");
  m.def("context_direct", [](int64_t id) {
    const jmc::Context* ctx = context(id);
    std::vector<bool> direct(ctx->s.world);
    for (int r = 0; r < ctx->s.world; ++r) direct[r] = r < jmc::kMaxNvlinkPeers && ctx->direct[r];
    return direct;
  }, "Per rank of the EP group: True where this rank stores into its buffers (NVLink), False where it puts.");
  m.def("context_flagged", [](int64_t id) { return context(id)->flagged; },
        "True when the context's fused calls take the low-latency path (flagged words).");
#ifdef JMC_MEASUREMENT
  m.def("take_kernel_marks", [](int64_t id) { return jmc::take_kernel_marks(context(id)); },
        "[phase * kMarks + mark] globaltimer ns of the last round trip's kernel steps, cleared (measurement builds).");
  m.def("take_traffic", [](int64_t id) { return jmc::take_traffic(context(id)); },
        "What this rank sent by NVSHMEM puts since the last call, cleared (measurement builds): [phase][rank] "
        "{puts, bytes}, then [rank] signals.");
#endif
  m.def("launch_phase", [](int64_t id, const std::string& phase, const std::map<std::string, int64_t>& args,
                           intptr_t stream) {
    const std::string error = jmc::launch_phase(jmc::find_context(id), phase, args, stream);
    if (!error.empty()) throw std::runtime_error("jax_moe_comm " + phase + ": CUDA launch failed: " + error);
  }, nb::arg("ctx"), nb::arg("phase"), nb::arg("args"), nb::arg("stream") = 0,
        "Launch one phase's kernel without XLA (device pointers as integers); tests/gpu/kernel_harness.py.");
  m.def("handlers", [] {
    return std::map<std::string, nb::capsule>{
        {"dispatch_send", nb::capsule(reinterpret_cast<void*>(jmc_dispatch_send))},
        {"dispatch_recv", nb::capsule(reinterpret_cast<void*>(jmc_dispatch_recv))},
        {"combine_send", nb::capsule(reinterpret_cast<void*>(jmc_combine_send))},
        {"combine_recv", nb::capsule(reinterpret_cast<void*>(jmc_combine_recv))},
        {"dispatch", nb::capsule(reinterpret_cast<void*>(jmc_dispatch))},
        {"combine", nb::capsule(reinterpret_cast<void*>(jmc_combine))},
#ifdef JMC_MEASUREMENT
        {"probe", nb::capsule(reinterpret_cast<void*>(jmc_probe))},
#endif
        {"check", nb::capsule(reinterpret_cast<void*>(jmc_check))}};
  }, "XLA FFI handler capsules for jax.ffi.register_ffi_target(..., platform='CUDA').");
  m.def("raise_if_failed_handlers", [] {
    return std::map<std::string, nb::capsule>{
        {"cpu", nb::capsule(reinterpret_cast<void*>(jmc_raise_if_failed_host))},
        {"CUDA", nb::capsule(reinterpret_cast<void*>(jmc_raise_if_failed_device))}};
  }, "The status check's XLA FFI handler capsules by platform (errors.py registers them).");
}
