// `ctr launch`: start N ranks of a job on this machine.
//
// Each rank is a child process with the rendezvous environment set (CTR_RANK,
// CTR_WORLD_SIZE, CTR_LOCAL_RANK, CTR_MASTER_ADDR, CTR_MASTER_PORT and a fresh
// random CTR_JOB_TOKEN). Its stdout and stderr come back through pipes and are
// printed line by line behind a "[rank] " prefix. SIGINT/SIGTERM/SIGHUP are
// forwarded. When a rank fails, the others are asked to stop (SIGTERM, then
// SIGKILL after a grace period; a stopped rank is continued so it can act on
// them) and the launcher exits with the failed rank's status, so a scheduler
// sees the job fail as a whole. A rank stopped by a signal for longer than
// --stopped-ms counts as failed. Ranks die with the launcher, even when it is
// killed with SIGKILL (PR_SET_PDEATHSIG), so nothing is left behind.
//
// With --max-restarts R, a job that failed in a way a restart may get past (a
// rank exited with status 75, see `ctr run`, or was killed by a signal) is
// started again, up to R times, with a fresh port and token and
// CTR_RESTART_COUNT set to the attempt; the command resumes itself (`ctr run
// --resume latest --save-dir DIR`, a fresh start when there is no checkpoint).
// Any other failure, or a signal to the launcher, ends it.
//
// Everything is driven by one poll loop over the output pipes and a self-pipe
// written by the signal handler, so no output is lost and no wait is a sleep.

#include "launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace ctr_tool {
namespace {

int g_sig_pipe[2] = {-1, -1};

void on_signal(int sig) {
  int saved = errno;
  unsigned char b = static_cast<unsigned char>(sig);
  if (write(g_sig_pipe[1], &b, 1) < 0) {
  }
  errno = saved;
}

// A listening socket on a free loopback port, held from here until rank 0
// takes it over (CTR_MASTER_LISTEN_FD): no other process can take the port in
// between, and ranks that connect before rank 0 starts wait in its backlog.
// Returns the descriptor (close-on-exec) and sets *port; -1 on failure.
int listen_on_free_port(int *port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0 || listen(fd, 1024) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr *>(&a), &len) != 0) {
    close(fd);
    return -1;
  }
  *port = ntohs(a.sin_port);
  return fd;
}

std::string random_token() {
  unsigned char b[16] = {0};
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    if (read(fd, b, sizeof b) != static_cast<ssize_t>(sizeof b)) {
    }
    close(fd);
  }
  char hex[33];
  for (int i = 0; i < 16; ++i) std::snprintf(hex + 2 * i, 3, "%02x", b[i]);
  return std::string(hex, 32);
}

struct Rank {
  std::chrono::steady_clock::time_point stopped_since = std::chrono::steady_clock::time_point::max();
  int stop_signal = 0;
  pid_t pid = -1;
  int out_fd = -1, err_fd = -1;
  std::string out_buf, err_buf;
  bool running = false;
  int status = 0;
};

void emit(int rank, std::string &buf, FILE *to, bool flush_all) {
  size_t pos;
  while ((pos = buf.find('\n')) != std::string::npos) {
    std::fprintf(to, "[%d] %.*s\n", rank, static_cast<int>(pos), buf.data());
    buf.erase(0, pos + 1);
  }
  if (flush_all && !buf.empty()) {
    std::fprintf(to, "[%d] %s\n", rank, buf.c_str());
    buf.clear();
  }
  std::fflush(to);
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

constexpr int kExitRetry = 75;  // as `ctr run`: a failure a restart may get past

// Whether a rank's exit status is worth a restart.
bool retryable(int status) {
  return (WIFEXITED(status) && WEXITSTATUS(status) == kExitRetry) || WIFSIGNALED(status);
}

struct Outcome {
  int code = 0;        // the launcher's exit status for this attempt
  bool retry = false;  // failed in a way a restart may get past
};

Outcome run_once(const LaunchOptions &opt, int attempt);

}  // namespace

int launch(const LaunchOptions &opt) {
  if (opt.nprocs < 1) {
    std::fprintf(stderr, "ctr: error: launch: -n must be at least 1\n");
    return 2;
  }
  if (opt.command.empty()) {
    std::fprintf(stderr, "ctr: error: launch: no command given (ctr launch -n N -- COMMAND ...)\n");
    return 2;
  }
  if (pipe2(g_sig_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    std::fprintf(stderr, "ctr: error: launch: pipe: %s\n", std::strerror(errno));
    return 1;
  }
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaction(s, &sa, nullptr);

  Outcome out;
  for (int attempt = 0;; ++attempt) {
    out = run_once(opt, attempt);
    if (out.code == 0 || !out.retry || attempt >= opt.max_restarts) break;
    std::fprintf(stderr, "ctr: launch: restarting the job (restart %d of %d)\n", attempt + 1,
                 opt.max_restarts);
  }
  close(g_sig_pipe[0]);
  close(g_sig_pipe[1]);
  return out.code;
}

namespace {

Outcome run_once(const LaunchOptions &opt, int attempt) {
  // A restart gets a fresh port unless one was given: the old one may linger.
  int port = opt.port;
  int listen_fd = -1;
  if (port <= 0) {
    listen_fd = listen_on_free_port(&port);
    if (listen_fd < 0) {
      std::fprintf(stderr, "ctr: error: launch: cannot listen on a free TCP port on 127.0.0.1: %s\n",
                   std::strerror(errno));
      return {1, false};
    }
  }
  const std::string token = random_token();
  const pid_t launcher = getpid();

  std::vector<Rank> ranks(static_cast<size_t>(opt.nprocs));
  // A rank that cannot be started: the ranks already started are killed and
  // reaped, and every descriptor this attempt opened is closed.
  auto abandon = [&](const char *what, std::initializer_list<int> fds) {
    const int e = errno;
    for (int fd : fds)
      if (fd >= 0) close(fd);
    if (listen_fd >= 0) close(listen_fd), listen_fd = -1;
    for (Rank &rk : ranks) {
      if (!rk.running) continue;
      kill(rk.pid, SIGKILL);
      waitpid(rk.pid, nullptr, 0);
      close(rk.out_fd);
      close(rk.err_fd);
      rk.running = false;
    }
    std::fprintf(stderr, "ctr: error: launch: %s: %s\n", what, std::strerror(e));
    return Outcome{1, false};
  };
  for (int r = 0; r < opt.nprocs; ++r) {
    int out[2] = {-1, -1}, err[2] = {-1, -1};
    if (pipe2(out, O_CLOEXEC) != 0) return abandon("pipe", {});
    if (pipe2(err, O_CLOEXEC) != 0) return abandon("pipe", {out[0], out[1]});
    pid_t pid = fork();
    if (pid < 0) return abandon("fork", {out[0], out[1], err[0], err[1]});
    if (pid == 0) {
      // Die with the launcher; if it is already gone, do not start at all.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != launcher) _exit(128 + SIGKILL);
      dup2(out[1], STDOUT_FILENO);
      dup2(err[1], STDERR_FILENO);
      for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) signal(s, SIG_DFL);
      setenv("CTR_RANK", std::to_string(r).c_str(), 1);
      setenv("CTR_LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("CTR_WORLD_SIZE", std::to_string(opt.nprocs).c_str(), 1);
      setenv("CTR_MASTER_ADDR", "127.0.0.1", 1);
      setenv("CTR_MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("CTR_JOB_TOKEN", token.c_str(), 1);
      setenv("CTR_RESTART_COUNT", std::to_string(attempt).c_str(), 1);
      if (listen_fd >= 0 && r == 0) {
        fcntl(listen_fd, F_SETFD, 0);  // rank 0 inherits the store's socket
        setenv("CTR_MASTER_LISTEN_FD", std::to_string(listen_fd).c_str(), 1);
      }
      std::vector<char *> argv;
      for (const auto &a : opt.command) argv.push_back(const_cast<char *>(a.c_str()));
      argv.push_back(nullptr);
      execvp(argv[0], argv.data());
      std::fprintf(stderr, "ctr: error: launch: cannot run '%s': %s\n", argv[0], std::strerror(errno));
      _exit(127);
    }
    close(out[1]);
    close(err[1]);
    if (r == 0 && listen_fd >= 0) close(listen_fd), listen_fd = -1;
    ranks[r].pid = pid;
    ranks[r].out_fd = out[0];
    ranks[r].err_fd = err[0];
    ranks[r].running = true;
  }

  int failed_rank = -1, failed_code = 0;
  bool retry = false, stopping = false, signalled = false;
  using Clock = std::chrono::steady_clock;
  auto stop_deadline = Clock::time_point::max();
  auto stop_all = [&](int sig) {
    for (auto &rk : ranks)
      if (rk.running) kill(rk.pid, sig);
  };
  auto begin_stop = [&]() {
    if (stopping) return;
    stopping = true;
    stop_all(SIGTERM);
    stop_all(SIGCONT);  // a stopped rank acts on SIGTERM only once continued
    stop_deadline = Clock::now() + std::chrono::milliseconds(opt.grace_ms);
  };

  for (;;) {
    // Reap exited ranks; note stopped and continued ones.
    for (int r = 0; r < opt.nprocs; ++r) {
      Rank &rk = ranks[r];
      if (!rk.running) continue;
      int st = 0;
      pid_t p = waitpid(rk.pid, &st, WNOHANG | WUNTRACED | WCONTINUED);
      if (p != rk.pid) continue;
      if (WIFSTOPPED(st)) {
        rk.stopped_since = Clock::now();
        rk.stop_signal = WSTOPSIG(st);
        continue;
      }
      if (WIFCONTINUED(st)) {
        rk.stopped_since = Clock::time_point::max();
        continue;
      }
      rk.running = false;
      rk.status = st;
      int code = exit_code(st);
      if (code != 0 && failed_rank < 0 && !stopping) {
        failed_rank = r;
        failed_code = code;
        retry = retryable(st);
        std::fprintf(stderr, "ctr: launch: rank %d exited with status %d; stopping the job\n", r, code);
        begin_stop();
      }
    }
    // A rank stopped too long is as good as hung: it ends the job (a restart may help).
    auto wake_at = Clock::time_point::max();
    for (int r = 0; r < opt.nprocs && !stopping; ++r) {
      Rank &rk = ranks[r];
      if (!rk.running || rk.stopped_since == Clock::time_point::max()) continue;
      const auto limit = rk.stopped_since + std::chrono::milliseconds(opt.stopped_ms);
      if (Clock::now() >= limit) {
        failed_rank = r;
        failed_code = kExitRetry;
        retry = true;
        std::fprintf(stderr,
                     "ctr: launch: rank %d has been stopped (signal %d) for %.1f s; stopping the "
                     "job\n",
                     r, rk.stop_signal, opt.stopped_ms / 1000.0);
        begin_stop();
      } else {
        wake_at = std::min(wake_at, limit);
      }
    }
    bool any_running = false, any_open = false;
    for (auto &rk : ranks) {
      any_running |= rk.running;
      any_open |= rk.out_fd >= 0 || rk.err_fd >= 0;
    }
    if (!any_running && !any_open) break;

    std::vector<pollfd> fds;
    std::vector<std::pair<int, bool>> who;  // rank, is_err
    fds.push_back({g_sig_pipe[0], POLLIN, 0});
    who.emplace_back(-1, false);
    for (int r = 0; r < opt.nprocs; ++r) {
      if (ranks[r].out_fd >= 0) {
        fds.push_back({ranks[r].out_fd, POLLIN, 0});
        who.emplace_back(r, false);
      }
      if (ranks[r].err_fd >= 0) {
        fds.push_back({ranks[r].err_fd, POLLIN, 0});
        who.emplace_back(r, true);
      }
    }
    int timeout = -1;
    if (wake_at != Clock::time_point::max())
      timeout = static_cast<int>(std::max<int64_t>(
          1, std::chrono::duration_cast<std::chrono::milliseconds>(wake_at - Clock::now()).count()));
    if (stopping && any_running) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                      stop_deadline - std::chrono::steady_clock::now())
                      .count();
      if (left <= 0) {
        stop_all(SIGKILL);
        timeout = 100;  // reap promptly; SIGCHLD also wakes the loop
      } else {
        timeout = static_cast<int>(left);
      }
    }
    if (!any_running && any_open) timeout = 1000;  // drain pipes held open by grandchildren
    int n = poll(fds.data(), fds.size(), timeout);
    if (n < 0 && errno != EINTR) break;
    if (n == 0 && !any_running) {
      // Pipes kept open by a process the rank left behind: stop reading them.
      for (auto &rk : ranks) {
        if (rk.out_fd >= 0) close(rk.out_fd), rk.out_fd = -1;
        if (rk.err_fd >= 0) close(rk.err_fd), rk.err_fd = -1;
      }
      continue;
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      if (who[i].first < 0) {
        unsigned char sigs[64];
        ssize_t got = read(g_sig_pipe[0], sigs, sizeof sigs);
        for (ssize_t k = 0; k < got; ++k) {
          int sig = sigs[k];
          if (sig == SIGCHLD) continue;
          std::fprintf(stderr, "ctr: launch: received signal %d, forwarding to all ranks\n", sig);
          stop_all(sig);
          stop_all(SIGCONT);
          signalled = true;
          if (!stopping) {
            stopping = true;
            failed_code = 128 + sig;
            stop_deadline = Clock::now() + std::chrono::milliseconds(opt.grace_ms);
          }
        }
        continue;
      }
      Rank &rk = ranks[who[i].first];
      int &fd = who[i].second ? rk.err_fd : rk.out_fd;
      std::string &buf = who[i].second ? rk.err_buf : rk.out_buf;
      char tmp[65536];
      ssize_t got = read(fd, tmp, sizeof tmp);
      if (got > 0) {
        buf.append(tmp, static_cast<size_t>(got));
        emit(who[i].first, buf, who[i].second ? stderr : stdout, false);
      } else if (got == 0 || (got < 0 && errno != EINTR && errno != EAGAIN)) {
        emit(who[i].first, buf, who[i].second ? stderr : stdout, true);
        close(fd);
        fd = -1;
      }
    }
  }
  for (auto &rk : ranks) {
    if (rk.running) {
      kill(rk.pid, SIGKILL);
      waitpid(rk.pid, &rk.status, 0);
    }
  }
  if (signalled) return {failed_code, false};  // the launcher was told to stop
  if (failed_rank >= 0) return {failed_code, retry};
  if (failed_code) return {failed_code, false};
  for (auto &rk : ranks)
    if (exit_code(rk.status) != 0) return {exit_code(rk.status), retryable(rk.status)};
  return {0, false};
}

}  // namespace

}  // namespace ctr_tool
