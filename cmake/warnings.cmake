# Warnings as errors for mixprec's own targets: mixprec_warnings(<target>).
# LibTorch's headers are system headers (imported target), so their warnings do not count.
function(mixprec_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE
      -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion -Werror)
    # With AddressSanitizer at -O1 (the asan presets use -O0; a user may raise it), GCC 12
    # loses track of which std::optional payloads are engaged and reports copies of a
    # disengaged TrainerOptions::distributed as "may be used uninitialized". The sanitizer
    # build looks for runtime errors, which ASan and UBSan find; the Release builds keep the
    # warning as an error.
    if(MIXPREC_SANITIZE AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
      target_compile_options(${target} PRIVATE -Wno-maybe-uninitialized)
    endif()
  endif()
endfunction()
