# tally_test(<target> LABEL <label> SOURCES <files...> [LINK <libraries...>]
#            [TORCH] [SLOW <gtest filter>] [CHECK <gtest filter>])
# One GoogleTest binary and its ctest tests (gtest_discover_tests), each test
# labelled <label>, but those SLOW matches labelled `slow` (the long ones of a
# fast binary, which `make check` leaves to `make test`) and those CHECK
# matches `<label>-check` (the few of a slow binary that `make check` runs;
# `ctest -L <label>` still selects them); the libraries' CMakeLists.txt and tests/ register their
# tests with it. Every test runs with OMP_NUM_THREADS=1 (ctest -j runs tests
# side by side on few cores: tally-server's --threads default and LibTorch
# both read it, and BLIS's spinning threads crawl on shared cores) and with
# TALLY_SOURCE_DIR (the tests that read data/ or tests/data/). TORCH: the
# binary reuses tally_test_util's precompiled <torch/torch.h>.
#
#   include(${PROJECT_SOURCE_DIR}/tests/testing/tally_test.cmake)
#   tally_test(tally_client_test LABEL unit
#     SOURCES command_line_test.cc LINK tally_client)
# DIRECTORY, not GLOBAL: the variables below must reach every directory that
# includes it (and those below), the function is global either way.
include_guard(DIRECTORY)
include(GoogleTest)

set(TALLY_TEST_ENVIRONMENT
  "TALLY_SOURCE_DIR=${PROJECT_SOURCE_DIR};OMP_NUM_THREADS=1")
# The same for gtest_discover_tests, one value per property: it flattens a
# list value, so that ENVIRONMENT "A;B" would set A only.
set(TALLY_TEST_DISCOVERY_ENVIRONMENT
  ENVIRONMENT "TALLY_SOURCE_DIR=${PROJECT_SOURCE_DIR}"
  ENVIRONMENT_MODIFICATION "OMP_NUM_THREADS=set:1")

function(tally_test name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "TORCH" "LABEL;SLOW;CHECK"
    "SOURCES;LINK")
  if(NOT arg_LABEL OR NOT arg_SOURCES)
    message(FATAL_ERROR "tally_test(${name}): LABEL and SOURCES are required")
  endif()
  add_executable(${name} ${arg_SOURCES})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PRIVATE ${arg_LINK} GTest::gtest GTest::gmock
    GTest::gtest_main)
  if(arg_TORCH)
    target_link_libraries(${name} PRIVATE tally_test_util)
    # Deferred to the end of the top-level CMakeLists.txt, as REUSE_FROM
    # wants tally_test_util defined and the libraries' directories come
    # before tests/testing (EVAL: ${name} expanded now, not then).
    cmake_language(EVAL CODE "cmake_language(DEFER DIRECTORY
      [[${PROJECT_SOURCE_DIR}]] CALL target_precompile_headers ${name}
      REUSE_FROM tally_test_util)")
  endif()
  set(label_SLOW slow)
  set(label_CHECK ${arg_LABEL}-check)
  set(others "")
  foreach(subset SLOW CHECK)
    if(arg_${subset})
      gtest_discover_tests(${name} DISCOVERY_TIMEOUT 120
        TEST_FILTER ${arg_${subset}}
        PROPERTIES LABELS ${label_${subset}}
        ${TALLY_TEST_DISCOVERY_ENVIRONMENT})
      list(APPEND others ${arg_${subset}})
    endif()
  endforeach()
  set(filter "")
  if(others)
    list(JOIN others ":" others)
    set(filter TEST_FILTER "-${others}")
  endif()
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 120 ${filter}
    PROPERTIES LABELS ${arg_LABEL} ${TALLY_TEST_DISCOVERY_ENVIRONMENT})
endfunction()
