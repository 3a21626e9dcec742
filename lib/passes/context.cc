// Context parallelism, part of pass place (see passes.h): every activation of
// the forward graph split by its sequence dim over the `cp` axis.
//
// Each sequence of T positions is cut into 2 * cp chunks of L = T / (2 * cp);
// rank r keeps chunks r and 2 * cp - 1 - r (ctr_cp_position), so that under a
// causal mask every rank has the same share of visible keys: one early chunk
// with few keys and its mirror with many. The graph's inputs stay whole on
// every rank of a cp group (the host feeds the group the same rows, as for tp);
// each rank selects its chunks of them right where they are read (two slices
// and a cat along dim 1), tokens and targets alike, so the loss pairs each
// position with its own target.
//
// From there the model computes on [B, 2L, ...] rows. Ops that compute each
// position from its own rows run as they are (element-wise ops, norms over the
// last dim, linear, embedding, the cross-entropy: its mean over this rank's
// positions; the mean over cp of those means is the whole mean, and the
// gradients of the parameters, replicated over cp, are averaged over cp by the
// shard pass), and so do the layout ops of exported code that keep [B, T] in
// place, once a sequence size they state is left to their input. The ops that
// mix positions are rewritten:
// - attention reads every rank's keys and values: an all-gather over cp of k
//   and v (transposed to put the sequence first, so that the gather's blocks
//   are rows), whose gradient is a reduce-scatter of the partial gradients;
//   cp_attention applies the causal mask (and a window) by global positions;
// - rope rotates by global positions (cp_rope);
// - a learned position table read by take_rows is read for the whole sequence
//   and its rows chunked like the tokens (the table's gradient rows are this
//   rank's positions', averaged over cp with the rest).
// Anything else that reads the sequence is refused naming the node and the op:
// it may mix positions, and nothing here knows how to split it.

#include <algorithm>
#include <map>
#include <set>

#include "core/status.h"
#include "passes/passes.h"

namespace ctr {
namespace {

const char *kCp = "cp";

class ContextSplit {
 public:
  ContextSplit(Graph &g, int64_t ranks, int64_t index, const std::string &mode,
               const std::function<bool(OpId)> &has_kernel)
      : g_(g), R_(ranks), r_(index), ulysses_(mode == "ulysses"), ring_(mode == "ring"), has_kernel_(has_kernel) {
    seq_.assign(g.tensors.size(), 0);
  }

  std::string run() {
    find_sequence();
    const int nn = static_cast<int>(g_.nodes.size());
    before_.resize(static_cast<size_t>(nn));
    after_.resize(static_cast<size_t>(nn));
    int token_wise = 0;
    for (int ni = 0; ni < nn; ++ni) {
      Node &n = g_.nodes[static_cast<size_t>(ni)];
      bool reads_seq = false;
      for (int i : n.inputs) reads_seq = reads_seq || seq_[static_cast<size_t>(i)];
      if (n.op == "take_rows" && reads_input(n)) {
        positions(ni);
        continue;
      }
      if (!reads_seq) continue;
      if (n.op == "attention") {
        attention(ni);
      } else if (n.op == "rope") {
        need_kernels(n, {"cp_rope", "cp_rope_bwd"});
        n.op = "cp_rope";
        n.attrs["cp_ranks"] = Attr::of_int(R_);
        n.attrs["cp_index"] = Attr::of_int(r_);
        ++ropes_;
      } else if (keeps_positions(n)) {
        ++token_wise;
      } else {
        const std::string why = token_wise_refusal(n);
        CTR_REQUIRE(why.empty(), CTR_STATUS_UNSUPPORTED,
                    "place: context parallelism (cp=%lld) splits every activation by its sequence dim, and node "
                    "'%s' (%s) cannot take a sequence shard: %s; use dp, fsdp or tp for this graph",
                    static_cast<long long>(R_), n.name.c_str(), n.op.c_str(), why.c_str());
        ++token_wise;
      }
      for (int i = 0; i < static_cast<int>(n.inputs.size()); ++i) {
        const int t = n.inputs[static_cast<size_t>(i)];
        if (g_.tensors[static_cast<size_t>(t)].role == Role::Input) n.inputs[static_cast<size_t>(i)] = chunks_of(t, ni);
      }
      for (int o : n.outputs) mark(o);
    }
    rescale_gathers();
    std::vector<Node> nodes;
    for (int ni = 0; ni < nn; ++ni) {
      for (Node &n : before_[static_cast<size_t>(ni)]) nodes.push_back(std::move(n));
      nodes.push_back(std::move(g_.nodes[static_cast<size_t>(ni)]));
      for (Node &n : after_[static_cast<size_t>(ni)]) nodes.push_back(std::move(n));
    }
    g_.nodes = std::move(nodes);
    return strformat(
        "place: cp=%lld, sequences of %lld positions in %lld chunks of %lld; this rank (cp index %lld) holds "
        "chunks %lld and %lld\n"
        "  %d attentions %s (%lld bytes per micro-batch %s forward, as many %s backward), %d ropes and %d "
        "position tables at global positions, %d token-wise nodes on this rank's positions\n",
        static_cast<long long>(R_), static_cast<long long>(T_), static_cast<long long>(2 * R_),
        static_cast<long long>(L_), static_cast<long long>(r_), static_cast<long long>(r_),
        static_cast<long long>(2 * R_ - 1 - r_), attentions_,
        ulysses_ ? "exchange heads for positions all-to-all over cp (q, k, v in, the output back)"
        : ring_  ? "pass keys and values around the cp ring, one block of attention per rank's keys merged by "
                   "log-sum-exp"
                 : "gather keys and values over cp",
        static_cast<long long>(moved_bytes_), ulysses_ || ring_ ? "sent to other ranks" : "gathered",
        ulysses_ ? "exchanged" : ring_ ? "passed back" : "reduce-scattered", ropes_, tables_, token_wise);
  }

 private:
  Graph &g_;
  int64_t R_, r_;
  bool ulysses_, ring_;
  const std::function<bool(OpId)> &has_kernel_;
  int64_t T_ = -1, L_ = 0;
  std::vector<char> seq_;                        // tensors that carry this rank's chunks
  std::map<int, int> chunks_;                    // whole input -> this rank's chunks
  std::vector<std::vector<Node>> before_, after_;
  int attentions_ = 0, ropes_ = 0, tables_ = 0;
  int64_t moved_bytes_ = 0;  // per micro-batch, forward, leaving this rank

  void mark(int t) {
    if (static_cast<size_t>(t) >= seq_.size()) seq_.resize(static_cast<size_t>(t) + 1, 0);
    seq_[static_cast<size_t>(t)] = 1;
  }

  int add_tensor(const std::string &name, int like) {
    Tensor t;
    t.name = name;
    t.dtype = g_.tensors[static_cast<size_t>(like)].dtype;
    t.shape = g_.tensors[static_cast<size_t>(like)].shape;
    t.has_shape = true;
    const int id = g_.add_tensor(std::move(t));
    seq_.resize(g_.tensors.size(), 0);
    return id;
  }

  // The sequence length, from the inputs: every input is [batch, seq, ...].
  void find_sequence() {
    for (int t = 0; t < static_cast<int>(g_.tensors.size()); ++t) {
      const Tensor &x = g_.tensors[static_cast<size_t>(t)];
      if (x.role != Role::Input) continue;
      CTR_REQUIRE(x.shape.size() >= 2, CTR_STATUS_UNSUPPORTED,
                  "place: context parallelism (cp=%lld) splits the inputs by their sequence dim (dim 1), but "
                  "input '%s' has %d dims",
                  static_cast<long long>(R_), x.name.c_str(), static_cast<int>(x.shape.size()));
      if (T_ < 0) T_ = x.shape[1];
      CTR_REQUIRE(x.shape[1] == T_, CTR_STATUS_UNSUPPORTED,
                  "place: context parallelism (cp=%lld): input '%s' has %lld positions, the others %lld",
                  static_cast<long long>(R_), x.name.c_str(), static_cast<long long>(x.shape[1]),
                  static_cast<long long>(T_));
      seq_[static_cast<size_t>(t)] = 1;
    }
    CTR_REQUIRE(T_ > 0, CTR_STATUS_UNSUPPORTED,
                "place: context parallelism (cp=%lld) splits the inputs' sequences, but graph '%s' has no input",
                static_cast<long long>(R_), g_.name.c_str());
    CTR_REQUIRE(T_ % (2 * R_) == 0, CTR_STATUS_UNSUPPORTED,
                "place: context parallelism (cp=%lld) splits each sequence into 2*cp = %lld chunks (two per rank, "
                "mirrored, for a balanced causal mask), but the sequence length %lld is not divisible by %lld; use "
                "a sequence length that is a multiple of %lld, or another cp",
                static_cast<long long>(R_), static_cast<long long>(2 * R_), static_cast<long long>(T_),
                static_cast<long long>(2 * R_),
                static_cast<long long>(2 * R_));
    L_ = T_ / (2 * R_);
  }

  bool reads_input(const Node &n) const {
    return n.inputs.size() == 2 && g_.tensors[static_cast<size_t>(n.inputs[1])].role == Role::Input &&
           n.attr_int("axis", 1) == 1;
  }

  // This rank's two chunks of x along dim, emitted in front of node at.
  int select_chunks(int x, int dim, int at, std::string name) {
    const int blk = g_.nodes[static_cast<size_t>(at)].block;
    const int64_t first = r_ * L_, second = (2 * R_ - 1 - r_) * L_;
    const int a = add_tensor(name + ".cp_first", x), b = add_tensor(name + ".cp_second", x);
    const int y = add_tensor(name + ".cp", x);
    auto &list = before_[static_cast<size_t>(at)];
    list.push_back(Node::make("slice", name + ".cp_first", {x}, {a}, blk,
                              {{"dim", Attr::of_int(dim)}, {"start", Attr::of_int(first)},
                               {"end", Attr::of_int(first + L_)}}));
    list.push_back(Node::make("slice", name + ".cp_second", {x}, {b}, blk,
                              {{"dim", Attr::of_int(dim)}, {"start", Attr::of_int(second)},
                               {"end", Attr::of_int(second + L_)}}));
    list.push_back(Node::make("cat", name + ".cp", {a, b}, {y}, blk, {{"dim", Attr::of_int(dim)}}));
    mark(y);
    return y;
  }

  int chunks_of(int input, int at) {
    auto it = chunks_.find(input);
    if (it != chunks_.end()) return it->second;
    const int y = select_chunks(input, 1, at, g_.tensors[static_cast<size_t>(input)].name);
    chunks_[input] = y;
    return y;
  }

  // take_rows(table, input): the table's rows for the whole sequence, then the
  // rows of this rank's positions.
  void positions(int ni) {
    Node &n = g_.nodes[static_cast<size_t>(ni)];
    const int whole = n.outputs[0];
    const int rows = add_tensor(g_.tensors[static_cast<size_t>(whole)].name + ".whole", whole);
    n.outputs[0] = rows;
    // The chunks are computed after the node, into the tensor its readers read.
    const int64_t first = r_ * L_, second = (2 * R_ - 1 - r_) * L_;
    const std::string name = g_.tensors[static_cast<size_t>(whole)].name;
    const int a = add_tensor(name + ".cp_first", whole), b = add_tensor(name + ".cp_second", whole);
    auto &list = after_[static_cast<size_t>(ni)];
    list.push_back(Node::make("slice", name + ".cp_first", {rows}, {a}, n.block,
                              {{"dim", Attr::of_int(0)}, {"start", Attr::of_int(first)},
                               {"end", Attr::of_int(first + L_)}}));
    list.push_back(Node::make("slice", name + ".cp_second", {rows}, {b}, n.block,
                              {{"dim", Attr::of_int(0)}, {"start", Attr::of_int(second)},
                               {"end", Attr::of_int(second + L_)}}));
    list.push_back(Node::make("cat", name + ".cp", {a, b}, {whole}, n.block, {{"dim", Attr::of_int(0)}}));
    mark(whole);
    ++tables_;
  }

  void need_kernels(const Node &n, std::initializer_list<const char *> ops) {
    for (const char *op : ops) {
      const OpDef *d = find_op(op);
      CTR_REQUIRE(d != nullptr && has_kernel_ && has_kernel_(d->id), CTR_STATUS_UNSUPPORTED,
                  "place: context parallelism (cp=%lld) runs node '%s' (%s) as %s, which this backend has no "
                  "kernel for; use dp, fsdp or tp on this backend",
                  static_cast<long long>(R_), n.name.c_str(), n.op.c_str(), op);
    }
  }

  // k or v gathered over cp: [B, 2L, W] -> [2L, B, W] -> all ranks' rows -> [B, cp*2L, W].
  // The gather is issued right after x is computed, so that it runs while the
  // rest of the attention's inputs are (v after k, the rotations of q and k);
  // the attention waits for it where it reads it.
  int gather(int x, const Node &at, int ni) {
    const std::string name = g_.tensors[static_cast<size_t>(x)].name;
    const std::vector<int64_t> s = g_.tensors[static_cast<size_t>(x)].shape;
    CTR_REQUIRE(s.size() == 3, CTR_STATUS_UNSUPPORTED,
                "place: context parallelism: attention '%s' reads '%s' of %d dims, not [batch, seq, width]",
                at.name.c_str(), name.c_str(), static_cast<int>(s.size()));
    const int t = add_tensor(name + ".cp_seq_first", x), gt = add_tensor(name + ".cp_gathered_rows", x);
    const int y = add_tensor(name + ".cp_gathered", x);
    auto &issue = issue_after(x, ni);
    issue.push_back(Node::make("transpose", name + ".cp_seq_first", {x}, {t}, at.block,
                               {{"perm", Attr::of_ints({1, 0, 2})}}));
    issue.push_back(Node::make("all_gather", name + ".cp_all_gather", {t}, {gt}, at.block,
                               {{"axis", Attr::of_string(kCp)},
                                {"ranks", Attr::of_int(R_)},
                                {"rows", Attr::of_int(R_ * 2 * L_)},
                                {"activation", Attr::of_int(1)}}));
    before_[static_cast<size_t>(ni)].push_back(Node::make("transpose", name + ".cp_gathered", {gt}, {y}, at.block,
                                                          {{"perm", Attr::of_ints({1, 0, 2})}}));
    // Whole-sequence bytes: the gathered tensor's (every rank's rows).
    moved_bytes_ += g_.tensors[static_cast<size_t>(x)].bytes();
    return y;
  }

  // Where the collectives reading x are issued: right after x is computed.
  std::vector<Node> &issue_after(int x, int ni) {
    int p = -1;
    for (int m = 0; m < ni; ++m)
      for (int o : g_.nodes[static_cast<size_t>(m)].outputs)
        if (o == x) p = m;
    return p >= 0 ? after_[static_cast<size_t>(p)] : before_[static_cast<size_t>(ni)];
  }

  std::map<std::string, Attr> exchange_attrs() const {
    return {{"axis", Attr::of_string(kCp)}, {"ranks", Attr::of_int(R_)}, {"activation", Attr::of_int(1)}};
  }

  // x [B, 2L, R*W] (this rank's positions of every head) -> [B, R*2L, W] (every
  // rank's positions, in rank order, of this rank's 1/R of the heads): the
  // blocks of heads put first, exchanged all-to-all, then every rank's rows.
  int heads_to_ranks(int x, const Node &at, int ni) {
    const std::string name = g_.tensors[static_cast<size_t>(x)].name;
    const int a = add_tensor(name + ".cp_heads", x), b = add_tensor(name + ".cp_heads_first", x);
    const int c = add_tensor(name + ".cp_exchanged", x), d = add_tensor(name + ".cp_ranks_second", x);
    const int y = add_tensor(name + ".cp_sequence", x);
    auto &issue = issue_after(x, ni);
    issue.push_back(Node::make("reshape", name + ".cp_heads", {x}, {a}, at.block,
                               {{"shape", Attr::of_ints({0, 0, R_, -1})}}));
    issue.push_back(Node::make("transpose", name + ".cp_heads_first", {a}, {b}, at.block,
                               {{"perm", Attr::of_ints({2, 0, 1, 3})}}));
    issue.push_back(Node::make("all_to_all", name + ".cp_all_to_all", {b}, {c}, at.block, exchange_attrs()));
    auto &wait = before_[static_cast<size_t>(ni)];
    wait.push_back(Node::make("transpose", name + ".cp_ranks_second", {c}, {d}, at.block,
                              {{"perm", Attr::of_ints({1, 0, 2, 3})}}));
    wait.push_back(Node::make("reshape", name + ".cp_sequence", {d}, {y}, at.block,
                              {{"shape", Attr::of_ints({0, -1, g_.tensors[static_cast<size_t>(x)].shape[2] / R_})}}));
    moved_bytes_ += sent_bytes(x);
    return y;
  }

  // The inverse, written into y: [B, R*2L, W] -> [B, 2L, R*W].
  void ranks_to_heads(int x, int y, const Node &at, int ni) {
    const std::string name = g_.tensors[static_cast<size_t>(y)].name;
    const int64_t W = g_.tensors[static_cast<size_t>(y)].shape[2] / R_;
    const int a = add_tensor(name + ".cp_ranks", y), b = add_tensor(name + ".cp_ranks_first", y);
    const int c = add_tensor(name + ".cp_exchanged", y), d = add_tensor(name + ".cp_heads_second", y);
    auto &list = after_[static_cast<size_t>(ni)];
    list.push_back(Node::make("reshape", name + ".cp_ranks", {x}, {a}, at.block,
                              {{"shape", Attr::of_ints({0, R_, -1, W})}}));
    list.push_back(Node::make("transpose", name + ".cp_ranks_first", {a}, {b}, at.block,
                              {{"perm", Attr::of_ints({1, 0, 2, 3})}}));
    list.push_back(Node::make("all_to_all", name + ".cp_all_to_all", {b}, {c}, at.block, exchange_attrs()));
    list.push_back(Node::make("transpose", name + ".cp_heads_second", {c}, {d}, at.block,
                              {{"perm", Attr::of_ints({1, 2, 0, 3})}}));
    list.push_back(Node::make("reshape", name + ".cp_positions", {d}, {y}, at.block,
                              {{"shape", Attr::of_ints({0, 0, -1})}}));
    mark(y);
    moved_bytes_ += sent_bytes(y);
  }

  // What one exchange of t sends to other ranks: (R-1)/R of this rank's 1/R
  // of the whole sequence (shapes are still whole here).
  int64_t sent_bytes(int t) const { return g_.tensors[static_cast<size_t>(t)].bytes() / (R_ * R_) * (R_ - 1); }

  // Ring attention (cp_mode ring): k and v passed R - 1 times to the next rank
  // of the cp ring (each shift issued behind the one before, right after k or
  // v is computed), one cp_attention_block per source rank, each merged into
  // the running result by log-sum-exp as soon as it is computed, so that the
  // comm stream passes the next keys on while compute attends to these.
  // (Backward passes the keys and values around again: pass recompute.)
  void attention_by_ring(int ni) {
    const Node copy = g_.nodes[static_cast<size_t>(ni)];
    const int out = copy.outputs[0];
    const std::string base = g_.tensors[static_cast<size_t>(out)].name;
    std::vector<int> keys[2];
    for (int w = 0; w < 2; ++w) {
      const int x = copy.inputs[static_cast<size_t>(1 + w)];
      const std::string name = g_.tensors[static_cast<size_t>(x)].name;
      keys[w].push_back(x);
      auto &issue = issue_after(x, ni);
      for (int64_t s = 1; s < R_; ++s) {
        const int y = add_tensor(name + ".cp_ring" + std::to_string(s), x);
        issue.push_back(Node::make("ring_shift", name + ".cp_ring" + std::to_string(s), {keys[w].back()}, {y},
                                   copy.block,
                                   {{"axis", Attr::of_string(kCp)}, {"ranks", Attr::of_int(R_)},
                                    {"shift", Attr::of_int(1)}, {"activation", Attr::of_int(1)}}));
        keys[w].push_back(y);
        moved_bytes_ += g_.tensors[static_cast<size_t>(x)].bytes() / R_;
      }
    }
    std::map<std::string, Attr> attrs = copy.attrs;
    attrs["cp_ranks"] = Attr::of_int(R_);
    attrs["cp_index"] = Attr::of_int(r_);
    auto block_attrs = [&](int64_t s) {
      std::map<std::string, Attr> a = attrs;
      a["cp_source"] = Attr::of_int((r_ - s + R_) % R_);
      return a;
    };
    const std::map<std::string, Attr> merge_attrs = {{"heads", Attr::of_int(copy.attr_int("heads", 1))}};
    // Block 0 (this rank's own keys) is the attention node itself.
    int acc_o = add_tensor(base + ".cp_block0", out), acc_l = add_tensor(base + ".cp_block0.lse", out);
    Node &m = g_.nodes[static_cast<size_t>(ni)];
    m.op = "cp_attention_block";
    m.attrs = block_attrs(0);
    m.outputs = {acc_o, acc_l, copy.outputs[1]};
    auto &list = after_[static_cast<size_t>(ni)];
    for (int64_t s = 1; s < R_; ++s) {
      const std::string tag = ".cp_block" + std::to_string(s);
      const int o = add_tensor(base + tag, out), l = add_tensor(base + tag + ".lse", out);
      const int p = add_tensor(base + tag + ".probs", copy.outputs[1]);
      list.push_back(Node::make("cp_attention_block", base + tag, {copy.inputs[0], keys[0][static_cast<size_t>(s)],
                                                                   keys[1][static_cast<size_t>(s)]},
                                {o, l, p}, copy.block, block_attrs(s)));
      const bool last = s + 1 == R_;
      const int mo = last ? out : add_tensor(base + ".cp_merged" + std::to_string(s), out);
      const int ml = add_tensor(base + ".cp_merged" + std::to_string(s) + ".lse", out);
      list.push_back(Node::make("attn_merge", base + ".cp_merge" + std::to_string(s), {acc_o, acc_l, o, l},
                                {mo, ml}, copy.block, merge_attrs));
      acc_o = mo;
      acc_l = ml;
    }
    mark(out);
    ++attentions_;
  }

  // Attention on every position of 1/R of the heads (cp_mode ulysses).
  void attention_by_heads(int ni) {
    const Node copy = g_.nodes[static_cast<size_t>(ni)];
    const int64_t H = copy.attr_int("heads", 1), Hkv = copy.attr_int("kv_heads", H);
    CTR_REQUIRE(H % R_ == 0 && Hkv % R_ == 0, CTR_STATUS_UNSUPPORTED,
                "place: context parallelism (cp=%lld, cp_mode ulysses) gives each rank 1/cp of the heads, but "
                "attention '%s' has heads=%lld and kv_heads=%lld on this rank, which cp=%lld does not divide; use "
                "cp_mode gather (keys and values gathered) or another cp",
                static_cast<long long>(R_), copy.name.c_str(), static_cast<long long>(H),
                static_cast<long long>(Hkv), static_cast<long long>(R_));
    int in[3];
    for (int i = 0; i < 3; ++i) in[i] = heads_to_ranks(copy.inputs[static_cast<size_t>(i)], copy, ni);
    const int out = copy.outputs[0];
    const int local = add_tensor(g_.tensors[static_cast<size_t>(out)].name + ".cp_heads_out", out);
    Node &m = g_.nodes[static_cast<size_t>(ni)];
    m.inputs = {in[0], in[1], in[2]};
    m.outputs[0] = local;
    m.op = "cp_attention";
    m.attrs["heads"] = Attr::of_int(H / R_);
    m.attrs["kv_heads"] = Attr::of_int(Hkv / R_);
    m.attrs["cp_ranks"] = Attr::of_int(R_);
    m.attrs["cp_index"] = Attr::of_int(-1);
    ranks_to_heads(local, out, copy, ni);
    ++attentions_;
  }

  void attention(int ni) {
    Node &n = g_.nodes[static_cast<size_t>(ni)];
    if (ring_)
      need_kernels(n, {"cp_attention_block", "cp_attention_block_bwd", "attn_merge", "attn_merge_bwd"});
    else
      need_kernels(n, {"cp_attention", "cp_attention_bwd"});
    for (size_t i = 0; i < 3; ++i)
      CTR_REQUIRE(seq_[static_cast<size_t>(n.inputs[i])], CTR_STATUS_UNSUPPORTED,
                  "place: context parallelism: attention '%s' reads '%s', which is not computed from the sequence",
                  n.name.c_str(), g_.tensors[static_cast<size_t>(n.inputs[i])].name.c_str());
    if (ulysses_) return attention_by_heads(ni);
    if (ring_) return attention_by_ring(ni);
    const Node copy = n;
    const int k = gather(copy.inputs[1], copy, ni), v = gather(copy.inputs[2], copy, ni);
    Node &m = g_.nodes[static_cast<size_t>(ni)];
    m.inputs[1] = k;
    m.inputs[2] = v;
    m.op = "cp_attention";
    m.attrs["cp_ranks"] = Attr::of_int(R_);
    m.attrs["cp_index"] = Attr::of_int(r_);
    ++attentions_;
  }

  // Layout ops that keep the leading [batch, seq] dims in place (exported code
  // views each position's features as heads, GQA repeats kv heads): they run on
  // this rank's positions once a size they state for the sequence is left to
  // the input (0 in a reshape's shape, -1 in an expand's).
  bool keeps_positions(Node &n) const {
    if (n.op != "reshape" && n.op != "expand" && n.op != "transpose" && n.op != "slice") return false;
    const std::vector<int64_t> &x = g_.tensors[static_cast<size_t>(n.inputs[0])].shape;
    const std::vector<int64_t> &y = g_.tensors[static_cast<size_t>(n.outputs[0])].shape;
    if (n.op == "reshape" && x.size() >= 1 && y.size() == x.size() + 1 && y[0] == 1 && x[0] == T_ &&
        std::equal(x.begin(), x.end(), y.begin() + 1)) {
      // A position table's rows given a batch dim of 1.
      std::vector<int64_t> s = y;
      s[1] = -1;
      n.attrs.erase("dims");
      n.attrs["shape"] = Attr::of_ints(s);
      return true;
    }
    if (x.size() < 2 || y.size() < 2 || x[0] != y[0] || x[1] != y[1] || x[1] != T_) return false;
    if (n.op == "slice") {
      // Along a feature dim (a fused projection split into q, k and v).
      int64_t dim = n.attr_int("dim", 0);
      if (dim < 0) dim += static_cast<int64_t>(x.size());
      return dim >= 2;
    }
    if (n.op == "transpose") {
      const std::vector<int64_t> perm = n.attr_ints("perm");
      return perm.size() >= 2 && perm[0] == 0 && perm[1] == 1;
    }
    if (n.op == "expand") {
      std::vector<int64_t> s = n.attr_ints("shape");
      if (s.size() != x.size()) return false;
      s[0] = s[1] = -1;
      n.attrs["shape"] = Attr::of_ints(s);
      return true;
    }
    std::vector<int64_t> s = y;
    s[0] = s[1] = 0;
    n.attrs.erase("dims");
    n.attrs["shape"] = Attr::of_ints(s);
    return true;
  }

  // Why node n cannot run on this rank's positions alone ("" if it can).
  std::string token_wise_refusal(const Node &n) const {
    static const std::set<std::string> token_wise = {
        "silu", "swiglu", "geglu", "exp",  "log", "tanh", "erf", "rsqrt", "sqrt", "neg", "reciprocal",
        "sigmoid", "pow", "gelu", "relu", "clamp", "add", "sub", "mul", "div", "layernorm", "rmsnorm",
        "linear", "embedding", "vocab_embedding", "cross_entropy", "vocab_ce_stats", "vocab_ce_loss",
        "fanout", "all_reduce"};
    // Mixture-of-experts ops route, permute and compute each token's row on its
    // own; their load-balancing statistics are summed over the world by the
    // expert pass, so they count every rank's positions.
    if (n.op.rfind("moe_", 0) == 0) return "";
    if (n.op == "all_gather" && n.attr_int("activation", 0) != 0) return "";
    if (n.op == "matmul") {
      // x [B, T, in] @ w [in, out] (a Conv1D's weight) is per position; a product
      // with another sequence tensor mixes them.
      const int w = n.inputs[1];
      if (!seq_[static_cast<size_t>(n.inputs[0])] || seq_[static_cast<size_t>(w)] ||
          g_.tensors[static_cast<size_t>(w)].shape.size() != 2)
        return "its operands are not a sequence tensor and a matrix";
      return "";
    }
    if (!token_wise.count(n.op)) return "it may mix positions, and no rule splits it by the sequence";
    static const std::set<std::string> weighted = {"layernorm", "rmsnorm", "linear", "embedding",
                                                   "vocab_embedding"};
    if (weighted.count(n.op)) return "";
    // An element-wise operand broadcast along the sequence must be this rank's
    // rows too: a table of the whole sequence (unfused rope's cos and sin) is not.
    const size_t rank = g_.tensors[static_cast<size_t>(n.outputs[0])].shape.size();
    for (int i : n.inputs) {
      const std::vector<int64_t> &s = g_.tensors[static_cast<size_t>(i)].shape;
      if (seq_[static_cast<size_t>(i)] || rank < 2 || s.size() + 1 < rank) continue;
      const size_t at = s.size() + 1 - rank;  // s's dim under the output's dim 1
      if (s[at] == T_ && T_ > 1)
        return "it reads '" + g_.tensors[static_cast<size_t>(i)].name + "', a tensor of the whole sequence's " +
               std::to_string(T_) + " positions that nothing splits";
    }
    return "";
  }

  // Activation gathers placed before (the vocabulary-parallel head's statistics
  // over tp) count rows of the whole sequences; they now gather this rank's.
  void rescale_gathers() {
    for (Node &n : g_.nodes) {
      if (n.op != "all_gather" || n.attr_int("activation", 0) == 0 || n.attr_string("axis", "") == kCp) continue;
      if (n.has_attr("rows")) n.attrs["rows"] = Attr::of_int(n.attr_int("rows", 0) / R_);
    }
  }
};

}  // namespace

std::string place_context(Graph &g, const CompileOptions &opt, const std::function<bool(OpId)> &has_kernel) {
  const int64_t cp = opt.mesh.size(kCp);
  if (cp <= 1) return "";
  ContextSplit split(g, cp, opt.mesh.index(kCp), opt.cp_mode, has_kernel);
  std::string report = split.run();
  infer_local_shapes(g);
  return report;
}

}  // namespace ctr
