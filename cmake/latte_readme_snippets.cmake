# Compiled README: every ```cpp block of README.md becomes a function of one
# program, readme_snippets (tests/readme/preamble.hpp first: the small inputs the
# snippets name without defining; #include lines go to the top), and the CTest
# readme_snippets runs them all, so a snippet that drifts from the API fails to
# compile or to run. #line points compiler errors at README.md. Editing the
# README re-runs the configure.
set(latte_readme "${PROJECT_SOURCE_DIR}/README.md")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${latte_readme}")
file(READ "${latte_readme}" latte_readme_text)
set(rest "${latte_readme_text}")
set(consumed 0)  # characters of the README before `rest`
set(includes "")
set(functions "")
set(calls "")
set(count 0)
# string(FIND / SUBSTRING) only: code is full of ';' and '[' that list commands would split.
while(TRUE)
  string(FIND "${rest}" "```cpp\n" fence)
  if(fence EQUAL -1)
    break()
  endif()
  math(EXPR code_begin "${fence} + 7")
  math(EXPR consumed "${consumed} + ${code_begin}")
  string(SUBSTRING "${rest}" ${code_begin} -1 rest)
  string(FIND "${rest}" "```" code_length)
  if(code_length EQUAL -1)
    message(FATAL_ERROR "README.md: a ```cpp block is not closed")
  endif()
  string(SUBSTRING "${rest}" 0 ${code_length} code)
  string(SUBSTRING "${rest}" ${code_length} -1 rest)
  string(SUBSTRING "${latte_readme_text}" 0 ${consumed} before)
  math(EXPR consumed "${consumed} + ${code_length}")
  string(REGEX MATCHALL "\n" newlines "${before}")
  list(LENGTH newlines line)
  math(EXPR line "${line} + 1")  # the block's first line, 1-based
  math(EXPR count "${count} + 1")

  # #include lines move to the top (blanked in place, so #line stays true).
  string(REGEX MATCHALL "#include[^\n]*" block_includes "${code}")
  foreach(include IN LISTS block_includes)
    string(APPEND includes "${include}\n")
  endforeach()
  string(REGEX REPLACE "#include[^\n]*" "" code "${code}")
  string(APPEND functions "void readme_snippet_${count}() {\n#line ${line} \"README.md\"\n${code}}\n\n")
  string(APPEND calls "  readme_snippet_${count}();\n")
endwhile()
if(count EQUAL 0)
  message(FATAL_ERROR "README.md has no ```cpp block: cmake/latte_readme_snippets.cmake expects some")
endif()

set(latte_readme_source "${PROJECT_BINARY_DIR}/readme/readme_snippets.cpp")
file(WRITE "${latte_readme_source}.new"
     "// Generated from README.md by cmake/latte_readme_snippets.cmake; edit the README.\n"
     "#include \"readme/preamble.hpp\"\n${includes}\n#include <cstdio>\n\n${functions}"
     "int main() {\n${calls}  std::printf(\"${count} README snippets ran\\n\");\n  return 0;\n}\n")
configure_file("${latte_readme_source}.new" "${latte_readme_source}" COPYONLY)  # only when changed
add_executable(readme_snippets "${latte_readme_source}")
target_link_libraries(readme_snippets PRIVATE latte::latte)
target_include_directories(readme_snippets PRIVATE "${PROJECT_SOURCE_DIR}/tests")
latte_target_warnings(readme_snippets)
latte_test_optimisation(readme_snippets)  # -O2 in Release (tests/CMakeLists.txt): it runs in 0.5 s
add_test(NAME readme_snippets COMMAND readme_snippets)
set_tests_properties(readme_snippets PROPERTIES LABELS docs
  PASS_REGULAR_EXPRESSION "^${count} README snippets ran")
