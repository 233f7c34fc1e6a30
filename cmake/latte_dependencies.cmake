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

set(LATTE_CUDA_ENABLED OFF)
if(LATTE_WITH_CUDA STREQUAL "AUTO" OR LATTE_WITH_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(LATTE_CUDA_ENABLED ON)
  elseif(NOT LATTE_WITH_CUDA STREQUAL "AUTO")
    message(FATAL_ERROR "LATTE_WITH_CUDA=ON but no CUDA compiler was found")
  endif()
endif()
message(STATUS "latte: OpenMP=${LATTE_WITH_OPENMP} xsimd=${LATTE_WITH_XSIMD} CUDA toolkit found=${LATTE_CUDA_ENABLED} (no CUDA kernels in this version)")
