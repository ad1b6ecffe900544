// TMA descriptor encoding shared by the kernels' host code. cuTensorMapEncodeTiled is taken from the
// driver at run time, so the extension links no libcuda and loads on machines without a GPU.
#pragma once
#include <cuda.h>
#include <cstdint>

namespace mla_common {

enum class TmaElement { kBf16, kFp16, kFp8 };

// Encodes a tiled map. 16-bit elements are 128-byte swizzled (the WGMMA operand layout); fp8 bytes
// are 64-byte swizzled (boxes of 64-byte rows, read back by LDS/ldmatrix without bank conflicts).
// dims/box are innermost first; strides_bytes holds the rank - 1 outer strides. Returns an error
// message or nullptr.
const char* encode_tma(CUtensorMap* map, TmaElement element, int rank, const void* base, const uint64_t* dims,
                       const uint64_t* strides_bytes, const uint32_t* box);

}  // namespace mla_common
