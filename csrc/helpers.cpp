// Index builders for GPT datasets: the sample index and the blending indices.
//
// Same algorithms and outputs as Megatron's megatron/core/datasets/helpers.cpp
// (shared/reference/megatron-and-launchers.md 2.3 and 2.5). The Python facade
// megatron_hpc/data/helpers.py checks dtypes and value ranges before calling in,
// and holds the NumPy fallback these functions are tested against.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using Int32Array = py::array_t<int32_t, py::array::c_style>;
using Int64Array = py::array_t<int64_t, py::array::c_style>;
using DoubleArray = py::array_t<double, py::array::c_style>;

constexpr int64_t kMaxDatasets = 32767;  // dataset ids are stored as int16

int64_t count_samples(int32_t seq_length, int32_t num_epochs, int64_t tokens_per_epoch,
                      bool drop_last_partial_sequence, int32_t add_extra_token) {
  const int64_t total = static_cast<int64_t>(num_epochs) * tokens_per_epoch - add_extra_token;
  if (drop_last_partial_sequence) {
    return total / seq_length;
  }
  // Megatron divides in float (32-bit) here; keep it so the sample count matches.
  return static_cast<int64_t>(std::ceil(static_cast<float>(total) / static_cast<float>(seq_length)));
}

// Row k of the (num_samples + 1, 2) result is (position in document_idx, token offset in that
// document) where sample k starts. Consecutive samples share one token when add_extra_token is 1.
template <typename T>
py::array_t<T> build_sample_idx(const Int32Array &sizes_, const Int32Array &document_idx_, int32_t seq_length,
                                int32_t num_epochs, int64_t tokens_per_epoch, bool drop_last_partial_sequence,
                                int32_t add_extra_token) {
  if (seq_length <= 1 || num_epochs <= 0 || tokens_per_epoch <= 1 || add_extra_token < 0 || add_extra_token > 1) {
    throw std::invalid_argument("build_sample_idx: need seq_length > 1, num_epochs > 0, tokens_per_epoch > 1, "
                                "add_extra_token in {0, 1}");
  }
  if (sizes_.ndim() != 1 || document_idx_.ndim() != 1 || document_idx_.shape(0) == 0) {
    throw std::invalid_argument("build_sample_idx: sizes and document_idx must be 1-D, document_idx non-empty");
  }
  const int64_t num_samples =
      count_samples(seq_length, num_epochs, tokens_per_epoch, drop_last_partial_sequence, add_extra_token);
  if (num_samples < 0) {
    throw std::invalid_argument("build_sample_idx: negative sample count");
  }
  const int32_t *sizes = sizes_.data();
  const int32_t *document_idx = document_idx_.data();
  const int64_t num_sizes = sizes_.shape(0);
  const int64_t num_docs = document_idx_.shape(0);

  py::array_t<T> result({num_samples + 1, static_cast<int64_t>(2)});
  T *out = result.mutable_data();
  bool ran_out = false;
  bool bad_doc = false;
  {
    py::gil_scoped_release release;
    int64_t position = 0;
    T offset = 0;
    out[0] = 0;
    out[1] = 0;
    for (int64_t sample = 1; sample <= num_samples && !ran_out && !bad_doc; ++sample) {
      int32_t remaining = seq_length + add_extra_token;
      while (remaining != 0) {
        const int32_t doc = document_idx[position];
        if (doc < 0 || doc >= num_sizes) {
          bad_doc = true;
          break;
        }
        const T length = static_cast<T>(sizes[doc]) - offset;
        remaining -= static_cast<int32_t>(length);
        if (remaining <= 0) {
          offset += static_cast<T>(remaining) + length - static_cast<T>(add_extra_token);
          remaining = 0;
        } else if (position == num_docs - 1) {
          // End of the document list: only the last (partial) sample may get here.
          ran_out = sample != num_samples;
          offset = static_cast<T>(sizes[doc]) - static_cast<T>(add_extra_token);
          break;
        } else {
          ++position;
          offset = 0;
        }
      }
      out[2 * sample] = static_cast<T>(position);
      out[2 * sample + 1] = offset;
    }
  }
  if (bad_doc) {
    throw std::invalid_argument("build_sample_idx: document_idx holds an id outside sizes");
  }
  if (ran_out) {
    throw std::invalid_argument("build_sample_idx: the document index holds fewer tokens than tokens_per_epoch");
  }
  return result;
}

void check_weights(const double *weights, int64_t n) {
  if (n <= 0 || n > kMaxDatasets) {
    throw std::invalid_argument("blending: need 1 to 32767 datasets, got " + std::to_string(n));
  }
  for (int64_t d = 0; d < n; ++d) {
    if (!(weights[d] > 0.0) || !std::isfinite(weights[d])) {
      throw std::invalid_argument("blending: weights must be finite and positive");
    }
  }
}

// For each sample i pick the dataset d maximising weights[d] * max(i, 1) - taken[d] (ties: lowest d).
py::tuple build_blending_indices(const DoubleArray &weights_, int64_t size) {
  if (weights_.ndim() != 1 || size < 0) {
    throw std::invalid_argument("build_blending_indices: weights must be 1-D and size >= 0");
  }
  const int64_t n = weights_.shape(0);
  const double *weights = weights_.data();
  check_weights(weights, n);
  py::array_t<int16_t> dataset_index(size);
  py::array_t<int64_t> dataset_sample_index(size);
  int16_t *index_out = dataset_index.mutable_data();
  int64_t *sample_out = dataset_sample_index.mutable_data();
  std::vector<int64_t> taken(static_cast<size_t>(n), 0);
  {
    py::gil_scoped_release release;
    for (int64_t i = 0; i < size; ++i) {
      const double scale = std::max(static_cast<double>(i), 1.0);
      int64_t best = 0;
      double best_error = weights[0] * scale - static_cast<double>(taken[0]);
      for (int64_t d = 1; d < n; ++d) {
        const double error = weights[d] * scale - static_cast<double>(taken[d]);
        if (error > best_error) {
          best_error = error;
          best = d;
        }
      }
      index_out[i] = static_cast<int16_t>(best);
      sample_out[i] = taken[best];
      ++taken[best];
    }
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

// Draw exactly sizes[d] samples from each dataset d, in proportion to the sizes.
py::tuple build_exhaustive_blending_indices(const Int64Array &sizes_) {
  if (sizes_.ndim() != 1) {
    throw std::invalid_argument("build_exhaustive_blending_indices: sizes must be 1-D");
  }
  const int64_t n = sizes_.shape(0);
  const int64_t *sizes = sizes_.data();
  if (n <= 0 || n > kMaxDatasets) {
    throw std::invalid_argument("build_exhaustive_blending_indices: need 1 to 32767 datasets");
  }
  int64_t total = 0;
  for (int64_t d = 0; d < n; ++d) {
    if (sizes[d] <= 0) {
      throw std::invalid_argument("build_exhaustive_blending_indices: sizes must be positive");
    }
    total += sizes[d];
  }
  std::vector<double> weights(static_cast<size_t>(n));
  for (int64_t d = 0; d < n; ++d) {
    weights[d] = static_cast<double>(sizes[d]) / static_cast<double>(total);
  }
  py::array_t<int16_t> dataset_index(total);
  py::array_t<int64_t> dataset_sample_index(total);
  int16_t *index_out = dataset_index.mutable_data();
  int64_t *sample_out = dataset_sample_index.mutable_data();
  std::vector<int64_t> taken(static_cast<size_t>(n), 0);
  {
    py::gil_scoped_release release;
    std::set<int64_t> unspent;
    for (int64_t d = 0; d < n; ++d) {
      unspent.insert(d);
    }
    for (int64_t i = 0; i < total; ++i) {
      const double scale = std::max(static_cast<double>(i), 1.0);
      int64_t best = -1;
      double best_error = std::numeric_limits<double>::lowest();
      for (const int64_t d : unspent) {
        const double error = weights[d] * scale - static_cast<double>(taken[d]);
        if (error > best_error) {
          best_error = error;
          best = d;
        }
      }
      index_out[i] = static_cast<int16_t>(best);
      sample_out[i] = taken[best];
      ++taken[best];
      if (taken[best] == sizes[best]) {
        unspent.erase(best);
      }
    }
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

}  // namespace

PYBIND11_MODULE(_helpers, m) {
  m.doc() = "GPT dataset index builders (Megatron helpers.cpp algorithms); use megatron_hpc.data.helpers";
  m.def("build_sample_idx_int32", &build_sample_idx<int32_t>, py::arg("sizes"), py::arg("document_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        py::arg("drop_last_partial_sequence") = true, py::arg("add_extra_token") = 1);
  m.def("build_sample_idx_int64", &build_sample_idx<int64_t>, py::arg("sizes"), py::arg("document_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        py::arg("drop_last_partial_sequence") = true, py::arg("add_extra_token") = 1);
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"));
  m.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices, py::arg("sizes"));
}
