// Element types of the memory-bound kernels (merge, KV cache), as the bindings name them without
// including CUDA's type headers.
#pragma once

namespace mla_common {

enum class Dtype { kBf16, kFp16, kFp32, kFp8E4m3 };

}  // namespace mla_common
