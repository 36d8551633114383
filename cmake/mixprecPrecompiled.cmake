# mixprec_add_precompiled(<source> <header> <work dir>): defines mixprec::precompiled, the
# compiled companion (docs/build.md), a static library of the Trainers of trainer/precompiled.hpp's
# policies, one object per policy (they build side by side), compiled with the flags of the
# project that builds it and only where something links it. Whatever links it compiles none of
# them: it defines MIXPREC_PRECOMPILED, under which they are `extern template`. <source> is
# src/precompiled.cpp, <header> include/mixprec/trainer/precompiled.hpp (the list, counted here),
# <work dir> where the per-policy sources are written.
function(mixprec_add_precompiled source header work_dir)
  file(READ ${header} _text)
  string(REGEX MATCHALL "\n  X\\(" _policies "${_text}")
  list(LENGTH _policies _count)
  if(_count EQUAL 0)
    message(FATAL_ERROR "mixprec: ${header} lists no policy (lines '  X(policy)')")
  endif()
  math(EXPR _last "${_count} - 1")
  set(_sources)
  foreach(_part RANGE ${_last})
    set(_tu ${work_dir}/part${_part}.cpp)
    file(CONFIGURE OUTPUT ${_tu} CONTENT
         "// Generated: policy ${_part} of mixprec/trainer/precompiled.hpp's list.\n#define MIXPREC_PRECOMPILED_PART ${_part}\n#include \"${source}\"\n")
    list(APPEND _sources ${_tu})
  endforeach()
  add_library(mixprec_precompiled STATIC EXCLUDE_FROM_ALL ${_sources})
  add_library(mixprec::precompiled ALIAS mixprec_precompiled)
  target_link_libraries(mixprec_precompiled PUBLIC mixprec::mixprec)
  target_compile_definitions(mixprec_precompiled PUBLIC MIXPREC_PRECOMPILED)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${header})
endfunction()
