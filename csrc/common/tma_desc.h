// TMA descriptor encoding shared by the kernels' host code. cuTensorMapEncodeTiled is taken from the
// driver at run time, so the extension links no libcuda and loads on machines without a GPU.
#pragma once
#include <cuda.h>
#include <cstdint>

namespace mla_common {

// Encodes a tiled, 128-byte-swizzled map of 16-bit elements (bf16 or fp16). dims/box are innermost
// first; strides_bytes holds the rank - 1 outer strides. Returns an error message or nullptr.
const char* encode_tma_16bit(CUtensorMap* map, bool is_bf16, int rank, const void* base, const uint64_t* dims,
                             const uint64_t* strides_bytes, const uint32_t* box);

}  // namespace mla_common
