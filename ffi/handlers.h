// The XLA FFI handler symbols (C ABI), registered from Python through nanobind capsules.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* jmc_dispatch_send(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jmc_dispatch_recv(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jmc_combine_send(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jmc_combine_recv(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jmc_dispatch(XLA_FFI_CallFrame* call_frame);  // the fused halves (NVLink path)
XLA_FFI_Error* jmc_combine(XLA_FFI_CallFrame* call_frame);
#ifdef JMC_MEASUREMENT
XLA_FFI_Error* jmc_probe(XLA_FFI_CallFrame* call_frame);  // the bench's floor (probe.cu; measurement builds)
#endif
XLA_FFI_Error* jmc_check(XLA_FFI_CallFrame* call_frame);  // the deferred error check (host only)
// A status's failure raised as the call's error on the GPU (synchronous); on the CPU: status.h.
XLA_FFI_Error* jmc_raise_if_failed_device(XLA_FFI_CallFrame* call_frame);
}
