// What every loramux operator (ops.cpp) shares: the ISA variant the kernels run in (chosen in
// isa.cpp) and the argument checks that run before any raw pointer reaches a C kernel (each
// raises RuntimeError or ValueError naming the operator and the argument).
#ifndef LORAMUX_OPS_COMMON_H
#define LORAMUX_OPS_COMMON_H

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kernels.h"

namespace lmx {

// One ISA variant's kernels (kernels.h).
struct Variant {
  const char* name;
  bool (*runs_here)();
  decltype(&loramux_paged_attention_scalar) paged_attention;
  decltype(&loramux_add_rms_norm_scalar) add_rms_norm;
  decltype(&loramux_rope_scalar) rope;
  decltype(&loramux_act_mul_scalar) act_mul;
  decltype(&loramux_lora_sgmv_scalar) lora_sgmv;
};

// The variant the operators run: the best this binary carries and the CPU runs, unless
// select_isa chose another.
const Variant& active();
std::string isa();
std::vector<std::string> isas();
std::string select_isa(const std::string& name);


inline int dtype_code(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "loramux::", op,
              ": ", name, " must be float32 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kFloat ? 0 : 1;
}

inline int dtype_code(at::ScalarType s, const char* op, const char* name) {
  TORCH_CHECK(s == at::kFloat || s == at::kBFloat16, "loramux::", op, ": ", name,
              " must be float32 or bfloat16, got ", s);
  return s == at::kFloat ? 0 : 1;
}

inline void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "loramux::", op, ": ", name, " must be a CPU tensor, got ",
              t.device());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == dim, "loramux::", op, ": ", name, " must have ", dim,
              " dimensions, got shape ", t.sizes());
}

inline void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "loramux::", op, ": ", name,
              " must be contiguous, got strides ", t.strides());
}

// [rows, n] with dense rows (any row stride)
inline void check_rows(const at::Tensor& t, const char* op, const char* name) {
  check_cpu(t, op, name);
  check_dim(t, 2, op, name);
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, "loramux::", op, ": ", name,
              " must have dense rows (stride 1 along the last dimension), got strides ",
              t.strides());
}

inline void check_index(const at::Tensor& t, at::ScalarType dtype, int64_t dim, const char* op,
                        const char* name) {
  check_cpu(t, op, name);
  TORCH_CHECK(t.scalar_type() == dtype, "loramux::", op, ": ", name, " must be ", dtype,
              ", got ", t.scalar_type());
  check_dim(t, dim, op, name);
  check_contiguous(t, op, name);
}

inline int as_int(int64_t v, const char* op, const char* name) {
  TORCH_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), "loramux::", op, ": ", name, " (",
              v, ") is out of range");
  return static_cast<int>(v);
}

inline void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op,
                             const char* an, const char* bn) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "loramux::", op, ": ", bn, " (",
              b.scalar_type(), ") must have the dtype of ", an, " (", a.scalar_type(), ")");
}

// a tensor the operator writes must not have rows (or elements) that share memory
inline void check_writable(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, "loramux::", op, ": ", name,
              " has elements that share memory (an expanded view?); it is written in place");
}

inline void check_rc(int rc, const char* op) {
  TORCH_CHECK(rc == 0, "loramux::", op, ": could not allocate the kernel's work buffers");
}

inline int threads() { return at::get_num_threads(); }

}  // namespace lmx

#endif
