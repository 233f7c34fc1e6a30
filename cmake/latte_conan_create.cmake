# cmake -D CONAN=<conan> -D SOURCE_DIR=<latte source> -D WORK_DIR=<scratch>
#       [-D REQUIRE_CONAN=ON] -P latte_conan_create.cmake
#
# CTest package_conan_create: `conan create` of latte's recipe, offline. It runs in
# a fresh Conan home under WORK_DIR (the user's ~/.conan2 is not touched) on a copy
# of the recipe and its exported sources (so test_package's build stays out of the
# source tree), with --no-remote and conan/profiles/offline, whose
# [platform_requires] take eigen and xsimd from the system: nothing is downloaded.
#
# Without conan the test is skipped, saying why (CTest's SKIP_REGULAR_EXPRESSION matches
# "package_conan_create skipped:"), unless REQUIRE_CONAN is on (LATTE_REQUIRE_CONAN:
# scripts/test.sh and CI), which makes it a failure.
foreach(variable IN ITEMS SOURCE_DIR WORK_DIR)
  if(NOT ${variable})
    message(FATAL_ERROR "latte_conan_create.cmake: -D ${variable}=... is required")
  endif()
endforeach()
string(CONCAT how_to_get_conan "Run ./scripts/setup.sh, which installs it into .venv/, then "
       "re-run cmake (or pass -DLATTE_CONAN_EXECUTABLE=/path/to/conan).")
if(NOT CONAN AND NOT REQUIRE_CONAN)
  message("package_conan_create skipped: conan (Conan 2) was not found, so `conan create` "
          "is not tested. ${how_to_get_conan}")
  return()
elseif(NOT CONAN)
  message(FATAL_ERROR
    "conan (Conan 2) was not found, so `conan create` cannot be tested, and "
    "LATTE_REQUIRE_CONAN is ON.\n${how_to_get_conan}")
endif()

# run_conan(<output variable> <arguments>...): runs conan, echoes what it printed.
function(run_conan output)
  string(JOIN " " command_line conan ${ARGN})
  message(STATUS "$ ${command_line}")
  execute_process(COMMAND "${CONAN}" ${ARGN} WORKING_DIRECTORY "${WORK_DIR}/recipe"
                  OUTPUT_VARIABLE printed ERROR_VARIABLE printed RESULT_VARIABLE result)
  message("${printed}")
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "`${command_line}` failed (exit code ${result})")
  endif()
  set(${output} "${printed}" PARENT_SCOPE)
endfunction()

execute_process(COMMAND "${CONAN}" --version OUTPUT_VARIABLE version RESULT_VARIABLE result
                OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT result EQUAL 0 OR NOT version MATCHES "version 2\\.")
  message(FATAL_ERROR "${CONAN} is not a working Conan 2 (`conan --version`: '${version}'); "
                      "run ./scripts/setup.sh")
endif()
message(STATUS "${version} (${CONAN})")

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}/recipe")
foreach(entry IN ITEMS conanfile.py CMakeLists.txt cmake include conan test_package)
  file(COPY "${SOURCE_DIR}/${entry}" DESTINATION "${WORK_DIR}/recipe"
       PATTERN "build" EXCLUDE PATTERN "CMakeUserPresets.json" EXCLUDE)
endforeach()

set(ENV{CONAN_HOME} "${WORK_DIR}/home")
run_conan(printed profile detect --force)
run_conan(printed create . --profile:all conan/profiles/offline --no-remote)
# conan create skips the test stage silently when test_package/ has no recipe:
# insist that the consumer program ran and reported success.
if(NOT printed MATCHES "latte [0-9.]+: causal forward [^\n]* ok")
  message(FATAL_ERROR "conan create did not run test_package (its success line is missing)")
endif()
