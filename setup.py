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
        shutil.copy2(built, dest)
        for shim in build_dir.glob("libmemsched_alloc*.so"):
            shutil.copy2(shim, dest.parent / shim.name)
            # An editable install copies only _C into the source tree; the
            # allocator library (loaded by path, memsched/allocator.py) goes there too.
            shutil.copy2(shim, ROOT / "python" / "memsched" / shim.name)


setup(
    ext_modules=[CMakeExtension("memsched._C")],
    cmdclass={"build_ext": CMakeBuild},
)
