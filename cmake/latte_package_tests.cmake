# Packaging tests (CTest, label "package"): latte is consumed the ways a user
# consumes it, each time by a small program that runs a Latte forward
# (test_package/test_package.cpp):
#
#   package_install            cmake --install into a staging prefix under the build dir
#   package_find_package       test_package/ built against that prefix: find_package(latte CONFIG REQUIRED)
#   package_components         ... requesting the components this build has (must configure)
#   package_missing_component  ... requesting an unknown component (must fail, with latte's message)
#   package_build_tree         test_package/ built against this build tree (export(); no install)
#   package_add_subdirectory   tests/consumers/add_subdirectory/: latte's source via add_subdirectory
#   package_conan_create       `conan create .` offline, with conan/profiles/offline
#
# Consumers are configured with this build's compiler, build type and flags.
set(latte_package_work "${PROJECT_BINARY_DIR}/package-tests")
set(latte_package_prefix "${latte_package_work}/prefix")

set(latte_consumer_options
  "-DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}"
  "-DCMAKE_CXX_FLAGS=${CMAKE_CXX_FLAGS}"
  "-DCMAKE_EXE_LINKER_FLAGS=${CMAKE_EXE_LINKER_FLAGS}"
  "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF")
if(CMAKE_BUILD_TYPE)
  list(APPEND latte_consumer_options "-DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE}")
endif()
set(latte_build_and_test
  --build-generator "${CMAKE_GENERATOR}"
  --build-makeprogram "${CMAKE_MAKE_PROGRAM}")
if(CMAKE_CONFIGURATION_TYPES)
  list(APPEND latte_build_and_test --build-config $<CONFIG>)
endif()

# latte_add_consumer_test(<name> <source dir> <executable> [options...]):
# configure, build and run a consumer project with ctest --build-and-test.
function(latte_add_consumer_test name source executable)
  add_test(NAME ${name}
    COMMAND "${CMAKE_CTEST_COMMAND}" --build-and-test "${source}" "${latte_package_work}/${name}"
            ${latte_build_and_test}
            --build-options ${latte_consumer_options} ${ARGN}
            --test-command ${executable})
  set_tests_properties(${name} PROPERTIES LABELS package TIMEOUT 300)
endfunction()

# ---- Installed package ---------------------------------------------------------
add_test(NAME package_install
  COMMAND "${CMAKE_COMMAND}" -D "BUILD_DIR=${PROJECT_BINARY_DIR}" -D "PREFIX=${latte_package_prefix}"
          -D "CONFIG=$<CONFIG>" -P "${CMAKE_CURRENT_LIST_DIR}/latte_stage_install.cmake")
set_tests_properties(package_install PROPERTIES
  LABELS package TIMEOUT 120 FIXTURES_SETUP latte_staged_install)

set(latte_installed_config_dir "${latte_package_prefix}/${CMAKE_INSTALL_DATADIR}/latte/cmake")
latte_add_consumer_test(package_find_package "${PROJECT_SOURCE_DIR}/test_package" test_package
  "-DCMAKE_PREFIX_PATH=${latte_package_prefix}"
  "-DLATTE_EXPECTED_DIR=${latte_installed_config_dir}")
set_tests_properties(package_find_package PROPERTIES FIXTURES_REQUIRED latte_staged_install)

# Components: those this build has must be found when REQUIRED ...
set(latte_built_components "")
if(LATTE_WITH_OPENMP)
  list(APPEND latte_built_components OpenMP)
endif()
if(LATTE_WITH_XSIMD)
  list(APPEND latte_built_components xsimd)
endif()
if(LATTE_CUDA_ENABLED)
  list(APPEND latte_built_components CUDA)  # also finds CUDAToolkit in the consumer
endif()
if(LATTE_MPI_ENABLED)
  list(APPEND latte_built_components MPI)  # finds MPI in the consumer; latte::mpi must exist
endif()
list(JOIN latte_built_components "$<SEMICOLON>" latte_built_components_arg)
add_test(NAME package_components
  COMMAND "${CMAKE_COMMAND}" -S "${PROJECT_SOURCE_DIR}/test_package"
          -B "${latte_package_work}/package_components"
          ${latte_consumer_options}
          "-DCMAKE_PREFIX_PATH=${latte_package_prefix}"
          "-DLATTE_EXPECTED_DIR=${latte_installed_config_dir}"
          "-DLATTE_TEST_COMPONENTS=${latte_built_components_arg}")
set_tests_properties(package_components PROPERTIES
  LABELS package TIMEOUT 120 FIXTURES_REQUIRED latte_staged_install)
# ... and one that does not exist must stop the consumer's configure with latte's message.
add_test(NAME package_missing_component
  COMMAND "${CMAKE_COMMAND}" -S "${PROJECT_SOURCE_DIR}/test_package"
          -B "${latte_package_work}/package_missing_component"
          ${latte_consumer_options}
          "-DCMAKE_PREFIX_PATH=${latte_package_prefix}"
          "-DLATTE_TEST_COMPONENTS=NoSuchComponent")
# The message is printed only when latte's config rejects the request, which
# stops the configure (PASS_REGULAR_EXPRESSION then decides, not the exit code).
set_tests_properties(package_missing_component PROPERTIES
  LABELS package TIMEOUT 120 FIXTURES_REQUIRED latte_staged_install
  PASS_REGULAR_EXPRESSION "requested components are not available:[ \n]+NoSuchComponent: unknown component")

# ---- Build tree (export(), no install) -----------------------------------------
latte_add_consumer_test(package_build_tree "${PROJECT_SOURCE_DIR}/test_package" test_package
  "-Dlatte_DIR=${PROJECT_BINARY_DIR}"
  "-DLATTE_EXPECTED_DIR=${PROJECT_BINARY_DIR}")

# ---- add_subdirectory ----------------------------------------------------------
latte_add_consumer_test(package_add_subdirectory
  "${PROJECT_SOURCE_DIR}/tests/consumers/add_subdirectory" consumer
  "-DLATTE_SOURCE_DIR=${PROJECT_SOURCE_DIR}"
  "-DLATTE_WITH_OPENMP=${LATTE_WITH_OPENMP}"
  "-DLATTE_WITH_XSIMD=${LATTE_WITH_XSIMD}"
  "-DLATTE_WITH_CUDA=${LATTE_WITH_CUDA}")

# ---- Conan 2 -------------------------------------------------------------------
# scripts/setup.sh installs conan into .venv/. Without it the test reports itself
# skipped, with the reason; LATTE_REQUIRE_CONAN=ON (scripts/test.sh, hence CI) makes a
# missing conan a failure instead.
find_program(LATTE_CONAN_EXECUTABLE conan
  HINTS "${PROJECT_SOURCE_DIR}/.venv/bin"
  DOC "Conan 2 client for the package_conan_create test (scripts/setup.sh installs it in .venv/)")
option(LATTE_REQUIRE_CONAN "Fail package_conan_create, rather than skip it, when conan is missing"
       OFF)
if(NOT LATTE_CONAN_EXECUTABLE)
  if(LATTE_REQUIRE_CONAN)
    message(STATUS "latte: conan not found: package_conan_create will fail (LATTE_REQUIRE_CONAN=ON); "
                   "./scripts/setup.sh installs it into .venv/")
  else()
    message(STATUS "latte: conan not found: package_conan_create will be skipped; "
                   "./scripts/setup.sh installs it into .venv/")
  endif()
endif()
set(latte_conan_skip_line "package_conan_create skipped:")
function(latte_add_conan_test name conan require)
  add_test(NAME ${name}
    COMMAND "${CMAKE_COMMAND}" -D "CONAN=${conan}" -D "REQUIRE_CONAN=${require}"
            -D "SOURCE_DIR=${PROJECT_SOURCE_DIR}" -D "WORK_DIR=${latte_package_work}/${name}"
            -P "${CMAKE_CURRENT_LIST_DIR}/latte_conan_create.cmake")
endfunction()
latte_add_conan_test(package_conan_create "${LATTE_CONAN_EXECUTABLE}" "${LATTE_REQUIRE_CONAN}")
set_tests_properties(package_conan_create PROPERTIES LABELS package TIMEOUT 600
  SKIP_REGULAR_EXPRESSION "${latte_conan_skip_line}")
# Both answers to a missing conan (a name conan cannot have): skipped with the
# reason, or, required, a failure that says why.
latte_add_conan_test(package_conan_missing_skips "conan-NOTFOUND" OFF)
set_tests_properties(package_conan_missing_skips PROPERTIES LABELS package TIMEOUT 60
  PASS_REGULAR_EXPRESSION "${latte_conan_skip_line} conan \\(Conan 2\\) was not found")
latte_add_conan_test(package_conan_missing_required "conan-NOTFOUND" ON)
set_tests_properties(package_conan_missing_required PROPERTIES LABELS package TIMEOUT 60
  PASS_REGULAR_EXPRESSION "cannot be tested, and[ \n]+LATTE_REQUIRE_CONAN is ON")
