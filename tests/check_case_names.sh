#!/bin/sh
# ctest splits a discovered doctest case's name at ';' (a CMake list
# separator), so a case whose name holds one is registered under part of
# its name and runs nothing. Fails, naming them, if any TEST_CASE under
# folder $1 has one.
found=$(grep -rnE 'TEST_CASE\("[^"]*;' --include='*.cpp' "$1")
[ -z "$found" ] && exit 0
echo "TEST_CASE names with ';', which ctest cannot pass back to doctest:" >&2
echo "$found" >&2
exit 1
