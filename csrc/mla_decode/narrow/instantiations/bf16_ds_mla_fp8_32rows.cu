#include "mla_decode/narrow/kernel.cuh"
template cudaError_t mla_decode::run_mla_decode_narrow_ds_mla_fp8<cutlass::bfloat16_t, 32>(
    const mla_decode::DecodeParams&, const mla_decode::DecodeTma&, cudaStream_t);
