# cmake -DMODE=... -DSOURCE_DIR=... -DMAIN_BINARY_DIR=... -DWORK_DIR=... -DGENERATOR=...
#       -DTorch_DIR=... -DGLOO_INCLUDE_DIR=... [-DCXX=...] -P run.cmake
# Configures, builds and runs tests/consumer against mixprec found by MODE.
# MAIN_BINARY_DIR: unused since find_package installs from a configure of its own.
file(REMOVE_RECURSE ${WORK_DIR})
# The LibTorch root, not only Torch_DIR: TorchConfig's find_library searches the prefixes' lib/
# before the system's, so a Debian libtorch.so cannot slip in beside the wheel's headers.
get_filename_component(_torch_root "${Torch_DIR}/../../.." ABSOLUTE)
set(_prefix_path ${_torch_root})
if(MODE STREQUAL "find_package")
  # The README's install: the checkout configured top-level without the tests (nothing but
  # LibTorch needed, and not one warning printed), then installed.
  execute_process(
    COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/library -G ${GENERATOR}
            -DMIXPREC_BUILD_TESTS=OFF "-DCMAKE_PREFIX_PATH=${_torch_root}"
    RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
  if(NOT _rc EQUAL 0 OR _err MATCHES "Warning")
    message(FATAL_ERROR "configuring mixprec for install (-DMIXPREC_BUILD_TESTS=OFF) failed or "
                        "warned:\n${_out}${_err}")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} --install ${WORK_DIR}/library --prefix ${WORK_DIR}/prefix
                  RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "cmake --install failed")
  endif()
  list(PREPEND _prefix_path ${WORK_DIR}/prefix)
  # The installed launcher starts N ranks with torchrun's variables.
  execute_process(COMMAND ${WORK_DIR}/prefix/bin/mixprec-launch -n 2 --
                          sh -c "echo \"rank $RANK of $WORLD_SIZE, local $LOCAL_RANK\""
                  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
  if(NOT _rc EQUAL 0 OR NOT _out MATCHES "rank 0 of 2, local 0" OR
     NOT _out MATCHES "rank 1 of 2, local 1")
    message(FATAL_ERROR "the installed bin/mixprec-launch did not start 2 ranks:\n${_out}${_err}")
  endif()
endif()
set(_launcher)
find_program(_ccache ccache)
if(_ccache)
  set(_launcher -DCMAKE_CXX_COMPILER_LAUNCHER=${_ccache})
endif()
# CXX: the compiler of the build that runs this test (not given: CMake's default, as a user's).
if(CXX)
  list(APPEND _launcher -DCMAKE_CXX_COMPILER=${CXX})
endif()
execute_process(
  COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build -G ${GENERATOR}
          -DMODE=${MODE} -DMIXPREC_SOURCE_DIR=${SOURCE_DIR} -DTorch_DIR=${Torch_DIR}
          -DMIXPREC_GLOO_INCLUDE_DIR=${GLOO_INCLUDE_DIR} --no-warn-unused-cli
          "-DCMAKE_PREFIX_PATH=${_prefix_path}" ${_launcher}
  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer (${MODE}) failed:\n${_out}${_err}")
endif()
# No warning of mixprec's (the libgomp one was CMake's "Cannot generate a safe runtime search
# path" per executable: cmake/mixprecOpenMP.cmake). The wheel's TorchConfig.cmake warns "library
# kineto not found" in any project that finds it (its kineto is inside libtorch_cpu): LibTorch's,
# documented in docs/guide.md, and the only one allowed.
string(REGEX MATCHALL "CMake Warning" _warnings "${_err}")
string(REGEX MATCHALL "TorchConfig.cmake:[0-9]+ \\(message\\):\n  library kineto not found"
       _kineto "${_err}")
list(LENGTH _warnings _warning_count)
list(LENGTH _kineto _kineto_count)
if(_warning_count GREATER _kineto_count)
  message(FATAL_ERROR "configuring the consumer (${MODE}) warned:\n${_err}")
endif()
message(STATUS "consumer (${MODE}) configured: ${_warning_count} warning(s), LibTorch's kineto "
               "one ${_kineto_count} time(s)")
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "building the consumer (${MODE}) failed")
endif()
execute_process(COMMAND ${WORK_DIR}/build/consumer RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "the consumer (${MODE}) ran but mixprec misbehaved")
endif()
