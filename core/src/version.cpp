#include "kdispatch/version.h"

namespace kdispatch {

const char* version() noexcept { return KDISPATCH_VERSION_STRING; }

}  // namespace kdispatch
