#include "mla_decode/rows64_seesaw/kernel.cuh"
template cudaError_t mla_decode::run_mla_decode_rows64_seesaw<cutlass::bfloat16_t>(
    const mla_decode::DecodeParams&, const mla_decode::DecodeTma&, cudaStream_t);
