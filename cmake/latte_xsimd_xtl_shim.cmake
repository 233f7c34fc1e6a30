# Debian's xsimd 8.1 exports a target whose INTERFACE_LINK_LIBRARIES names
# "xtl" even when xtl is not installed (latte uses no xtl feature), which
# turns into a failing "-lxtl" at link time. Use xtl's own package when it is
# present; otherwise stand in an empty interface target of that name.
if(TARGET xsimd AND NOT TARGET xtl)
  find_package(xtl QUIET CONFIG)
  if(NOT TARGET xtl)
    add_library(xtl INTERFACE IMPORTED)
  endif()
endif()
