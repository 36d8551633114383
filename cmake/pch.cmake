# One precompiled <torch/torch.h> for every executable of the build: a translation unit that
# parses it costs 20-40 s on the 2-core CI machine, building the header once ~100 s.
# mixprec_use_pch(<target>) reuses it. The targets must be compiled with the same flags (GCC
# checks this and refuses the header otherwise: -Winvalid-pch, an error under -Werror).
add_library(mixprec_pch OBJECT ${CMAKE_CURRENT_LIST_DIR}/pch.cpp)
target_link_libraries(mixprec_pch PRIVATE mixprec::mixprec)
target_precompile_headers(mixprec_pch PRIVATE <torch/torch.h>)
mixprec_warnings(mixprec_pch)

function(mixprec_use_pch target)
  target_precompile_headers(${target} REUSE_FROM mixprec_pch)
endfunction()
