// What the memory system delivers to a decode kernel's producer, with no math: one CTA per SM streams
// a paged latent cache (128 x 16384 keys, 576 values per key, pages in random order) through a ring
// of shared-memory stages, one thread issuing the loads and one releasing each stage as it lands.
// Patterns: the decode kernels' TMA boxes (9 slabs of 64 columns per 64-key tile; 16-row copies as
// at page 16) under each L2 promotion of the tensor map, other box orders, one bulk copy per page,
// and one bulk copy per key row. bf16 (1152 bytes per key) and fp8 (576).
// Then gathered rows, one bulk copy per listed row as the row-staged kernels copy them (16 lanes of
// each of 4 warps, a row each; the row list read before the stage wait), bf16 / e4m3 / ds_mla_fp8
// rows (1152 / 576 / 656 bytes), 2M rows per run: "page 1" lists every row of a 2M-row cache once
// in random order (a page-1 block table); "top-k" lists, for each of 1024 query tokens, 2048
// distinct random rows of its own 8192-row context, whose 64-row pages lie in random order in an
// 8M-row cache (bench_sparse.py's data at s_q 1); "L2" reads the page-1 list folded onto 16,384 rows,
// which stay in L2 (no HBM in the way: the gather's own rate). Each from 1 stage up to as many as fit.
//   TB/s = bytes moved / median time of 10 runs (CUDA events; every cache but "L2"'s is far larger
//   than L2).
// Standalone (not part of the extension): nvcc -O2 -std=c++17 -arch=sm_90a -o tma_read_probe tma_read_probe.cu
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e = (x);                                                                      \
    if (e != cudaSuccess) {                                                                   \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));                        \
      exit(1);                                                                                \
    }                                                                                         \
  } while (0)

typedef CUresult (*EncodeFn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                             const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                             CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

enum Pattern { kSlabBoxes, kRowGroups, kRowMajor, kBulkPage, kBulkRows };
constexpr int kGatherRows = 1 << 21, kTopk = 2048, kContext = 8192, kL2Rows = 16384;
constexpr int kKeys = 64, kSlabs = 9, kPages = 128 * 256;  // b128 x L16384 at 64 keys per page

struct Case {
  Pattern pattern;
  int rows_per_copy;  // kSlabBoxes: keys per TMA box (64, or 16 as at page 16)
  CUtensorMapL2promotion promotion;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void wait_parity(uint32_t bar, uint32_t parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n"
               ::"r"(bar), "r"(parity));
}

// A CTA's ring: `stages` shared-memory stages of stage_bytes from the first 1024-byte boundary of raw, then
// per stage a full barrier (full_arrivals arrivals and the stage's bytes) and an empty one (one arrival).
struct Ring {
  uint8_t* stages;
  uint64_t* full;
  uint64_t* empty;
};
__device__ Ring init_ring(uint8_t* raw, int stages, int stage_bytes, int full_arrivals) {
  Ring ring;
  ring.stages = raw + ((1024 - (smem_u32(raw) & 1023)) & 1023);
  ring.full = reinterpret_cast<uint64_t*>(ring.stages + stages * stage_bytes);
  ring.empty = ring.full + stages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(ring.full + s)), "r"(full_arrivals));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(ring.empty + s)));
    }
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  return ring;
}
// This CTA's tiles [x, y) of n.
__device__ int2 cta_tiles(int n) {
  return make_int2(int(int64_t(n) * blockIdx.x / gridDim.x), int(int64_t(n) * (blockIdx.x + 1) / gridDim.x));
}
// The L2 policy of every copy: the cache is read once.
__device__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// The default policy: rows read again (the "L2" row list) stay in L2.
__device__ uint64_t evict_normal_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// Tile i of this CTA: kKeys keys from page perm[i] (kBulkRows: one bulk copy per key row, 32 lanes,
// rows padded by 16 bytes in shared memory).
template <Pattern kPattern>
__global__ void __launch_bounds__(64) stream_tiles(const __grid_constant__ CUtensorMap map, const uint8_t* cache,
                                                   const int* perm, int stages, int row_bytes, int rows_per_copy) {
  extern __shared__ uint8_t raw[];
  const int tile_bytes = kKeys * row_bytes;
  const int stage_bytes = kKeys * (kPattern == kBulkRows ? row_bytes + 16 : row_bytes);
  const Ring ring = init_ring(raw, stages, stage_bytes, 1);
  uint8_t* smem = ring.stages;
  uint64_t *full = ring.full, *empty = ring.empty;
  const int2 range = cta_tiles(kPages);
  const int begin = range.x, end = range.y;
  const uint64_t policy = evict_first_policy();
  const uint64_t tmap = reinterpret_cast<uint64_t>(&map);
  const int lanes = kPattern == kBulkRows ? 32 : 1;
  if (threadIdx.x < lanes) {
    for (int i = begin; i < end; ++i) {
      const int k = i - begin, s = k % stages;
      wait_parity(smem_u32(empty + s), ((k / stages) & 1) ^ 1);
      const uint32_t bar = smem_u32(full + s);
      if (threadIdx.x == 0) asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(tile_bytes));
      const int page = perm[i];
      uint8_t* dst = smem + s * stage_bytes;
      if (kPattern == kSlabBoxes) {  // box (64 columns, rows_per_copy keys), slab-major tile
        const int slab_bytes = tile_bytes / kSlabs;
        for (int r = 0; r < kKeys; r += rows_per_copy)
          for (int j = 0; j < kSlabs; ++j)
            asm volatile(
                "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                " [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(smem_u32(dst + j * slab_bytes + r * (slab_bytes / kKeys))),
                "l"(tmap), "r"(j * 64), "r"(r), "r"(page), "r"(bar), "l"(policy) : "memory");
      } else if (kPattern == kRowGroups) {  // one box: [8-key group][slab][8 keys][64 columns]
        asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                     " [%0], [%1, {0, 0, 0, 0, %2}], [%3], %4;" ::"r"(smem_u32(dst)), "l"(tmap), "r"(page), "r"(bar),
                     "l"(policy) : "memory");
      } else if (kPattern == kRowMajor) {  // one box in memory order: [key][slab][64 columns]
        asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                     " [%0], [%1, {0, 0, 0, %2}], [%3], %4;" ::"r"(smem_u32(dst)), "l"(tmap), "r"(page), "r"(bar),
                     "l"(policy) : "memory");
      } else if (kPattern == kBulkPage) {
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                     " [%0], [%1], %2, [%3], %4;" ::"r"(smem_u32(dst)), "l"(cache + int64_t(page) * tile_bytes),
                     "r"(tile_bytes), "r"(bar), "l"(policy) : "memory");
      } else {
        for (int r = threadIdx.x; r < kKeys; r += lanes)
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                       " [%0], [%1], %2, [%3], %4;" ::"r"(smem_u32(dst + r * (row_bytes + 16))),
                       "l"(cache + int64_t(page) * tile_bytes + r * row_bytes), "r"(row_bytes), "r"(bar), "l"(policy)
                       : "memory");
      }
    }
  } else if (threadIdx.x == 32) {
    for (int i = begin; i < end; ++i) {
      const int k = i - begin, s = k % stages;
      wait_parity(smem_u32(full + s), (k / stages) & 1);
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(empty + s)));
    }
  }
}

// Tile i of this CTA: keys rows[64 i, 64 i + 64) of the cache, one bulk copy per row from lanes 0-15 of
// warps 0-3 into staging rows of row_bytes + pad bytes; thread 128 hands each stage back as it lands.
__global__ void __launch_bounds__(160) gather_rows(const uint8_t* cache, const int* rows, int tiles, int stages,
                                                   int row_bytes, int pad, bool keep_in_l2) {
  extern __shared__ uint8_t raw[];
  const int stride = row_bytes + pad, stage_bytes = kKeys * stride;
  const Ring ring = init_ring(raw, stages, stage_bytes, 4);  // an arrival per producer warp
  uint8_t* smem = ring.stages;
  uint64_t *full = ring.full, *empty = ring.empty;
  const int2 range = cta_tiles(tiles);
  const int begin = range.x, end = range.y;
  const uint64_t policy = keep_in_l2 ? evict_normal_policy() : evict_first_policy();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < 4) {
    for (int i = begin; i < end; ++i) {
      const int k = i - begin, s = k % stages, r = 16 * warp + lane;
      const int row = lane < 16 ? rows[int64_t(i) * kKeys + r] : 0;
      wait_parity(smem_u32(empty + s), ((k / stages) & 1) ^ 1);
      const uint32_t bar = smem_u32(full + s);
      if (lane == 0) asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(16 * row_bytes));
      __syncwarp();
      if (lane < 16)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                     " [%0], [%1], %2, [%3], %4;" ::"r"(smem_u32(smem + s * stage_bytes + r * stride)),
                     "l"(cache + int64_t(row) * row_bytes), "r"(row_bytes), "r"(bar), "l"(policy) : "memory");
    }
  } else if (threadIdx.x == 128) {
    for (int i = begin; i < end; ++i) {
      const int k = i - begin, s = k % stages;
      wait_parity(smem_u32(full + s), (k / stages) & 1);
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(empty + s)));
    }
  }
}

__global__ void plain_read(const int4* p, int64_t n, int* out) {
  int acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678) *out = acc;
}

int main() {
  EncodeFn encode;
  cudaDriverEntryPointQueryResult status;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                         cudaEnableDefault, &status));
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t max_bytes = size_t(kPages) * kKeys * 1152;
  uint8_t* cache;
  CHECK(cudaMalloc(&cache, max_bytes));
  CHECK(cudaMemset(cache, 1, max_bytes));
  std::vector<int> perm(kPages);
  for (int i = 0; i < kPages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), std::mt19937(1));
  int *dperm, *dout;
  CHECK(cudaMalloc(&dperm, kPages * 4));
  CHECK(cudaMemcpy(dperm, perm.data(), kPages * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&dout, 4));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  auto time_it = [&](auto launch, double bytes, const char* name) {
    for (int w = 0; w < 3; ++w) launch();
    CHECK(cudaDeviceSynchronize());
    std::vector<float> ms(10);
    for (float& t : ms) {
      CHECK(cudaEventRecord(e0));
      launch();
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaEventElapsedTime(&t, e0, e1));
    }
    std::sort(ms.begin(), ms.end());
    printf("%-52s %8.1f us %6.3f TB/s\n", name, ms[5] * 1e3, bytes / (ms[5] * 1e-3) / 1e12);
  };
  time_it([&] { plain_read<<<sms * 8, 512>>>(reinterpret_cast<int4*>(cache), int64_t(max_bytes / 16), dout); },
          double(max_bytes), "plain ld.global.cs.v4, 2.4 GB");

  const char* promotion_names[] = {"none", "64B", "128B", "256B"};
  const char* pattern_names[] = {"slabs", "row groups", "row major", "bulk page", "bulk rows"};
  std::vector<Case> cases;
  for (int rows : {64, 16})
    for (int promo = 0; promo < 4; ++promo) cases.push_back({kSlabBoxes, rows, CUtensorMapL2promotion(promo)});
  for (Pattern pattern : {kRowGroups, kRowMajor})
    for (int promo : {0, 2, 3}) cases.push_back({pattern, 64, CUtensorMapL2promotion(promo)});
  cases.push_back({kBulkPage, 64, CU_TENSOR_MAP_L2_PROMOTION_NONE});
  cases.push_back({kBulkRows, 64, CU_TENSOR_MAP_L2_PROMOTION_NONE});

  for (int elem : {2, 1}) {
    const int row_bytes = 576 * elem, tile_bytes = kKeys * row_bytes, slab_bytes = 64 * elem;
    const int stages = elem == 2 ? 2 : 5;  // as the 16-bit and the fp8 narrow kernels
    const CUtensorMapDataType type = elem == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8;
    const CUtensorMapSwizzle swizzle = elem == 2 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
    const cuuint32_t ones[5] = {1, 1, 1, 1, 1};
    for (const Case& c : cases) {
      CUtensorMap map;
      memset(&map, 0, sizeof(map));
      CUresult r = CUDA_SUCCESS;
      auto make = [&](int rank, const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box) {
        return encode(&map, type, rank, cache, dims, strides, box, ones, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                      c.promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
      };
      if (c.pattern == kSlabBoxes) {
        const cuuint64_t dims[3] = {576, kKeys, kPages}, strides[2] = {cuuint64_t(row_bytes), cuuint64_t(tile_bytes)};
        const cuuint32_t box[3] = {64, cuuint32_t(c.rows_per_copy), 1};
        r = make(3, dims, strides, box);
      } else if (c.pattern == kRowGroups) {  // (column, key in group, slab, group, page)
        const cuuint64_t dims[5] = {64, 8, kSlabs, kKeys / 8, kPages};
        const cuuint64_t strides[4] = {cuuint64_t(row_bytes), cuuint64_t(slab_bytes), cuuint64_t(8 * row_bytes),
                                       cuuint64_t(tile_bytes)};
        const cuuint32_t box[5] = {64, 8, kSlabs, kKeys / 8, 1};
        r = make(5, dims, strides, box);
      } else if (c.pattern == kRowMajor) {  // (column, slab, key, page)
        const cuuint64_t dims[4] = {64, kSlabs, kKeys, kPages};
        const cuuint64_t strides[3] = {cuuint64_t(slab_bytes), cuuint64_t(row_bytes), cuuint64_t(tile_bytes)};
        const cuuint32_t box[4] = {64, kSlabs, kKeys, 1};
        r = make(4, dims, strides, box);
      }
      if (r != CUDA_SUCCESS) {
        printf("%s: the tensor map was rejected (%d)\n", pattern_names[c.pattern], int(r));
        continue;
      }
      const int stage_bytes = kKeys * (c.pattern == kBulkRows ? row_bytes + 16 : row_bytes);
      const int smem = stages * stage_bytes + 1024 + 16 * stages;
      char name[128];
      snprintf(name, sizeof(name), "%s %s%s, promotion %s", elem == 2 ? "bf16" : "fp8 ", pattern_names[c.pattern],
               c.pattern == kSlabBoxes ? (c.rows_per_copy == 64 ? " (64-key boxes)" : " (16-key boxes)") : "",
               c.pattern <= kRowMajor ? promotion_names[c.promotion] : "-");
      auto run = [&](auto kernel) {
        CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        time_it([&] { kernel<<<sms, 64, smem>>>(map, cache, dperm, stages, row_bytes, c.rows_per_copy); },
                double(kPages) * tile_bytes, name);
        CHECK(cudaGetLastError());
      };
      switch (c.pattern) {
        case kSlabBoxes: run(stream_tiles<kSlabBoxes>); break;
        case kRowGroups: run(stream_tiles<kRowGroups>); break;
        case kRowMajor: run(stream_tiles<kRowMajor>); break;
        case kBulkPage: run(stream_tiles<kBulkPage>); break;
        case kBulkRows: run(stream_tiles<kBulkRows>); break;
      }
    }
  }

  // Gathered rows: the row lists, then each row size with 1 stage up to as many as fit (the kernels hold
  // some of theirs while their math reads them, so fewer are in flight than they have).
  const int64_t cache_rows = int64_t(kGatherRows / kTopk) * kContext;  // top-k: 1024 contexts of 8192 rows
  uint8_t* big;
  CHECK(cudaMalloc(&big, cache_rows * 1152));
  CHECK(cudaMemset(big, 1, cache_rows * 1152));
  std::mt19937 gen(2);
  std::vector<int> page1(kGatherRows), topk;
  for (int i = 0; i < kGatherRows; ++i) page1[i] = i;
  std::shuffle(page1.begin(), page1.end(), gen);
  std::vector<int> pages(cache_rows / kKeys), order(kContext);
  for (size_t i = 0; i < pages.size(); ++i) pages[i] = int(i);
  std::shuffle(pages.begin(), pages.end(), gen);
  for (int t = 0; t < kGatherRows / kTopk; ++t) {
    for (int i = 0; i < kContext; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), gen);
    for (int i = 0; i < kTopk; ++i)
      topk.push_back(pages[t * (kContext / kKeys) + order[i] / kKeys] * kKeys + order[i] % kKeys);
  }
  // "L2": the page-1 list folded onto the cache's first kL2Rows rows, which stay in L2 (as where every
  // request reads one shared cache: bench_decode.py --l2-resident), so the gather's own rate shows.
  std::vector<int> l2rows(kGatherRows);
  for (int i = 0; i < kGatherRows; ++i) l2rows[i] = page1[i] % kL2Rows;
  int *dpage1, *dtopk, *dl2;
  CHECK(cudaMalloc(&dpage1, kGatherRows * 4));
  CHECK(cudaMalloc(&dtopk, kGatherRows * 4));
  CHECK(cudaMalloc(&dl2, kGatherRows * 4));
  CHECK(cudaMemcpy(dpage1, page1.data(), kGatherRows * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dtopk, topk.data(), kGatherRows * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dl2, l2rows.data(), kGatherRows * 4, cudaMemcpyHostToDevice));
  struct RowCase { const char* name; int row_bytes, pad; };
  const RowCase row_cases[] = {{"bf16", 1152, 16}, {"e4m3", 576, 16}, {"ds_mla_fp8", 656, 0}};
  const char* list_names[] = {"page 1", "top-k", "L2"};
  for (const RowCase& rc : row_cases) {
    const int stage_bytes = kKeys * (rc.row_bytes + rc.pad);
    const int max_stages = (227 * 1024 - 1024) / (stage_bytes + 16);
    for (int list = 0; list < 3; ++list) {
      const int* rows = list == 0 ? dpage1 : list == 1 ? dtopk : dl2;
      for (int stages = 1; stages <= max_stages; ++stages) {
        const int smem = stages * stage_bytes + 1024 + 16 * stages;
        CHECK(cudaFuncSetAttribute(gather_rows, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        char name[128];
        snprintf(name, sizeof(name), "gather %s rows, %s, %d stages", rc.name, list_names[list], stages);
        time_it([&] { gather_rows<<<sms, 160, smem>>>(list == 1 ? big : cache, rows, kGatherRows / kKeys, stages,
                                                     rc.row_bytes, rc.pad, list == 2); },
                double(kGatherRows) * rc.row_bytes, name);
        CHECK(cudaGetLastError());
      }
    }
  }
  return 0;
}
