"""pip install ./python: builds zinf's Python module with the project's CMake (offline: the
dependencies are Debian packages, see scripts/deps.sh) and installs the package.

The build goes to $ZINF_BUILD_DIR when set (an existing build of the repository: only the
module is built), else to build-python/ at the repository root (a fresh configure and build,
some minutes on two cores). $ZINF_JOBS sets the build's parallelism.
"""
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.environ.get("ZINF_BUILD_DIR") or os.path.join(ROOT, "build-python")
        if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            subprocess.check_call([
                "cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja",
                "-DCMAKE_BUILD_TYPE=Release", "-DZINF_BUILD_TESTS=OFF", "-DZINF_BUILD_BENCH=OFF",
                "-DZINF_BUILD_TRAIN=OFF", "-DZINF_PYTHON=ON",
                "-DPython3_EXECUTABLE=" + sys.executable])
        jobs = os.environ.get("ZINF_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "zinf_python",
                               "-j", jobs])
        package = os.path.join(build_dir, "python", "zinf")
        built = [f for f in os.listdir(package) if f.startswith("_zinf") and f.endswith(".so")]
        if len(built) != 1:
            raise RuntimeError("zinf: expected one _zinf module in %s, found %s" % (package, built))
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(package, built[0]), target)


def compat_files():
    """zinf/compat's files (the deepspeed package and its metadata), relative to zinf/."""
    base = os.path.join(HERE, "zinf")
    out = []
    for root, dirs, files in os.walk(os.path.join(base, "compat")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [os.path.relpath(os.path.join(root, f), base) for f in files
                if not f.endswith(".pyc")]
    return out


setup(
    name="zinf",
    version="0.1.0",
    description="zinf: train models larger than GPU and host memory (ZeRO-Infinity engine)",
    packages=["zinf", "zinf._ds"],
    package_data={"zinf": compat_files()},
    ext_modules=[Extension("zinf._zinf", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.8",
    zip_safe=False,
)
