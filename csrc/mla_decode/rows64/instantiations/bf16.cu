#include "mla_decode/rows64/kernel.cuh"
template cudaError_t mla_decode::run_mla_decode<cutlass::bfloat16_t, false>(
    const mla_decode::DecodeParams&, const mla_decode::DecodeTma&, cudaStream_t);
