#include "mla_prefill/prefill_launch.cuh"
template cudaError_t mla_prefill::run_mla_prefill<cutlass::half_t>(const mla_prefill::PrefillParams&,
                                                                 const mla_prefill::PrefillTma&, cudaStream_t);
