# The installed package: what `cmake --install --prefix P` lays out beside
# the library, the headers, the tool and the plugins (each installed by its
# own directory):
#   lib/cmake/kdispatch/   kdispatchConfig.cmake, kdispatchConfigVersion.cmake,
#                          the exported targets (the tool among them:
#                          kdispatch::kdispatch), kdispatch_add_plugin()
#                          and the scripts it runs
#   lib/pkgconfig/         kdispatch.pc
#   share/kdispatch/       op schemas (ops/), JSON Schemas (schema/) and the
#                          examples (examples/: the scaled_add plugin, the
#                          consumer program)
#   share/doc/kdispatch/   README.md, docs/*.md
include(CMakePackageConfigHelpers)

set(KDISPATCH_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/kdispatch")

install(TARGETS kdispatch_plugin_api EXPORT kdispatchTargets)
install(EXPORT kdispatchTargets NAMESPACE kdispatch:: DESTINATION "${KDISPATCH_CMAKE_DIR}")

configure_package_config_file(cmake/kdispatchConfig.cmake.in
  "${PROJECT_BINARY_DIR}/cmake/kdispatchConfig.cmake"
  INSTALL_DESTINATION "${KDISPATCH_CMAKE_DIR}"
  PATH_VARS CMAKE_INSTALL_INCLUDEDIR CMAKE_INSTALL_LIBDIR CMAKE_INSTALL_DATADIR)
# SameMajorVersion: the SONAME carries the major, and a program built
# against one major runs with any later release of it.
write_basic_package_version_file("${PROJECT_BINARY_DIR}/cmake/kdispatchConfigVersion.cmake"
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES
  "${PROJECT_BINARY_DIR}/cmake/kdispatchConfig.cmake"
  "${PROJECT_BINARY_DIR}/cmake/kdispatchConfigVersion.cmake"
  cmake/KdispatchPlugin.cmake
  cmake/KdispatchPluginKernels.cmake
  cmake/KdispatchPluginCheck.cmake
  cmake/plugin.map
  DESTINATION "${KDISPATCH_CMAKE_DIR}")

# pkg-config: the same include directories and library. The C++ API needs
# C++20 (`-std=c++20`), which a .pc file cannot require; docs/building.md says so.
set(KDISPATCH_PC_DLPACK_CFLAGS "")
if(KDISPATCH_DLPACK_INSTALL_INCLUDE)
  set(KDISPATCH_PC_DLPACK_CFLAGS " -I${KDISPATCH_DLPACK_INSTALL_INCLUDE}")
endif()
# The prefix relative to the .pc file, so that an install to any --prefix works.
file(RELATIVE_PATH KDISPATCH_PC_TO_PREFIX "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
configure_file(cmake/kdispatch.pc.in "${PROJECT_BINARY_DIR}/kdispatch.pc" @ONLY)
install(FILES "${PROJECT_BINARY_DIR}/kdispatch.pc" DESTINATION "${CMAKE_INSTALL_LIBDIR}/pkgconfig")

install(DIRECTORY manifests/ops/ DESTINATION "${CMAKE_INSTALL_DATADIR}/kdispatch/ops")
# The examples the documentation points to: an out-of-tree plugin and a
# program built against the package.
install(DIRECTORY plugins/examples/ DESTINATION "${CMAKE_INSTALL_DATADIR}/kdispatch/examples")
install(DIRECTORY tests/consumer/ DESTINATION "${CMAKE_INSTALL_DATADIR}/kdispatch/examples/consumer")
install(DIRECTORY manifests/schema/ DESTINATION "${CMAKE_INSTALL_DATADIR}/kdispatch/schema")
install(FILES README.md DESTINATION "${CMAKE_INSTALL_DOCDIR}")
install(DIRECTORY docs/ DESTINATION "${CMAKE_INSTALL_DOCDIR}/docs" FILES_MATCHING PATTERN "*.md")
