# cmake -DSOURCE_DIR=... -DWORK_DIR=... -DGENERATOR=... -DTorch_DIR=... -DPYTHON=... -P configure_warnings.cmake
# Configures the whole project (tests, examples, benchmarks: every executable) afresh, as
# ./scripts/test and ./scripts/demo do on a first run, and fails on any CMake warning. The one
# this guards against was "Cannot generate a safe runtime search path ... libgomp" once per
# executable (29 of them), from linking GCC's libgomp where LibTorch loads its own
# (cmake/mixprecOpenMP.cmake).
file(REMOVE_RECURSE ${WORK_DIR})
get_filename_component(_torch_root "${Torch_DIR}/../../.." ABSOLUTE)
execute_process(
  COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR} -G ${GENERATOR}
          "-DCMAKE_PREFIX_PATH=${_torch_root}" -DMIXPREC_PYTHON=${PYTHON}
  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
file(REMOVE_RECURSE ${WORK_DIR})
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "configuring the project failed:\n${_out}${_err}")
endif()
string(REGEX MATCHALL "CMake Warning" _warnings "${_err}")
list(LENGTH _warnings _count)
if(_count GREATER 0)
  message(FATAL_ERROR "configuring the project printed ${_count} warning(s):\n${_err}")
endif()
message(STATUS "configured without warnings")
