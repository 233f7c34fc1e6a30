# Compiled documentation: every code block in docs/*.md introduced by
#
#   <!-- compiled: NAME -->
#   ```cpp
#   ...a whole program...
#   ```
#
# becomes the executable doc_snippet_NAME (linked to latte::latte, warnings on)
# and the CTest doc_snippet_NAME that runs it. Editing a page re-runs the configure.
file(GLOB latte_doc_pages CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/docs/*.md")
set(latte_doc_snippet_dir "${PROJECT_BINARY_DIR}/doc_snippets")

foreach(page IN LISTS latte_doc_pages)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${page}")
  file(READ "${page}" rest)
  get_filename_component(page_name "${page}" NAME)
  # string(FIND / SUBSTRING) only: code is full of ';' and '[' that list commands would split.
  while(TRUE)
    string(FIND "${rest}" "<!-- compiled: " marker)
    if(marker EQUAL -1)
      break()
    endif()
    math(EXPR name_begin "${marker} + 15")
    string(SUBSTRING "${rest}" ${name_begin} -1 rest)
    string(FIND "${rest}" " -->" name_length)
    string(SUBSTRING "${rest}" 0 ${name_length} name)
    if(NOT name MATCHES "^[a-z0-9_]+$")
      message(FATAL_ERROR "${page_name}: snippet name '${name}' must be [a-z0-9_]+")
    endif()
    string(FIND "${rest}" "```cpp\n" fence)
    math(EXPR expected_fence "${name_length} + 5")  # " -->\n" then the fence
    if(fence EQUAL -1 OR NOT fence EQUAL expected_fence)
      message(FATAL_ERROR "${page_name}: <!-- compiled: ${name} --> must be followed by a ```cpp line")
    endif()
    math(EXPR code_begin "${fence} + 7")
    string(SUBSTRING "${rest}" ${code_begin} -1 rest)
    string(FIND "${rest}" "```" code_length)
    if(code_length EQUAL -1)
      message(FATAL_ERROR "${page_name}: the code block of snippet ${name} is not closed")
    endif()
    string(SUBSTRING "${rest}" 0 ${code_length} code)
    string(SUBSTRING "${rest}" ${code_length} -1 rest)
    if(TARGET doc_snippet_${name})
      message(FATAL_ERROR "${page_name}: snippet name ${name} is used twice")
    endif()

    # Rewritten only when it changed, so an unrelated edit of the page rebuilds nothing.
    file(WRITE "${latte_doc_snippet_dir}/${name}.cpp.new"
         "// Generated from docs/${page_name} (snippet ${name}); edit the page, not this file.\n${code}")
    configure_file("${latte_doc_snippet_dir}/${name}.cpp.new" "${latte_doc_snippet_dir}/${name}.cpp"
                   COPYONLY)
    add_executable(doc_snippet_${name} "${latte_doc_snippet_dir}/${name}.cpp")
    target_link_libraries(doc_snippet_${name} PRIVATE latte::latte)
    if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
      target_compile_options(doc_snippet_${name} PRIVATE -Wall -Wextra -Wpedantic)
      if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")  # as in tests/: GCC 12, Eigen AVX-512 false positive
        target_compile_options(doc_snippet_${name} PRIVATE -Wno-maybe-uninitialized)
      endif()
    endif()
    add_test(NAME doc_snippet_${name} COMMAND doc_snippet_${name})
    set_tests_properties(doc_snippet_${name} PROPERTIES LABELS docs)
  endwhile()
endforeach()
