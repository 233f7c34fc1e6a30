# Options of latte's own CUDA translation units (tests/cuda, bench/cuda).
# Included by latte_dependencies.cmake once the CUDA language is enabled.

# C++20 for nvcc; Eigen (pulled in by the umbrella header) without its own
# CUDA annotations, which only produce warnings in host-only Eigen code;
# warning 3189 is nvcc reading an identifier named `module` as a possible
# C++20 module declaration.
function(latte_cuda_target_options target)
  # -std=c++20 directly: CMake 3.25 does not know the CUDA20 flag of nvcc 13.
  target_compile_definitions(${target} PRIVATE EIGEN_NO_CUDA)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20 -diag-suppress=3189>)
  if(LATTE_WITH_OPENMP)
    # The CPU backend in the same file keeps its threads (OpenMP::OpenMP_CXX's
    # flag applies to CXX sources only).
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-fopenmp>)
  endif()
endfunction()
