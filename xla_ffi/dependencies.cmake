# Finds what the C++ side builds against, for CMakeLists.txt and tests/cpp:
# jax's XLA FFI headers, nanobind, and the CUDA runtime, cuBLAS, NCCL and
# cuBLASMp headers and libraries (from the NVIDIA wheels of
# ${Python_EXECUTABLE}, or CUDA_HOME, NCCL_HOME, CUBLASMP_HOME). Sets:
#   JCG_XLA_FFI_INCLUDE_DIR    jax.ffi.include_dir(), if jax imports
#   JCG_GPU_INCLUDE_DIRS       the CUDA, cuBLAS, NCCL and cuBLASMp header dirs
#   JCG_MISSING_HEADERS        what of those headers was not found ("" if none)
#   JCG_MISSING_LIBRARIES      what of the libraries was not found ("" if none)
#   JCG_CUDART_LIB, JCG_CUBLASLT_LIB, JCG_NCCL_LIB, JCG_CUBLASMP_LIB, JCG_CUDA_MAJOR
execute_process(
  COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_LIST_DIR}/cmake_hints.py"
  OUTPUT_FILE "${CMAKE_CURRENT_BINARY_DIR}/jcg_hints.cmake"
  RESULT_VARIABLE _hints_rc)
include("${CMAKE_CURRENT_BINARY_DIR}/jcg_hints.cmake")

set(_cuda_roots $ENV{CUDA_HOME} $ENV{CUDA_PATH} /usr/local/cuda)
find_path(JCG_CUDART_INCLUDE cuda_runtime_api.h
  HINTS ${JCG_INCLUDE_HINTS} PATHS ${_cuda_roots} PATH_SUFFIXES include)
# cuda_runtime_api.h and cublas_v2.h pull in crt/ and nv/target (CCCL), which
# CUDA 13 ships in wheels of their own.
find_path(JCG_CUDA_CRT_INCLUDE crt/host_defines.h
  HINTS ${JCG_INCLUDE_HINTS} PATHS ${_cuda_roots} PATH_SUFFIXES include)
find_path(JCG_CCCL_INCLUDE nv/target
  HINTS ${JCG_INCLUDE_HINTS} PATHS ${_cuda_roots} PATH_SUFFIXES include include/cccl)
find_path(JCG_CUBLAS_INCLUDE cublas_v2.h
  HINTS ${JCG_INCLUDE_HINTS} PATHS ${_cuda_roots} PATH_SUFFIXES include)
find_path(JCG_NCCL_INCLUDE nccl.h
  HINTS ${JCG_INCLUDE_HINTS} $ENV{NCCL_HOME} PATH_SUFFIXES include)
find_path(JCG_CUBLASMP_INCLUDE cublasmp.h
  HINTS ${JCG_INCLUDE_HINTS} $ENV{CUBLASMP_HOME} PATH_SUFFIXES include)
find_library(JCG_CUDART_LIB NAMES libcudart.so.13 libcudart.so.12 cudart
  HINTS ${JCG_LIBRARY_HINTS} PATHS ${_cuda_roots} PATH_SUFFIXES lib64 lib)
find_library(JCG_CUBLASLT_LIB NAMES libcublasLt.so.13 libcublasLt.so.12 cublasLt
  HINTS ${JCG_LIBRARY_HINTS} PATHS ${_cuda_roots} PATH_SUFFIXES lib64 lib)
find_library(JCG_NCCL_LIB NAMES libnccl.so.2 nccl
  HINTS ${JCG_LIBRARY_HINTS} $ENV{NCCL_HOME} PATH_SUFFIXES lib)
find_library(JCG_CUBLASMP_LIB NAMES libcublasmp.so.0 cublasmp
  HINTS ${JCG_LIBRARY_HINTS} $ENV{CUBLASMP_HOME} PATH_SUFFIXES lib)

# What is missing, as "<file> (<variable>)" for the error message.
set(JCG_MISSING_HEADERS "")
set(JCG_GPU_INCLUDE_DIRS "")
foreach(_pair JCG_CUDART_INCLUDE:cuda_runtime_api.h JCG_CUDA_CRT_INCLUDE:crt/host_defines.h
              JCG_CCCL_INCLUDE:nv/target JCG_CUBLAS_INCLUDE:cublas_v2.h
              JCG_NCCL_INCLUDE:nccl.h JCG_CUBLASMP_INCLUDE:cublasmp.h)
  string(REPLACE ":" ";" _pair "${_pair}")
  list(GET _pair 0 _var)
  list(GET _pair 1 _file)
  if(${_var})
    list(APPEND JCG_GPU_INCLUDE_DIRS "${${_var}}")
  else()
    list(APPEND JCG_MISSING_HEADERS "${_file} (${_var})")
  endif()
endforeach()
list(REMOVE_DUPLICATES JCG_GPU_INCLUDE_DIRS)

set(JCG_MISSING_LIBRARIES "")
foreach(_pair JCG_CUDART_LIB:libcudart JCG_CUBLASLT_LIB:libcublasLt JCG_NCCL_LIB:libnccl
              JCG_CUBLASMP_LIB:libcublasmp)
  string(REPLACE ":" ";" _pair "${_pair}")
  list(GET _pair 0 _var)
  list(GET _pair 1 _file)
  if(NOT ${_var})
    list(APPEND JCG_MISSING_LIBRARIES "${_file} (${_var})")
  endif()
endforeach()

if(JCG_CUDART_INCLUDE)
  file(READ "${JCG_CUDART_INCLUDE}/cuda_runtime_api.h" _cudart_header LIMIT 20000)
  string(REGEX MATCH "#define CUDART_VERSION +([0-9]+)" _ "${_cudart_header}")
  math(EXPR JCG_CUDA_MAJOR "${CMAKE_MATCH_1} / 1000")
endif()
