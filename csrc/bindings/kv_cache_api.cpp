// CUDA implementations of the KV-cache ops: checks, params, launch. The Python wrappers
// (python/mla_attn/kv_cache.py) check first with readable messages; these checks are the last line for
// callers of torch.ops.mla_attn.* directly. None of them syncs with the host.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "bindings/checks.h"
#include "kv_cache/kv_cache.h"

namespace {
using at::Tensor;
using namespace mla_kv_cache;

bool is_half(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// The cache formats of python/mla_attn/kv_cache.py; a cache's dtype names its format.
enum class CacheFormat { kModel, kFp8, kDsMlaFp8 };

// The cache's format, from its dtype; a given kv_format must name that format.
CacheFormat cache_format(const Tensor& kv_cache, const std::optional<c10::string_view>& kv_format) {
  const at::ScalarType t = kv_cache.scalar_type();
  TORCH_CHECK(is_half(t) || t == at::kFloat8_e4m3fn || t == at::kByte,
              "mla_attn: kv_cache must be bfloat16, float16, float8_e4m3fn or uint8 (ds_mla_fp8), got ", t);
  const CacheFormat inferred =
      t == at::kByte ? CacheFormat::kDsMlaFp8 : t == at::kFloat8_e4m3fn ? CacheFormat::kFp8 : CacheFormat::kModel;
  if (!kv_format.has_value()) return inferred;
  const c10::string_view name = *kv_format;
  const bool known = name == "model" || name == "fp8" || name == "ds_mla_fp8";
  TORCH_CHECK_VALUE(known, "mla_attn: unknown kv_format '", name, "'; the formats are model, fp8, ds_mla_fp8");
  const CacheFormat named =
      name == "ds_mla_fp8" ? CacheFormat::kDsMlaFp8 : name == "fp8" ? CacheFormat::kFp8 : CacheFormat::kModel;
  TORCH_CHECK_VALUE(named == inferred, "mla_attn: kv_format='", name, "' needs a ",
                    named == CacheFormat::kDsMlaFp8 ? "uint8" : named == CacheFormat::kFp8 ? "float8_e4m3fn"
                                                                                             : "bfloat16 or float16",
                    " kv_cache, got ", t);
  return inferred;
}

// Checks the cache and its scale; returns nullptr or the scale's pointer (fp8 caches).
const float* check_cache(const Tensor& kv_cache, const std::optional<Tensor>& k_scale, const Tensor& like,
                         CacheFormat format) {
  const int64_t row = format == CacheFormat::kDsMlaFp8 ? kDsRowBytes : kDimRow;
  TORCH_CHECK((kv_cache.dim() == 3 || (kv_cache.dim() == 4 && kv_cache.size(2) == 1)) &&
                  kv_cache.size(-1) == row && kv_cache.stride(-1) == 1,
              "mla_attn: kv_cache must be [num_pages, page_size, ", row, "] or [num_pages, page_size, 1, ", row,
              "], contiguous in the last dim; got ", kv_cache.sizes());
  mla_bindings::check_page_size(kv_cache.size(1));
  // 8-element chunks: 16-byte aligned rows (8-byte for fp8); ds_mla_fp8 rows take 16-byte stores
  const int64_t align = format == CacheFormat::kDsMlaFp8 ? 16 : 8 * kv_cache.element_size();
  mla_bindings::check_aligned(kv_cache, "kv_cache", align);
  mla_bindings::check_same_device({kv_cache}, like);
  if (format == CacheFormat::kDsMlaFp8) {
    TORCH_CHECK_VALUE(!k_scale.has_value(),
                      "mla_attn: k_scale is not used with a ds_mla_fp8 kv_cache (its scales are in the rows)");
    return nullptr;
  }
  if (format == CacheFormat::kModel) {
    TORCH_CHECK(!k_scale.has_value(), "mla_attn: k_scale is only valid with a float8_e4m3fn kv_cache");
    return nullptr;
  }
  TORCH_CHECK(k_scale.has_value(), "mla_attn: a float8_e4m3fn kv_cache needs k_scale (float32, shape [1])");
  TORCH_CHECK(mla_bindings::is_scale_tensor(*k_scale),
              "mla_attn: k_scale must be a float32 tensor of shape [1]");
  mla_bindings::check_same_device({*k_scale}, like);
  return k_scale->data_ptr<float>();
}

void write_kv_cache_cuda(const Tensor& kv_c, const Tensor& k_pe, Tensor kv_cache, const Tensor& slot_mapping,
                         const std::optional<Tensor>& k_scale, const std::optional<c10::string_view>& kv_format) {
  TORCH_CHECK(is_half(kv_c.scalar_type()), "mla_attn: kv_c must be bfloat16 or float16, got ", kv_c.scalar_type());
  TORCH_CHECK(kv_c.dim() == 2 && kv_c.size(1) == kDimLatent && kv_c.stride(1) == 1,
              "mla_attn: kv_c must be [T, 512], contiguous in the last dim; got ", kv_c.sizes());
  const int64_t T = kv_c.size(0);
  TORCH_CHECK(k_pe.scalar_type() == kv_c.scalar_type(), "mla_attn: k_pe must have kv_c's dtype");
  TORCH_CHECK(((k_pe.dim() == 2 && k_pe.size(0) == T) || (k_pe.dim() == 3 && k_pe.size(0) == T && k_pe.size(1) == 1)) &&
                  k_pe.size(-1) == kDimRope && k_pe.stride(-1) == 1,
              "mla_attn: k_pe must be [T, 64] or [T, 1, 64], contiguous in the last dim; got ", k_pe.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == T,
              "mla_attn: slot_mapping must be int64 [T]");
  TORCH_CHECK(kv_cache.scalar_type() == kv_c.scalar_type() || kv_cache.scalar_type() == at::kFloat8_e4m3fn ||
                  kv_cache.scalar_type() == at::kByte,
              "mla_attn: kv_cache must have kv_c's dtype or be float8_e4m3fn or uint8 (ds_mla_fp8)");
  const CacheFormat format = cache_format(kv_cache, kv_format);
  const float* scale = check_cache(kv_cache, k_scale, kv_c, format);
  mla_bindings::check_no_internal_overlap(kv_cache, "kv_cache");  // tokens on one address would race
  // a row read after another thread wrote its slot would race too
  mla_bindings::check_apart(kv_cache, "kv_cache", {{&kv_c, "kv_c"}, {&k_pe, "k_pe"}, {&slot_mapping, "slot_mapping"},
                                                   {mla_bindings::maybe(k_scale), "k_scale"}});
  mla_bindings::check_same_device({k_pe, slot_mapping}, kv_c);
  mla_bindings::check_aligned(kv_c, "kv_c", 16);
  mla_bindings::check_aligned(k_pe, "k_pe", 16);
  if (T == 0) return;
  mla_bindings::check_sm90(kv_c, "KV-cache write");

  WriteParams p = {};
  p.kv_c = kv_c.data_ptr();
  p.kv_c_stride = kv_c.stride(0);
  p.k_pe = k_pe.data_ptr();
  p.k_pe_stride = k_pe.stride(0);
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.slot_stride = slot_mapping.stride(0);
  p.cache = kv_cache.data_ptr();
  p.page_stride = kv_cache.stride(0);
  p.token_stride = kv_cache.stride(1);
  p.num_tokens = T;
  p.page_size = kv_cache.size(1);
  p.num_slots = kv_cache.size(0) * kv_cache.size(1);
  p.k_scale = scale;
  const c10::cuda::CUDAGuard guard(kv_c.device());
  if (format == CacheFormat::kDsMlaFp8) {
    C10_CUDA_CHECK(run_write_ds_mla_fp8(p, mla_bindings::kernel_dtype(kv_c.scalar_type(), "kv_c"),
                                        at::cuda::getCurrentCUDAStream()));
    return;
  }
  C10_CUDA_CHECK(run_write_kv_cache(p, mla_bindings::kernel_dtype(kv_c.scalar_type(), "kv_c"),
                                    mla_bindings::kernel_dtype(kv_cache.scalar_type(), "kv_cache"),
                                    at::cuda::getCurrentCUDAStream()));
}

Tensor gather_kv_cache_cuda(const Tensor& kv_cache, const Tensor& block_table, const Tensor& cu_seqlens,
                            int64_t num_tokens, const std::optional<Tensor>& k_scale,
                            std::optional<at::ScalarType> out_dtype, const std::optional<c10::string_view>& kv_format) {
  const CacheFormat format = cache_format(kv_cache, kv_format);
  const float* scale = check_cache(kv_cache, k_scale, block_table, format);
  mla_bindings::check_i32(block_table, "block_table", kv_cache);
  mla_bindings::check_i32(cu_seqlens, "cu_seqlens", kv_cache);
  TORCH_CHECK(block_table.dim() == 2, "mla_attn: block_table must be [B, max_pages]");
  const int64_t batch = block_table.size(0);
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) == batch + 1, "mla_attn: cu_seqlens must be [B + 1]");
  TORCH_CHECK(num_tokens >= 0, "mla_attn: num_tokens must be >= 0");
  // The kernel takes both as ints (an expanded cache may claim more pages; check_cache bounds page_size).
  TORCH_CHECK(kv_cache.size(0) <= INT32_MAX && kv_cache.size(1) <= INT32_MAX,
              "mla_attn: kv_cache must have at most 2^31 - 1 pages of at most 2^31 - 1 rows, got ", kv_cache.sizes());
  TORCH_CHECK(batch < INT32_MAX && block_table.size(1) <= INT32_MAX,  // an expanded table may claim more
              "mla_attn: block_table must have fewer than 2^31 - 1 rows of at most 2^31 - 1 pages, got ",
              block_table.sizes());
  const at::ScalarType dtype =
      out_dtype.value_or(format == CacheFormat::kModel ? kv_cache.scalar_type() : at::kBFloat16);
  TORCH_CHECK(is_half(dtype) || dtype == at::kFloat, "mla_attn: out_dtype must be bfloat16, float16 or float32");
  Tensor out = at::empty({num_tokens, kDimRow}, kv_cache.options().dtype(dtype));
  if (num_tokens == 0) return out;
  mla_bindings::check_sm90(kv_cache, "KV-cache gather");

  GatherParams p = {};
  p.cache = kv_cache.data_ptr();
  p.page_stride = kv_cache.stride(0);
  p.token_stride = kv_cache.stride(1);
  p.num_pages = int(kv_cache.size(0));
  p.page_size = int(kv_cache.size(1));
  p.block_table = block_table.data_ptr<int>();
  p.block_table_stride = block_table.stride(0);
  p.max_pages = int(block_table.size(1));
  p.cu_seqlens = cu_seqlens.data_ptr<int>();
  p.batch = int(batch);
  p.out = out.data_ptr();
  p.num_tokens = num_tokens;
  p.k_scale = scale;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  if (format == CacheFormat::kDsMlaFp8) {
    C10_CUDA_CHECK(run_gather_ds_mla_fp8(p, mla_bindings::kernel_dtype(dtype, "out_dtype"),
                                         at::cuda::getCurrentCUDAStream()));
    return out;
  }
  C10_CUDA_CHECK(run_gather_kv_cache(p, mla_bindings::kernel_dtype(kv_cache.scalar_type(), "kv_cache"),
                                     mla_bindings::kernel_dtype(dtype, "out_dtype"),
                                     at::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(mla_attn, CUDA, m) {
  m.impl("write_kv_cache", &write_kv_cache_cuda);
  m.impl("gather_kv_cache", &gather_kv_cache_cuda);
}
