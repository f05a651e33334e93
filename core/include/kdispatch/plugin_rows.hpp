// Addressing the rows of a tensor laid out as an op schema's "layout": "rows"
// allows (docs/op-schema.md): its last dims form a dense block (a row of a
// norm, the heads x head_size of a token), each dim before them may have
// any stride. Header-only, nothing beyond <kdispatch/plugin_api.h>; the
// addressing compiles in CUDA and HIP device code too.
//
//   const kd_plugin::RowLayout rows = kd_plugin::row_layout(x, 1);   // host
//   ... x_data + rows.offset(r) ...                                  // host or device
//
// row_layout() merges the leading dims that a single stride addresses, so a
// contiguous tensor and a slice of the columns of a matrix both become one
// dim, and offset() is one multiply; views with more dims pay a division per
// extra dim.
#ifndef KDISPATCH_PLUGIN_ROWS_HPP_
#define KDISPATCH_PLUGIN_ROWS_HPP_

#include <kdispatch/plugin_api.h>

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KD_PLUGIN_HOST_DEVICE __host__ __device__
#else
#define KD_PLUGIN_HOST_DEVICE
#endif

namespace kd_plugin {

struct RowLayout {
  static constexpr int kMaxDims = 8;
  int64_t count = 1;  // rows: the product of the leading dims
  int32_t ndim = 0;   // leading dims left after merging (0: one row)
  int64_t size[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};  // in elements

  // Element offset of the first element of row `row` (0 <= row < count).
  KD_PLUGIN_HOST_DEVICE int64_t offset(int64_t row) const {
    if (ndim == 1) return row * stride[0];
    int64_t off = 0;
    for (int d = ndim - 1; d > 0; --d) {
      off += (row % size[d]) * stride[d];
      row /= size[d];
    }
    return ndim == 0 ? 0 : off + row * stride[0];
  }
  // True when the rows are one stride apart (at most one leading dim left
  // after merging: a contiguous tensor, a column slice of a matrix), so
  // that a LinearRows addresses them.
  KD_PLUGIN_HOST_DEVICE bool linear() const { return ndim <= 1; }
  // True when row r starts at r * row_elems: the rows lie back to back.
  KD_PLUGIN_HOST_DEVICE bool dense(int64_t row_elems) const {
    return ndim == 0 || (ndim == 1 && stride[0] == row_elems);
  }
};

// The rows of a linear() RowLayout: one stride. It takes 8 bytes of a
// kernel's arguments where a RowLayout takes 144, and a graph's launch of a
// kernel copies its arguments every time: kernels that run for a couple of
// microseconds take these.
struct LinearRows {
  int64_t stride = 0;  // in elements
  KD_PLUGIN_HOST_DEVICE int64_t offset(int64_t row) const { return row * stride; }
};

// `rows` as LinearRows; rows.linear() must hold.
inline LinearRows linear_rows(const RowLayout& rows) { return LinearRows{rows.ndim == 0 ? 0 : rows.stride[0]}; }

// Element strides of `t`, computed for a tensor without strides.
inline int64_t element_stride(const DLTensor& t, int dim) {
  if (t.strides != nullptr) return t.strides[dim];
  int64_t s = 1;
  for (int d = t.ndim - 1; d > dim; --d) s *= t.shape[d];
  return s;
}

// The rows of `t` over its dims before the last `inner` ones. Dims of size 1
// are dropped and a dim whose stride equals the next one's extent is merged
// into it. The host's check refuses a "rows" tensor with more than kMaxDims
// leading dims (docs/op-schema.md), so nothing is lost here.
inline RowLayout row_layout(const DLTensor& t, int inner) {
  RowLayout rows;
  const int lead = t.ndim > inner ? t.ndim - inner : 0;
  // From the innermost leading dim outwards, into a reversed list.
  int64_t rsize[RowLayout::kMaxDims];
  int64_t rstride[RowLayout::kMaxDims];
  int n = 0;
  for (int d = lead - 1; d >= 0; --d) {
    const int64_t size = t.shape[d];
    rows.count *= size;
    if (size == 1) continue;
    const int64_t stride = element_stride(t, d);
    if (n > 0 && stride == rstride[n - 1] * rsize[n - 1]) {
      rsize[n - 1] *= size;
      continue;
    }
    if (n == RowLayout::kMaxDims) break;
    rsize[n] = size;
    rstride[n] = stride;
    ++n;
  }
  rows.ndim = n;
  for (int i = 0; i < n; ++i) {
    rows.size[i] = rsize[n - 1 - i];
    rows.stride[i] = rstride[n - 1 - i];
  }
  return rows;
}

}  // namespace kd_plugin

#endif  // KDISPATCH_PLUGIN_ROWS_HPP_
