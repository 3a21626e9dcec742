// Checkpoint directories: the layout and policy every host would otherwise
// write for itself, so that each binding gets the same one.
//
//   ROOT/step_00000100/   one checkpoint per save, named by the step count
//   ROOT/step_00000200/
//   ROOT/latest           "step_00000200\n": the newest complete checkpoint
//
// `latest` moves only once its checkpoint is in place. The step calls back here
// (PendingSave::on_publish) on rank 0 right after it has renamed the directory
// into place: within the save for a synchronous one, in whichever later call
// publishes it for a background one. The file is replaced by a rename, so a
// crash leaves the old name or the new one, and never one of a checkpoint that
// is not complete. Pruning follows in the same callback; a failure of either
// fails the publishing call on every rank, because the step reports rank 0's
// errors there to all ranks.
//
// Resuming from `latest` falls back to older checkpoints when the newest turns
// out damaged (its load fails with CTR_STATUS_CHECKPOINT_ERROR): a checkpoint
// corrupted after it was written costs the steps since the previous one, not
// the run. Every rank reads the directory for itself, so the ranks must share
// the root; each load is collective with an agreed outcome, so all ranks walk
// the same list of candidates together.

#include "ckpt/directory.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <vector>

#include "ckpt/pending_save.h"
#include "core/status.h"
#include "runtime/step.h"

namespace fs = std::filesystem;

namespace ctr {
namespace {

constexpr const char *kLatest = "latest";

// ---------------------------------------------------------------------------
// Names

std::string normalize_root(std::string root) {
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  return root;
}

std::string join(const std::string &root, const std::string &name) {
  return root == "/" ? root + name : root + "/" + name;
}

std::string checkpoint_name(int64_t step) {
  return strformat("step_%08lld", static_cast<long long>(step));
}

// The step of a checkpoint name, "step_" and digits only; nothing for any other
// name (step_00000100.tmp and .old are a save in progress, not checkpoints).
std::optional<int64_t> checkpoint_step(const std::string &name) {
  if (name.size() <= 5 || name.compare(0, 5, "step_") != 0) return std::nullopt;
  const char *begin = name.data() + 5, *end = name.data() + name.size();
  if (*begin < '0' || *begin > '9') return std::nullopt;
  int64_t step = 0;
  auto [at, ec] = std::from_chars(begin, end, step);
  if (ec != std::errc() || at != end) return std::nullopt;
  return step;
}

struct Checkpoint {
  int64_t step;
  std::string name;
};

// The checkpoint directories under root, oldest first; none for a missing root.
std::vector<Checkpoint> list_checkpoints(const std::string &root) {
  std::vector<Checkpoint> out;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    std::optional<int64_t> step = checkpoint_step(name);
    std::error_code type_ec;
    if (step && it->is_directory(type_ec)) out.push_back({*step, std::move(name)});
  }
  std::sort(out.begin(), out.end(), [](const Checkpoint &a, const Checkpoint &b) {
    return a.step != b.step ? a.step < b.step : a.name < b.name;
  });
  return out;
}

// ---------------------------------------------------------------------------
// Publication (rank 0, from the step's finish_save)

[[noreturn]] void io_fail(const std::string &path, const char *what) {
  fail(CTR_STATUS_IO_ERROR, strformat("%s: %s: %s", path.c_str(), what, std::strerror(errno)));
}

void sync_dir(const std::string &dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) io_fail(dir, "cannot open to sync");
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) io_fail(dir, "fsync failed");
}

// Points root/latest at name: written to latest.tmp, synced, renamed over.
void write_latest(const std::string &root, const std::string &name) {
  const std::string tmp = join(root, std::string(kLatest) + ".tmp"), dst = join(root, kLatest);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) io_fail(tmp, "cannot create");
  const std::string text = name + "\n";
  size_t done = 0;
  while (done < text.size()) {
    ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      int saved = errno;
      ::close(fd);
      errno = saved;
      io_fail(tmp, "write failed");
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0) {
    int saved = errno;
    ::close(fd);
    errno = saved;
    io_fail(tmp, "fsync failed");
  }
  ::close(fd);
  if (::rename(tmp.c_str(), dst.c_str()) != 0) io_fail(dst, "cannot replace");
  sync_dir(root);
}

// Keeps the checkpoint just published and the keep - 1 newest ones before it.
// Checkpoints numbered after it were left by a run that resumed from an older
// one; `latest` no longer leads to them, but they are not this run's to delete.
void prune(const std::string &root, const std::string &published, int64_t keep) {
  if (keep <= 0) return;
  const int64_t at = checkpoint_step(published).value_or(INT64_MAX);
  int64_t others = keep - 1;
  std::vector<Checkpoint> all = list_checkpoints(root);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->name == published || it->step > at) continue;
    if (others > 0) {
      --others;
      continue;
    }
    const std::string dir = join(root, it->name);
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (ec)
      fail(CTR_STATUS_IO_ERROR,
           strformat("%s: cannot remove an old checkpoint (keep %lld): %s", dir.c_str(),
                     static_cast<long long>(keep), ec.message().c_str()));
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Save

std::string save_checkpoint(Step &step, const std::string &root_in, int64_t keep) {
  const std::string root = normalize_root(root_in);
  CTR_REQUIRE(!root.empty(), CTR_STATUS_INVALID_ARGUMENT, "ctr_step_save_checkpoint: empty root directory");
  const std::string name = checkpoint_name(step.count());
  const std::string dir = join(root, name);
  // Step::save creates root (rank 0); rank 0 moves `latest` and prunes when the
  // save is published.
  step.save(dir, step.async_save(), [root, name, keep] {
    write_latest(root, name);
    prune(root, name, keep);
  });
  return dir;
}

// ---------------------------------------------------------------------------
// Resume

Resumed resume_checkpoint(Step &step, const std::string &root_in, const std::string &which) {
  const std::string root = normalize_root(root_in);
  CTR_REQUIRE(!root.empty(), CTR_STATUS_INVALID_ARGUMENT, "ctr_step_resume: empty root directory");
  Resumed out;
  if (!which.empty() && which != kLatest) {
    out.path = which;
    std::error_code ec;
    if (which.find('/') == std::string::npos && fs::is_directory(join(root, which), ec))
      out.path = join(root, which);
    step.load(out.path);
    return out;
  }

  auto pass_over = [&out](const std::string &dir, const std::string &why) {
    if (!out.skipped.empty()) out.skipped += '\n';
    out.skipped += dir + ": " + why;
  };

  // The one `latest` names, then older checkpoints, newest first.
  std::vector<std::string> candidates;
  std::string named;
  std::optional<int64_t> named_step;
  const std::string latest = join(root, kLatest);
  struct stat latest_st {};
  if (::stat(latest.c_str(), &latest_st) == 0 && !S_ISREG(latest_st.st_mode)) {
    pass_over(latest, "is not a regular file");
  } else if (std::ifstream f(latest, std::ios::binary); f) {
    // A name is short; a damaged file of any size costs one small read.
    char buf[256];
    f.read(buf, sizeof buf);
    named.assign(buf, static_cast<size_t>(f.gcount()));
    // The file holds one checkpoint's name and a newline, nothing after it.
    const bool more = f.gcount() == static_cast<std::streamsize>(sizeof buf) && f.peek() != EOF;
    bool trailing = more;
    if (size_t nl = named.find('\n'); nl != std::string::npos) {
      trailing = trailing || named.find_first_not_of(" \t\r\n", nl) != std::string::npos;
      named.resize(nl);
    }
    while (!named.empty() && std::isspace(static_cast<unsigned char>(named.back()))) named.pop_back();
    const bool printable = std::all_of(named.begin(), named.end(), [](char c) {
      return std::isprint(static_cast<unsigned char>(c)) != 0;
    });
    if (printable && !trailing && !named.empty() && named.size() < 64 && !checkpoint_step(named)) {
      pass_over(latest, strformat("names no checkpoint ('%s')", named.c_str()));
      named.clear();
    } else if (named.empty() || named == "." || named == ".." || named.find('/') != std::string::npos ||
               !printable || trailing || named.size() >= sizeof buf) {
      pass_over(latest, trailing                      ? std::string("is damaged (more than a checkpoint's name)")
                        : printable && named.size() < 64 ? strformat("names no checkpoint ('%s')", named.c_str())
                                                         : std::string("is damaged (it holds no checkpoint name)"));
      named.clear();
    } else {
      candidates.push_back(join(root, named));
      named_step = checkpoint_step(named);
    }
  }
  std::vector<Checkpoint> all = list_checkpoints(root);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->name == named || (named_step && it->step >= *named_step)) continue;
    candidates.push_back(join(root, it->name));
  }
  if (candidates.empty())
    fail(CTR_STATUS_NOT_FOUND,
         strformat("ctr_step_resume: no checkpoint in '%s'%s%s", root.c_str(), out.skipped.empty() ? "" : ": ",
                   out.skipped.c_str()));

  for (const std::string &dir : candidates) {
    try {
      step.load(dir);
      out.path = dir;
      return out;
    } catch (const Error &e) {
      if (e.code() != CTR_STATUS_CHECKPOINT_ERROR) throw;
      pass_over(dir, e.message());
    }
  }
  std::string all_reasons;
  for (char c : out.skipped) all_reasons += c == '\n' ? std::string("; ") : std::string(1, c);
  fail(CTR_STATUS_CHECKPOINT_ERROR,
       strformat("ctr_step_resume: no usable checkpoint in '%s': %s", root.c_str(), all_reasons.c_str()));
}

}  // namespace ctr
