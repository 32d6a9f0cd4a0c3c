"""Builds dynamicemb and its ops library dynamicemb/lib/libdynamicemb_ops.so
from csrc/.

The library holds the TORCH_LIBRARY(dynamicemb) registrations and kernels
only: no Python module init and no libtorch_python (py_limited_api=True
leaves it out), so a C++ program with libtorch alone can load it (dlopen)
and serve an AOTInductor package of dynamicemb tables
(examples/serve_cpp/). dynamicemb/_ops.py loads it with
torch.ops.load_library. CPU kernels are always built; the CUDA kernels
(csrc/**/*.cu) too when torch is a CUDA build and nvcc is found. Build in
place for development:

    python setup.py build_ext --inplace
"""
import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "**", pattern), recursive=True))


def _extension():
    with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if os.environ.get("DYNAMICEMB_NO_CUDA") == "1":
        with_cuda = False
    # -fopenmp: at::parallel_for is an inline OpenMP region in torch's headers
    # (ATen/ParallelOpenMP.h); without the flag it silently runs serially.
    # The extension then needs libgomp.so.1, which torch has already loaded.
    cxx = ["-O3", "-std=c++20", "-fvisibility=hidden", "-ffp-contract=off", "-g0", "-fopenmp"]
    os.makedirs(os.path.join(HERE, "dynamicemb", "lib"), exist_ok=True)  # where --inplace puts it
    common = dict(
        name="dynamicemb.lib.libdynamicemb_ops",
        include_dirs=[os.path.join(HERE, "csrc")],
        py_limited_api=True,  # no libtorch_python: the library loads without Python
        extra_link_args=["-fopenmp"],
    )
    if not with_cuda:
        return cpp_extension.CppExtension(sources=_sources("*.cpp"), extra_compile_args={"cxx": cxx}, **common)
    archs = os.environ.get("DYNAMICEMB_CUDA_ARCHS", "80;90").split(";")
    nvcc = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-fmad=false", "-DDYNAMICEMB_WITH_CUDA"]
    for a in archs:
        nvcc += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return cpp_extension.CUDAExtension(
        sources=_sources("*.cpp") + _sources("*.cu"),
        extra_compile_args={"cxx": cxx + ["-DDYNAMICEMB_WITH_CUDA"], "nvcc": nvcc},
        **common,
    )


setup(
    name="dynamicemb",
    version="0.1.0",
    description="Dynamic, hash-table-backed embedding tables for TorchRec",
    packages=find_packages(include=["dynamicemb", "dynamicemb.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True, no_python_abi_suffix=True)},
    python_requires=">=3.10",
)
