# Decides whether kernels/*.cu are built, and if so enables the CUDA language.
# Sets TALLY_CUDA_ENABLED. Include before find_package(Torch): a CUDA LibTorch
# enables CUDA itself, and must find the nvcc and architectures chosen here.
#
# nvcc comes from CMAKE_CUDA_COMPILER, $CUDACXX, PATH or /usr/local/cuda/bin.
# It compiles host code with the project's C++ compiler (nvcc would otherwise
# pick whatever g++ is on PATH). CMAKE_CUDA_ARCHITECTURES defaults to 80;90,
# which nvcc 11.8 through 13 accept (13 dropped everything below sm_75). A
# CUDA LibTorch's config replaces CMAKE_CUDA_ARCHITECTURES by -gencode flags
# in CMAKE_CUDA_FLAGS from TORCH_CUDA_ARCH_LIST, which is therefore set from
# CMAKE_CUDA_ARCHITECTURES unless the environment sets it. nccl.h and libnccl come from TALLY_PYTHON's
# nvidia-nccl wheel (site-packages/nvidia/nccl), else the toolkit or the system.
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
  if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST}
     AND CMAKE_CUDA_ARCHITECTURES MATCHES "^[0-9]+(;[0-9]+)*$")
    # 80;90 -> 8.0;9.0
    string(REGEX REPLACE "([0-9])(;|$)" ".\\1\\2" torch_arch_list
      "${CMAKE_CUDA_ARCHITECTURES}")
    set(ENV{TORCH_CUDA_ARCH_LIST} "${torch_arch_list}")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  # A wheel's NCCL comes first: LibTorch loads that libnccl.so.2, and there
  # is one per process.
  execute_process(
    COMMAND ${TALLY_PYTHON} -c "import nvidia.nccl; print(nvidia.nccl.__path__[0])"
    OUTPUT_VARIABLE nccl_wheel_dir OUTPUT_STRIP_TRAILING_WHITESPACE
    ERROR_QUIET RESULT_VARIABLE nccl_wheel_result)
  set(nccl_include_hints)
  set(nccl_library_hints)
  if(nccl_wheel_result EQUAL 0)
    set(nccl_include_hints ${nccl_wheel_dir}/include)
    set(nccl_library_hints ${nccl_wheel_dir}/lib)
  endif()
  find_path(TALLY_NCCL_INCLUDE_DIR nccl.h HINTS ${nccl_include_hints}
    PATHS /usr/local/cuda/include /usr/include)
  # The wheel ships libnccl.so.2 without the libnccl.so link.
  find_library(TALLY_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
    HINTS ${nccl_library_hints} PATHS /usr/local/cuda/lib64 /usr/local/cuda/lib)
  if(CMAKE_CUDA_COMPILER AND TALLY_NCCL_INCLUDE_DIR)
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(CMAKE_CUDA_EXTENSIONS OFF)
    find_package(CUDAToolkit REQUIRED)
    # A CUDA LibTorch's config also runs FindCUDA, which must land on this
    # toolkit (it refuses two CUDA versions).
    get_filename_component(toolkit_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
    set(CUDA_TOOLKIT_ROOT_DIR "${toolkit_root}" CACHE PATH
      "CUDA toolkit for LibTorch's FindCUDA: nvcc's")
    set(TALLY_CUDA_ENABLED ON)
  elseif(TALLY_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "TALLY_WITH_CUDA=ON but there is no working nvcc for "
      "CMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES} (CMAKE_CUDA_COMPILER="
      "${CMAKE_CUDA_COMPILER}) or no nccl.h (TALLY_NCCL_INCLUDE_DIR="
      "${TALLY_NCCL_INCLUDE_DIR})")
  endif()
endif()
message(STATUS "tally: CUDA kernels ${TALLY_CUDA_ENABLED}")
