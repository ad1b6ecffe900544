// Whether two strided tensors have a byte in common, for the outputs' overlap checks (checks.h). The
// same search as python/mla_attn/_validation.py's _share_an_address, so that a CUDA op called directly
// refuses what the wrappers and the CPU ops refuse.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <utility>
#include <vector>

namespace mla_bindings {

// How many coefficients share_an_address tries before it calls the pair overlapping.
constexpr int kAddressSearchSteps = 256;

// [first, end) byte addresses t's elements span (t non-empty).
inline std::pair<uintptr_t, uintptr_t> byte_range(const at::Tensor& t) {
  int64_t span = 0;
  for (int64_t d = 0; d < t.dim(); ++d) span += t.stride(d) * (t.size(d) - 1);
  const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {first, first + static_cast<uintptr_t>((span + 1) * t.element_size())};
}

class AddressSearch {
 public:
  AddressSearch(const at::Tensor& a, const at::Tensor& b) {
    std::map<int64_t, std::pair<int64_t, int64_t>, std::greater<>> terms;  // byte stride -> coefficient range
    add_terms(a, 1, terms);
    add_terms(b, -1, terms);
    for (const auto& [stride, range] : terms) terms_.push_back({stride, range.first, range.second});
    rest_low_.assign(terms_.size() + 1, 0);
    rest_high_.assign(terms_.size() + 1, 0);
    for (size_t k = terms_.size(); k-- > 0;) {
      rest_low_[k] = rest_low_[k + 1] + terms_[k].low * terms_[k].stride;
      rest_high_[k] = rest_high_[k + 1] + terms_[k].high * terms_[k].stride;
    }
    distance_ = static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.data_ptr()) -
                                     reinterpret_cast<uintptr_t>(a.data_ptr()));
  }

  bool found() { return reach(0, distance_); }

 private:
  struct Term {
    int64_t stride, low, high;
  };

  // t's byte addresses, start + sum(i_d * stride_d) + byte, as coefficient ranges per byte stride;
  // sign -1 adds them negated.
  template <typename Terms>
  static void add_terms(const at::Tensor& t, int sign, Terms& terms) {
    auto add = [&](int64_t stride, int64_t size) {
      auto& [low, high] = terms[stride];
      (sign > 0 ? high : low) += sign * (size - 1);
    };
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (t.size(d) > 1 && t.stride(d) != 0) add(t.stride(d) * t.element_size(), t.size(d));
    }
    add(1, t.element_size());
  }

  static int64_t floor_div(int64_t x, int64_t y) { return x / y - (x % y != 0 && (x < 0) != (y < 0)); }

  bool reach(size_t k, int64_t rest) {
    if (k == terms_.size()) return rest == 0;
    const Term& term = terms_[k];
    const int64_t first = std::max(term.low, -floor_div(rest_high_[k + 1] - rest, term.stride));
    const int64_t last = std::min(term.high, floor_div(rest - rest_low_[k + 1], term.stride));
    for (int64_t c = first; c <= last; ++c) {
      if (--tries_ < 0 || reach(k + 1, rest - c * term.stride)) return true;
    }
    return false;
  }

  std::vector<Term> terms_;
  std::vector<int64_t> rest_low_, rest_high_;  // what terms_[k:] can add
  int64_t distance_ = 0;
  int tries_ = kAddressSearchSteps;
};

// Whether a and b have a byte in common: some coefficients, each in its range, make sum(c_s * s) over
// the byte strides s of both equal b's start - a's. Searched from the largest stride down, each
// coefficient bounded by what the smaller strides can still add: where the strides nest (the views an
// engine makes) that leaves at most two per stride. Past kAddressSearchSteps tries it answers true:
// refusing an odd layout is safe, passing an overlap is not. By addresses, not storages, so memory
// reached through a second storage (a tensor from DLPack or from_blob) counts too.
inline bool share_an_address(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.device() != b.device()) return false;
  const auto [a_first, a_end] = byte_range(a);
  const auto [b_first, b_end] = byte_range(b);
  if (a_end <= b_first || b_end <= a_first) return false;
  return AddressSearch(a, b).found();
}

}  // namespace mla_bindings
