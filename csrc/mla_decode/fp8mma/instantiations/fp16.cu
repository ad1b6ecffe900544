#include "mla_decode/fp8mma/kernel.cuh"
template cudaError_t mla_decode::run_mla_decode_fp8mma<cutlass::half_t>(
    const mla_decode::DecodeParams&, const mla_decode::DecodeTma&, cudaStream_t);
