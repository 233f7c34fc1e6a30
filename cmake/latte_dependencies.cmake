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

# MPI (LATTE_WITH_MPI = ON, OFF or AUTO) for latte::mpi, the distributed part
# (latte/distributed.hpp, docs/distributed.md): Open MPI from Debian
# (scripts/setup.sh). Only latte::mpi and its tests and example use it.
set(LATTE_MPI_ENABLED OFF)
if(LATTE_WITH_MPI STREQUAL "AUTO")
  find_package(MPI QUIET COMPONENTS CXX)
elseif(LATTE_WITH_MPI)
  find_package(MPI REQUIRED COMPONENTS CXX)
endif()
if(MPI_CXX_FOUND)
  set(LATTE_MPI_ENABLED ON)
  # mpirun flags of latte's tests and example: more ranks than cores (CI has 2).
  execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE latte_mpiexec_version
                  ERROR_QUIET RESULT_VARIABLE latte_mpiexec_result)
  set(latte_mpirun_flags)
  if(latte_mpiexec_version MATCHES "Open MPI|OpenRTE")
    set(latte_mpirun_flags --oversubscribe)
  endif()
  string(REGEX MATCH "[^\n]*" latte_mpiexec_version "${latte_mpiexec_version}")
  message(STATUS "latte: MPI=ON (MPI ${MPI_CXX_VERSION}; ${MPIEXEC_EXECUTABLE}: ${latte_mpiexec_version})")
else()
  message(STATUS "latte: MPI=OFF (latte::mpi and the distributed tests are not built)")
endif()
