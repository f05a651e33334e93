// KD_CPU_MULTIVERSION: compile a row kernel twice, for baseline x86-64 and for
// x86-64-v3 (AVX2, FMA, F16C), and pick one at load time (an ifunc).
//
// The plugin must run on any x86-64, so it cannot be built with -march flags,
// yet the element-wise kernels are only as fast as memory with 256-bit
// vectors. `flatten` inlines the whole row loop, conversions and math
// included, into each clone so all of it gets the wider instructions.
//
// The plugin is built with -ffp-contract=off, so the v3 clone does not fuse
// multiply-adds and both clones round identically: a result does not depend on
// the host CPU. (Reductions use a fixed number of partial sums for the same
// reason.)
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KD_CPU_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default"), flatten))
#else
#define KD_CPU_MULTIVERSION __attribute__((flatten))
#endif

namespace kdispatch::cpu {

// Partial sums kept by the row reductions: enough independent accumulators to
// fill two 256-bit registers, fixed so that the summation order (and thus
// the result) is the same for every clone.
inline constexpr int kReductionLanes = 16;

}  // namespace kdispatch::cpu
