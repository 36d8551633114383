# cmake -DACTION=build -DSOURCE_DIR=... -DWORK_DIR=... -DGENERATOR=... -DTorch_DIR=... -DCXX=...
#       [-DOPT=-O0|-O1] -P run.cmake
# cmake -DACTION=run -DWORK_DIR=... -DTARGET=trainer_load|scaler_load|ops_mask|safetensors|torch_save -DSECONDS=40
#       [-DREGRESSIONS=tests/fuzz/regressions] -P run.cmake
# build: configures and builds tests/fuzz with clang++ against the main build's LibTorch, at OPT
# (default -O1), or at $ENV{MIXPREC_FUZZ_OPT} where that is set (scripts/fuzz: -O1).
# run: writes the target's seeds (real checkpoints, state dicts, op calls) and adds the saved
# inputs of REGRESSIONS/<target>/; SECONDS 0 replays them once (what ctest does); SECONDS > 0
# fuzzes for that long in libFuzzer's fork mode (./scripts/fuzz), prints the executions and
# coverage. Either fails on a crash, a hang, a sanitizer report or a broken contract.
# Out-of-memory inputs are not failures when fuzzing: they are LibTorch's unpickler reserving a
# length read from the input (docs/reliability.md).
if(ACTION STREQUAL "build")
  get_filename_component(_torch_root "${Torch_DIR}/../../.." ABSOLUTE)
  set(_launcher)
  find_program(_ccache ccache)
  if(_ccache)
    set(_launcher -DCMAKE_CXX_COMPILER_LAUNCHER=${_ccache})
  endif()
  if(DEFINED ENV{MIXPREC_FUZZ_OPT})
    set(OPT $ENV{MIXPREC_FUZZ_OPT})
  elseif(NOT OPT)
    set(OPT -O1)
  endif()
  execute_process(
    COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/fuzz -B ${WORK_DIR}/build -G ${GENERATOR}
            -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMIXPREC_FUZZ_OPT=${OPT}
            -DMIXPREC_SOURCE_DIR=${SOURCE_DIR} -DTorch_DIR=${Torch_DIR}
            "-DCMAKE_PREFIX_PATH=${_torch_root}" ${_launcher}
    RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "configuring tests/fuzz with ${CXX} failed")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "building tests/fuzz failed")
  endif()
  return()
endif()

set(_binary ${WORK_DIR}/build/fuzz_${TARGET})
set(_corpus ${WORK_DIR}/corpus_${TARGET})
set(_artifacts ${WORK_DIR}/artifacts_${TARGET}/)
file(REMOVE_RECURSE ${_corpus} ${_artifacts})
file(MAKE_DIRECTORY ${_corpus} ${_artifacts})
set(_env ${CMAKE_COMMAND} -E env OMP_NUM_THREADS=1
    "LSAN_OPTIONS=suppressions=${CMAKE_CURRENT_LIST_DIR}/lsan.supp"
    "UBSAN_OPTIONS=print_stacktrace=1"
    # A malloc that cannot be served returns null (LibTorch's allocator then throws) rather than
    # aborting; operator new still aborts, which harness.cpp's pickles_fit keeps inputs from.
    "ASAN_OPTIONS=allocator_may_return_null=1")
# The seeds: LLVMFuzzerInitialize writes them where MIXPREC_FUZZ_SEEDS points; -runs=0 stops there.
execute_process(COMMAND ${_env} MIXPREC_FUZZ_SEEDS=${_corpus} ${_binary} -runs=0
                RESULT_VARIABLE _rc OUTPUT_QUIET ERROR_VARIABLE _seed_log)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "writing the seeds of fuzz_${TARGET} failed:\n${_seed_log}")
endif()
if(REGRESSIONS AND IS_DIRECTORY ${REGRESSIONS}/${TARGET})
  file(GLOB _saved ${REGRESSIONS}/${TARGET}/*)
  file(COPY ${_saved} DESTINATION ${_corpus})
endif()
file(GLOB _inputs ${_corpus}/*)
list(LENGTH _inputs _count)
if(SECONDS EQUAL 0)
  # -runs=0: every input of the corpus runs once, then libFuzzer exits.
  execute_process(COMMAND ${_env} ${_binary} ${_corpus} -runs=0 -timeout=20 -rss_limit_mb=4096
                          -artifact_prefix=${_artifacts}
                  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _log)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "fuzz_${TARGET}: replaying its ${_count} inputs failed (exit ${_rc})\n${_log}")
  endif()
  message(STATUS "fuzz_${TARGET}: ${_count} inputs replayed, no failure")
  return()
endif()
execute_process(
  COMMAND ${_env} ${_binary} ${_corpus} -fork=1 -ignore_ooms=1 -ignore_timeouts=0
          -ignore_crashes=0 -timeout=20 -malloc_limit_mb=2048 -rss_limit_mb=4096
          -max_total_time=${SECONDS} -artifact_prefix=${_artifacts}
  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _log)
# Fork mode reports "#EXECS: cov: C ft: F corp: N exec/s R oom/timeout/crash: O/T/X time: S".
string(REGEX MATCHALL "#[0-9]+: cov: [0-9]+ ft: [0-9]+ corp: [0-9]+ exec/s:? [0-9]+ oom/timeout/crash: [0-9]+/[0-9]+/[0-9]+"
       _lines "${_log}")
list(GET _lines -1 _last)
message(STATUS "fuzz_${TARGET}, ${SECONDS} s: ${_last}")
# Fork mode exits with the code of its last job, so a run whose last job ran out of memory (an
# ignored OOM, libFuzzer's exit code 71) ends in 71 with no crash and no hang in its counts.
if(_rc EQUAL 71 AND _last MATCHES "oom/timeout/crash: [1-9][0-9]*/0/0$")
  set(_rc 0)
endif()
if(NOT _rc EQUAL 0 OR NOT _last MATCHES "oom/timeout/crash: [0-9]+/0/0$")
  message(FATAL_ERROR "fuzz_${TARGET} found a failure (exit ${_rc}); inputs in ${_artifacts}\n${_log}")
endif()
