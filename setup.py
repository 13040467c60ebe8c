"""setup.py -- drives CMake (the source of truth) to build memsched._C.

Build against the torch that is installed:
    pip install --no-build-isolation -e .
Environment:
    MEMSCHED_BUILD_DIR     CMake binary dir, kept between builds (default: build)
    MEMSCHED_CMAKE_ARGS    extra -D... arguments, e.g. "-DMEMSCHED_WITH_CUDA=OFF"
    MAX_JOBS               parallel compile jobs (default: number of cores)
"""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _replace_file(src: Path, dest: Path) -> None:
    """Install `src` as `dest` by copy-then-rename.

    WARNING: copying over a shared library in place rewrites the inode that
    running processes have memory-mapped (a test run importing memsched._C
    crashes mid-run); a rename gives the new library a new inode instead.
    """
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    shutil.copy2(src, tmp)
    os.replace(tmp, dest)


def torch_requirement() -> str:
    """Note [A wheel needs its torch]
    memsched._C and libmemsched_alloc link against the libtorch of the torch they are compiled
    with; torch's C++ ABI changes between releases, so a wheel imported under another torch fails
    with undefined symbols. The wheel therefore requires the torch release it was built against
    (the local tag, e.g. +cu130, is left out: any build of that release has the same ABI). Without
    an importable torch (an isolated build) it falls back to the supported range."""
    try:
        import torch
    except ImportError:
        return "torch>=2.11"
    return f"torch=={torch.__version__.split('+')[0]}"


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configure once into a persistent build dir, build every target, copy the
    module (and the allocator shim, when built) next to the package."""

    def build_extension(self, ext: Extension) -> None:
        build_dir = Path(os.environ.get("MEMSCHED_BUILD_DIR", ROOT / "build")).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        cmake_args = [
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if shutil.which("ninja"):
            cmake_args += ["-G", "Ninja"]
        cmake_args += shlex.split(os.environ.get("MEMSCHED_CMAKE_ARGS", ""))
        configured = (build_dir / "build.ninja").exists() or (build_dir / "Makefile").exists()
        if not configured or os.environ.get("MEMSCHED_CMAKE_ARGS"):
            subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_dir)] + cmake_args)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", str(build_dir), "--parallel", jobs])

        dest = Path(self.get_ext_fullpath(ext.name)).resolve()
        dest.parent.mkdir(parents=True, exist_ok=True)
        built = next(build_dir.glob("_C*.so"))
        _replace_file(built, dest)
        libraries = [built] + list(build_dir.glob("libmemsched_alloc*.so"))
        for lib in libraries[1:]:
            _replace_file(lib, dest.parent / lib.name)
        if getattr(self, "editable_mode", False) or self.inplace:
            # The package lives in the source tree: put _C and the allocator
            # library (loaded by path, memsched/allocator.py) there ourselves,
            # by rename. setuptools then finds _C up to date (same mtime) and
            # skips its own in-place copy.
            for lib in libraries:
                _replace_file(lib, ROOT / "python" / "memsched" / lib.name)


setup(
    install_requires=[torch_requirement()],
    ext_modules=[CMakeExtension("memsched._C")],
    cmdclass={"build_ext": CMakeBuild},
)
