# Decides whether kernels/*.cu are built, and if so enables the CUDA language.
# Sets TALLY_CUDA_ENABLED.
#
# nvcc comes from CMAKE_CUDA_COMPILER, $CUDACXX, PATH or /usr/local/cuda/bin.
# It compiles host code with the project's C++ compiler (nvcc would otherwise
# pick whatever g++ is on PATH). CMAKE_CUDA_ARCHITECTURES defaults to 80;90,
# which nvcc 11.8 through 13 accept (13 dropped everything below sm_75).
#
#   cmake -S . -B build -DTALLY_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=86
set(TALLY_CUDA_ENABLED OFF)
if(NOT TALLY_WITH_CUDA STREQUAL "OFF")
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX}
     AND EXISTS /usr/local/cuda/bin/nvcc)
    set(ENV{CUDACXX} /usr/local/cuda/bin/nvcc)
  endif()
  if(NOT DEFINED CMAKE_CUDA_HOST_COMPILER AND NOT DEFINED ENV{CUDAHOSTCXX})
    set(ENV{CUDAHOSTCXX} ${CMAKE_CXX_COMPILER})
  endif()
  set(CMAKE_CUDA_ARCHITECTURES "80;90" CACHE STRING
    "CUDA architectures the kernels are compiled for")
  # check_language() configures a throw-away project that reads the
  # architectures from the environment: it must test what the build will use,
  # so that AUTO falls back instead of failing in enable_language().
  set(ENV{CUDAARCHS} "${CMAKE_CUDA_ARCHITECTURES}")
  include(CheckLanguage)
  check_language(CUDA)
  find_path(TALLY_NCCL_INCLUDE_DIR nccl.h PATHS /usr/local/cuda/include /usr/include)
  if(CMAKE_CUDA_COMPILER AND TALLY_NCCL_INCLUDE_DIR)
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(CMAKE_CUDA_EXTENSIONS OFF)
    find_package(CUDAToolkit REQUIRED)
    set(TALLY_CUDA_ENABLED ON)
  elseif(TALLY_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "TALLY_WITH_CUDA=ON but there is no working nvcc for "
      "CMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES} (CMAKE_CUDA_COMPILER="
      "${CMAKE_CUDA_COMPILER}) or no nccl.h (TALLY_NCCL_INCLUDE_DIR="
      "${TALLY_NCCL_INCLUDE_DIR})")
  endif()
endif()
message(STATUS "tally: CUDA kernels ${TALLY_CUDA_ENABLED}")
