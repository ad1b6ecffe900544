// A correct program that compute-sanitizer racecheck reports as racy (H200, CUDA 13.0): the pattern
// of the narrow decode kernel's end-of-request merge.
//
// Two math warpgroups of a 384-thread CTA hand values to each other through shared memory, each
// hand-off behind a 256-thread named barrier (ids 4-6). Before that, a warpgroup may have run
// 128-thread barriers of its own (ids 2 / 3) a number of times: in the decode kernel, once per KV
// tile it processed, and the two warpgroups rarely process the same number of tiles.
//   - both warpgroups run their local barriers equally often: 0 hazards;
//   - only warpgroup 0 runs them: racecheck reports RAW/WAR hazards on every hand-off below, although
//     each access pair is ordered by bar.sync 4/5/6 over all 256 math threads.
// Build and run: nvcc -arch=sm_90a -lineinfo scripts/racecheck_probe.cu -o /tmp/racecheck_probe &&
//                compute-sanitizer --tool racecheck /tmp/racecheck_probe
#include <cstdio>

__device__ __forceinline__ void bar(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

template <bool kOnlyWarpgroup0>
__global__ void probe(float* out) {
  __shared__ float stat[2][4];
  __shared__ float handoff[2][128];
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128, warp = tid / 32;
  if (wg == 2) return;  // the producer warpgroup leaves early, as in the kernel
  float acc = 0.f;
  if (!kOnlyWarpgroup0 || wg == 0) {
    for (int it = 0; it < 3; ++it) {  // warpgroup-local hand-offs (the kernel's per-tile column max)
      if (tid % 32 == 0) stat[wg][warp] = float(it + warp);
      bar(2 + wg, 128);
      for (int w = 0; w < 4; ++w) acc += stat[wg][w];
      bar(2 + wg, 128);
    }
  }
  handoff[wg][tid] = acc;
  bar(4, 256);
  out[blockIdx.x * 256 + threadIdx.x] = handoff[1 - wg][tid];
  bar(5, 256);
  handoff[wg][tid] = acc + 1.f;  // reuse once both have read
  bar(6, 256);
  out[blockIdx.x * 256 + threadIdx.x] += handoff[1 - wg][tid];
}

int main() {
  float* out;
  cudaMalloc(&out, 4 * 256 * sizeof(float));
  probe<false><<<4, 384>>>(out);
  cudaDeviceSynchronize();
  printf("both warpgroups run local barriers (expect 0 hazards): %s\n", cudaGetErrorString(cudaGetLastError()));
  probe<true><<<4, 384>>>(out);
  cudaDeviceSynchronize();
  printf("only warpgroup 0 runs them (racecheck reports hazards): %s\n", cudaGetErrorString(cudaGetLastError()));
  cudaFree(out);
}
