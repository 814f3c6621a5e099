// The weight-only int8 / int4 linear as a torch.library operator: torch.ops.loramux.wq_linear.
//
//   wq_linear(x [M, K] fp32/bf16, w uint8 [N, Kp * bits / 8] (or float8_e4m3fn [N, Kp], bits 8),
//             scale fp32 [N, G],
//             zero fp32 [N, G]?, bias fp32 [N]?, bits, in_features K, group_size,
//             out_dtype) -> y [M, N]
//
// w, scale and zero are in the kernel's layout (wq_linear.c; built once at load by
// int_packed.py's kernel_layout): Kp = K rounded up to 32; group_size 0 = one scale per row
// (G = 1), else a multiple of 32 dividing K (G = K / group_size). Every argument is checked
// here before a pointer reaches the C kernel, which runs the ISA variant isa.cpp chose (the
// one loramux::select_isa sets). The fake implementation is in kernels/fake.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "ops_common.h"
#include "wq_kernels.h"

namespace {

using namespace lmx;
/* the ISA variant's two entry points (the kernel, and the band dequantizer of the large-M path) and
 * the rows from which the op takes the band path (dense_call), for bf16 x with a bf16 y and for the
 * other calls; `bf16_bands`: the bands are bf16 (a CPU with native bf16 GEMMs), else fp32 */
struct WqVariant {
  decltype(&loramux_wq_linear_scalar) linear;
  decltype(&loramux_wq_dequantize_scalar) dequantize;
  int64_t bf16_dense_min_m;
  int64_t dense_min_m;
  bool bf16_bands;
};
#define LMX_WQ_VARIANT(v, bf16_dense, dense, bf16_bands) \
  WqVariant{loramux_wq_linear_##v, loramux_wq_dequantize_##v, bf16_dense, dense, bf16_bands}

/* From a variant's dense rows (a prefill chunk, or a decode step of many sequences) W is
 * dequantized a band of output rows at a time (wq_linear.c's loramux_wq_dequantize) and each band
 * multiplied by ATen's GEMM, whose blocking beats the kernel's own sums there: the kernel's
 * sums grow with every row while a band is dequantized once for all of them.
 * - Native bf16 (the avx512bf16 variant): bf16 x with a bf16 y takes bf16 bands ((stored - zero) *
 *   scale rounded to bf16 once: the weight a bf16 model of the checkpoint holds) and oneDNN's bf16
 *   GEMM, 1.3-2.5x the kernel's GEMM. Its own tiles (wq_bf16.h) run to DENSE_MIN_M_BF16 rows:
 *   since int4 takes 128 values a load and each row of x is loaded once for a tile's weight rows,
 *   its sums beat the bands up to about 24 rows (random weights of the default model's 120 shapes,
 *   medians of 12 alternated passes, AVX512_BF16 EPYC: int4 g64 at 12 rows 15.6 ms against 23.7,
 *   16: 20.9 / 24.7, 24: 28.4 / 30.5, 31: 39.1 / 36.0; int8 at 12: 16.5 / 22.9, 16: 23.2 / 25.9,
 *   24: 29.5 / 29.0, 31: 38.4 / 35.0). fp32 x keeps the kernel's GEMM there: ATen's fp32 GEMM of an
 *   unpacked weight (MKL) is no faster than it (2048 x 2048, 64 rows: 3.8 ms vs 3.2).
 * - The avx512 variant (no native bf16 GEMM): the kernel for every call (its GEMM matched MKL's
 *   fp32 above; the bf16 bands it took from 12 rows would run an emulated bf16 GEMM, which on an
 *   AVX2 CPU ran 3-6x slower than fp32's; no such CPU was at hand to measure).
 * - AVX2 (and scalar): every call from DENSE_MIN_M_AVX2 rows, fp32 bands, x in fp32 (bf16 x
 *   widened once), the fp32 product rounded once; ATen's emulated bf16 GEMM runs 3-6x slower than
 *   fp32's there. On an AVX2 Zen 3 (the default model's 4 projections of a layer, 2 threads,
 *   kernel / bands, ms): int4 g64 at 128 rows 8.5 / 9.8, 256: 16.5 / 15.4, 512: 36.9 / 30.6;
 *   int8 at 128 10.2 / 11.7, 256: 17.1 / 17.9, 512: 32.7 / 28.0.
 * BAND_ELEMS weights a band (wider bands measured no faster, narrower slower). */
constexpr int64_t DENSE_MIN_M_BF16 = 24;
constexpr int64_t DENSE_MIN_M_AVX2 = 256;
constexpr int64_t NEVER = INT64_MAX;
constexpr int64_t BAND_ELEMS = int64_t{1} << 20;

WqVariant wq_variant() {
  const std::string name = isa();
#ifdef LMX_HAVE_AVX512BF16
  if (name == "avx512bf16") return LMX_WQ_VARIANT(avx512bf16, DENSE_MIN_M_BF16, NEVER, true);
#endif
#ifdef LMX_HAVE_AVX512
  if (name == "avx512") return LMX_WQ_VARIANT(avx512, NEVER, NEVER, false);
#endif
#ifdef LMX_HAVE_AVX2
  if (name == "avx2") return LMX_WQ_VARIANT(avx2, DENSE_MIN_M_AVX2, DENSE_MIN_M_AVX2, false);
#endif
  return LMX_WQ_VARIANT(scalar, DENSE_MIN_M_AVX2, DENSE_MIN_M_AVX2, false);
}

/* whether a call of M rows takes the band path */
bool takes_bands(const WqVariant& v, int64_t M, const at::Tensor& x, at::ScalarType out_dtype) {
  const bool bf16 = x.scalar_type() == at::kBFloat16 && out_dtype == at::kBFloat16;
  return M >= (bf16 ? v.bf16_dense_min_m : v.dense_min_m);
}

/* y = x @ W^T + bias by bands of W dequantized into the GEMM's dtype (bf16 bands: bf16 x, the
 * product in bf16; fp32 bands: x widened to fp32 once, the fp32 product and bias rounded once) */
at::Tensor dense_call(const WqVariant& v, const at::Tensor& x, const at::Tensor& w,
                      const at::Tensor& scale, const std::optional<at::Tensor>& zero,
                      const std::optional<at::Tensor>& bias, int64_t bits /* the kernels' code */,
                      int64_t K, int64_t Kp, int64_t group, int64_t G, int64_t N, at::ScalarType out_dtype) {
  const char* op = "wq_linear";
  const at::ScalarType gemm = v.bf16_bands && x.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
  const at::Tensor xg = x.scalar_type() == gemm ? x : x.to(gemm);
  const int64_t rows = std::min<int64_t>(N, std::max<int64_t>(16, BAND_ELEMS / K));
  // one band buffer per thread, kept between calls: a fresh one would be mapped (and its pages
  // faulted in) by every call
  thread_local at::Tensor buffer;
  const int64_t need = rows * K * at::elementSize(gemm);
  if (!buffer.defined() || buffer.numel() < need) buffer = at::empty({need}, x.options().dtype(at::kByte));
  at::Tensor band = buffer.narrow(0, 0, need).view(gemm).view({rows, K});
  at::Tensor y = at::empty({x.size(0), N}, x.options().dtype(gemm));
  const int od = dtype_code(gemm, op, "the band");
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t r = std::min(rows, N - r0);
    at::Tensor wb = band.narrow(0, 0, r);
    v.dequantize(static_cast<const uint8_t*>(w.data_ptr()), static_cast<int>(bits), scale.data_ptr<float>(),
                 zero.has_value() ? zero->data_ptr<float>() : nullptr, as_int(G, op, "G"),
                 as_int(group, op, "group_size"), as_int(r0, op, "N"), as_int(r0 + r, op, "N"),
                 as_int(K, op, "in_features"), as_int(Kp, op, "in_features"), wb.data_ptr(), od,
                 threads());
    at::Tensor yb = y.narrow(1, r0, r);
    at::mm_out(yb, xg, wb.t());
  }
  if (bias.has_value()) y.add_(*bias);  // bf16 bands: the fp32 bias into the bf16 product, one more rounding
  return y.scalar_type() == out_dtype ? y : y.to(out_dtype);
}

void check_f32(const at::Tensor& t, int64_t rows, int64_t cols, const char* op, const char* name) {
  check_cpu(t, op, name);
  check_contiguous(t, op, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "loramux::", op, ": ", name,
              " must be float32, got ", t.scalar_type());
  if (cols < 0) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == rows, "loramux::", op, ": ", name, " must be [",
                rows, "], got ", t.sizes());
  } else {
    TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, "loramux::", op, ": ",
                name, " must be [", rows, ", ", cols, "], got ", t.sizes());
  }
}

at::Tensor wq_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     const std::optional<at::Tensor>& zero, const std::optional<at::Tensor>& bias,
                     int64_t bits, int64_t in_features, int64_t group_size,
                     at::ScalarType out_dtype) {
  const char* op = "wq_linear";
  check_rows(x, op, "x");
  const int xd = dtype_code(x, op, "x"), yd = dtype_code(out_dtype, op, "out_dtype");
  TORCH_CHECK_VALUE(bits == 4 || bits == 8, "loramux::", op, ": bits must be 4 or 8, got ", bits);
  const int64_t M = x.size(0), K = in_features, Kp = (K + 31) / 32 * 32;
  TORCH_CHECK(x.size(1) == K, "loramux::", op, ": x has ", x.size(1), " columns, in_features is ",
              K);
  TORCH_CHECK_VALUE(K > 0, "loramux::", op, ": in_features must be positive, got ", K);
  TORCH_CHECK_VALUE(group_size == 0 || (group_size % 32 == 0 && group_size > 0 && K % group_size == 0),
                    "loramux::", op, ": group_size must be 0 (per channel) or a multiple of 32 "
                    "dividing in_features (", K, "), got ", group_size);
  check_cpu(w, op, "w");
  check_contiguous(w, op, "w");
  check_dim(w, 2, op, "w");
  const bool fp8 = w.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(w.scalar_type() == at::kByte || fp8, "loramux::", op,
              ": w must be uint8 (packed integers) or float8_e4m3fn, got ", w.scalar_type());
  TORCH_CHECK_VALUE(!fp8 || (bits == 8 && !zero.has_value()), "loramux::", op,
                    ": float8_e4m3fn weights take bits 8 and no zero");
  const int code = fp8 ? LMX_WQ_FP8 : static_cast<int>(bits);  // the C kernels' `bits`
  const int64_t N = w.size(0), G = group_size ? K / group_size : 1;
  TORCH_CHECK(w.size(1) == Kp * bits / 8, "loramux::", op, ": w must be [N, ", Kp * bits / 8,
              "] (", Kp, " values of ", bits, " bits a row), got ", w.sizes());
  check_f32(scale, N, G, op, "scale");
  if (zero.has_value()) check_f32(*zero, N, G, op, "zero");
  if (bias.has_value()) check_f32(*bias, N, -1, op, "bias");
  at::Tensor y = at::empty({M, N}, x.options().dtype(out_dtype));
  if (M == 0 || N == 0) return y;
  const WqVariant v = wq_variant();
  if (takes_bands(v, M, x, out_dtype))
    return dense_call(v, x, w, scale, zero, bias, code, K, Kp, group_size ? group_size : Kp, G, N, out_dtype);
  const int rc = v.linear(
      x.data_ptr(), x.stride(0), xd, static_cast<const uint8_t*>(w.data_ptr()), code,
      scale.data_ptr<float>(), zero.has_value() ? zero->data_ptr<float>() : nullptr,
      as_int(G, op, "the number of groups"), as_int(group_size ? group_size : Kp, op, "group_size"),
      bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr(), yd, M,
      as_int(N, op, "N"), as_int(K, op, "in_features"), as_int(Kp, op, "in_features"), threads());
  check_rc(rc, op);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loramux, m) {
  m.def(
      "wq_linear(Tensor x, Tensor w, Tensor scale, Tensor? zero, Tensor? bias, int bits, "
      "int in_features, int group_size, ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(loramux, CPU, m) { m.impl("wq_linear", &wq_linear); }
