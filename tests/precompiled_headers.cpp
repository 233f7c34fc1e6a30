// The owner of the tests' precompiled headers (tests/CMakeLists.txt): an
// empty file compiled with precompiled.hpp, whose .gch every test program reuses.
