"""Installs the Python package `forkguard`, offline, with Debian's setuptools and pybind11:

    /usr/bin/python3 -m venv --system-site-packages venv
    venv/bin/pip install --no-build-isolation ./python

The native module is built by the project's own CMake (only the targets it needs), for the
interpreter running this script.
"""
import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
BUILD = ROOT / "build" / "pip"
BUILD.mkdir(parents=True, exist_ok=True)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build = pathlib.Path(self.build_temp).resolve() / "cmake"
        subprocess.check_call([
            "cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DFORKGUARD_BUILD_TESTS=OFF",
            "-DFORKGUARD_BUILD_BENCHMARKS=OFF", f"-DPython3_EXECUTABLE={sys.executable}"])
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", str(build), "--target", "forkguard_python",
                               "-j", jobs])
        built = next((build / "python" / "forkguard").glob("_native*.so"))
        dest = pathlib.Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, dest)


def version():
    for line in (ROOT / "CMakeLists.txt").read_text().splitlines():
        if line.startswith("project(forkguard VERSION"):
            return line.split()[2]
    return "0"


setup(
    name="forkguard",
    version=version(),
    description="Multi-process GPU work that survives fork: notebook_launch, probe, ImageLoader",
    packages=["forkguard"],
    package_data={"forkguard": ["*.pyi", "py.typed"]},
    ext_modules=[Extension("forkguard._native", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    # Build products under the project's (ignored) build/, not beside the sources.
    options={"build": {"build_base": str(BUILD)}, "egg_info": {"egg_base": str(BUILD)}},
    python_requires=">=3.9",
    zip_safe=False,
)
