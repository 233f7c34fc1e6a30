#!/usr/bin/env bash
# Installs what latte builds and tests against, when missing (Debian/Ubuntu):
# - system packages: a C++20 compiler with OpenMP, CMake >= 3.25, Ninja (for
#   CMakePresets.json), Eigen 3.4, xsimd, doctest, Google Benchmark, and Python 3
#   with venv; clang with its OpenMP runtime (libomp, with the Archer TSan tool)
#   and its sanitizer / libFuzzer runtimes, for scripts/sanitize.sh (tsan preset)
#   and scripts/fuzz.sh;
# - Open MPI (libopenmpi-dev, openmpi-bin) for latte::mpi, the distributed part, and its
#   tests under mpirun: optional (without it CMake leaves latte::mpi out and says so);
# - Conan 2 from PyPI into .venv/ (git-ignored), for the package_conan_create test;
# - the Python module's build and test requirements (nanobind, scikit-build-core,
#   NumPy, pytest) from PyPI into the same .venv/, for python/ and tests/python;
# - PyTorch, tqdm and matplotlib into .venv/, for latte.torch and its tests.
# Nothing is downloaded at configure or build time.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(g++ make cmake ninja-build libeigen3-dev libxsimd-dev doctest-dev libbenchmark-dev
          python3 python3-venv python3-dev clang libomp-dev)
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
updated=0
install_packages() {
  echo "latte setup: installing $*"
  if ((!updated)); then "${sudo_cmd[@]}" apt-get update -qq; updated=1; fi
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "$@"
}

missing=()
for package in "${packages[@]}"; do
  if ! installed "$package"; then missing+=("$package"); fi
done
if ((${#missing[@]})); then
  install_packages "${missing[@]}"
else
  echo "latte setup: all system packages present"
fi

# libFuzzer and the sanitizer runtimes belong to one clang major version
# (Debian 12: clang 14 -> libclang-rt-14-dev).
clang_major="$(clang --version | sed -n 's/.*clang version \([0-9][0-9]*\).*/\1/p' | head -n 1)"
if [ -n "$clang_major" ] && ! installed "libclang-rt-$clang_major-dev"; then
  install_packages "libclang-rt-$clang_major-dev"
fi

# Open MPI for latte::mpi (docs/distributed.md). Not fatal: without it the rest builds.
mpi_packages=(libopenmpi-dev openmpi-bin)
missing_mpi=()
for package in "${mpi_packages[@]}"; do
  if ! installed "$package"; then missing_mpi+=("$package"); fi
done
if ((${#missing_mpi[@]})) && ! (install_packages "${missing_mpi[@]}"); then
  echo "latte setup: WARNING: could not install ${missing_mpi[*]};" \
       "latte::mpi and its tests are left out until Open MPI is installed" >&2
fi

# Conan 2 in a virtual environment of its own. A failure here is not fatal for
# building latte, but the package_conan_create test then fails, saying why.
conan_requirement='conan>=2.2,<3'
if .venv/bin/conan --version 2>/dev/null | grep -q 'version 2\.'; then
  echo "latte setup: $(.venv/bin/conan --version) present in .venv/"
elif python3 -m venv --clear .venv &&
     .venv/bin/python -m pip install --quiet --disable-pip-version-check "$conan_requirement"; then
  echo "latte setup: installed $(.venv/bin/conan --version) into .venv/"
else
  echo "latte setup: WARNING: could not install $conan_requirement into .venv/;" \
       "the package_conan_create test will fail until it is installed" >&2
fi

# The Python module (python/) builds with nanobind and is tested with pytest
# (the python_tests CTest) from this .venv; scripts/test.sh points CMake at it.
python_requirements=('nanobind>=2.4' 'scikit-build-core>=0.10' 'numpy>=1.21' 'pytest>=7')
if .venv/bin/python -c 'import nanobind, numpy, pytest, scikit_build_core' 2>/dev/null; then
  echo "latte setup: nanobind, scikit-build-core, NumPy and pytest present in .venv/"
elif { [ -x .venv/bin/python ] || python3 -m venv .venv; } &&
     .venv/bin/python -m pip install --quiet --disable-pip-version-check "${python_requirements[@]}"; then
  echo "latte setup: installed ${python_requirements[*]} into .venv/"
else
  echo "latte setup: WARNING: could not install ${python_requirements[*]} into .venv/;" \
       "the Python module and python_tests will fail until they are installed" >&2
fi

# PyTorch (latte.torch's ops, tests/python/test_torch*.py and the MQAR example's
# test), tqdm and matplotlib (the example's progress bar and plot), into the same
# .venv/. PyPI's torch wheel brings its CUDA libraries (~5.4 GB, ~4 minutes here;
# the ops run on the CPU). Without it the torch tests skip, saying why; CI sets
# LATTE_REQUIRE_TORCH=1, which makes a failed install fail the set-up instead.
torch_requirements=('torch>=2.4' 'tqdm' 'matplotlib')
if .venv/bin/python -c 'import torch, tqdm, matplotlib' 2>/dev/null; then
  echo "latte setup: PyTorch $(.venv/bin/python -c 'import torch; print(torch.__version__)'), tqdm and matplotlib present in .venv/"
elif .venv/bin/python -m pip install --quiet --disable-pip-version-check "${torch_requirements[@]}"; then
  echo "latte setup: installed ${torch_requirements[*]} into .venv/"
elif [ "${LATTE_REQUIRE_TORCH:-0}" = 1 ]; then
  echo "latte setup: ERROR: could not install ${torch_requirements[*]} into .venv/ (LATTE_REQUIRE_TORCH=1)" >&2
  exit 1
else
  echo "latte setup: WARNING: could not install ${torch_requirements[*]} into .venv/;" \
       "latte.torch's tests skip until PyTorch is installed" >&2
fi
