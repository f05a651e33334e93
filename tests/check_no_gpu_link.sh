#!/bin/sh
# The core and the tool must not link any GPU runtime: only plugins may.
# Usage: check_no_gpu_link.sh FILE...
status=0
for f in "$@"; do
  needed=$(readelf -d "$f" | grep NEEDED)
  echo "$f:"
  echo "$needed"
  if echo "$needed" | grep -E 'libcuda|libcudart|libnvrtc|libamdhip64|libhsa-runtime|librocm'; then
    echo "FAIL: $f links a GPU runtime"
    status=1
  fi
done
exit $status
