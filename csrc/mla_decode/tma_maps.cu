// TMA descriptors of the decode kernels: the paged latent cache and Q tiles.
#include "common/tma_desc.h"
#include "mla_decode/config.h"
#include "mla_decode/decode.h"

namespace mla_decode {

namespace {
int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }
}  // namespace

// Round-up reciprocal: with 2^(p-1) < divisor <= 2^p (2^p for a power of two), multiplier =
// ceil(2^(31+p) / divisor) < 2^32, and n * multiplier >> (31 + p) = n / divisor for n < 2^31.
FastDivisor make_fast_divisor(int divisor) {
  if (divisor == 1) return FastDivisor{1, 0, 0};  // FastDivisor::divide special-cases it
  int p = 0;
  while ((1 << p) < divisor) ++p;
  const uint64_t multiplier = ((uint64_t(1) << (31 + p)) + uint64_t(divisor) - 1) / uint64_t(divisor);
  return FastDivisor{divisor, uint32_t(multiplier), uint32_t(p - 1)};
}

const char* make_kv_tma(const DecodeParams& p, mla_common::TmaElement element, bool rows_only, bool row_groups,
                        DecodeTma* tma) {
  tma->page_size = make_fast_divisor(p.page_size);
  // A TMA copy of fewer than 16 rows (or one per key of a sparse list) would cost more to issue than
  // to gather the rows (by cp.async; the 64-row kernel's fp8 forms copy every row whole: rows_only).
  tma->gather = rows_only || p.kv_slots || p.page_size % 16 != 0;
  tma->row_groups = row_groups && !tma->gather;
  if (tma->gather) return nullptr;
  if (row_groups) {
    if (element != mla_common::TmaElement::kFp8) return "row-group tiles are an fp8 cache's";
    // (64 columns, keys, 9 slabs, pages): a box of 16 keys x 9 slabs lands as [slab][key][64 B], the
    // layout of a row group (shared/fp8_dequant.cuh: fp8_tile_offset).
    tma->rows_per_copy_log2 = __builtin_ctz(kFp8GroupRows);
    const uint64_t dims[4] = {uint64_t(kTmaColumns), uint64_t(p.page_size), uint64_t(kSlabs), uint64_t(p.num_pages)};
    const uint64_t strides[3] = {uint64_t(p.kv_token_stride), uint64_t(kTmaColumns), uint64_t(p.kv_page_stride)};
    const uint32_t box[4] = {uint32_t(kTmaColumns), uint32_t(kFp8GroupRows), uint32_t(kSlabs), 1};
    return mla_common::encode_tma(&tma->kv, element, 4, p.kv, dims, strides, box);
  }
  // A copy never crosses a page: rows_per_copy divides page_size (a multiple of 16) and 64.
  const int rows_per_copy = gcd(p.page_size, kBlockN);
  tma->rows_per_copy_log2 = __builtin_ctz(rows_per_copy);
  const size_t elem = element == mla_common::TmaElement::kFp8 ? 1 : 2;
  const uint64_t dims[3] = {uint64_t(kHeadDimK), uint64_t(p.page_size), uint64_t(p.num_pages)};
  const uint64_t strides[2] = {uint64_t(p.kv_token_stride * elem), uint64_t(p.kv_page_stride * elem)};
  const uint32_t box[3] = {uint32_t(kTmaColumns), uint32_t(rows_per_copy), 1};
  return mla_common::encode_tma(&tma->kv, element, 3, p.kv, dims, strides, box);
}

bool make_q_tma(const DecodeParams& p, int64_t num_tokens, int64_t num_batches, mla_common::TmaElement element,
                DecodeTma* tma) {
  auto encode = [&](CUtensorMap* map, const void* base, int dims0, int64_t batch_stride, int64_t token_stride,
                    int64_t head_stride) {
    // A dimension of extent 1 is never stepped and its stride is free in q (varlen q has no batch
    // dimension): it gets the packed one. A broadcast dimension (stride 0) stays with cp.async.
    if (num_tokens == 1) token_stride = head_stride * p.num_heads_q;
    if (num_batches == 1) batch_stride = token_stride * num_tokens;
    if (head_stride == 0 || token_stride == 0 || batch_stride == 0) return false;
    const uint64_t dims[4] = {uint64_t(dims0), uint64_t(p.num_heads_q), uint64_t(num_tokens), uint64_t(num_batches)};
    const uint64_t strides[3] = {uint64_t(head_stride * 2), uint64_t(token_stride * 2), uint64_t(batch_stride * 2)};
    const uint32_t box[4] = {uint32_t(kTmaColumns), uint32_t(kBlockM), 1, 1};  // 64 heads of one token
    return mla_common::encode_tma(map, element, 4, base, dims, strides, box) == nullptr;
  };
  // Only where a q-tile is 64 heads of one token (h_q 128 in the seesaw kernel).
  return p.num_heads_q % kBlockM == 0 &&
         encode(&tma->q_nope, p.q_nope, kHeadDimV, p.q_nope_batch_stride, p.q_nope_token_stride, p.q_nope_head_stride) &&
         encode(&tma->q_pe, p.q_pe, kHeadDimK - kHeadDimV, p.q_pe_batch_stride, p.q_pe_token_stride, p.q_pe_head_stride);
}

}  // namespace mla_decode
