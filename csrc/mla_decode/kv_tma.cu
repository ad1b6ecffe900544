// TMA descriptor of the paged latent cache. cuTensorMapEncodeTiled is taken from the driver at run
// time, so the extension links no libcuda and loads on machines without a GPU.
#include <cuda.h>
#include <cuda_runtime.h>

#include "mla_decode/config.h"
#include "mla_decode/decode.h"

namespace mla_decode {

namespace {
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      ptr = nullptr;
    }
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }
}  // namespace

const char* make_kv_tma(const DecodeParams& p, bool is_bf16, DecodeTma* tma) {
  EncodeTiledFn encode = encode_tiled();
  if (encode == nullptr) return "cuTensorMapEncodeTiled is not available from the CUDA driver";
  // A copy never crosses a page: rows_per_copy divides page_size (a multiple of 16) and 64.
  tma->rows_per_copy = gcd(p.page_size, kBlockN);
  const size_t elem = 2;
  const cuuint64_t dims[3] = {cuuint64_t(kHeadDimK), cuuint64_t(p.page_size), cuuint64_t(p.num_pages)};
  const cuuint64_t strides[2] = {cuuint64_t(p.kv_token_stride * elem), cuuint64_t(p.kv_page_stride * elem)};
  const cuuint32_t box[3] = {cuuint32_t(kTmaColumns), cuuint32_t(tma->rows_per_copy), 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(&tma->kv, is_bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                            3, const_cast<void*>(p.kv), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? nullptr : "cuTensorMapEncodeTiled rejected the KV cache layout";
}

}  // namespace mla_decode
