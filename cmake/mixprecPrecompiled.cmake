# mixprec_add_precompiled(<source>): defines mixprec::precompiled, the compiled companion
# (docs/build.md), a static library of the Trainers of trainer/precompiled.hpp's policies, in one
# object (they share most of their code, which one TU compiles once), compiled with the flags of
# the project that builds it and only where something links it. Whatever links it compiles none
# of them: it defines MIXPREC_PRECOMPILED, under which they are `extern template`. <source> is
# src/precompiled.cpp.
function(mixprec_add_precompiled source)
  add_library(mixprec_precompiled STATIC EXCLUDE_FROM_ALL ${source})
  add_library(mixprec::precompiled ALIAS mixprec_precompiled)
  target_link_libraries(mixprec_precompiled PUBLIC mixprec::mixprec)
  target_compile_definitions(mixprec_precompiled PUBLIC MIXPREC_PRECOMPILED)
endfunction()
