"""Conan 2 recipe for latte, a header-only C++20 library of linear-time attention.

    conan create . --profile:all conan/profiles/offline --no-remote   # offline, system eigen/xsimd
    conan create . -o "latte/*:openmp=False"                          # without OpenMP threads

The package is latte's own CMake installation (headers + latteConfig.cmake), so
consumers write the same CMake as everywhere else:

    find_package(latte CONFIG REQUIRED)          # COMPONENTS OpenMP / CUDA: see latteConfig.cmake
    target_link_libraries(app PRIVATE latte::latte)

Requirements are version *ranges*, so a profile's [platform_requires] (e.g.
eigen/3.4.0, xsimd/8.1.0 from Debian) can stand in for them. doctest and Google
Benchmark are only for latte's own tests and benchmarks, which the package does
not build.
"""
import os
import re

from conan import ConanFile
from conan.tools.build import check_min_cppstd
from conan.tools.cmake import CMake, CMakeDeps, CMakeToolchain, cmake_layout
from conan.tools.files import load

required_conan_version = ">=2.2"  # [platform_requires], --profile:all


class LatteConan(ConanFile):
    name = "latte"
    description = "Header-only C++20 linear-time attention: Latte, linear attention, exact softmax baseline"
    topics = ("attention", "transformer", "linear-attention", "header-only")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    options = {
        "openmp": [True, False],  # LATTE_WITH_OPENMP: the CPU backend runs on OpenMP threads
        "cuda": [True, False],    # LATTE_WITH_CUDA: the CUDA backend (needs a CUDA compiler)
    }
    default_options = {"openmp": True, "cuda": False}
    # Everything `cmake --install` needs: `conan create .` works without a network.
    exports_sources = "CMakeLists.txt", "cmake/*", "include/*"
    no_copy_source = True

    def set_version(self):
        # One version for CMake, latte/version.hpp and the package: project(latte VERSION x.y.z).
        cmakelists = load(self, os.path.join(self.recipe_folder, "CMakeLists.txt"))
        self.version = re.search(r"project\(latte VERSION ([0-9.]+)", cmakelists).group(1)

    def layout(self):
        cmake_layout(self)

    def requirements(self):
        self.requires("eigen/[>=3.4.0 <4]")
        self.requires("xsimd/[>=8.1.0 <14]")

    def package_id(self):
        # Header-only: one package whatever the compiler or build type. The options stay
        # in the id, because they change the installed latteConfig.cmake.
        self.info.settings.clear()
        self.info.requires.clear()

    def validate(self):
        check_min_cppstd(self, 20)

    def generate(self):
        toolchain = CMakeToolchain(self)
        toolchain.cache_variables["LATTE_WITH_OPENMP"] = bool(self.options.openmp)
        toolchain.cache_variables["LATTE_WITH_XSIMD"] = True
        toolchain.cache_variables["LATTE_WITH_CUDA"] = "ON" if self.options.cuda else "OFF"
        # latte::mpi (the distributed part) is not packaged for Conan yet: the package is
        # the same whether or not the build machine has an MPI.
        toolchain.cache_variables["LATTE_WITH_MPI"] = "OFF"
        for part in ("TESTS", "BENCHMARKS", "EXAMPLES"):
            toolchain.cache_variables[f"LATTE_BUILD_{part}"] = False
        toolchain.generate()
        CMakeDeps(self).generate()

    def build(self):
        # Configuring checks that the dependencies are found (nothing is compiled).
        cmake = CMake(self)
        cmake.configure()

    def package(self):
        CMake(self).install()

    def package_info(self):
        # Consumers use latte's own latteConfig.cmake (it knows Debian's xsimd quirks
        # and the OpenMP / CUDA components), not a CMakeDeps-generated one.
        self.cpp_info.set_property("cmake_find_mode", "none")
        self.cpp_info.set_property("cmake_file_name", "latte")
        self.cpp_info.set_property("cmake_target_name", "latte::latte")
        self.cpp_info.builddirs = [os.path.join("share", "latte", "cmake")]
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        # For generators other than CMake (PkgConfigDeps, MSBuildDeps, ...).
        self.cpp_info.requires = ["eigen::eigen", "xsimd::xsimd"]
        self.cpp_info.defines = ["LATTE_WITH_XSIMD=1"]
        if self.options.openmp:
            self.cpp_info.defines.append("LATTE_WITH_OPENMP=1")
            if self.settings.compiler in ("gcc", "clang"):
                self.cpp_info.cxxflags = ["-fopenmp"]
                self.cpp_info.sharedlinkflags = ["-fopenmp"]
                self.cpp_info.exelinkflags = ["-fopenmp"]
        else:  # off even when the consumer compiles with -fopenmp (core/config.hpp)
            self.cpp_info.defines.append("LATTE_WITH_OPENMP=0")
        if self.options.cuda:
            self.cpp_info.defines.append("LATTE_WITH_CUDA=1")
