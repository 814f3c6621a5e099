// The CPU kernels as torch.library operators: torch.ops.loramux.*.
//
// Each operator has a schema (below), checks every argument before it hands raw pointers to
// the C kernels (a wrong dtype, shape, device, stride or index raises RuntimeError or
// ValueError, never reads or writes outside a tensor; the checks are ops_common.h's), and
// runs the ISA variant chosen once at load (isa.cpp: the best that both this binary carries
// and the CPU runs, overridable with loramux::select_isa).
// The fake (meta) implementations that check shapes without data live in Python
// (loramux/engine/model/kernels/fake.py); the calls show in torch.profiler by name.
//
// Built by setup.py (torch.utils.cpp_extension), as loramux.engine.model.kernels._C.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "ops_common.h"

namespace {

using namespace lmx;

// ---- operators -----------------------------------------------------------------------------

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     at::Tensor& out, const at::Tensor& block_tables, const at::Tensor& row_start,
                     const at::Tensor& num_new, const at::Tensor& ctx_len, int64_t block_size,
                     double scale, int64_t window, double softcap) {
  const char* op = "paged_attention";
  check_cpu(q, op, "q");
  check_dim(q, 3, op, "q");
  const int dtype = dtype_code(q, op, "q");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(H > 0 && D > 0, "loramux::", op, ": q [T, H, D] needs heads and a head dim, got ",
              q.sizes());
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "loramux::", op,
              ": q [T, H, D] must have its heads and dims dense (any token stride), got strides ",
              q.strides());
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    const char* name = c == &k_cache ? "k_cache" : "v_cache";
    check_cpu(*c, op, name);
    check_dim(*c, 3, op, name);
    check_contiguous(*c, op, name);
    check_same_dtype(q, *c, op, "q", name);
  }
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "loramux::", op, ": k_cache ", k_cache.sizes(),
              " and v_cache ", v_cache.sizes(), " must have one shape");
  const int64_t S = k_cache.size(0), Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D, "loramux::", op, ": the caches' head dim (", k_cache.size(2),
              ") must equal q's (", D, ")");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "loramux::", op, ": q's ", H,
              " heads must be a multiple of the caches' ", Hkv, " KV heads");
  check_cpu(out, op, "out");
  check_dim(out, 2, op, "out");
  check_contiguous(out, op, "out");
  check_same_dtype(q, out, op, "q", "out");
  TORCH_CHECK(out.size(1) == H * D, "loramux::", op, ": out must be [T, H * D] = [*, ", H * D,
              "], got ", out.sizes());
  check_index(block_tables, at::kInt, 2, op, "block_tables");
  const int64_t nseq = block_tables.size(0), width = block_tables.size(1);
  for (const at::Tensor* t : {&row_start, &num_new, &ctx_len}) {
    const char* name = t == &row_start ? "row_start" : t == &num_new ? "num_new" : "ctx_len";
    check_index(*t, at::kInt, 1, op, name);
    TORCH_CHECK(t->size(0) == nseq, "loramux::", op, ": ", name, " must have one entry per block "
                "table row (", nseq, "), got ", t->size(0));
  }
  TORCH_CHECK_VALUE(block_size > 0, "loramux::", op, ": block_size must be positive, got ",
                    block_size);
  TORCH_CHECK_VALUE(window >= 0, "loramux::", op, ": window must be >= 0 (0 = none), got ", window);
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0, "loramux::", op,
                    ": scale must be a positive number, got ", scale);
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0, "loramux::", op,
                    ": softcap must be >= 0 (0 = none), got ", softcap);
  const int64_t rows = std::min(T, out.size(0));
  const int32_t* tab = block_tables.data_ptr<int32_t>();
  const int32_t* rs = row_start.data_ptr<int32_t>();
  const int32_t* nn = num_new.data_ptr<int32_t>();
  const int32_t* cl = ctx_len.data_ptr<int32_t>();
  for (int64_t s = 0; s < nseq; s++) {
    TORCH_CHECK_VALUE(nn[s] >= 0 && rs[s] >= 0 && rs[s] + (int64_t)nn[s] <= rows, "loramux::", op,
                      ": sequence ", s, " writes rows ", rs[s], "..", rs[s] + (int64_t)nn[s],
                      " outside the ", rows, " rows of q and out");
    TORCH_CHECK_VALUE(cl[s] >= nn[s] && cl[s] <= width * block_size, "loramux::", op,
                      ": sequence ", s, " has context length ", cl[s], " for ", nn[s],
                      " new tokens and a block table of ", width, " x ", block_size, " slots");
    for (int64_t b = 0; b * block_size < cl[s]; b++) {
      const int64_t id = tab[s * width + b];
      const int64_t used = std::min<int64_t>(block_size, cl[s] - b * block_size);
      TORCH_CHECK_VALUE(id >= 0 && id * block_size + used <= S, "loramux::", op, ": sequence ", s,
                        " names block ", id, ", outside the cache's ", S, " slots");
    }
  }
  if (nseq == 0) return;
  const int rc = active().paged_attention(
      q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tab,
      width, rs, nn, cl, as_int(nseq, op, "the number of sequences"), as_int(H, op, "H"),
      as_int(Hkv, op, "Hkv"), as_int(D, op, "D"), as_int(block_size, op, "block_size"),
      as_int(window, op, "window"), static_cast<float>(scale), static_cast<float>(softcap), dtype,
      threads());
  check_rc(rc, op);
}

at::Tensor add_rms_norm(at::Tensor& residual, const std::optional<at::Tensor>& delta,
                        const at::Tensor& weight, double eps, at::ScalarType out_dtype,
                        bool unit_offset) {
  const char* op = "add_rms_norm";
  check_rows(residual, op, "residual");
  const int dtype = dtype_code(residual, op, "residual");
  const int out_code = dtype_code(out_dtype, op, "out_dtype");
  const int64_t T = residual.size(0), H = residual.size(1);
  if (delta.has_value()) check_writable(residual, op, "residual");
  check_cpu(weight, op, "weight");
  check_dim(weight, 1, op, "weight");
  check_contiguous(weight, op, "weight");
  check_same_dtype(residual, weight, op, "residual", "weight");
  TORCH_CHECK(weight.size(0) == H, "loramux::", op, ": weight must be [", H, "], got ",
              weight.sizes());
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, "loramux::", op, ": eps must be >= 0, got ",
                    eps);
  const void* dptr = nullptr;
  int64_t dstride = 0;
  int dcode = 0;
  if (delta.has_value()) {
    check_rows(*delta, op, "delta");
    dcode = dtype_code(*delta, op, "delta");
    TORCH_CHECK(delta->sizes() == residual.sizes(), "loramux::", op, ": delta ", delta->sizes(),
                " must have the shape of residual ", residual.sizes());
    dptr = delta->data_ptr();
    dstride = delta->stride(0);
  }
  at::Tensor out = at::empty({T, H}, residual.options().dtype(out_dtype));
  if (T == 0 || H == 0) return out;
  const int rc = active().add_rms_norm(residual.data_ptr(), residual.stride(0), dptr, dstride,
                                       dcode, weight.data_ptr(), out.data_ptr(), out_code, T, H,
                                       static_cast<float>(eps), unit_offset ? 1 : 0, dtype,
                                       threads());
  check_rc(rc, op);
  return out;
}

void rope(at::Tensor& qk, const at::Tensor& positions, const at::Tensor& cos,
          const at::Tensor& sin) {
  const char* op = "rope";
  check_cpu(qk, op, "qk");
  check_dim(qk, 3, op, "qk");
  const int dtype = dtype_code(qk, op, "qk");
  const int64_t T = qk.size(0), heads = qk.size(1), D = qk.size(2);
  TORCH_CHECK(qk.stride(2) == 1 && qk.stride(1) == D, "loramux::", op,
              ": qk [T, heads, D] must have its heads and dims dense (any token stride), got "
              "strides ", qk.strides());
  TORCH_CHECK(D % 2 == 0, "loramux::", op, ": the head dim must be even, got ", D);
  check_writable(qk, op, "qk");
  for (const at::Tensor* t : {&cos, &sin}) {
    const char* name = t == &cos ? "cos" : "sin";
    check_cpu(*t, op, name);
    check_dim(*t, 2, op, name);
    check_contiguous(*t, op, name);
    check_same_dtype(qk, *t, op, "qk", name);
    TORCH_CHECK(t->size(1) == D, "loramux::", op, ": ", name, " must be [positions, ", D,
                "], got ", t->sizes());
  }
  TORCH_CHECK(cos.sizes() == sin.sizes(), "loramux::", op, ": cos ", cos.sizes(), " and sin ",
              sin.sizes(), " must have one shape");
  check_index(positions, at::kLong, 1, op, "positions");
  TORCH_CHECK(positions.size(0) == T, "loramux::", op, ": positions must have one entry per token (",
              T, "), got ", positions.size(0));
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t P = cos.size(0);
  for (int64_t t = 0; t < T; t++)
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < P, "loramux::", op, ": position ", pos[t],
                      " is outside the rotary tables' ", P, " positions");
  if (T == 0 || heads == 0) return;
  const int rc = active().rope(qk.data_ptr(), qk.stride(0), pos, cos.data_ptr(), sin.data_ptr(), T,
                               as_int(heads, op, "heads"), as_int(D, op, "D"), dtype, threads());
  check_rc(rc, op);
}

at::Tensor act_mul(const char* op, const at::Tensor& gate_up, at::ScalarType out_dtype, int act) {
  check_rows(gate_up, op, "gate_up");
  const int dtype = dtype_code(gate_up, op, "gate_up");
  const int out_code = dtype_code(out_dtype, op, "out_dtype");
  const int64_t T = gate_up.size(0), two_i = gate_up.size(1);
  TORCH_CHECK(two_i % 2 == 0, "loramux::", op, ": gate_up must be [T, 2 * I] (gate | up), got ",
              gate_up.sizes());
  at::Tensor out = at::empty({T, two_i / 2}, gate_up.options().dtype(out_dtype));
  if (T == 0 || two_i == 0) return out;
  const int rc = active().act_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out_code,
                                  T, two_i / 2, act, dtype, threads());
  check_rc(rc, op);
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up, at::ScalarType out_dtype) {
  return act_mul("silu_mul", gate_up, out_dtype, 0);
}

at::Tensor gelu_tanh_mul(const at::Tensor& gate_up, at::ScalarType out_dtype) {
  return act_mul("gelu_tanh_mul", gate_up, out_dtype, 1);
}

void lora_sgmv(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& runs, const at::Tensor& ranks, const at::Tensor& slice_offsets) {
  const char* op = "lora_sgmv";
  check_rows(y, op, "y");
  check_rows(x, op, "x");
  const int y_code = dtype_code(y, op, "y"), x_code = dtype_code(x, op, "x");
  check_writable(y, op, "y");
  TORCH_CHECK(x.size(0) == y.size(0), "loramux::", op, ": x ", x.sizes(), " and y ", y.sizes(),
              " must have one row per token");
  check_cpu(a, op, "a");
  check_dim(a, 4, op, "a");
  check_contiguous(a, op, "a");
  check_cpu(b, op, "b");
  check_dim(b, 3, op, "b");
  check_contiguous(b, op, "b");
  const int w_code = dtype_code(a, op, "a");
  check_same_dtype(a, b, op, "a", "b");
  const int64_t slots = a.size(0), S = a.size(1), R = a.size(2), K = a.size(3), N = b.size(2);
  TORCH_CHECK(K == x.size(1), "loramux::", op, ": a [slots, S, R, K] has K = ", K,
              ", x has ", x.size(1), " columns");
  TORCH_CHECK(b.size(0) == slots && b.size(1) == S * R && N == y.size(1), "loramux::", op,
              ": b must be [slots, S * R, N] = [", slots, ", ", S * R, ", ", y.size(1), "], got ",
              b.sizes());
  check_index(runs, at::kLong, 2, op, "runs");
  TORCH_CHECK(runs.size(1) == 3, "loramux::", op, ": runs must be [n, 3] (start, end, slot), got ",
              runs.sizes());
  check_index(ranks, at::kLong, 1, op, "ranks");
  TORCH_CHECK(ranks.size(0) == slots, "loramux::", op, ": ranks must have one entry per slot (",
              slots, "), got ", ranks.size(0));
  check_index(slice_offsets, at::kLong, 1, op, "slice_offsets");
  TORCH_CHECK_VALUE(slice_offsets.size(0) == S + 1, "loramux::", op, ": slice_offsets must be ",
                    S + 1, " ints from 0 to ", N, ", got ", slice_offsets.size(0));
  const int64_t* off = slice_offsets.data_ptr<int64_t>();
  for (int64_t s = 0; s <= S; s++)
    TORCH_CHECK_VALUE((s == 0 ? off[s] == 0 : off[s] >= off[s - 1]) && (s < S || off[s] == N),
                      "loramux::", op, ": slice_offsets must rise from 0 to ", N, ", got ",
                      slice_offsets);
  const int64_t* rk = ranks.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots; i++)
    TORCH_CHECK_VALUE(rk[i] >= 0 && rk[i] <= R, "loramux::", op, ": slot ", i, " has rank ", rk[i],
                      ", outside 0..", R);
  const int64_t* rn = runs.data_ptr<int64_t>();
  const int64_t nruns = runs.size(0), T = y.size(0);
  for (int64_t r = 0; r < nruns; r++) {
    const int64_t start = rn[3 * r], end = rn[3 * r + 1], slot = rn[3 * r + 2];
    TORCH_CHECK_VALUE(start >= (r ? rn[3 * r - 2] : 0) && end >= start && end <= T, "loramux::", op,
                      ": run ", r, " covers tokens ", start, "..", end, "; runs must be ordered, "
                      "disjoint and within the ", T, " tokens");
    TORCH_CHECK_VALUE(slot >= 0 && slot < slots, "loramux::", op, ": run ", r, " names slot ",
                      slot, ", outside 0..", slots - 1);
  }
  if (nruns == 0) return;
  const int rc = active().lora_sgmv(
      x.data_ptr(), x.stride(0), x_code, a.data_ptr(), b.data_ptr(), w_code, y.data_ptr(),
      y.stride(0), y_code, rn, as_int(nruns, op, "the number of runs"), rk, as_int(S, op, "S"),
      as_int(R, op, "R"), as_int(K, op, "K"), as_int(N, op, "N"), off, threads());
  check_rc(rc, op);
}

}  // namespace

TORCH_LIBRARY(loramux, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor(a!) out, "
      "Tensor block_tables, Tensor row_start, Tensor num_new, Tensor ctx_len, int block_size, "
      "float scale, int window=0, float softcap=0.0) -> ()");
  m.def(
      "add_rms_norm(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps, "
      "ScalarType out_dtype, bool unit_offset=False) -> Tensor");
  m.def("rope(Tensor(a!) qk, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up, ScalarType out_dtype) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up, ScalarType out_dtype) -> Tensor");
  m.def(
      "lora_sgmv(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor runs, Tensor ranks, "
      "Tensor slice_offsets) -> ()");
  m.def("isa() -> str", &lmx::isa);
  m.def("isas() -> str[]", &lmx::isas);
  m.def("select_isa(str name) -> str", &lmx::select_isa);
}

TORCH_LIBRARY_IMPL(loramux, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
  m.impl("lora_sgmv", &lora_sgmv);
}

// An importable module with no Python API (the operators register when it loads).
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C",
                               "loramux's CPU kernels: torch.ops.loramux.*", -1, nullptr};
  return PyModule_Create(&module);
}
