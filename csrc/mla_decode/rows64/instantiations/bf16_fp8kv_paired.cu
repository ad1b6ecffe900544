#include "mla_decode/rows64/kernel.cuh"
template cudaError_t mla_decode::run_mla_decode_fp8_paired<cutlass::bfloat16_t>(
    const mla_decode::DecodeParams&, const mla_decode::DecodeTma&, cudaStream_t);
