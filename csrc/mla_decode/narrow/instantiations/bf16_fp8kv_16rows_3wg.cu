#include "mla_decode/narrow/kernel.cuh"
template cudaError_t mla_decode::run_mla_decode_narrow<cutlass::bfloat16_t, 16, 3, true>(
    const mla_decode::DecodeParams&, const mla_decode::DecodeTma&, cudaStream_t);
