"""The optional C++ extension: ``pallas_kernels/quant_matmul_cpu``'s XLA:CPU FFI
kernels, ``ragged_paged_attention/kernel_cpu.cc``'s attention handlers and
``sampling_cpu/kernel.cc``'s greedy sampling handler,
one library (everything else is in pyproject.toml).

The build never fails the install: with no compiler, no jax headers
(``jax.ffi.include_dir()``) or a compile error it warns and skips the
library, and ``quant_matmul_cpu.available()`` is then False (the XLA path).
Flags: -O3 -std=c++17 -fPIC; no -march=native (the kernel picks AVX2 or
AVX-512 at run time).
"""

import warnings

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing."""

    def finalize_options(self):
        super().finalize_options()
        try:
            import jax.ffi
            include = jax.ffi.include_dir()
        except Exception as e:  # noqa: BLE001 - any failure only skips the kernel
            warnings.warn(f"quant_matmul_cpu: no jax FFI headers ({e}); skipping the CPU kernel")
            self.extensions = []
            return
        for ext in self.extensions:
            ext.include_dirs.append(include)

    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - missing compiler, setuptools errors
            warnings.warn(f"quant_matmul_cpu: build failed ({e}); skipping the CPU kernel")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 - CompileError, LinkError, OSError
            warnings.warn(f"quant_matmul_cpu: {ext.name} failed to build ({e}); "
                          "quantized matmuls will take the XLA path")


setup(
    ext_modules=[Extension(
        "pallas_kernels.quant_matmul_cpu._quant_matmul_cpu",
        sources=["pallas_kernels/quant_matmul_cpu/kernel.cc",
                 "pallas_kernels/quant_matmul_cpu/kernel_a8.cc",
                 "pallas_kernels/ragged_paged_attention/kernel_cpu.cc",
                 "pallas_kernels/sampling_cpu/kernel.cc"],
        depends=["pallas_kernels/quant_matmul_cpu/kernel_common.h",
                 "pallas_kernels/quant_matmul_cpu/kernel_a8_act.inc",
                 "pallas_kernels/quant_matmul_cpu/kernel_a8_vnni.inc",
                 "pallas_kernels/quant_matmul_cpu/kernel_body.inc",
                 "pallas_kernels/quant_matmul_cpu/kernel_panel.inc",
                 "pallas_kernels/ragged_paged_attention/kernel_cpu_body.inc",
                 "pallas_kernels/ragged_paged_attention/kernel_cpu_prefill.inc"],
        language="c++",
        extra_compile_args=["-O3", "-std=c++17", "-fPIC", "-g0"],
        py_limited_api=False,
    )],
    cmdclass={"build_ext": OptionalBuildExt},
)
