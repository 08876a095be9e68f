// The failure texts and the status check's CPU handler (status.h). Plain C++: compiled into the status module and
// into the CUDA extension.
#include "status.h"

namespace ffi = xla::ffi;

namespace jmc {
namespace {

Messages& messages() {
  static Messages table;
  return table;
}

void replace_all(std::string& text, const std::string& key, const std::string& value) {
  for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at + value.size()))
    text.replace(at, key.size(), value);
}

}  // namespace

void set_messages(const std::string& header, const std::map<int32_t, std::string>& parts, const std::string& joiner,
                  const std::string& fatal_suffix, const std::vector<std::string>& phases) {
  messages() = Messages{header, joiner, fatal_suffix, parts, phases};
}

std::string describe_failure(const std::vector<int32_t>& words) {
  const Messages& m = messages();
  const int32_t code = words[kCode], phase = words[kPhaseWord];
  const auto phase_name = [&](int32_t p) {
    return p >= 0 && p < static_cast<int32_t>(m.phases.size()) ? m.phases[p] : "phase " + std::to_string(p);
  };
  std::string text = m.header;
  replace_all(text, "{phase}", phase_name(phase));
  replace_all(text, "{rank}", std::to_string(words[kRankWord]));
  std::string parts;
  for (const auto& [bit, part] : m.parts) {
    if (!(code & bit)) continue;
    std::string one = part;
    replace_all(one, "{a}", std::to_string(words[kDetailA]));
    replace_all(one, "{b}", std::to_string(words[kDetailB]));
    replace_all(one, "{over}", std::to_string(words[kDetailA] - words[kDetailB]));
    replace_all(one, "{expected}", phase_name(words[kDetailA]));
    parts += (parts.empty() ? "" : m.joiner) + one;
  }
  return text + parts + ((code & kFatalCodes) ? m.fatal_suffix : "");
}

ffi::Error raise_if_failed(const std::vector<int32_t>& words) {
  if (words[kCode] == 0) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kAborted, describe_failure(words));
}

ffi::Error status_words_checked(const ffi::Buffer<ffi::S32>& status) {
  if (status.element_count() == kStatusWords) return ffi::Error::Success();
  return ffi::Error::InvalidArgument("jax_moe_comm: a status has " + std::to_string(kStatusWords) + " words, got " +
                                     std::to_string(status.element_count()));
}

namespace {

// The status check that runs where XLA runs it (check_errors="sync", and every check of the reference backend):
// this call's error is the failure's text when the status's code is non-zero, so the user's error begins with our
// message (a host callback's would begin with its Python stack). `ok` is 0 when it returns. On the GPU:
// handlers.cu's RaiseIfFailedDevice.
ffi::Error RaiseIfFailedHost(ffi::Buffer<ffi::S32> status,             // [kStatusWords] the round trip's status
                             ffi::AnyBuffer /*after*/,                   // orders the check after the round trip
                             ffi::Result<ffi::Buffer<ffi::S32>> ok) {    // []: 0
  if (ffi::Error bad = status_words_checked(status); bad.failure()) return bad;
  const int32_t* words = status.typed_data();
  if (ffi::Error failed = raise_if_failed({words, words + kStatusWords}); failed.failure()) return failed;
  *ok->typed_data() = 0;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmc

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_raise_if_failed_host, jmc::RaiseIfFailedHost,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // status
                                  .Arg<ffi::AnyBuffer>()          // after
                                  .Ret<ffi::Buffer<ffi::S32>>()); // ok
