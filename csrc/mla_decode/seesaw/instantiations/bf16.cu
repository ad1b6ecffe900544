#include "mla_decode/seesaw/kernel.cuh"
template cudaError_t mla_decode::run_mla_decode_seesaw<cutlass::bfloat16_t, false>(
    const mla_decode::DecodeParams&, const mla_decode::DecodeTma&, cudaStream_t);
