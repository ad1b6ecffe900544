// CUDA implementations of the decode ops: input checks, params, launch. The Python layer
// (python/mla_attn/decode.py) validates with readable messages first; these checks are the last line
// for callers of torch.ops.mla_attn.* directly. None of them syncs with the host.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "bindings/checks.h"
#include "common/ds_mla_fp8_layout.h"
#include "mla_decode/config.h"
#include "mla_decode/decode.h"
#include "mla_decode/dispatch.h"

namespace {
using at::Tensor;
using mla_decode::DecodeKernel;
using mla_decode::DecodeParams;
using mla_decode::DecodeProblem;
using namespace mla_bindings;

// Query tokens per request: MAX_SEQLEN_Q of python/mla_attn/_constants.py, which the wrappers check.
constexpr int64_t kMaxSeqlenQ = 512;

// Before anything indexes q's dims (the out shape, size(-2)): a 0-dim q crashed the host.
void check_q_rank(const Tensor& q, bool varlen) {
  TORCH_CHECK(q.dim() == (varlen ? 3 : 4), "mla_attn: q must be [B, s_q, h_q, D] or, with cu_seqlens_q, [T, h_q, D]");
}

// The split kernel: the one `name` forces (ValueError if it is unknown or cannot run this case),
// else the default choice.
DecodeKernel resolve_decode_kernel(const std::optional<c10::string_view>& name, const DecodeProblem& problem) {
  using namespace mla_decode;
  if (!name.has_value()) return choose_decode_kernel(problem);
  const std::optional<DecodeKernel> kernel = parse_decode_kernel(*name);
  if (!kernel.has_value()) {
    std::string known;
    for (const auto& entry : kDecodeKernelNames) known += (known.empty() ? "" : ", ") + std::string(entry.name);
    TORCH_CHECK_VALUE(false, "mla_attn: unknown decode kernel '", *name, "'; the kernels are ", known);
  }
  TORCH_CHECK_VALUE(!problem.ds_mla_fp8_cache || decode_kernel_supports(*kernel, problem), "mla_attn: decode kernel '",
                    *name, "' cannot run this case: a ds_mla_fp8 cache is read by rows64, and by narrow16 / narrow32 "
                    "at up to 16 / 32 query rows per request (max_seqlen_q x h_q); got ", problem.rows());
  TORCH_CHECK_VALUE(decode_kernel_supports(*kernel, problem), "mla_attn: decode kernel '", *name,
                    "' cannot run this case: it needs ", decode_kernel_requirement(*kernel), "; got ",
                    problem.rows(), " query rows per request and a ",
                    problem.fp8_cache ? "float8_e4m3fn" : "16-bit", " cache");
  return decode_kernel_that_runs(*kernel, problem);
}

void mla_decode_cuda_impl(const Tensor& q, const std::optional<Tensor>& q_pe, const Tensor& kv_cache,
                          const Tensor& block_table, const Tensor& cache_seqlens,
                          const std::optional<Tensor>& cu_seqlens_q, int64_t max_seqlen_q,
                          double softmax_scale, bool causal, const Tensor& tile_sched,
                          const Tensor& req_splits, int64_t num_sm_parts, Tensor& out, Tensor& lse,
                          const std::optional<Tensor>& k_scale, const std::optional<Tensor>& q_scale,
                          bool deterministic, bool fp8_mma, const std::optional<c10::string_view>& kernel_name,
                          bool kv_slots, bool skip_invalid_slots, const std::optional<Tensor>& attn_sink) {
  using namespace mla_decode;
  check_sm90(q, "decode");
  const bool fp8_kv = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  // DeepSeek-V3.2's cache: uint8 rows of 656 bytes with their own scales (kv_format "ds_mla_fp8").
  const bool ds_kv = kv_cache.scalar_type() == at::kByte;
  const bool varlen = cu_seqlens_q.has_value();
  check_q_rank(q, varlen);
  check_softmax_scale(softmax_scale);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "mla_attn: q must be bf16 or fp16");
  TORCH_CHECK(fp8_kv || ds_kv || kv_cache.scalar_type() == q.scalar_type(),
              "mla_attn: kv_cache dtype must equal q dtype, or be float8_e4m3fn (with k_scale) or uint8 (ds_mla_fp8)");
  TORCH_CHECK(fp8_kv == k_scale.has_value(), "mla_attn: k_scale is required with, and only valid with, a float8_e4m3fn kv_cache");
  TORCH_CHECK(fp8_kv || !fp8_mma, "mla_attn: fp8_mma needs a float8_e4m3fn kv_cache");
  if (fp8_kv) {
    TORCH_CHECK(is_scale_tensor(*k_scale) && k_scale->device() == q.device(),
                "mla_attn: k_scale must be a float32 tensor of shape [1] on q's device");
  }
  TORCH_CHECK(fp8_mma || !q_scale.has_value(), "mla_attn: q_scale is only valid with fp8_mma=True");
  if (q_scale.has_value()) {
    TORCH_CHECK(is_scale_tensor(*q_scale) && q_scale->device() == q.device(),
                "mla_attn: q_scale must be a float32 tensor of shape [1] on q's device");
  }
  if (attn_sink.has_value()) {
    TORCH_CHECK(attn_sink->scalar_type() == at::kFloat && attn_sink->dim() == 1 &&
                    attn_sink->size(0) == q.size(-2) &&
                    (attn_sink->size(0) == 1 || attn_sink->stride(0) == 1) && attn_sink->device() == q.device(),
                "mla_attn: attn_sink must be a contiguous float32 tensor of shape [h_q] on q's device");
  }
  const int64_t q_dim = q.size(-1);
  TORCH_CHECK(q_pe.has_value() ? q_dim == kHeadDimV : q_dim == kHeadDimK,
              "mla_attn: q last dim must be 576, or 512 with q_pe given");
  // q_pe, out and lse are indexed with q's leading dims (mla_decode_out takes out and lse from the caller).
  const auto lead = q.sizes().slice(0, q.dim() - 1);
  TORCH_CHECK(!q_pe.has_value() || (q_pe->scalar_type() == q.scalar_type() && q_pe->dim() == q.dim() &&
                                    q_pe->sizes().slice(0, q.dim() - 1).equals(lead) && q_pe->size(-1) == kHeadDimK - kHeadDimV),
              "mla_attn: q_pe must be [.., h_q, 64] of q's dtype with q's leading dims");
  TORCH_CHECK(out.dim() == q.dim() && out.sizes().slice(0, q.dim() - 1).equals(lead) && lse.sizes().equals(lead),
              "mla_attn: out must be [.., h_q, 512] and lse [.., h_q] with q's leading dims");
  check_no_internal_overlap(out, "out");
  check_no_internal_overlap(lse, "lse");
  for (const auto& [t, name] : {std::pair{&out, "out"}, std::pair{&lse, "lse"}}) {
    check_apart(*t, name, {{&q, "q"}, {maybe(q_pe), "q_pe"}, {&kv_cache, "kv_cache"}, {&block_table, "block_table"},
                           {&cache_seqlens, "cache_seqlens"}, {maybe(cu_seqlens_q), "cu_seqlens_q"},
                           {&tile_sched, "tile_sched"}, {&req_splits, "req_splits"}, {maybe(k_scale), "k_scale"},
                           {maybe(q_scale), "q_scale"}, {maybe(attn_sink), "attn_sink"}});
  }
  check_apart(lse, "lse", {{&out, "out"}});
  const int64_t row_elements = ds_kv ? mla_common::kDsRowBytes : kHeadDimK;
  TORCH_CHECK(kv_cache.dim() == 3 || (kv_cache.dim() == 4 && kv_cache.size(2) == 1),
              "mla_attn: kv_cache must be [pages, page_size, ", row_elements, "] or [pages, page_size, 1, ", row_elements, "]");
  TORCH_CHECK(kv_cache.size(-1) == row_elements && kv_cache.stride(-1) == 1, "mla_attn: kv_cache last dim must be ",
              row_elements, ds_kv ? " (ds_mla_fp8)" : "", ", contiguous");
  const int64_t page_size = kv_cache.size(1);
  check_page_size(page_size);
  TORCH_CHECK(kv_cache.size(0) * page_size < (int64_t(1) << 31), "mla_attn: the cache must hold fewer than 2^31 slots");
  // Page ids are clamped to [0, num_pages - 1]; a slot list (kv_slots) over no page has no key at all.
  TORCH_CHECK(kv_slots || kv_cache.size(0) >= 1, "mla_attn: kv_cache must hold at least one page, got 0");
  TORCH_CHECK(q.stride(-1) == 1 && (!q_pe.has_value() || q_pe->stride(-1) == 1), "mla_attn: q and q_pe must be contiguous in the last dim");
  check_aligned(q, "q", 16);
  if (q_pe.has_value()) check_aligned(*q_pe, "q_pe", 16);
  check_aligned(kv_cache, "kv_cache", 16);
  check_aligned(out, "out", 16);  // the 64-row, seesaw and combine kernels store 16-byte vectors
  for (const Tensor& t : {q, kv_cache, block_table, cache_seqlens, out, lse}) {
    TORCH_CHECK(t.device() == q.device(), "mla_attn: all tensors must be on ", q.device());
  }
  TORCH_CHECK(!q_pe.has_value() || q_pe->device() == q.device(), "mla_attn: all tensors must be on ", q.device());
  check_i32(block_table, "block_table", q);
  check_i32(cache_seqlens, "cache_seqlens", q);
  check_i32(tile_sched, "tile_sched", q);
  check_i32(req_splits, "req_splits", q);
  // The kernels read cache_seqlens[b] and cu_seqlens_q[b] flat: a 2-D tensor would be read as one row.
  TORCH_CHECK(cache_seqlens.dim() == 1, "mla_attn: cache_seqlens must be [B], got ", cache_seqlens.sizes());
  const int64_t batch = cache_seqlens.size(0);
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == batch,
              kv_slots ? "mla_attn: with kv_slots, block_table must be [B, max_keys]" : "mla_attn: block_table must be [B, max_pages]");
  TORCH_CHECK(tile_sched.dim() == 2 && tile_sched.size(1) == kScheduleRowInts && tile_sched.is_contiguous() &&
                  req_splits.dim() == 2 && req_splits.size(1) == 2 && req_splits.is_contiguous(),
              "mla_attn: metadata must be contiguous tile_sched [num_sms, 8] and req_splits [B, 2]");
  TORCH_CHECK(req_splits.size(0) == batch, "mla_attn: metadata was made for another batch size");
  if (varlen) {
    check_i32(*cu_seqlens_q, "cu_seqlens_q", q);
    TORCH_CHECK(cu_seqlens_q->dim() == 1 && cu_seqlens_q->numel() == batch + 1,
                "mla_attn: cu_seqlens_q must be [B + 1], got ", cu_seqlens_q->sizes());
  } else {
    TORCH_CHECK(q.size(0) == batch && q.size(1) == max_seqlen_q, "mla_attn: q must be [B, s_q, h_q, D]");
  }
  const int64_t heads = q.size(-2);
  TORCH_CHECK(heads >= 1 && heads <= 128, "mla_attn: h_q must be in [1, 128]");
  TORCH_CHECK(max_seqlen_q >= 1 && max_seqlen_q <= kMaxSeqlenQ, "mla_attn: max_seqlen_q must be in [1, ", kMaxSeqlenQ,
              "]");
  const DecodeProblem problem{.fp8_cache = fp8_kv, .ds_mla_fp8_cache = ds_kv, .max_seqlen_q = max_seqlen_q, .heads_q = heads, .batch = batch,
                              .deterministic = deterministic, .fp8_mma = fp8_mma,
                              .gathered_rows = kv_slots || page_size % 16 != 0};
  const DecodeKernel kernel = resolve_decode_kernel(kernel_name, problem);
  // Only the ds_mla_fp8 forms skip invalid slots (they copy each row by itself and mask the keys not
  // copied); the other kernels require every listed slot to be valid.
  TORCH_CHECK_VALUE(!skip_invalid_slots || (kv_slots && ds_kv),
                    "mla_attn: skip_invalid_slots needs kv_slots and a ds_mla_fp8 cache");
  const int tiles = int(problem.q_tiles());
  TORCH_CHECK(num_sm_parts >= 1 && num_sm_parts <= tile_sched.size(0) && num_sm_parts <= kMaxSmParts,
              "mla_attn: num_sm_parts out of range");

  const c10::cuda::CUDAGuard guard(q.device());
  auto stream = at::cuda::getCurrentCUDAStream();

  DecodeParams p = {};
  auto set_q = [&](const Tensor& t, int64_t offset, const void*& ptr, int64_t& bs, int64_t& ts, int64_t& hs) {
    ptr = static_cast<const char*>(t.data_ptr()) + offset * t.element_size();
    bs = varlen ? 0 : t.stride(0);
    ts = varlen ? t.stride(0) : t.stride(1);
    hs = t.stride(-2);
  };
  set_q(q, 0, p.q_nope, p.q_nope_batch_stride, p.q_nope_token_stride, p.q_nope_head_stride);
  if (q_pe.has_value()) {
    set_q(*q_pe, 0, p.q_pe, p.q_pe_batch_stride, p.q_pe_token_stride, p.q_pe_head_stride);
  } else {
    set_q(q, kHeadDimV, p.q_pe, p.q_pe_batch_stride, p.q_pe_token_stride, p.q_pe_head_stride);
  }
  const void* unused = nullptr;
  set_q(out, 0, unused, p.out_batch_stride, p.out_token_stride, p.out_head_stride);
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.lse_batch_stride = varlen ? 0 : lse.stride(0);
  p.lse_token_stride = varlen ? lse.stride(0) : lse.stride(1);
  p.lse_head_stride = lse.stride(-1);

  p.block_table = block_table.data_ptr<int>();
  p.block_table_stride = block_table.stride(0);
  p.max_pages = int(block_table.size(1));
  p.kv_slots = kv_slots;
  p.skip_invalid_slots = skip_invalid_slots;
  p.attn_sink = attn_sink.has_value() ? attn_sink->data_ptr<float>() : nullptr;
  // No page (kv_slots only): no slot is in the cache, so every request is empty (slots would clamp to -1).
  p.max_keys = kv_cache.size(0) == 0
                   ? 0
                   : int(std::min<int64_t>(block_table.size(1) * (kv_slots ? 1 : page_size), INT32_MAX));
  p.cache_seqlens = cache_seqlens.data_ptr<int>();
  p.cu_seqlens_q = varlen ? cu_seqlens_q->data_ptr<int>() : nullptr;
  p.num_q_tokens = varlen ? int(std::min<int64_t>(q.size(0), INT32_MAX)) : 0;
  p.kv = kv_cache.data_ptr();
  p.k_scale = fp8_kv ? k_scale->data_ptr<float>() : nullptr;
  p.q_scale = q_scale.has_value() ? q_scale->data_ptr<float>() : nullptr;
  p.kv_page_stride = kv_cache.stride(0);
  p.kv_token_stride = kv_cache.stride(1);
  p.num_pages = int(kv_cache.size(0));
  p.page_size = int(page_size);
  p.batch = int(batch);
  p.num_heads_q = int(heads);
  const FastDivisor heads_divisor = make_fast_divisor(p.num_heads_q);
  p.heads_multiplier = heads_divisor.multiplier;
  p.heads_shift = uint8_t(heads_divisor.shift);
  p.max_seqlen_q = int(max_seqlen_q);
  p.scale_log2 = float(softmax_scale * M_LOG2E);
  p.causal = causal;
  p.tile_sched = reinterpret_cast<const ScheduleRow*>(tile_sched.data_ptr<int>());
  p.req_splits = req_splits.data_ptr<int>();
  p.num_sm_parts = int(num_sm_parts);
  p.num_q_tiles = tiles;
  p.partials_fp32 = decode_partials_fp32(kernel, problem);
  Tensor partial_out, partial_lse;
  if (num_sm_parts > 1) {
    const int64_t rows = int64_t(split_partial_slots(int(num_sm_parts))) * tiles * kBlockM;
    partial_out = at::empty({rows, kHeadDimV}, p.partials_fp32 ? q.options().dtype(at::kFloat) : q.options());
    partial_lse = at::empty({rows}, q.options().dtype(at::kFloat));
    p.partial_out = partial_out.data_ptr();
    p.partial_lse = partial_lse.data_ptr<float>();
  }
  if (batch == 0) return;

  const bool bf16 = q.scalar_type() == at::kBFloat16;
  using mla_common::TmaElement;
  DecodeTma tma;
  // The 64-row kernel's fp8 forms copy whole rows at every page size: no map.
  const bool rows_only = ds_kv || (fp8_kv && kernel == DecodeKernel::kRows64);
  const bool row_groups = fp8_kv && (kernel == DecodeKernel::kNarrow16 || kernel == DecodeKernel::kNarrow16x3 ||
                                     kernel == DecodeKernel::kNarrow32);
  const char* tma_error = make_kv_tma(p, fp8_kv || ds_kv ? TmaElement::kFp8 : bf16 ? TmaElement::kBf16 : TmaElement::kFp16,
                                      rows_only, row_groups, &tma);
  TORCH_CHECK(tma_error == nullptr, "mla_attn: ", tma_error ? tma_error : "");
  tma.q_by_tma = decode_kernel_wants_q_by_tma(kernel, problem) &&
                 make_q_tma(p, varlen ? q.size(0) : q.size(1), varlen ? 1 : batch,
                            bf16 ? TmaElement::kBf16 : TmaElement::kFp16, &tma);
  const cudaError_t err = dispatch_half_type<cutlass::bfloat16_t, cutlass::half_t>(
      q.scalar_type(), "decode", [&]<typename Element>() {
        switch (kernel) {
          case DecodeKernel::kNarrow16:
            if (ds_kv) return run_mla_decode_narrow_ds_mla_fp8<Element, kNarrow16Rows>(p, tma, stream);
            return fp8_kv ? run_mla_decode_narrow<Element, kNarrow16Rows, 2, true>(p, tma, stream)
                          : run_mla_decode_narrow<Element, kNarrow16Rows, 2, false>(p, tma, stream);
          case DecodeKernel::kNarrow16x3: return run_mla_decode_narrow<Element, kNarrow16Rows, 3, true>(p, tma, stream);
          case DecodeKernel::kNarrow32:
            if (ds_kv) return run_mla_decode_narrow_ds_mla_fp8<Element, kNarrow32Rows>(p, tma, stream);
            return run_mla_decode_narrow<Element, kNarrow32Rows, 2, true>(p, tma, stream);
          case DecodeKernel::kRows64:
            if (ds_kv) return run_mla_decode_ds_mla_fp8<Element>(p, tma, stream);
            return fp8_kv ? run_mla_decode<Element, true>(p, tma, stream) : run_mla_decode<Element, false>(p, tma, stream);
          case DecodeKernel::kSeesaw: return run_mla_decode_seesaw<Element, false>(p, tma, stream);
          case DecodeKernel::kSeesawSteady: return run_mla_decode_seesaw<Element, true>(p, tma, stream);
          case DecodeKernel::kFp8Mma: return run_mla_decode_fp8mma<Element>(p, tma, stream);
          case DecodeKernel::kRows64Seesaw: return run_mla_decode_rows64_seesaw<Element>(p, tma, stream);
        }
        return cudaErrorInvalidValue;  // not reached: every kernel has its case
      });
  C10_CUDA_CHECK(err);
}

std::tuple<Tensor, Tensor> mla_decode_cuda(const Tensor& q, const std::optional<Tensor>& q_pe,
                                           const Tensor& kv_cache, const Tensor& block_table,
                                           const Tensor& cache_seqlens,
                                           const std::optional<Tensor>& cu_seqlens_q,
                                           int64_t max_seqlen_q, double softmax_scale, bool causal,
                                           const Tensor& tile_sched, const Tensor& req_splits,
                                           int64_t num_sm_parts, const std::optional<Tensor>& k_scale,
                                           const std::optional<Tensor>& q_scale, bool deterministic, bool fp8_mma,
                                           std::optional<c10::string_view> kernel, bool kv_slots,
                                           bool skip_invalid_slots, const std::optional<Tensor>& attn_sink) {
  check_q_rank(q, cu_seqlens_q.has_value());
  auto out_shape = q.sizes().vec();
  out_shape.back() = mla_decode::kHeadDimV;
  Tensor out = at::empty(out_shape, q.options());
  Tensor lse = at::empty(q.sizes().slice(0, q.dim() - 1), q.options().dtype(at::kFloat));
  mla_decode_cuda_impl(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q,
                       softmax_scale, causal, tile_sched, req_splits, num_sm_parts, out, lse, k_scale,
                       q_scale, deterministic, fp8_mma, kernel, kv_slots, skip_invalid_slots, attn_sink);
  return {out, lse};
}

void mla_decode_out_cuda(const Tensor& q, const std::optional<Tensor>& q_pe, const Tensor& kv_cache,
                         const Tensor& block_table, const Tensor& cache_seqlens,
                         const std::optional<Tensor>& cu_seqlens_q, int64_t max_seqlen_q,
                         double softmax_scale, bool causal, const Tensor& tile_sched,
                         const Tensor& req_splits, int64_t num_sm_parts, Tensor out, const std::optional<Tensor>& lse,
                         const std::optional<Tensor>& k_scale, const std::optional<Tensor>& q_scale,
                         bool deterministic, bool fp8_mma, std::optional<c10::string_view> kernel, bool kv_slots,
                         bool skip_invalid_slots, const std::optional<Tensor>& attn_sink) {
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.dim() >= 1 && out.size(-1) == mla_decode::kHeadDimV &&
                  out.stride(-1) == 1,
              "mla_attn: out must be [.., h_q, 512] of q's dtype, contiguous in the last dim");
  TORCH_CHECK(!lse.has_value() || lse->scalar_type() == at::kFloat, "mla_attn: lse must be float32");
  check_q_rank(q, cu_seqlens_q.has_value());
  // Without lse the kernels still write one (the split kernels' unsplit rows, the combine).
  Tensor lse_out = lse.has_value() ? *lse : at::empty(q.sizes().slice(0, q.dim() - 1), q.options().dtype(at::kFloat));
  mla_decode_cuda_impl(q, q_pe, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q,
                       softmax_scale, causal, tile_sched, req_splits, num_sm_parts, out, lse_out, k_scale,
                       q_scale, deterministic, fp8_mma, kernel, kv_slots, skip_invalid_slots, attn_sink);
}

std::tuple<Tensor, Tensor> get_decode_metadata_cuda(const Tensor& cache_seqlens,
                                                    const std::optional<Tensor>& cu_seqlens_q,
                                                    int64_t max_seqlen_q, int64_t num_heads_q,
                                                    bool causal, int64_t num_sm_parts, int64_t num_sms,
                                                    bool deterministic) {
  (void)max_seqlen_q; (void)num_heads_q; (void)causal;  // enter via num_sm_parts
  check_i32(cache_seqlens, "cache_seqlens", cache_seqlens);
  TORCH_CHECK(cache_seqlens.dim() == 1, "mla_attn: cache_seqlens must be [B], got ", cache_seqlens.sizes());
  TORCH_CHECK(num_sm_parts >= 1 && num_sm_parts <= num_sms && num_sms <= mla_decode::kMaxSmParts,
              "mla_attn: need 1 <= num_sm_parts <= num_sms <= ", mla_decode::kMaxSmParts);
  if (cu_seqlens_q.has_value()) check_i32(*cu_seqlens_q, "cu_seqlens_q", cache_seqlens);
  const c10::cuda::CUDAGuard guard(cache_seqlens.device());
  const int64_t batch = cache_seqlens.size(0);
  TORCH_CHECK(batch <= 50000, "mla_attn: get_decode_metadata supports at most 50000 requests");
  auto opts = cache_seqlens.options().dtype(at::kInt);
  Tensor tile_sched = at::empty({num_sms, mla_decode::kScheduleRowInts}, opts);
  Tensor req_splits = at::empty({batch, 2}, opts);
  C10_CUDA_CHECK(mla_decode::run_decode_metadata(
      cache_seqlens.data_ptr<int>(), int(batch), int(num_sm_parts), int(num_sms),
      deterministic, reinterpret_cast<mla_decode::ScheduleRow*>(tile_sched.data_ptr<int>()), req_splits.data_ptr<int>(),
      at::cuda::getCurrentCUDAStream()));
  return {tile_sched, req_splits};
}

}  // namespace

TORCH_LIBRARY_IMPL(mla_attn, CUDA, m) {
  m.impl("mla_decode", &mla_decode_cuda);
  m.impl("mla_decode_out", &mla_decode_out_cuda);
  m.impl("get_decode_metadata", &get_decode_metadata_cuda);
}
