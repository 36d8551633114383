# One precompiled <torch/torch.h> for every executable of the build: a translation unit that
# parses it costs 20-40 s on the 2-core CI machine, building the header once ~100 s.
# mixprec_use_pch(<target>) reuses it. The targets must be compiled with the same flags (GCC
# checks this and refuses the header otherwise: -Winvalid-pch, an error under -Werror).
add_library(mixprec_pch OBJECT ${CMAKE_CURRENT_LIST_DIR}/pch.cpp)
target_link_libraries(mixprec_pch PRIVATE mixprec::mixprec)
target_precompile_headers(mixprec_pch PRIVATE <torch/torch.h>)
mixprec_warnings(mixprec_pch)
# MIXPREC_QUICK_BUILD: the header and every target that uses it at -O0 (GCC refuses a header
# built with __OPTIMIZE__ in a TU without it, and the other way round).
if(MIXPREC_QUICK_BUILD)
  target_compile_options(mixprec_pch PRIVATE -O0)
endif()

# MIXPREC_USE_PRECOMPILED (OFF): every program of this build links the compiled companion,
# mixprec::precompiled. Off by default: at -O0 (./scripts/test) a test TU spends little of its
# time on the Trainers it instantiates, and the companion's own objects cost more than they save
# (docs/build.md has the figures); the README's example links it in the builds with build checks.
option(MIXPREC_USE_PRECOMPILED "The project's own programs link mixprec::precompiled" OFF)

function(mixprec_use_pch target)
  target_precompile_headers(${target} REUSE_FROM mixprec_pch)
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
