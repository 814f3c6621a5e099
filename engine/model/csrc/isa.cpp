// The ISA variants of the CPU kernels: the best of avx512bf16 / avx512 / avx2 / scalar that
// both this binary carries (setup.py's LMX_HAVE_* defines) and the CPU runs
// (__builtin_cpu_supports), chosen once at first use; loramux::select_isa overrides it (tests force each one).
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <atomic>
#include <string>
#include <vector>

#include "ops_common.h"

namespace lmx {
namespace {

#define LMX_VARIANT(isa, check)                                                        \
  Variant {                                                                            \
    #isa, check, loramux_paged_attention_##isa, loramux_add_rms_norm_##isa,            \
        loramux_rope_##isa, loramux_act_mul_##isa, loramux_lora_sgmv_##isa             \
  }

#if defined(__x86_64__) || defined(__i386__)
bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
}
// avx512 + AVX512_BF16 (VDPBF16PS): the native bf16 dot products of the kernels' bf16 paths
bool cpu_has_avx512bf16() {
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}
#endif
bool always() { return true; }

// best first; only the variants this binary was built with (setup.py's LMX_HAVE_* defines)
const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = {
#ifdef LMX_HAVE_AVX512BF16
      LMX_VARIANT(avx512bf16, cpu_has_avx512bf16),
#endif
#ifdef LMX_HAVE_AVX512
      LMX_VARIANT(avx512, cpu_has_avx512),
#endif
#ifdef LMX_HAVE_AVX2
      LMX_VARIANT(avx2, cpu_has_avx2),
#endif
      LMX_VARIANT(scalar, always),
  };
  return all;
}

const Variant* best_variant() {
  for (const Variant& v : variants())
    if (v.runs_here()) return &v;
  return &variants().back();
}

std::atomic<const Variant*> g_active{nullptr};

}  // namespace

const Variant& active() {
  const Variant* v = g_active.load(std::memory_order_acquire);
  if (v == nullptr) {
    v = best_variant();
    g_active.store(v, std::memory_order_release);
  }
  return *v;
}

std::string isa() { return active().name; }

std::vector<std::string> isas() {
  std::vector<std::string> names;
  for (const Variant& v : variants())
    if (v.runs_here()) names.emplace_back(v.name);
  return names;
}

std::string select_isa(const std::string& name) {
  if (name == "auto") {
    g_active.store(best_variant(), std::memory_order_release);
    return isa();
  }
  std::string built;
  for (const Variant& v : variants()) {
    if (name == v.name) {
      TORCH_CHECK_VALUE(v.runs_here(), "loramux::select_isa: this CPU cannot run the ", name,
                        " kernels (it runs: ", c10::Join(", ", isas()), ")");
      g_active.store(&v, std::memory_order_release);
      return isa();
    }
    built += built.empty() ? v.name : std::string(", ") + v.name;
  }
  TORCH_CHECK_VALUE(false, "loramux::select_isa: unknown ISA '", name, "'; this build has: auto, ",
                    built);
  return isa();
}

}  // namespace lmx
