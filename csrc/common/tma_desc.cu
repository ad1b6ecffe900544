#include <cuda_runtime.h>

#include "common/tma_desc.h"

namespace mla_common {
namespace {
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                             cudaEnableDefault, &status);
#else  // CUDA 12.4 has no ByVersion query (the plain one is deprecated from 12.5); one ABI since 12.0
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr, cudaEnableDefault, &status);
#endif
    if (err != cudaSuccess || status != cudaDriverEntryPointSuccess) {
      ptr = nullptr;
    }
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}
}  // namespace

const char* encode_tma(CUtensorMap* map, TmaElement element, int rank, const void* base, const uint64_t* dims,
                       const uint64_t* strides_bytes, const uint32_t* box) {
  EncodeTiledFn encode = encode_tiled();
  if (encode == nullptr) return "cuTensorMapEncodeTiled is not available from the CUDA driver";
  const bool fp8 = element == TmaElement::kFp8;
  cuuint64_t d[5], s[4];
  cuuint32_t b[5], elem_strides[5];
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    b[i] = box[i];
    elem_strides[i] = 1;
    // Dim i + 1's stride. A dim of extent 1 is never stepped, and torch lets it carry any stride (a
    // one-page cache, a one-token q), which TMA would refuse unless a multiple of 16 bytes: it gets
    // the packed one, the span of the dims inside it.
    if (i + 1 < rank) s[i] = dims[i + 1] != 1 ? strides_bytes[i] : i == 0 ? dims[0] * (fp8 ? 1 : 2) : s[i - 1] * dims[i];
  }
  const CUtensorMapDataType type = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : element == TmaElement::kBf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                  : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  // L2 promotion 128 B, the size of a box row (a 64-column slab row of a 16-bit tile, two fp8 ones):
  // 256 B promotes bytes no box of this row asks for and streams the paged cache slower; none and 64 B
  // lose for fp8 (benchmarks/tma_read_probe.cu, docs/design-decisions.md).
  const CUresult r = encode(map, type, cuuint32_t(rank), const_cast<void*>(base), d, s, b, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, fp8 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? nullptr : "cuTensorMapEncodeTiled rejected the tensor layout (strides/alignment)";
}

}  // namespace mla_common
