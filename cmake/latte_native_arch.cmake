# latte is header-only: the SIMD width of its CPU kernels is decided by the
# flags of the program that includes it. For latte's own tests, benchmarks and
# examples, LATTE_NATIVE_ARCH (ON when top-level) compiles for this machine's
# instruction set; the installed latte::latte target never carries the flag.
option(LATTE_NATIVE_ARCH "Compile latte's own tests, benchmarks and examples with -march=native"
       ${PROJECT_IS_TOP_LEVEL})
if(LATTE_NATIVE_ARCH AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  include(CheckCXXCompilerFlag)
  check_cxx_compiler_flag(-march=native LATTE_HAS_MARCH_NATIVE)
  if(LATTE_HAS_MARCH_NATIVE)
    add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-march=native>)
  endif()
endif()
