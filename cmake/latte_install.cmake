include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS latte EXPORT latteTargets)
if(LATTE_MPI_ENABLED)
  install(TARGETS latte_mpi EXPORT latteTargets)
endif()
install(DIRECTORY include/latte DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT latteTargets NAMESPACE latte:: DESTINATION ${CMAKE_INSTALL_DATADIR}/latte/cmake)
export(EXPORT latteTargets NAMESPACE latte:: FILE ${PROJECT_BINARY_DIR}/latteTargets.cmake)

configure_file(cmake/latte_xsimd_xtl_shim.cmake ${PROJECT_BINARY_DIR}/latte_xsimd_xtl_shim.cmake COPYONLY)
configure_package_config_file(cmake/latteConfig.cmake.in
  ${PROJECT_BINARY_DIR}/latteConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_DATADIR}/latte/cmake)
# Header-only: any architecture may consume it.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/latteConfigVersion.cmake
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${PROJECT_BINARY_DIR}/latteConfig.cmake ${PROJECT_BINARY_DIR}/latteConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/latte_xsimd_xtl_shim.cmake
  DESTINATION ${CMAKE_INSTALL_DATADIR}/latte/cmake)
