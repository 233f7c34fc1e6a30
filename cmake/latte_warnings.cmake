# latte_target_warnings(target): the warning flags of latte's own tests, examples
# and benchmarks. GCC 12 reports false -Wmaybe-uninitialized inside Eigen's AVX-512
# GEMM kernels when they are inlined into our code under -march=native, so that
# one is off for GCC.
function(latte_target_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic)
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
      target_compile_options(${target} PRIVATE -Wno-maybe-uninitialized)
    endif()
  endif()
endfunction()
