# cmake -D CXX=<compiler> -D SOURCE=<program> -D INCLUDE_DIRS=<dir|dir...> -D WORK_DIR=<scratch>
#       -D TARGET_PROGRAM=<the program built through latte::latte>
#       -D TARGET_OPENMP=ON|OFF -D TARGET_XSIMD=ON|OFF -D SAME_FLAGS=ON|OFF
#       -P latte_plain_compiler_test.cmake
#
# CTest header_only_plain_compiler: a header-only user's build, `<compiler> -O2 -march=native
# -fopenmp -std=c++20 -I...` with no CMake target and no defines, must get OpenMP and xsimd
# (include/latte/core/config.hpp detects them); with -DLATTE_WITH_OPENMP=0
# -DLATTE_WITH_XSIMD=0 it must get neither; and the same program built through latte::latte
# must report what the CMake options say, which with both ON (and the same -march) is the
# plain build's line up to its CUDA part (the target carries LATTE_WITH_CUDA when CMake found
# a toolkit).
cmake_minimum_required(VERSION 3.25)
foreach(variable IN ITEMS CXX SOURCE WORK_DIR TARGET_PROGRAM TARGET_OPENMP TARGET_XSIMD)
  if(NOT DEFINED ${variable})
    message(FATAL_ERROR "latte_plain_compiler_test.cmake: -D ${variable}=... is required")
  endif()
endforeach()
string(REPLACE "|" ";" include_dirs "${INCLUDE_DIRS}")
list(TRANSFORM include_dirs PREPEND "-I")
file(MAKE_DIRECTORY "${WORK_DIR}")

# build_and_report(<output variable> <program name> <extra flags>...): compiles SOURCE with
# the bare compiler, runs it, returns the line it printed.
function(build_and_report output name)
  set(command "${CXX}" -O2 -march=native -fopenmp -std=c++20 ${ARGN} ${include_dirs} "${SOURCE}"
              -o "${WORK_DIR}/${name}")
  string(JOIN " " command_line ${command})
  message(STATUS "$ ${command_line}")
  execute_process(COMMAND ${command} RESULT_VARIABLE result OUTPUT_VARIABLE printed
                  ERROR_VARIABLE printed)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "the plain compiler build failed:\n${printed}")
  endif()
  run_program(line "${WORK_DIR}/${name}")
  set(${output} "${line}" PARENT_SCOPE)
endfunction()

function(run_program output program)
  execute_process(COMMAND "${program}" RESULT_VARIABLE result OUTPUT_VARIABLE line
                  ERROR_VARIABLE line OUTPUT_STRIP_TRAILING_WHITESPACE)
  message(STATUS "${program}: ${line}")
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "${program} failed (exit code ${result})")
  endif()
  set(${output} "${line}" PARENT_SCOPE)
endfunction()

# expect(<line> <what> <ON|OFF> <name>): the line says "<what> on" or "<what> off".
function(expect line what wanted name)
  if(wanted)
    set(word on)
  else()
    set(word off)
  endif()
  string(FIND "${line}" "${what} ${word}" found)
  if(found EQUAL -1)
    message(FATAL_ERROR "${name}: expected '${what} ${word}' in build_info(), given: ${line}")
  endif()
endfunction()

build_and_report(plain plain)
expect("${plain}" OpenMP ON "plain build (-fopenmp, xsimd on the include path)")
expect("${plain}" xsimd ON "plain build (-fopenmp, xsimd on the include path)")

build_and_report(opted_out opted_out -DLATTE_WITH_OPENMP=0 -DLATTE_WITH_XSIMD=0)
expect("${opted_out}" OpenMP OFF "plain build with -DLATTE_WITH_OPENMP=0 -DLATTE_WITH_XSIMD=0")
expect("${opted_out}" xsimd OFF "plain build with -DLATTE_WITH_OPENMP=0 -DLATTE_WITH_XSIMD=0")

run_program(through_target "${TARGET_PROGRAM}")
expect("${through_target}" OpenMP ${TARGET_OPENMP} "build through latte::latte (LATTE_WITH_OPENMP=${TARGET_OPENMP})")
expect("${through_target}" xsimd ${TARGET_XSIMD} "build through latte::latte (LATTE_WITH_XSIMD=${TARGET_XSIMD})")
string(REGEX REPLACE ", CUDA .*" "" plain_cpu "${plain}")
string(REGEX REPLACE ", CUDA .*" "" through_target_cpu "${through_target}")
if(TARGET_OPENMP AND TARGET_XSIMD AND SAME_FLAGS AND NOT plain_cpu STREQUAL through_target_cpu)
  message(FATAL_ERROR "the plain build and the build through latte::latte differ:\n"
                      "  plain:          ${plain}\n  through target: ${through_target}")
endif()
