// Pass lower: the sharded graph becomes instruction lists, one per phase
// (forward, backward), each instruction on a stream, ordered across streams by
// events.
//
// Kernels run on stream 0 and collectives on stream 1. Before a collective is
// issued, stream 0 records an event that stream 1 waits for (unless nothing ran
// on stream 0 since the last one), so the collective sees everything computed
// before it. Stream 0 waits for a collective's event
// at the first node that reads one of its outputs — never at the issue — so the
// compute in between overlaps the communication. A collective that no node on
// stream 0 reads (a gradient reduce-scatter whose result only the optimizer
// reads) is waited for at the start of the second segment (run of nodes of one
// block) after the one it was issued in, unless a later collective reads its
// output (then that one's completion implies it): it has a segment of compute
// to hide under, and its buffers do not stay busy to the end of the phase. At the end of a phase stream 0 waits for
// whatever is still in flight. complete_at records, per collective, the node
// position of that wait: plan_memory keeps the buffers alive until then.

#include <algorithm>
#include <set>
#include <sstream>

#include "backend/plugin.h"
#include "core/status.h"
#include "passes/passes.h"

namespace ctr {
namespace {

struct InFlight {
  int event;
  std::vector<int> nodes;  // collectives whose completion this event implies
  std::set<int> outputs;
  bool orphan = false;     // no compute node of the phase reads its outputs
  int segment = 0;         // compute segment (run of one block) it was issued in
};

void lower_phase(const Graph &g, int begin, int end, std::vector<Instr> &out, Program &p,
                 const std::function<bool(OpId)> &has_kernel, bool overlap) {
  // Tensors some compute node of this phase reads: a collective writing none of
  // them is an orphan, waited for when the next collective is issued.
  std::set<int> read_by_compute;
  for (int ni = begin; ni < end; ++ni)
    if (!is_collective(g.nodes[static_cast<size_t>(ni)]))
      read_by_compute.insert(g.nodes[static_cast<size_t>(ni)].inputs.begin(),
                             g.nodes[static_cast<size_t>(ni)].inputs.end());
  std::vector<InFlight> pending;
  int seg = 0, block = g.nodes.empty() ? -1 : g.nodes[static_cast<size_t>(begin < end ? begin : 0)].block;
  bool dirty = true;  // stream 0 has work the comm stream has not been ordered after
  auto new_event = [&] { return p.num_events++; };
  auto await = [&](size_t k, int pos) {
    Instr w;
    w.kind = Instr::Wait;
    w.stream = 0;
    w.event = pending[k].event;
    out.push_back(w);
    for (int n : pending[k].nodes) p.complete_at[static_cast<size_t>(n)] = pos;
    pending.erase(pending.begin() + static_cast<long>(k));
  };
  auto reads = [&](const Node &n, size_t k) {
    for (int in : n.inputs)
      if (pending[k].outputs.count(in)) return true;
    return false;
  };
  for (int ni = begin; ni < end; ++ni) {
    const Node &n = g.nodes[static_cast<size_t>(ni)];
    if (is_collective(n)) {
      p.num_streams = 2;
      // A collective this one reads that no compute reads (a reduction chain) is
      // implied by this one's completion (same stream). One that compute reads
      // too (a ring's shifts, each block attending to what one brought) keeps
      // its own event, so that compute waits for it alone.
      std::vector<int> chained;
      for (size_t k = 0; k < pending.size();) {
        if (reads(n, k) && pending[k].orphan) {
          chained.insert(chained.end(), pending[k].nodes.begin(), pending[k].nodes.end());
          pending.erase(pending.begin() + static_cast<long>(k));
        } else {
          ++k;
        }
      }
      if (collective_kind(n) == CollKind::ReduceScatter) {
        // The padded rows of each full gradient reduce to zero.
        for (int in : n.inputs) {
          const Tensor &t = g.tensors[static_cast<size_t>(in)];
          if (t.alloc_size() <= t.bytes()) continue;
          Instr f;
          f.kind = Instr::Fill;
          f.tensor = in;
          f.offset = t.bytes();
          f.bytes = t.alloc_size() - t.bytes();
          out.push_back(f);
          dirty = true;
        }
      }
      if (dirty) {
        Instr rec;
        rec.kind = Instr::Record;
        rec.stream = 0;
        rec.event = new_event();
        out.push_back(rec);
        Instr wait = rec;
        wait.kind = Instr::Wait;
        wait.stream = 1;
        out.push_back(wait);
        dirty = false;
      }
      Instr c;
      c.kind = Instr::Collective;
      c.stream = 1;
      c.node = ni;
      out.push_back(c);
      Instr done;
      done.kind = Instr::Record;
      done.stream = 1;
      done.event = new_event();
      out.push_back(done);
      InFlight f;
      f.event = done.event;
      f.nodes = chained;
      f.nodes.push_back(ni);
      f.outputs.insert(n.outputs.begin(), n.outputs.end());
      f.orphan = true;
      for (int o : n.outputs) f.orphan &= read_by_compute.count(o) == 0;
      f.segment = seg;
      pending.push_back(std::move(f));
      if (!overlap) await(pending.size() - 1, ni);
      continue;
    }
    const OpDef *def = find_op(n.op);
    CTR_CHECK(def != nullptr);
    if (!has_kernel(def->id))
      fail(CTR_STATUS_UNSUPPORTED,
           strformat("node '%s': the backend has no kernel for op '%s'", n.name.c_str(), n.op.c_str()));
    if (n.block != block) {
      block = n.block;
      ++seg;
    }
    // Waited for here: what this node reads, and orphans issued two segments
    // ago (a segment of compute to hide them, then their buffers are freed).
    for (size_t k = 0; k < pending.size();) {
      if (reads(n, k) || (pending[k].orphan && seg >= pending[k].segment + 2))
        await(k, ni);
      else
        ++k;
    }
    Instr in;
    in.kind = Instr::Kernel;
    in.node = ni;
    out.push_back(in);
    dirty = true;
  }
  while (!pending.empty()) await(0, end - 1);
}

const char *kind_name(Instr::Kind k) {
  switch (k) {
    case Instr::Kernel: return "kernel";
    case Instr::Collective: return "collective";
    case Instr::Fill: return "fill";
    case Instr::Record: return "record";
    case Instr::Wait: return "wait";
  }
  return "?";
}

}  // namespace

void apply_backend_layouts(Graph &g, uint32_t backend_flags) {
  if (!(backend_flags & CTR_BACKEND_ATTENTION_LSE)) return;
  for (const Node &n : g.nodes) {
    if (n.op != "attention" || n.outputs.size() < 2) continue;
    Tensor &saved = g.tensors[static_cast<size_t>(n.outputs[1])];
    if (saved.shape.size() != 4) continue;
    saved.shape.pop_back();
    saved.dims.resize(saved.shape.size());
    for (size_t d = 0; d < saved.shape.size(); ++d) saved.dims[d] = Dim{saved.shape[d], ""};
    saved.dtype = CTR_DTYPE_F32;
  }
}

Program pass_lower(const Graph &g, const std::function<bool(OpId)> &has_kernel, bool overlap,
                   std::vector<int> node_chunk, int chunks) {
  CTR_CHECK(g.num_forward >= 0);
  Program p;
  p.complete_at.assign(g.nodes.size(), -1);
  const int end = static_cast<int>(g.nodes.size());
  const int split = g.num_input_grad >= 0 ? g.num_input_grad : end;
  auto phase = [&](int ph, int begin, int stop, std::vector<Instr> &out) {
    if (node_chunk.empty()) {
      lower_phase(g, begin, stop, out, p, has_kernel, overlap);
      return;
    }
    // Each chunk's run of nodes on its own, so that it runs as its own task.
    p.chunk_range[ph].assign(static_cast<size_t>(chunks), {0, 0});
    for (int i = begin; i < stop;) {
      int j = i;
      while (j < stop && node_chunk[static_cast<size_t>(j)] == node_chunk[static_cast<size_t>(i)]) ++j;
      const size_t first = out.size();
      lower_phase(g, i, j, out, p, has_kernel, overlap);
      p.chunk_range[ph][static_cast<size_t>(node_chunk[static_cast<size_t>(i)])] = {first, out.size()};
      i = j;
    }
  };
  phase(0, 0, g.num_forward, p.forward);
  phase(1, g.num_forward, split, p.backward);
  if (split < end) phase(2, split, end, p.weight);
  p.node_chunk = std::move(node_chunk);
  return p;
}

std::string dump_program(const Graph &g, const Program &p) {
  std::ostringstream os;
  os << "streams: " << p.num_streams << " (0 compute" << (p.num_streams > 1 ? ", 1 comm" : "")
     << "), events: " << p.num_events << "\n";
  auto list = [&](const char *name, const std::vector<Instr> &v) {
    os << name << ": " << v.size() << " instructions\n";
    for (size_t i = 0; i < v.size(); ++i) {
      const Instr &in = v[i];
      os << "  " << i << ": stream " << in.stream << " " << kind_name(in.kind);
      if (in.node >= 0) {
        const Node &n = g.nodes[static_cast<size_t>(in.node)];
        os << " " << n.op << " " << n.name;
        if (in.kind == Instr::Collective) os << " (complete at node " << p.complete_at[static_cast<size_t>(in.node)] << ")";
      }
      if (in.event >= 0) os << " e" << in.event;
      if (in.kind == Instr::Fill)
        os << " " << g.tensors[static_cast<size_t>(in.tensor)].name << " bytes [" << in.offset << ", "
           << in.offset + in.bytes << ")";
      os << "\n";
    }
  };
  list("forward", p.forward);
  list("backward", p.backward);
  if (!p.weight.empty()) list("weight gradients", p.weight);
  return os.str();
}

}  // namespace ctr
