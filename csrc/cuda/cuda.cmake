# CUDA part of the native build, included by the top-level CMakeLists.txt.
#
# Where nvcc exists, every csrc/cuda/*.cu is compiled for sm_80 and sm_90 (override with
# -DZC_CUDA_ARCHS="80;90;100") into an object library that the default target depends on,
# so a CUDA compile error fails `cmake --build` (CI). A native test, test_cuda_host, links
# them with the CPU kernels and the static CUDA runtime: without a GPU it checks the device
# math (compiled for the host) and the launch planning against the CPU kernels and that
# every entry point fails cleanly; with a GPU it also runs the kernels against the CPU ones.
#
# Where torch is importable, csrc/bindings_cuda.cpp is compiled too (an object, not linked:
# it needs only torch's CPU headers, which every torch has), so the binding is checked in CI
# even though the extension with CUDA is only built against a CUDA torch.
# -DZC_CUDA=OFF skips all of this; without nvcc it is skipped with a message.
option(ZC_CUDA "compile the CUDA kernels when nvcc is found" ON)
option(ZC_CUDA_BINDING_CHECK "compile csrc/bindings_cuda.cpp against torch's headers" ON)
set(ZC_CUDA_ARCHS "80;90" CACHE STRING "CUDA architectures to compile for")

if(NOT ZC_CUDA)
  message(STATUS "zerocore: CUDA kernels not compiled (ZC_CUDA=OFF)")
  return()
endif()

include(CheckLanguage)
if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
  # $CUDA_HOME, then /usr/local/cuda, then PATH; check_language still tries it (a broken
  # nvcc leaves CMAKE_CUDA_COMPILER NOTFOUND and the CPU build goes on).
  find_program(ZC_NVCC nvcc HINTS ENV CUDA_HOME /usr/local/cuda PATH_SUFFIXES bin)
  if(ZC_NVCC)
    set(ENV{CUDACXX} ${ZC_NVCC})
  endif()
endif()
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  message(STATUS "zerocore: no working nvcc found; CUDA kernels not compiled")
  return()
endif()

set(CMAKE_CUDA_ARCHITECTURES ${ZC_CUDA_ARCHS})
enable_language(CUDA)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)
message(STATUS "zerocore: compiling CUDA kernels with nvcc ${CMAKE_CUDA_COMPILER_VERSION} for ${ZC_CUDA_ARCHS}")

file(GLOB ZC_CUDA_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/*.cu)
add_library(zerocore_cuda OBJECT ${ZC_CUDA_SOURCES})
target_include_directories(zerocore_cuda PUBLIC csrc)
target_compile_options(zerocore_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-O3 -Xcompiler=-Wall,-Wextra>)
set_target_properties(zerocore_cuda PROPERTIES POSITION_INDEPENDENT_CODE ON CUDA_ARCHITECTURES "${ZC_CUDA_ARCHS}")

add_executable(test_cuda_host csrc/cuda/test_cuda_host.cpp csrc/cuda/test_adam_plan_host.cpp
               $<TARGET_OBJECTS:zerocore_cuda>)
target_include_directories(test_cuda_host PRIVATE csrc)
target_compile_options(test_cuda_host PRIVATE -O2 -Wall -Wextra -Wno-psabi)
target_link_libraries(test_cuda_host PRIVATE zerocore_kernels CUDA::cudart_static)
set_target_properties(test_cuda_host PROPERTIES LINKER_LANGUAGE CXX)
add_test(NAME cuda_host COMMAND test_cuda_host)

if(ZC_CUDA_BINDING_CHECK)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c
      "import sysconfig, torch; from torch.utils import cpp_extension as c; print(';'.join(c.include_paths() + [sysconfig.get_paths()['include']])); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
    OUTPUT_VARIABLE ZC_TORCH_INFO OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
    RESULT_VARIABLE ZC_TORCH_RC)
  if(ZC_TORCH_RC EQUAL 0)
    string(REPLACE "\n" "|" ZC_TORCH_INFO "${ZC_TORCH_INFO}")
    string(REPLACE "|" ";" ZC_TORCH_LINES "${ZC_TORCH_INFO}")
    list(POP_BACK ZC_TORCH_LINES ZC_TORCH_ABI)
    # A shared library of the binding plus the kernels, linked like the extension but
    # without bindings.cpp and torch's libraries: the test below fails if the binding calls
    # a zc:: function that no .cu defines (a shared library may leave symbols undefined, so
    # only an explicit check catches it before the import on a GPU machine would).
    add_library(zerocore_cuda_binding_check SHARED csrc/bindings_cuda.cpp $<TARGET_OBJECTS:zerocore_cuda>)
    target_include_directories(zerocore_cuda_binding_check PRIVATE csrc)
    target_include_directories(zerocore_cuda_binding_check SYSTEM PRIVATE ${ZC_TORCH_LINES})
    target_compile_definitions(zerocore_cuda_binding_check PRIVATE ZEROCORE_WITH_CUDA TORCH_EXTENSION_NAME=_C
                               TORCH_API_INCLUDE_EXTENSION_H _GLIBCXX_USE_CXX11_ABI=${ZC_TORCH_ABI})
    target_compile_options(zerocore_cuda_binding_check PRIVATE -O0 -Wall -Wextra -Wno-unused-parameter)
    target_link_libraries(zerocore_cuda_binding_check PRIVATE zerocore_kernels CUDA::cudart_static)
    set_target_properties(zerocore_cuda_binding_check PROPERTIES LINKER_LANGUAGE CXX)
    add_test(NAME cuda_binding_links
             COMMAND ${CMAKE_COMMAND} -DLIB=$<TARGET_FILE:zerocore_cuda_binding_check>
                     -P ${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/check_undefined.cmake)
    message(STATUS "zerocore: checking csrc/bindings_cuda.cpp against torch's headers")
  else()
    message(STATUS "zerocore: torch not importable; csrc/bindings_cuda.cpp not compile-checked")
  endif()
endif()
