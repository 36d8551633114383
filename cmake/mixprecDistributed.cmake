# mixprec_distributed_requirements(<target>): gives <target> (mixprec::distributed) the c10d
# backends this LibTorch and machine can build: Gloo where its headers are installed (Debian:
# libgloo-dev; the wheels ship none), NCCL where LibTorch has CUDA, each with the definition
# that process_group.hpp tests (MIXPREC_C10D_GLOO, MIXPREC_C10D_NCCL: Torch's own USE_C10D_*,
# which its headers need too, the CUDA wheel's Torch target puts on every program, with or
# without the include paths) and the include paths its headers need. mixprec's own build runs
# it, and so does the installed mixprecConfig.cmake on the imported target: an installed
# mixprec::distributed finds the headers of the machine that uses it instead of carrying the
# paths of the one that installed it (the export leaves out what BUILD_INTERFACE wraps).
function(mixprec_distributed_requirements target)
  find_path(MIXPREC_GLOO_INCLUDE_DIR gloo/algorithm.h)
  if(MIXPREC_GLOO_INCLUDE_DIR)
    target_compile_definitions(${target} INTERFACE $<BUILD_INTERFACE:USE_C10D_GLOO>
                                                       $<BUILD_INTERFACE:MIXPREC_C10D_GLOO>)
    if(NOT MIXPREC_GLOO_INCLUDE_DIR STREQUAL "/usr/include")
      target_include_directories(${target} SYSTEM INTERFACE $<BUILD_INTERFACE:${MIXPREC_GLOO_INCLUDE_DIR}>)
    endif()
  endif()
  if(TORCH_CUDA_LIBRARIES)
    # ProcessGroupNCCL.hpp needs nccl.h and, through ATen's CUDA headers, cuSPARSE's and
    # cuBLAS's: a CUDA toolkit has them, and so do the wheels' nvidia packages beside torch/.
    set(_nvidia "${TORCH_INSTALL_PREFIX}/../nvidia")
    find_path(MIXPREC_NCCL_INCLUDE_DIR nccl.h HINTS "${_nvidia}/nccl/include" ENV NCCL_INCLUDE_DIR)
    find_path(MIXPREC_CUSPARSE_INCLUDE_DIR cusparse.h HINTS ${CUDAToolkit_INCLUDE_DIRS}
              ${CUDA_INCLUDE_DIRS} "${_nvidia}/cu13/include" "${_nvidia}/cusparse/include")
    find_path(MIXPREC_CUBLAS_INCLUDE_DIR cublas_v2.h HINTS ${CUDAToolkit_INCLUDE_DIRS}
              ${CUDA_INCLUDE_DIRS} "${_nvidia}/cu13/include" "${_nvidia}/cublas/include")
    if(MIXPREC_NCCL_INCLUDE_DIR AND MIXPREC_CUSPARSE_INCLUDE_DIR AND MIXPREC_CUBLAS_INCLUDE_DIR)
      target_compile_definitions(${target} INTERFACE $<BUILD_INTERFACE:USE_C10D_NCCL>
                                                         $<BUILD_INTERFACE:MIXPREC_C10D_NCCL>)
      foreach(_dir IN ITEMS ${MIXPREC_NCCL_INCLUDE_DIR} ${MIXPREC_CUSPARSE_INCLUDE_DIR}
                            ${MIXPREC_CUBLAS_INCLUDE_DIR})
        target_include_directories(${target} INTERFACE $<BUILD_INTERFACE:${_dir}>)
      endforeach()
    else()
      message(STATUS "mixprec: no NCCL process group (nccl.h, cusparse.h or cublas_v2.h not found)")
    endif()
  endif()
endfunction()
