# Google Highway (portable SIMD with run-time dispatch), the one third-party library moegrad's
# kernels need. Either an installed CMake package "hwy" (1.0 or newer), or, with
# -DMOEGRAD_FETCH_DEPS=ON, pinned sources downloaded and built by FetchContent.
# docs/decisions.md L63.

# Highway 1.2.0, pinned by commit (the tag's target), so a fetched build is reproducible.
set(MOEGRAD_HWY_VERSION 1.2.0)
set(MOEGRAD_HWY_COMMIT 457c891775a7397bdb0376bb1031e6e027af1c48)
set(MOEGRAD_HWY_REPOSITORY https://github.com/google/highway.git)

find_package(hwy 1.0 CONFIG QUIET)

if(NOT hwy_FOUND AND MOEGRAD_FETCH_DEPS)
  message(STATUS "moegrad: no installed Highway found; fetching Highway ${MOEGRAD_HWY_VERSION} "
                 "(commit ${MOEGRAD_HWY_COMMIT}) from ${MOEGRAD_HWY_REPOSITORY}")
  include(FetchContent)
  # Only the core library, static and position-independent (it ends up inside libmoegrad and
  # the Python module); no tests, examples, contrib or install rules of its own.
  set(HWY_ENABLE_TESTS OFF CACHE BOOL "" FORCE)
  set(HWY_ENABLE_EXAMPLES OFF CACHE BOOL "" FORCE)
  set(HWY_ENABLE_CONTRIB OFF CACHE BOOL "" FORCE)
  set(HWY_ENABLE_INSTALL OFF CACHE BOOL "" FORCE)
  set(HWY_FORCE_STATIC_LIBS ON CACHE BOOL "" FORCE)
  set(HWY_WARNINGS_ARE_ERRORS OFF CACHE BOOL "" FORCE)
  FetchContent_Declare(hwy
    GIT_REPOSITORY ${MOEGRAD_HWY_REPOSITORY}
    GIT_TAG ${MOEGRAD_HWY_COMMIT})
  FetchContent_MakeAvailable(hwy)
  set_target_properties(hwy PROPERTIES POSITION_INDEPENDENT_CODE ON)
  if(NOT TARGET hwy::hwy)
    add_library(hwy::hwy ALIAS hwy)
  endif()
  set(hwy_FOUND TRUE)
endif()

if(NOT hwy_FOUND)
  message(FATAL_ERROR
    "moegrad needs Google Highway (the SIMD library; CMake package \"hwy\", version 1.0 or "
    "newer), and none was found. Install it with your package manager:\n"
    "  Debian / Ubuntu:  sudo apt-get install libhwy-dev\n"
    "  Fedora:           sudo dnf install highway-devel\n"
    "  conda:            conda install -c conda-forge libhwy\n"
    "  Homebrew:         brew install highway\n"
    "  vcpkg:            vcpkg install highway   (and configure with "
    "-DCMAKE_TOOLCHAIN_FILE=<vcpkg root>/scripts/buildsystems/vcpkg.cmake)\n"
    "If it is installed under a prefix CMake does not search, add "
    "-DCMAKE_PREFIX_PATH=<prefix> (pip: pip install . -C cmake.define.CMAKE_PREFIX_PATH=<prefix>).\n"
    "Or let the build download and compile pinned Highway ${MOEGRAD_HWY_VERSION} sources "
    "(needs internet access to github.com):\n"
    "  cmake:  -DMOEGRAD_FETCH_DEPS=ON\n"
    "  pip:    pip install . -C cmake.define.MOEGRAD_FETCH_DEPS=ON")
endif()
