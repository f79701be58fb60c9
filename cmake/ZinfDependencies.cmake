# Every third-party dependency of zinf, found once here (Debian 12 packages; see scripts/deps.sh).
find_package(Threads REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(URING REQUIRED IMPORTED_TARGET liburing>=2.1)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)
find_package(LibAIO REQUIRED)
find_package(TBB REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
# gloo (libgloo-dev): the collectives of ranks that are processes on host devices (GlooComm).
find_package(Gloo CONFIG REQUIRED)
