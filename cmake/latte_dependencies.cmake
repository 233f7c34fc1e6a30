# Dependencies come from the system package manager (scripts/setup.sh);
# nothing is downloaded at configure time.
find_package(Eigen3 3.4 REQUIRED NO_MODULE)
if(LATTE_WITH_XSIMD)
  # Debian ships xsimd 8.1 whose version file accepts the same major only: no version pin.
  find_package(xsimd REQUIRED)
  include(${CMAKE_CURRENT_LIST_DIR}/latte_xsimd_xtl_shim.cmake)
endif()
if(LATTE_WITH_OPENMP)
  find_package(OpenMP REQUIRED COMPONENTS CXX)
endif()

# CUDA (LATTE_WITH_CUDA = ON, OFF or AUTO): with a toolkit, the CUDA language is
# enabled for latte's own CUDA tests and benchmarks (tests/cuda, bench/cuda) and
# latte::latte carries LATTE_WITH_CUDA, which turns on exec::cuda in the
# translation units nvcc compiles (policies/execution.hpp). Host-only files are
# unaffected. Default architecture: sm_90 (H100/H200) SASS + compute_90 PTX;
# pass -DCMAKE_CUDA_ARCHITECTURES=... for other GPUs.
set(LATTE_CUDA_ENABLED OFF)
if(LATTE_WITH_CUDA STREQUAL "AUTO" OR LATTE_WITH_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    enable_language(CUDA)
    set(LATTE_CUDA_ENABLED ON)
    include(${CMAKE_CURRENT_LIST_DIR}/latte_cuda.cmake)
  elseif(NOT LATTE_WITH_CUDA STREQUAL "AUTO")
    message(FATAL_ERROR "LATTE_WITH_CUDA=ON but no CUDA compiler was found")
  endif()
endif()
if(LATTE_CUDA_ENABLED)
  set(latte_cuda_status "ON (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES})")
else()
  set(latte_cuda_status "OFF")
endif()
message(STATUS "latte: OpenMP=${LATTE_WITH_OPENMP} xsimd=${LATTE_WITH_XSIMD} CUDA=${latte_cuda_status}")
