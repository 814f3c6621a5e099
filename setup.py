"""The CPU kernels' build; everything else about the package is in pyproject.toml.

The kernels (``engine/model/csrc``) become one extension, ``loramux.engine.model.kernels._C``,
built by torch's C++ extension tooling against the torch of the build environment
(``[build-system] requires`` pins it; ``make install`` builds with ``--no-build-isolation``
against the venv's torch, so the binary matches the torch it runs with). ``ops.cpp`` registers
the ``torch.ops.loramux.*`` operators; each C kernel source is compiled once per ISA variant
(:data:`ISA_VARIANTS`, never ``-march=native``), and the operators run the best variant the CPU
supports (``isa.cpp``), chosen when the extension loads: one binary for every x86-64 machine.

A machine without a C and C++ compiler installs the package without the extension and says
so; the engine then runs on torch ops and reports itself ``degraded``. Where a compiler is
present, a kernel that does not build fails the install.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys

from setuptools import setup
from setuptools.errors import CompileError
from torch.utils.cpp_extension import BuildExtension, CppExtension

CSRC = "engine/model/csrc"
KERNEL_SOURCES = [f"{CSRC}/{name}" for name in ("fused_ops.c", "paged_attention.c", "lora_sgmv.c",
                                                  "wq_linear.c")]
HEADERS = [f"{CSRC}/{name}" for name in ("bf16.h", "kernels.h", "attention_vec.h", "attention_bh.h",
                                         "attention_prefill.h", "attention_prefill_512.h", "attention_prefill_bh.h",
                                         "sgmv_shrink.h", "sgmv_bf16.h", "wq_kernels.h", "wq_bf16.h",
                                         "wq_dequant.h", "wq_gemm.h")]
C_FLAGS = ["-std=c11", "-O3", "-fno-wrapv", "-fPIC", "-fopenmp", "-Wall"]
"""Flags of every kernel object. OpenMP: the process's libgomp at run time is torch's own."""

X86_LINUX = sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64")
ISA_VARIANTS: dict[str, list[str]] = {"scalar": []}
"""ISA variant -> the compiler flags its copy of each kernel is built with (the vector paths
are guarded by the compiler's ISA macros, so ``scalar`` is the plain C)."""
if X86_LINUX:
    ISA_VARIANTS["avx2"] = ["-mavx2", "-mfma"]
    ISA_VARIANTS["avx512"] = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"]
    # avx512 + the native bf16 dot product (VDPBF16PS): the kernels' bf16 paths (sgmv_bf16.h,
    # wq_linear.c); run only where the CPU reports avx512_bf16 (isa.cpp)
    ISA_VARIANTS["avx512bf16"] = [*ISA_VARIANTS["avx512"], "-mavx512bf16"]

PROBES = {"avx512bf16": "#include <immintrin.h>\n"
                        "__m512 f(__m512 a, __m512bh b) { return _mm512_dpbf16_ps(a, b, b); }\n"}
"""ISA variant -> a C source its compiler must build, else the variant is left out of the build
(a compiler too old for ``-mavx512bf16``: the other variants still build, and run)."""


def compiler_builds(compiler, isa: str, build_temp: str) -> bool:
    """Whether ``compiler`` builds :data:`PROBES`'s source for ``isa`` with its flags."""
    os.makedirs(build_temp, exist_ok=True)
    src = os.path.join(build_temp, f"probe_{isa}.c")
    with open(src, "w") as f:
        f.write(PROBES[isa])
    try:
        compiler.compile([src], output_dir=os.path.join(build_temp, "probe"),
                         extra_postargs=[*C_FLAGS, *ISA_VARIANTS[isa]])
    except CompileError:
        return False
    return True


class BuildKernels(BuildExtension):
    """torch's ``BuildExtension``, plus: the kernel objects per ISA variant (compiled here with
    their own flags, linked into the extension), and no extension where no compiler exists."""

    def build_extensions(self) -> None:
        cc, cxx = self.compiler.compiler_so[0], self.compiler.compiler_cxx[0]
        missing = [exe for exe in (cc, cxx) if shutil.which(exe) is None]
        if missing:
            banner = "=" * 78
            print(f"\n{banner}\nloramux: no compiler here ({', '.join(missing)} not found): the CPU "
                  "kernels are NOT built.\nThe engine will run on torch ops (several times "
                  f"slower on the CPU) and report itself degraded.\n{banner}\n", file=sys.stderr)
            self.extensions = []
            return
        for isa in [name for name in ISA_VARIANTS if name in PROBES]:
            if not compiler_builds(self.compiler, isa, self.build_temp):
                print(f"loramux: {cc} does not build the {isa} kernels ({' '.join(ISA_VARIANTS[isa])}); "
                      "that variant is left out", file=sys.stderr)
                del ISA_VARIANTS[isa]
                for ext in self.extensions:
                    ext.define_macros = [m for m in ext.define_macros if m[0] != f"LMX_HAVE_{isa.upper()}"]
        for ext in self.extensions:
            objects = []
            for isa, flags in ISA_VARIANTS.items():
                objects += self.compiler.compile(
                    KERNEL_SOURCES, output_dir=os.path.join(self.build_temp, isa),
                    macros=[("LMX_ISA", isa)], include_dirs=[CSRC],
                    extra_postargs=[*C_FLAGS, *flags], depends=HEADERS,
                )
            ext.extra_objects = [*objects, *(ext.extra_objects or [])]
        super().build_extensions()


kernels = CppExtension(
    "loramux.engine.model.kernels._C",
    sources=[f"{CSRC}/ops.cpp", f"{CSRC}/isa.cpp", f"{CSRC}/quant_ops.cpp"],
    include_dirs=[os.path.abspath(CSRC)],
    define_macros=[(f"LMX_HAVE_{isa.upper()}", "1") for isa in ISA_VARIANTS if isa != "scalar"],
    extra_compile_args=["-O3"],
    extra_link_args=["-fopenmp", *(["-lmvec"] if X86_LINUX else []), "-lm"],
    depends=[*KERNEL_SOURCES, *HEADERS, f"{CSRC}/ops_common.h"],
)

setup(ext_modules=[kernels], cmdclass={"build_ext": BuildKernels})
