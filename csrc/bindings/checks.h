// Input checks and dtype dispatch shared by the binding TUs (the only files that include torch).
// None of these syncs with the device: they read tensor metadata only.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "bindings/address_overlap.h"
#include "common/dtype.h"

namespace mla_bindings {

// Dtypes can be compiled out (MLA_ATTN_DISABLE_BF16 / _FP16, see setup.py): then a clear error.
#ifdef MLA_ATTN_DISABLE_BF16
constexpr bool kHaveBf16 = false;
#else
constexpr bool kHaveBf16 = true;
#endif
#ifdef MLA_ATTN_DISABLE_FP16
constexpr bool kHaveFp16 = false;
#else
constexpr bool kHaveFp16 = true;
#endif

inline void check_sm90(const at::Tensor& t, const char* kernel) {
  const auto* prop = at::cuda::getDeviceProperties(t.device().index());
  TORCH_CHECK(prop->major == 9 && prop->minor == 0, "mla_attn: the ", kernel,
              " kernel needs an sm_90 (Hopper) GPU; got sm_", prop->major, prop->minor, " (", prop->name, ")");
}

// 16-byte vector copies (cp.async, TMA) need 16-byte aligned rows: base and every outer stride.
inline void check_aligned(const at::Tensor& t, const char* name, int64_t bytes) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0, "mla_attn: ", name,
              " must be ", bytes, "-byte aligned");
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    TORCH_CHECK(t.size(d) == 1 || (t.stride(d) * t.element_size()) % bytes == 0, "mla_attn: ", name,
                " stride(", d, ") must be a multiple of ", bytes, " bytes");
  }
}

inline void check_i32(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "mla_attn: ", name, " must be int32");
  TORCH_CHECK(t.device() == like.device(), "mla_attn: ", name, " must be on ", like.device());
  // A 0-dim tensor has no last dim: the callers' rank checks refuse it.
  TORCH_CHECK(t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1, "mla_attn: ", name,
              " must be contiguous in its last dim");
}

// The kernels take the block max of unscaled scores (the scale commutes with max only if > 0) and
// scale by softmax_scale * log2(e) in float32: that must be finite too (1e39 is not, as a float), and
// normal (their fast math flushes a denormal to 0). Compared in double (false for NaN and inf):
// converting a double past the float range is undefined.
inline void check_softmax_scale(double softmax_scale) {
  const double scale_log2 = softmax_scale * M_LOG2E;
  TORCH_CHECK(scale_log2 >= double(std::numeric_limits<float>::min()) &&
                  scale_log2 <= double(std::numeric_limits<float>::max()),
              "mla_attn: softmax_scale must be a finite number > 0 (also as float32 times log2(e)), got ",
              softmax_scale);
}

// Page sizes every op takes (PAGE_SIZE_MIN/MAX of python/mla_attn/_constants.py): the cache ops refuse
// a cache that decode would refuse later.
inline void check_page_size(int64_t page_size) {
  TORCH_CHECK(page_size >= 1 && page_size <= 256, "mla_attn: page_size must be in [1, 256], got ", page_size);
}

// A scale the kernels read on the device (k_scale, q_scale): float32 [1], the shape the wrappers take.
inline bool is_scale_tensor(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == 1;
}

// An output written by the kernels needs a distinct address per element, or threads race on one:
// each dim's stride must exceed the span of the dims with smaller strides (the wrappers' rule;
// at::assert_no_internal_overlap finds stride-0 dims only).
inline void check_no_internal_overlap(const at::Tensor& t, const char* name) {
  if (t.is_non_overlapping_and_dense()) return;  // the usual output, without the sort
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims that are stepped
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;
  for (const auto& [stride, size] : dims) {
    TORCH_CHECK(stride > span, "mla_attn: ", name, ": elements overlap in memory (sizes ", t.sizes(), ", strides ",
                t.strides(), "); an output needs a distinct address per element");
    span += stride * (size - 1);
  }
}

// An output that the kernels write while other CTAs (or the combine) still read the inputs: none of its
// memory may be an input's, or a CTA reads what another has written (a q row, a page, a table entry).
// A ValueError: the public wrappers leave this check, which needs the addresses of every call, to the op.
inline void check_apart(const at::Tensor& out, const char* name,
                        std::initializer_list<std::pair<const at::Tensor*, const char*>> inputs) {
  for (const auto& [in, in_name] : inputs) {
    TORCH_CHECK_VALUE(in == nullptr || !share_an_address(out, *in), "mla_attn: ", name, " shares memory with ", in_name,
                      "; the kernels still read it while they write ", name);
  }
}

// The address of an optional tensor, or nullptr (for check_apart).
inline const at::Tensor* maybe(const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; }

inline void check_same_device(std::initializer_list<at::Tensor> tensors, const at::Tensor& like) {
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device() == like.device(), "mla_attn: all tensors must be on ", like.device(),
                ", got one on ", t.device());
  }
}

// Calls launch.template operator()<Element>() for the element type of a bf16/fp16 tensor, or fails
// clearly if that dtype was compiled out. `Bf16`/`Fp16` are the kernels' element types.
template <typename Bf16, typename Fp16, typename Launch>
cudaError_t dispatch_half_type(at::ScalarType dtype, const char* kernel, Launch&& launch) {
  if (dtype == at::kBFloat16) {
    if constexpr (kHaveBf16) return launch.template operator()<Bf16>();
  } else if (dtype == at::kHalf) {
    if constexpr (kHaveFp16) return launch.template operator()<Fp16>();
  } else {
    TORCH_CHECK(false, "mla_attn: ", kernel, " supports bfloat16 and float16, got ", dtype);
  }
  TORCH_CHECK(false, "mla_attn was built without the ", dtype, " ", kernel,
              " kernel (MLA_ATTN_DISABLE_BF16 / MLA_ATTN_DISABLE_FP16)");
  return cudaErrorNotSupported;
}

// Element type of the memory-bound kernels (merge, KV cache), or a clear error naming `what`.
inline mla_common::Dtype kernel_dtype(at::ScalarType dtype, const char* what) {
  switch (dtype) {
    case at::kBFloat16: return mla_common::Dtype::kBf16;
    case at::kHalf: return mla_common::Dtype::kFp16;
    case at::kFloat: return mla_common::Dtype::kFp32;
    case at::kFloat8_e4m3fn: return mla_common::Dtype::kFp8E4m3;
    default: TORCH_CHECK(false, "mla_attn: unsupported dtype ", dtype, " for ", what);
  }
  return mla_common::Dtype::kFp32;
}

}  // namespace mla_bindings
