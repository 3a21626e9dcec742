// Owning wrappers of the C ABI's option and mesh handles for the unit tests:
// created in the constructor, freed in the destructor, every setter checked.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>

#include "ctr/ctr.h"

namespace ctr_test {

struct Opts {
  ctr_options *o = nullptr;
  Opts() { EXPECT_EQ(ctr_options_create(&o), CTR_STATUS_OK); }
  ~Opts() { ctr_options_free(o); }
  Opts(const Opts &) = delete;
  Opts &operator=(const Opts &) = delete;
  Opts &i(const char *k, int64_t v) {
    EXPECT_EQ(ctr_options_set_int(o, k, v), CTR_STATUS_OK);
    return *this;
  }
  Opts &f(const char *k, double v) {
    EXPECT_EQ(ctr_options_set_float(o, k, v), CTR_STATUS_OK);
    return *this;
  }
  Opts &s(const char *k, const char *v) {
    EXPECT_EQ(ctr_options_set_string(o, k, v), CTR_STATUS_OK);
    return *this;
  }
};

// A one-rank CPU mesh with default options.
struct Mesh {
  ctr_mesh *m = nullptr;
  Mesh() { EXPECT_EQ(ctr_mesh_create(nullptr, &m), CTR_STATUS_OK); }
  ~Mesh() { ctr_mesh_free(m); }
  Mesh(const Mesh &) = delete;
  Mesh &operator=(const Mesh &) = delete;
};

}  // namespace ctr_test
