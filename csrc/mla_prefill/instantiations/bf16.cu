#include "mla_prefill/prefill_launch.cuh"
template cudaError_t mla_prefill::run_mla_prefill<cutlass::bfloat16_t>(const mla_prefill::PrefillParams&,
                                                                 const mla_prefill::PrefillTma&, cudaStream_t);
