// C++ helpers that megatron-core does not ship (it ships helpers_cpp for sample and blending
// indices): packing variable-length documents into fixed token budgets, and length-bucketed
// batching for the dynamic-shape iterator. megatron_patch/data/packing.py holds the plain-Python
// reference implementations that the tests compare these against, element for element.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;
using i64 = int64_t;
using Lengths = py::array_t<i64, py::array::c_style | py::array::forcecast>;

// Best-fit decreasing: documents in decreasing length (ties: lower index first); each goes to the
// open bin with the least room that still fits it (ties: the bin opened first), else a new bin.
// Returns the bin id of every document, bins numbered in the order they were opened.
py::array_t<i64> pack_best_fit_decreasing(Lengths lengths, i64 capacity) {
  if (capacity <= 0) throw std::invalid_argument("capacity must be positive");
  auto len = lengths.unchecked<1>();
  const i64 n = len.shape(0);
  for (i64 i = 0; i < n; ++i) {
    if (len(i) < 0 || len(i) > capacity)
      throw std::invalid_argument("document " + std::to_string(i) + " has length " + std::to_string(len(i)) +
                                  ", outside [0, capacity=" + std::to_string(capacity) + "]");
  }
  std::vector<i64> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](i64 a, i64 b) { return len(a) > len(b); });

  py::array_t<i64> bins(n);
  auto out = bins.mutable_unchecked<1>();
  std::set<std::pair<i64, i64>> room;  // (remaining capacity, bin id)
  i64 next_bin = 0;
  {
    py::gil_scoped_release release;
    for (i64 doc : order) {
      const i64 need = len(doc);
      auto it = room.lower_bound({need, -1});
      i64 bin, left;
      if (it == room.end()) {
        bin = next_bin++;
        left = capacity - need;
      } else {
        bin = it->second;
        left = it->first - need;
        room.erase(it);
      }
      room.insert({left, bin});
      out(doc) = bin;
    }
  }
  return bins;
}

// Length-bucketed batches: samples sorted by (length, index); a batch grows while
// (size + 1) * round_up(longest, multiple) <= max_tokens and size < max_batch_size (0 = no cap).
// A sample too long for max_tokens on its own still gets a batch of one.
// Returns (order, offsets): batch b is order[offsets[b]:offsets[b+1]].
py::tuple bucket_by_length(Lengths lengths, i64 max_tokens, i64 multiple, i64 max_batch_size) {
  if (max_tokens <= 0 || multiple <= 0) throw std::invalid_argument("max_tokens and multiple must be positive");
  auto len = lengths.unchecked<1>();
  const i64 n = len.shape(0);
  py::array_t<i64> order_arr(n);
  auto order = order_arr.mutable_unchecked<1>();
  std::vector<i64> offsets{0};
  {
    py::gil_scoped_release release;
    std::vector<i64> idx(n);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](i64 a, i64 b) { return len(a) < len(b); });
    i64 size = 0;
    for (i64 k = 0; k < n; ++k) {
      const i64 padded = (len(idx[k]) + multiple - 1) / multiple * multiple;
      const bool full = size > 0 && ((size + 1) * padded > max_tokens || (max_batch_size > 0 && size >= max_batch_size));
      if (full) {
        offsets.push_back(k);
        size = 0;
      }
      order(k) = idx[k];
      ++size;
    }
    if (n > 0) offsets.push_back(n);
  }
  py::array_t<i64> offsets_arr(static_cast<py::ssize_t>(offsets.size()));
  std::copy(offsets.begin(), offsets.end(), offsets_arr.mutable_data());
  return py::make_tuple(order_arr, offsets_arr);
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "megatron_patch C++ helpers: document packing and length bucketing";
  m.def("pack_best_fit_decreasing", &pack_best_fit_decreasing, py::arg("lengths"), py::arg("capacity"),
        "Bin id of each document under best-fit-decreasing packing into bins of `capacity` tokens.");
  m.def("bucket_by_length", &bucket_by_length, py::arg("lengths"), py::arg("max_tokens"), py::arg("multiple"),
        py::arg("max_batch_size") = 0, "(order, offsets) of length-bucketed batches under a token budget.");
}
