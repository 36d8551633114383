# mixprec_use_torch_libgomp(): before find_package(OpenMP), points FindOpenMP's libgomp at the one
# LibTorch ships beside its libraries (the PyPI wheel's torch/lib/libgomp.so.1, LibTorch's zip's
# libgomp-<hash>.so.1), where it ships one and GCC compiles.
#
# Why: libtorch_cpu loads that libgomp through its $ORIGIN run path, so a program that links
# GCC's own (/usr/lib/gcc/.../libgomp.so) gets the same soname in two directories: CMake then
# "cannot generate a safe runtime search path" for every executable, and at run time the
# program's run path (LibTorch's lib/ first) loads LibTorch's copy anyway. Linking the copy that
# is loaded makes link time agree with run time: one OpenMP runtime, no warning, and a program
# that needs a newer libgomp than LibTorch's fails when it links rather than when it starts.
# mixprec's own build runs it, and so does the installed mixprecConfig.cmake, so that a consumer
# finds the LibTorch of its own machine. Nothing changes where LibTorch sits in a system
# directory (Debian's libtorch-dev loads the system's libgomp), where the project has found
# OpenMP already, or where OpenMP_gomp_LIBRARY names a library outside the compiler's
# directories (a choice of the user's; the compiler's own, cached by an earlier configure, is
# replaced).
macro(mixprec_use_torch_libgomp)
  if(NOT TARGET OpenMP::OpenMP_CXX AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND TORCH_LIBRARY)
    set(_mixprec_system_dirs)
    foreach(_mixprec_dir IN LISTS CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES
                                  CMAKE_PLATFORM_IMPLICIT_LINK_DIRECTORIES)
      get_filename_component(_mixprec_dir "${_mixprec_dir}" REALPATH)
      list(APPEND _mixprec_system_dirs "${_mixprec_dir}")
    endforeach()
    # A libgomp of the compiler's (what FindOpenMP finds, also cached by an earlier configure)
    # may be replaced; one the user chose elsewhere stays.
    set(_mixprec_replace ON)
    if(DEFINED OpenMP_gomp_LIBRARY AND OpenMP_gomp_LIBRARY)
      get_filename_component(_mixprec_dir "${OpenMP_gomp_LIBRARY}" DIRECTORY)
      get_filename_component(_mixprec_dir "${_mixprec_dir}" REALPATH)
      if(NOT _mixprec_dir IN_LIST _mixprec_system_dirs)
        set(_mixprec_replace OFF)
      endif()
    endif()
    get_filename_component(_mixprec_torch_lib_dir "${TORCH_LIBRARY}" DIRECTORY)
    get_filename_component(_mixprec_dir "${_mixprec_torch_lib_dir}" REALPATH)
    if(_mixprec_replace AND NOT _mixprec_dir IN_LIST _mixprec_system_dirs)
      file(GLOB _mixprec_torch_gomp "${_mixprec_torch_lib_dir}/libgomp*.so*")
      list(LENGTH _mixprec_torch_gomp _mixprec_count)
      if(_mixprec_count EQUAL 1)
        set(OpenMP_gomp_LIBRARY "${_mixprec_torch_gomp}" CACHE FILEPATH
            "libgomp for OpenMP: LibTorch's own, which libtorch_cpu loads (cmake/mixprecOpenMP.cmake)"
            FORCE)
      endif()
    endif()
    unset(_mixprec_system_dirs)
    unset(_mixprec_dir)
    unset(_mixprec_replace)
    unset(_mixprec_torch_lib_dir)
    unset(_mixprec_torch_gomp)
    unset(_mixprec_count)
  endif()
endmacro()
