# Warnings as errors for mixprec's own targets: mixprec_warnings(<target>).
# LibTorch's headers are system headers (imported target), so their warnings do not count.
function(mixprec_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE
      -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion -Werror)
  endif()
endfunction()
