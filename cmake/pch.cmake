# One precompiled <torch/torch.h> for every executable of the build: a translation unit that
# parses it costs 20-40 s on the 2-core CI machine, building the header once ~100 s.
# mixprec_use_pch(<target>) reuses it. The targets must be compiled with the same flags (GCC
# checks this and refuses the header otherwise: -Winvalid-pch, an error under -Werror).
#
# ./scripts/test's Clang build (MIXPREC_TEST_GROUPS, the wheel's LibTorch) precompiles
# <mixprec/mixprec.hpp> in it as well: on top of LibTorch's header, mixprec's cost a translation
# unit 13 s of Clang's front end at -O0 (-ftime-trace: 8 s parsing, 6 s instantiating what its
# inline functions use), and every test, example and benchmark TU includes them; the build took
# 259 s instead of 355 in the cold CI runs (docs/ci.md). Not with GCC: its header grew from 645
# to 862 MB and the distributed tests' TU took 94 s of CPU instead of 88 (GCC instantiates
# templates in each TU, not in the header). The header's definitions are then
# mixprec::distributed's (process_group.hpp tests MIXPREC_C10D_GLOO), which every target that
# uses it links too. A target whose own includes are what it checks (PCH_WITHOUT_MIXPREC: the
# moved headers) and one that links the compiled companion (whose extern templates a header
# compiled without MIXPREC_PRECOMPILED would leave out) parse LibTorch's header themselves
# there; off where every program links the companion (MIXPREC_USE_PRECOMPILED).

# MIXPREC_USE_PRECOMPILED (OFF): every program of this build links the compiled companion,
# mixprec::precompiled. Off by default: at -O0 (./scripts/test) a test TU spends little of its
# time on the Trainers it instantiates, and the companion's own objects cost more than they save
# (docs/build.md has the figures); the README's example links it in the builds with build checks.
option(MIXPREC_USE_PRECOMPILED "The project's own programs link mixprec::precompiled" OFF)
set(MIXPREC_PCH_HOLDS_MIXPREC OFF)
if(MIXPREC_TEST_GROUPS AND NOT MIXPREC_USE_PRECOMPILED AND CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  set(MIXPREC_PCH_HOLDS_MIXPREC ON)
endif()

add_library(mixprec_pch OBJECT ${CMAKE_CURRENT_LIST_DIR}/pch.cpp)
if(MIXPREC_PCH_HOLDS_MIXPREC)
  target_link_libraries(mixprec_pch PRIVATE mixprec::distributed)
  target_precompile_headers(mixprec_pch PRIVATE <torch/torch.h> <mixprec/mixprec.hpp>)
else()
  target_link_libraries(mixprec_pch PRIVATE mixprec::mixprec)
  target_precompile_headers(mixprec_pch PRIVATE <torch/torch.h>)
endif()
mixprec_warnings(mixprec_pch)
# MIXPREC_QUICK_BUILD: the header and every target that uses it at -O0 (GCC refuses a header
# built with __OPTIMIZE__ in a TU without it, and the other way round).
if(MIXPREC_QUICK_BUILD)
  target_compile_options(mixprec_pch PRIVATE -O0)
endif()

# Where the header holds mixprec, whether <target> uses it is decided at the end of the
# configure, once its libraries are known (the README example links the companion after it is
# declared).
function(_mixprec_reuse_pch target)
  get_target_property(_libraries ${target} LINK_LIBRARIES)
  get_target_property(_without ${target} PCH_WITHOUT_MIXPREC)
  if(_without OR target STREQUAL "mixprec_precompiled" OR "mixprec::precompiled" IN_LIST _libraries)
    return()
  endif()
  target_precompile_headers(${target} REUSE_FROM mixprec_pch)
endfunction()
function(mixprec_use_pch target)
  if(MIXPREC_PCH_HOLDS_MIXPREC)
    target_link_libraries(${target} PRIVATE mixprec::distributed)
    # (a deferred call's arguments are read when it runs: the name goes in as text)
    cmake_language(EVAL CODE
      "cmake_language(DEFER DIRECTORY [[${PROJECT_SOURCE_DIR}]] CALL _mixprec_reuse_pch [[${target}]])")
  else()
    target_precompile_headers(${target} REUSE_FROM mixprec_pch)
  endif()
  if(MIXPREC_USE_PRECOMPILED AND NOT target STREQUAL "mixprec_precompiled")
    target_link_libraries(${target} PRIVATE mixprec::precompiled)
  endif()
  if(MIXPREC_QUICK_BUILD)
    target_compile_options(${target} PRIVATE -O0)
  endif()
  # GCC 13 ties -m options (-munroll-only-small-loops, -mvzeroupper) to the -O level, so it
  # refuses the header in the -O1 test TUs built beside an -O3 one: there they parse it
  # themselves (slower, same code), a warning rather than an error.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 13)
    target_compile_options(${target} PRIVATE -Wno-error=invalid-pch)
  endif()
endfunction()

# mixprec_unity_groups(<target> <dir> <group>...): each <group> is a string of source files
# (relative to <dir>, without .cpp; spaces or new lines between them) that compile as one
# translation unit (CMake's unity build in GROUP mode); a source of the target in no group
# compiles alone, and a name that is not one of its sources is ignored (MIXPREC_TEST_ONLY may
# have left it out). ./scripts/test uses it (MIXPREC_TEST_GROUPS): a group loads the precompiled
# header and generates the templates that its files share once. The files of a group must declare
# no name alike: each test and benchmark file keeps its code in a namespace of its own
# (docs/ci.md).
function(mixprec_unity_groups target dir)
  # The target's sources as absolute paths, however they were given (add_executable takes
  # paths relative to the target's directory).
  get_target_property(_given ${target} SOURCES)
  get_target_property(_base ${target} SOURCE_DIR)
  set(_sources)
  foreach(_source IN LISTS _given)
    cmake_path(ABSOLUTE_PATH _source BASE_DIRECTORY ${_base} NORMALIZE)
    list(APPEND _sources ${_source})
  endforeach()
  set(_index 0)
  foreach(_group IN LISTS ARGN)
    string(STRIP "${_group}" _group)
    string(REGEX REPLACE "[ \n]+" ";" _files "${_group}")
    foreach(_file IN LISTS _files)
      set(_path ${dir}/${_file}.cpp)
      if(_path IN_LIST _sources)
        set_source_files_properties(${_path} TARGET_DIRECTORY ${target} PROPERTIES
                                    UNITY_GROUP ${target}_${_index})
      endif()
    endforeach()
    math(EXPR _index "${_index} + 1")
  endforeach()
  set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_MODE GROUP)
endfunction()
