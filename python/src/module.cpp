// latte's Python module, latte._latte: the mechanisms' classes (one binding
// file each), latte.Error, and what the build was compiled with.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <Python.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "array_memory.hpp"
#include "bindings.hpp"
#include "kernel_call.hpp"
#include "latte/build_info.hpp"
#include "latte/core/error.hpp"
#include "latte/version.hpp"

namespace nb = nanobind;

namespace latte::python {
void bind_latte_attention(nb::module_& m);
void bind_softmax_attention(nb::module_& m);
void bind_linear_attention(nb::module_& m);
void bind_latte_macchiato(nb::module_& m);
void bind_lavo(nb::module_& m);
void bind_conv_compressed(nb::module_& m);
}  // namespace latte::python

NB_MODULE(_latte, m) {
  m.doc() = "latte: linear-time attention kernels (C++), from Python";
  // latte.Error: a ValueError whose `argument` names the argument at fault.
  static nb::object error_type = nb::borrow(PyErr_NewExceptionWithDoc(
      "latte.Error",
      "Bad input to a latte call. A ValueError; `argument` names the argument at fault "
      "(\"values\", \"out\", \"dims.heads\", ...), the message says what was expected and what was given.",
      PyExc_ValueError, nullptr));
  m.attr("Error") = error_type;
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const latte::Error& error) {
      nb::object instance = error_type(nb::str(error.what()));
      instance.attr("argument") = nb::str(error.argument().c_str());
      PyErr_SetObject(error_type.ptr(), instance.ptr());
    }
  });
  m.attr("__version__") = LATTE_VERSION_STRING;
  m.def("build_info", [] { return latte::build_info().to_string(); },
        "How this module was compiled: SIMD instruction set and width, OpenMP, xsimd.");
  // For the tests: the address nanobind's view of an array reads, to show it is
  // the array's own memory (no conversion copy) for strided inputs too.
  m.def("_data_address", [](const latte::python::AnyArray& array) {
    return reinterpret_cast<std::uintptr_t>(array.data());
  });
  // The cache of freed output memory (array_memory.hpp).
  m.def("set_array_cache_limit",
        [](std::size_t bytes) { latte::python::ArrayMemory::instance().set_limit(bytes); }, nb::arg("bytes"),
        "Holds at most `bytes` of freed output arrays' memory for reuse from now on (0: none; default 1 GiB).\n"
        "latte's outputs of 4 MiB and more come from this cache when a freed block of a similar size is\n"
        "there: the kernel then writes memory already faulted in, as a C++ caller reusing its output does.");
  m.def("empty_array_cache", [] { latte::python::ArrayMemory::instance().empty(); },
        "Frees the memory the array cache holds (its limit stays).");
  m.def(
      "array_cache_info",
      [] {
        const auto& memory = latte::python::ArrayMemory::instance();
        nb::dict info;
        info["cached_bytes"] = memory.cached_bytes();
        info["limit"] = memory.limit();
        return info;
      },
      "{'cached_bytes': bytes held now, 'limit': the most it holds}.");
  m.def(
      "kernel_seconds",
      [] { return 1e-9 * static_cast<double>(latte::python::kernel_nanoseconds().load(std::memory_order_relaxed)); },
      "Seconds spent inside latte's C++ kernels called from Python since the module loaded, all threads\n"
      "(each call's wall time with the GIL released). The difference between a Python call's own wall\n"
      "time and this total's growth over it is what the Python side added: argument checks, output\n"
      "arrays, torch's dispatch and autograd.");
  latte::python::bind_latte_attention(m);
  latte::python::bind_softmax_attention(m);
  latte::python::bind_linear_attention(m);
  latte::python::bind_latte_macchiato(m);
  latte::python::bind_lavo(m);
  latte::python::bind_conv_compressed(m);
}
