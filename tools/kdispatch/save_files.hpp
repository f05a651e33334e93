// The files of `run --save DIR`: the directory is checked before anything
// runs, and each file is written under a temporary name in DIR and renamed
// into place once complete, so a full disk or a crash never leaves a
// truncated .npy or attrs.json under the final name.
#pragma once

#include <functional>
#include <string>

namespace kdispatch::cli {

// Creates DIR when missing and checks that a file can be created in it;
// throws UsageError naming DIR and the cause.
void check_save_dir(const std::string& dir);

// Writes `path` through `write`, which is given a temporary path in the same
// directory to fill (and throws on failure); then flushes it to disk and
// renames it to `path`. A `path` that exists and is not a regular file is
// refused. Throws Error (KD-E050) naming the file; the temporary is removed.
void write_atomically(const std::string& path, const std::function<void(const std::string&)>& write);

}  // namespace kdispatch::cli
