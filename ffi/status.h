// A round trip's status and its failure as the user reads it: the status words and error codes (shared with
// jax_moe_comm/errors.py), the failure texts and the status check's CPU handler. Plain C++ without CUDA: the status
// module (_status_ext, built wherever a C++ compiler is) and the CUDA extension both compile status.cc.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace jmc {

// Error codes shared with jax_moe_comm/errors.py (status[0] is a bit set). The first three are routing errors: the
// round trip still completes on every rank (offending rows dropped). The others are protocol failures: after one the
// MoEComm refuses every phase (kRefused) until it is reset.
enum ErrorCode : int32_t {
  kBadExpertId = 1,
  kRepeatedExpertId = 2,
  kCapacityOverflow = 4,
  kTimeout = 8,
  kOutOfOrder = 16,
  kRefused = 32,  // set on the copy of the failure that a refused phase reports
};
constexpr int32_t kFatalCodes = kTimeout | kOutOfOrder;

// A status, int32[kStatusWords]: {code, phase, rank that found it, detail_a, detail_b, epoch, 0, 0}. For kTimeout
// detail_a is the peer waited for; for id errors (token, id); for overflow (rows needed, capacity); for kOutOfOrder
// (the phase the MoEComm expected next, the phase that ran). The epoch is the round trip's (context.h: tagged).
constexpr int kStatusWords = 8;
enum StatusWord : int { kCode = 0, kPhaseWord = 1, kRankWord = 2, kDetailA = 3, kDetailB = 4, kEpochWord = 5 };

// The text of a failure (a status's words), from the templates jax_moe_comm/errors.py gives once (set_messages):
// header (with {phase}, {rank}), one part per code bit (with {a}, {b}, {over} = a - b, {expected}: the phase named
// by a), joined, and a suffix for protocol failures.
struct Messages {
  std::string header, joiner, fatal_suffix;
  std::map<int32_t, std::string> parts;
  std::vector<std::string> phases;
};
void set_messages(const std::string& header, const std::map<int32_t, std::string>& parts, const std::string& joiner,
                  const std::string& fatal_suffix, const std::vector<std::string>& phases);
std::string describe_failure(const std::vector<int32_t>& words);

// A status's failure as a call's error (kAborted, the failure's text); success for a status without one.
xla::ffi::Error raise_if_failed(const std::vector<int32_t>& words);
// InvalidArgument unless the buffer holds one status.
xla::ffi::Error status_words_checked(const xla::ffi::Buffer<xla::ffi::S32>& status);

}  // namespace jmc

extern "C" {
// A status's failure raised as the call's error, on the CPU (the status is host memory).
XLA_FFI_Error* jmc_raise_if_failed_host(XLA_FFI_CallFrame* call_frame);
}
