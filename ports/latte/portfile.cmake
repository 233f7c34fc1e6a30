# Overlay port for latte, built from this source tree (no download):
#   vcpkg install latte --overlay-ports=<latte>/ports
# Header-only: one release configuration, no binaries, latte's own CMake package
# (find_package(latte CONFIG REQUIRED) → latte::latte) moved to share/latte.
set(VCPKG_BUILD_TYPE release)
get_filename_component(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)

vcpkg_check_features(OUT_FEATURE_OPTIONS FEATURE_OPTIONS
  FEATURES
    openmp LATTE_WITH_OPENMP
    cuda   LATTE_WITH_CUDA
)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    ${FEATURE_OPTIONS}
    -DLATTE_WITH_XSIMD=ON
    -DLATTE_WITH_MPI=OFF
    -DLATTE_BUILD_TESTS=OFF
    -DLATTE_BUILD_BENCHMARKS=OFF
    -DLATTE_BUILD_EXAMPLES=OFF
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(PACKAGE_NAME latte CONFIG_PATH share/latte/cmake)

file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug")
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
if(EXISTS "${SOURCE_PATH}/LICENSE")
  vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
else()
  # The source tree has no LICENSE file yet; vcpkg requires a copyright file.
  file(WRITE "${CURRENT_PACKAGES_DIR}/share/${PORT}/copyright"
       "latte: no license file is distributed with this source tree.\n")
endif()
