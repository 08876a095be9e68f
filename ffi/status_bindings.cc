// nanobind module jax_moe_comm._status_ext: the status check's CPU handler and the failure texts, for an install
// without the CUDA extension (which holds the same, status.cc, beside its GPU handler). With it a failed round trip's
// error on the CPU begins with our message, as with the CUDA extension.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <string>

#include "status.h"

namespace nb = nanobind;

NB_MODULE(_status_ext, m) {
  m.doc() = "The status check's CPU XLA FFI handler of jax_moe_comm, and the texts it raises";
  m.def("constants", [] {
    return std::map<std::string, int>{{"status_words", jmc::kStatusWords}, {"fatal_codes", jmc::kFatalCodes},
                                      {"refused", jmc::kRefused}};
  }, "The status's constants (errors.py checks its own against them).");
  m.def("set_messages", &jmc::set_messages,
        "The texts of failures raised by the check handler (from jax_moe_comm/errors.py).");
  m.def("describe_failure", &jmc::describe_failure, "A failure's text, as the check handler raises it.");
  m.def("raise_if_failed_handlers", [] {
    return std::map<std::string, nb::capsule>{
        {"cpu", nb::capsule(reinterpret_cast<void*>(jmc_raise_if_failed_host))}};
  }, "The status check's XLA FFI handler capsule by platform (errors.py registers it).");
}
