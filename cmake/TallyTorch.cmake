# Finds LibTorch (Debian's 1.13 CPU build or a PyTorch wheel's, with CUDA),
# refuses one whose C++ ABI the rest of the stack cannot link with, and sets
# the C++ standard its headers need. Include after TALLY_PYTHON is chosen.
# Sets TALLY_TORCH_HAS_CUDA and defines TALLY_TORCH_CUDA (0 or 1) for every
# target.
#
# LibTorch comes from, in order: Torch_DIR; the CMake prefix of TALLY_PYTHON's
# torch (torch.utils.cmake_prefix_path), when it holds a TorchConfig.cmake;
# the default search path (Debian's libtorch-dev).
#
#   cmake -S . -B build -DTALLY_PYTHON=/opt/torch/.venv/bin/python3
#   cmake -S . -B build -DTorch_DIR=/opt/libtorch/share/cmake/Torch
#   cmake -S . -B build -DTALLY_CXX_STANDARD=20

set(TALLY_CXX_STANDARD "" CACHE STRING
  "C++ standard (17, 20, ...); empty: the smallest the LibTorch headers accept")

# Sets ${out} to the directory holding TorchConfig.cmake under the CMake
# prefix of ${python}'s torch, or to "" when it has none (Debian's
# python3-torch names a prefix that does not exist).
function(tally_python_torch_dir python out)
  set(${out} "" PARENT_SCOPE)
  execute_process(
    COMMAND ${python} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE prefix OUTPUT_STRIP_TRAILING_WHITESPACE
    ERROR_QUIET RESULT_VARIABLE result)
  if(result EQUAL 0 AND EXISTS "${prefix}/Torch/TorchConfig.cmake")
    set(${out} "${prefix}/Torch" PARENT_SCOPE)
  endif()
endfunction()

# Sets ${out} to the C++ standard ATen/ATen.h demands through its
# `__cplusplus < NNNNNNL` guard, at least 17.
function(tally_torch_cxx_standard out)
  set(standard 17)
  find_file(TALLY_ATEN_HEADER ATen/ATen.h PATHS ${TORCH_INCLUDE_DIRS}
    NO_DEFAULT_PATH)
  if(TALLY_ATEN_HEADER)
    file(STRINGS "${TALLY_ATEN_HEADER}" guard REGEX "__cplusplus < [0-9]+L")
    if(guard MATCHES "__cplusplus < (20[0-9][0-9])[0-9][0-9]L")
      # 201703 -> 17, 202002 -> 20, 202302 -> 23.
      math(EXPR required "${CMAKE_MATCH_1} - 2000")
      if(required GREATER standard)
        set(standard ${required})
      endif()
    endif()
  endif()
  set(${out} ${standard} PARENT_SCOPE)
endfunction()

if(NOT DEFINED Torch_DIR OR NOT Torch_DIR)
  tally_python_torch_dir(${TALLY_PYTHON} tally_python_torch_dir)
endif()
# HINTS come before the system prefixes, so a wheel's LibTorch wins over
# Debian's when TALLY_PYTHON names the wheel's interpreter.
find_package(Torch REQUIRED HINTS ${tally_python_torch_dir})
message(STATUS "tally: LibTorch ${Torch_VERSION} from ${Torch_DIR}")

# Debian's gRPC, Protobuf and Abseil are built with the C++11 ABI of
# libstdc++; a LibTorch built with the old one cannot link against them.
if(TORCH_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=0")
  message(FATAL_ERROR "tally: the LibTorch in ${Torch_DIR} is built with "
    "_GLIBCXX_USE_CXX11_ABI=0 (TORCH_CXX_FLAGS=${TORCH_CXX_FLAGS}), but "
    "gRPC, Protobuf and Abseil use the C++11 ABI (1): use a LibTorch or "
    "PyTorch wheel built with the C++11 ABI (torch._C._GLIBCXX_USE_CXX11_ABI "
    "is True)")
endif()

if(TALLY_CXX_STANDARD)
  set(CMAKE_CXX_STANDARD ${TALLY_CXX_STANDARD})
else()
  tally_torch_cxx_standard(CMAKE_CXX_STANDARD)
endif()
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_CXX_EXTENSIONS OFF)
message(STATUS "tally: C++${CMAKE_CXX_STANDARD}")

if(TORCH_CUDA_LIBRARIES OR TARGET torch_cuda)
  set(TALLY_TORCH_HAS_CUDA ON)
  add_compile_definitions(TALLY_TORCH_CUDA=1)
else()
  set(TALLY_TORCH_HAS_CUDA OFF)
  add_compile_definitions(TALLY_TORCH_CUDA=0)
endif()
message(STATUS "tally: LibTorch with CUDA ${TALLY_TORCH_HAS_CUDA}")
