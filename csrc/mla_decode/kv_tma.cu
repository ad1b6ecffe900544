// TMA descriptor of the paged latent cache.
#include "common/tma_desc.h"
#include "mla_decode/config.h"
#include "mla_decode/decode.h"

namespace mla_decode {

namespace {
int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }
}  // namespace

const char* make_kv_tma(const DecodeParams& p, mla_common::TmaElement element, DecodeTma* tma) {
  // A copy never crosses a page: rows_per_copy divides page_size (a multiple of 16) and 64.
  tma->rows_per_copy = gcd(p.page_size, kBlockN);
  const size_t elem = element == mla_common::TmaElement::kFp8 ? 1 : 2;
  const uint64_t dims[3] = {uint64_t(kHeadDimK), uint64_t(p.page_size), uint64_t(p.num_pages)};
  const uint64_t strides[2] = {uint64_t(p.kv_token_stride * elem), uint64_t(p.kv_page_stride * elem)};
  const uint32_t box[3] = {uint32_t(kTmaColumns), uint32_t(tma->rows_per_copy), 1};
  return mla_common::encode_tma(&tma->kv, element, 3, p.kv, dims, strides, box);
}

}  // namespace mla_decode
