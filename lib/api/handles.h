// The structs behind the public opaque handles.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "graph/ir.h"

struct ctr_mesh {
  int rank = 0;
  int world = 1;
  std::vector<std::pair<std::string, int>> axes;  // in mesh order, product == world
  std::string device = "cpu";
};

struct ctr_graph {
  ctr::Graph graph;  // verified, nodes in topological order
  std::vector<int> inputs;
  std::vector<int> params;
};

namespace ctr {
class Step;
}

struct ctr_step {
  std::unique_ptr<ctr::Step> impl;
};
