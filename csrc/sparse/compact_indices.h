// Top-k index compaction of the sparse (DeepSeek-V3.2) attention path: declarations only; the kernel
// is in compact_indices.cu. Semantics: csrc/bindings/ops_sparse.cpp.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace mla_sparse {

// Indices a CTA walks per tile. Positions are int and a tile's end is computed: topk may be at most
// INT_MAX - kCompactTile.
constexpr int kCompactTile = 2048;

struct CompactParams {
  const int* indices;        // [rows, topk]: cache slots; any value (-1, past the cache) allowed
  int64_t indices_stride;    // elements between rows
  const int* topk_length;    // [rows] or nullptr (every position counts)
  int64_t topk_length_stride;
  int64_t rows;
  int topk;
  int64_t num_slots;         // a slot s is valid iff 0 <= s < num_slots
  int* slots;                // [rows, topk], contiguous: the valid slots in order, then -1
  int* counts;               // [rows]: how many slots are valid
};

cudaError_t run_compact_sparse_indices(const CompactParams& params, cudaStream_t stream);

}  // namespace mla_sparse
