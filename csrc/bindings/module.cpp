// The Python module `mla_attn._C`.
//
// The ops themselves are not bound here: they are TORCH_LIBRARY schemas (ops.cpp) with CUDA
// kernels registered by decode_api.cpp. All three files end up in this one shared object, so
// `import mla_attn._C` is what registers `torch.ops.mla_attn.*`. This module only adds plain
// helpers that are not tensor ops, such as build_info().
//
// This translation unit deliberately includes no CUDA, CuTe or kernel headers: it must compile as
// plain C++ and the .so must import on a machine without a GPU or driver.
#include <torch/extension.h>

#include <cutlass/version.h>

// Defined by setup.py; fallbacks keep the file compilable outside it (e.g. by an IDE).
#ifndef MLA_ATTN_ARCH
#define MLA_ATTN_ARCH "sm_90a"
#endif
#ifndef MLA_ATTN_CUTLASS_SOURCE
#define MLA_ATTN_CUTLASS_SOURCE "unknown"
#endif
#ifndef MLA_ATTN_NVCC_VERSION
#define MLA_ATTN_NVCC_VERSION "unknown"
#endif
#ifndef MLA_ATTN_TORCH_VERSION
#define MLA_ATTN_TORCH_VERSION "unknown"
#endif

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
  info["arch"] = MLA_ATTN_ARCH;
  info["cutlass_version"] = std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) +
                            "." + std::to_string(CUTLASS_PATCH);
  info["cutlass_source"] = MLA_ATTN_CUTLASS_SOURCE;
  info["nvcc_version"] = MLA_ATTN_NVCC_VERSION;
  info["torch_version"] = MLA_ATTN_TORCH_VERSION;

  pybind11::list dtypes;
#ifndef MLA_ATTN_DISABLE_BF16
  dtypes.append("bf16");
#endif
#ifndef MLA_ATTN_DISABLE_FP16
  dtypes.append("fp16");
#endif
  info["dtypes"] = dtypes;

#ifdef NDEBUG
  info["debug"] = false;
#else
  info["debug"] = true;
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mla_attn native extension: DeepSeek MLA attention kernels for sm_90a (Hopper).";
  m.def("build_info", &build_info,
        "How this extension was built: arch, CUTLASS version and header source, nvcc version, "
        "torch version, compiled dtypes.");
}
