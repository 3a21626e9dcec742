#!/usr/bin/python3
"""The rendezvous against strangers: processes that are not ranks of the job connect to rank
0's store, pose as rank 0, flood it with connections or publish forged transport addresses.
Every real rank must either go on unharmed or fail with a clear error (never abort, never
hang), and a job that could be joined by anyone must refuse to start.

usage: test_rendezvous.py CTR  (with CTR_LIBRARY naming libctr.so)
"""
import os
import resource
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

CTR = os.path.abspath(sys.argv[1])
BINDING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python")
PROTOCOL = b"ctr-rendezvous/3"
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------
# The store's wire format: frames of a little-endian u32 length and a body.

def frame(body):
    return struct.pack("<I", len(body)) + body


def s_(b):
    return struct.pack("<I", len(b)) + b


def hello(rank, world, nonce=b"n" * 16, protocol=PROTOCOL):
    return frame(b"\x01" + s_(protocol) + struct.pack("<qq", rank, world) + s_(nonce))


def read_frame(sock, timeout=10.0):
    sock.settimeout(timeout)
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    n = struct.unpack("<I", head)[0]
    body = b""
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        if not chunk:
            return None
        body += chunk
    return body


def read_str(body, at):
    n = struct.unpack_from("<I", body, at)[0]
    return body[at + 4:at + 4 + n], at + 4 + n


def error_text(body):
    """The message of an error reply, or None for OK."""
    if body is None or body[0] == 0:
        return None
    return read_str(body, 1)[0].decode(errors="replace")


def connect(port, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=2)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# ---------------------------------------------------------------------------------------
# Ranks: Python processes on the binding, which join, report, wait for a line on stdin,
# then train one step together (proving the communicator works) and exit.

RANK_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, ctr
    opts = dict(rank=int(sys.argv[1]), world=2, master_port=int(sys.argv[2]), timeout=float(sys.argv[3]))
    if sys.argv[4]:
        opts["job_token"] = sys.argv[4]
    try:
        m = ctr.Mesh(**opts)
    except ctr.Error as e:
        print("mesh failed:", e, flush=True)
        sys.exit(3)
    print("joined", flush=True)
    sys.stdin.readline()
    g = ctr.Graph.preset("gpt", layers=1, dim=16, heads=2, vocab=32, seq=8)
    s = ctr.Step(m, g, batch=2)
    ids = (np.arange(16, dtype=np.int32) % 32).reshape(2, 8)
    s.set_input("tokens", ids)
    s.set_input("targets", ids)
    print("trained", s.run()["loss"], flush=True)
""")


def start_rank(rank, port, timeout_s, token, nofile=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTR_") or k == "CTR_LIBRARY"}
    env["CTR_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = BINDING
    limit = ["prlimit", f"--nofile={nofile}:{nofile}"] if nofile else []
    return subprocess.Popen([*limit, sys.executable, "-c", RANK_SCRIPT, str(rank), str(port), str(timeout_s), token],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def finish_ranks(procs, limit_s=60):
    outs = []
    for p in procs:
        try:
            p.stdin.write("go\n")
            p.stdin.flush()
        except BrokenPipeError:
            pass
    for p in procs:
        try:
            outs.append(p.communicate(timeout=limit_s))
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate())
            failures.append("a rank hung")
    return outs


def wait_listening(port, limit_s=20):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


def strangers_against_a_token_job():
    """Flood, early requests, wrong proofs and idle connections against rank 0 of a job
    with a token; the two real ranks then join and train."""
    port, token = free_port(), "s3cret-token"
    timeout_s = 4.0  # also the admission deadline (clamped to 1..10 s)
    r0 = start_rank(0, port, 30.0, token)
    check(wait_listening(port), "rank 0 never listened")

    # Raise our own descriptor limit so the flood can exceed rank 0's default.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    flood = []
    for _ in range(1500):
        try:
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            break
    check(len(flood) >= 1100, f"could open only {len(flood)} connections")

    # A request before HELLO.
    with connect(port) as s:
        s.sendall(frame(b"\x03" + s_(b"k") + s_(b"v")))
        msg = error_text(read_frame(s))
        check(msg and "before being admitted" in msg, f"request before HELLO: {msg!r}")
    # Another protocol.
    with connect(port) as s:
        s.sendall(hello(1, 2, protocol=b"ctr-rendezvous/1"))
        msg = error_text(read_frame(s))
        check(msg and "another rendezvous protocol" in msg, f"old protocol: {msg!r}")
    # A stranger without the token: rank 0 proves itself first, the stranger cannot.
    with connect(port) as s:
        s.sendall(hello(1, 2))
        body = read_frame(s)
        check(body is not None and body[0] == 0, "HELLO was not answered with a challenge")
        nonce, at = read_str(body, 1)
        tag, _ = read_str(body, at)
        check(len(nonce) == 16 and len(tag) == 32, f"challenge of {len(nonce)}/{len(tag)} bytes")
        check(token.encode() not in body, "rank 0 sent its token")
        s.sendall(frame(b"\x07" + s_(b"\x00" * 32)))
        msg = error_text(read_frame(s))
        check(msg and "job token mismatch" in msg, f"forged proof: {msg!r}")
    # A connection that never says anything is closed at the admission deadline.
    idle = connect(port)
    t0 = time.monotonic()
    body = read_frame(idle, timeout=timeout_s + 20)
    waited = time.monotonic() - t0
    msg = error_text(body)
    check(msg and "was not admitted within" in msg, f"idle connection: {msg!r}")
    check(waited < 10 + 5, f"idle connection closed after {waited:.1f} s")
    idle.close()
    # The flood was cut down to the cap, oldest first.
    closed = 0
    for s in flood:
        s.setblocking(False)
        try:
            s.recv(1 << 16)  # a refusal, or the end of the stream
            closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    check(closed >= len(flood) - 200, f"only {closed} of {len(flood)} idle connections were closed")

    r1 = start_rank(1, port, 30.0, token)
    for p, name in ((r0, "rank 0"), (r1, "rank 1")):
        line = p.stdout.readline()
        check(line.strip() == "joined", f"{name} did not join: {line!r}")
    outs = finish_ranks([r0, r1])
    for r, (p, (out, err)) in enumerate(zip([r0, r1], outs)):
        check(p.returncode == 0 and "trained" in out, f"rank {r} after the flood: {p.returncode} {out} {err}")
    for s in flood:
        s.close()


def out_of_descriptors():
    """Rank 0 limited to few descriptors (a hard limit it cannot raise) and flooded: the
    strangers' connections give way, and the real rank 1 still joins and trains."""
    port, token = free_port(), "fd-token"
    r0 = start_rank(0, port, 30.0, token, nofile=NOFILE)
    check(wait_listening(port), "rank 0 never listened")
    flood = []
    for _ in range(3 * NOFILE):
        try:
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            break
    r1 = start_rank(1, port, 30.0, token)
    for p, name in ((r0, "rank 0"), (r1, "rank 1")):
        line = p.stdout.readline()
        check(line.strip() == "joined", f"{name} did not join past the flood: {line!r}")
    for s in flood:
        s.close()
    outs = finish_ranks([r0, r1])
    for r, (p, (out, err)) in enumerate(zip([r0, r1], outs)):
        check(p.returncode == 0 and "trained" in out, f"rank {r} out of descriptors: {p.returncode} {out} {err}")
    check("out of file descriptors" in outs[0][1], f"rank 0 never ran out of descriptors: {outs[0][1]}")


NOFILE = 64


class FakeStore(threading.Thread):
    """A process posing as rank 0: answers HELLO with a given tag, then admits, and serves
    `forged` for every GET."""

    def __init__(self, port, tag, forged=b"junk"):
        super().__init__(daemon=True)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        self.tag, self.forged = tag, forged

    def run(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(c,), daemon=True).start()

    def serve(self, c):
        try:
            while True:
                body = read_frame(c, timeout=60)
                if body is None:
                    return
                kind = body[0]
                if kind == 1:
                    c.sendall(frame(b"\x00" + s_(os.urandom(16)) + s_(self.tag)))
                elif kind == 4:
                    c.sendall(frame(b"\x00" + s_(self.forged)))
                elif kind == 5:
                    c.sendall(frame(b"\x00" + struct.pack("<q", 1)))
                else:
                    c.sendall(frame(b"\x00"))
        except OSError:
            return


def ctr_rank(rank, port, extra_env, limit_s=60, world=2):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTR_")}
    env.update({"CTR_RANK": str(rank), "CTR_WORLD_SIZE": str(world), "CTR_MASTER_PORT": str(port)})
    env.update(extra_env)
    return subprocess.run([CTR, "run", GRAPH, "--mesh", f"fsdp={world}", "--batch", "2", "--steps", "2",
                           "--timeout", "10"],
                          capture_output=True, text=True, env=env, timeout=limit_s)


def impostors():
    # With a token: a store that does not know it is found out before anything is sent.
    port = free_port()
    fake = FakeStore(port, tag=os.urandom(32))
    fake.start()
    t0 = time.monotonic()
    p = ctr_rank(1, port, {"CTR_JOB_TOKEN": "abc"})
    check(p.returncode not in (0, -6, 134) and "does not hold this job's token" in p.stderr,
          f"impostor with a token job: {p.returncode} {p.stderr}")
    check(time.monotonic() - t0 < 15, "finding out the impostor took too long")
    fake.sock.close()

    # Without a token, an impostor of the same user is admitted by design, but what it
    # serves as a transport address is refused before it reaches UCX.
    port = free_port()
    fake = FakeStore(port, tag=b"", forged=os.urandom(300))
    fake.start()
    p = ctr_rank(1, port, {})
    check(p.returncode not in (0, -6, 134) and "refusing the transport address published as rank 0" in p.stderr,
          f"forged address from an impostor: {p.returncode} {p.stderr}")
    fake.sock.close()

    # A store that asks for a token the rank does not have.
    port = free_port()
    fake = FakeStore(port, tag=os.urandom(32))
    fake.start()
    p = ctr_rank(1, port, {})
    check(p.returncode != 0 and "requires a job token" in p.stderr, f"token expected: {p.returncode} {p.stderr}")
    fake.sock.close()


def forged_address_from_a_stranger():
    """A tokenless job on loopback: a stranger of the same user joins as rank 1 and
    publishes junk for its transport address; rank 0 refuses it with a clear error."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTR_")}
    env.update({"CTR_RANK": "0", "CTR_WORLD_SIZE": "2", "CTR_MASTER_PORT": str(port)})
    r0 = subprocess.Popen([CTR, "run", GRAPH, "--mesh", "fsdp=2", "--batch", "2", "--steps", "2",
                           "--timeout", "10"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    check(wait_listening(port), "rank 0 never listened")
    s = connect(port)
    s.sendall(hello(1, 2))
    body = read_frame(s)
    check(body is not None and body[0] == 0, f"tokenless HELLO refused: {error_text(body)}")
    s.sendall(frame(b"\x07" + s_(b"")))
    check(error_text(read_frame(s)) is None, "tokenless proof refused")
    s.sendall(frame(b"\x02" + struct.pack("<qq", 5000, 5000)))
    check(error_text(read_frame(s)) is None, "join refused")
    for key, value in ((b"ucx/0/host/1", b"elsewhere\n1\n1"), (b"ucx/0/addr/1", os.urandom(200))):
        s.sendall(frame(b"\x03" + s_(key) + s_(value)))
        read_frame(s)
    try:
        out, err = r0.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        r0.kill()
        out, err = r0.communicate()
        failures.append("rank 0 hung on a forged address")
    check(r0.returncode not in (0, -6, 134) and "refusing the transport address published as rank 1" in err,
          f"forged address: rank 0 exited {r0.returncode}: {err}")
    s.close()


def other_user():
    """A process of another user cannot join a tokenless job (needs root to become one)."""
    if os.geteuid() != 0:
        print("rendezvous: other-user check skipped: not root")
        return
    port = free_port()
    r0 = start_rank(0, port, 8.0, "")
    check(wait_listening(port), "rank 0 never listened")
    code = ("import socket,struct,sys\n"
            f"s=socket.create_connection(('127.0.0.1',{port}))\n"
            f"s.sendall({hello(1, 2)!r})\n"
            "s.settimeout(10); print(s.recv(4096))\n")
    p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=30)
    check("belongs to user id 65534" in p.stdout, f"another user's HELLO: {p.stdout} {p.stderr}")
    r0.kill()
    r0.communicate()


def local_address():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent for a UDP connect
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def addresses():
    port = free_port()
    p = ctr_rank(0, port, {"CTR_MASTER_ADDR": "no-such-host.invalid", "CTR_JOB_TOKEN": "t"})
    check(p.returncode != 0 and "cannot resolve rank 0's address 'no-such-host.invalid'" in p.stderr,
          f"unresolvable address: {p.returncode} {p.stderr}")
    p = ctr_rank(0, port, {"CTR_MASTER_ADDR": "192.0.2.1", "CTR_JOB_TOKEN": "t"})
    check(p.returncode != 0 and "cannot listen on 192.0.2.1" in p.stderr and "rank 0's own host" in p.stderr,
          f"foreign address: {p.returncode} {p.stderr}")
    addr = local_address()
    if addr is None:
        print("rendezvous: non-loopback checks skipped: this host has no other address")
        return
    p = ctr_rank(0, port, {"CTR_MASTER_ADDR": addr})
    check(p.returncode != 0 and "not a loopback address and the job has no token" in p.stderr
          and "CTR_JOB_TOKEN" in p.stderr, f"tokenless on {addr}: {p.returncode} {p.stderr}")
    # Opting out, or with a token, a job on that address trains.
    for extra in ({"CTR_ALLOW_NO_TOKEN": "1"}, {"CTR_JOB_TOKEN": "xyz"}):
        port = free_port()
        env = dict(extra, CTR_MASTER_ADDR=addr)
        results = [None, None]

        def run(r):
            results[r] = ctr_rank(r, port, env)
        ts = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for r, p in enumerate(results):
            check(p is not None and p.returncode == 0, f"{extra} on {addr}: rank {r}: {p and p.stderr}")


def main():
    global GRAPH
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        GRAPH = os.path.join(d, "g.ctrg")
        subprocess.run([CTR, "graph", "build", "--preset", "gpt", "--layers", "1", "--dim", "16", "--heads", "2",
                        "--vocab", "256", "--seq", "8", "-o", GRAPH], check=True, capture_output=True)
        for part in (strangers_against_a_token_job, out_of_descriptors, impostors, forged_address_from_a_stranger, other_user,
                     addresses):
            t0 = time.monotonic()
            part()
            print(f"rendezvous: {part.__name__} done in {time.monotonic() - t0:.1f} s", flush=True)
    if failures:
        print(f"{len(failures)} failure(s):")
        for f in failures:
            print(" -", f)
        return 1
    print("rendezvous: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
