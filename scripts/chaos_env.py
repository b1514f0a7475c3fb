"""The fault-injection soak's dealings with the system (scripts/chaos.py): the job's
processes, network namespaces, a small tmpfs, checkpoint files and their tensors."""

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
from pathlib import Path


# ---------------------------------------------------------------------------------------
# Processes


def proc_ids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def read_proc(pid, name):
    try:
        with open(f"/proc/{pid}/{name}", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def proc_stat(pid):
    """(state, ppid, session) of `pid`, or None."""
    raw = read_proc(pid, "stat").decode(errors="replace")
    if not raw:
        return None
    fields = raw[raw.rfind(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[3])


def children(pid):
    return [p for p in proc_ids() if (s := proc_stat(p)) and s[1] == pid]


def job_processes(marker, sessions):
    """Live processes of a job: in one of its sessions, or with `marker` (the run's config
    path) in their command line or ZRUN_RUN_ID in their environment."""
    found = []
    me = os.getpid()
    for pid in proc_ids():
        if pid == me:
            continue
        st = proc_stat(pid)
        if st is None or st[0] == "Z":
            continue
        cmd = read_proc(pid, "cmdline")
        if st[2] in sessions or marker.encode() in cmd:
            found.append((pid, cmd.replace(b"\0", b" ").decode(errors="replace").strip()))
    return found


def kill_all(marker, sessions):
    for pid, _ in job_processes(marker, sessions):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(*cmd):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# ---------------------------------------------------------------------------------------
# Capabilities: a small filesystem, network namespaces


class Netns:
    """Two namespaces joined by a veth pair: node 0 at 10.213.0.1, node 1 at 10.213.0.2."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.ns = [f"zchaos{tag}a", f"zchaos{tag}b"]
        self.dev = [f"zc{tag}a", f"zc{tag}b"]
        self.addr = ["10.213.0.1", "10.213.0.2"]
        self.up = False

    def create(self):
        steps = [
            ["ip", "netns", "add", self.ns[0]],
            ["ip", "netns", "add", self.ns[1]],
            ["ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1]],
        ]
        for i in range(2):
            steps += [
                ["ip", "link", "set", self.dev[i], "netns", self.ns[i]],
                ["ip", "-n", self.ns[i], "addr", "add", f"{self.addr[i]}/24", "dev", self.dev[i]],
                ["ip", "-n", self.ns[i], "link", "set", "lo", "up"],
                ["ip", "-n", self.ns[i], "link", "set", self.dev[i], "up"],
            ]
        self.up = True
        for cmd in steps:
            r = sh(*cmd)
            if r.returncode != 0:
                self.destroy()
                return f"`{' '.join(cmd)}` failed: {r.stdout.strip()}"
        return None

    def link(self, up):
        sh("ip", "-n", self.ns[0], "link", "set", self.dev[0], "up" if up else "down")

    def destroy(self):
        if self.up:
            for ns in self.ns:
                sh("ip", "netns", "del", ns)
            self.up = False


def can_mount_tmpfs(base):
    d = Path(tempfile.mkdtemp(prefix="tmpfs-probe-", dir=base))
    try:
        r = sh("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d))
        if r.returncode != 0:
            return f"cannot mount a tmpfs: {r.stdout.strip() or 'mount failed'}"
        sh("umount", str(d))
        return None
    except OSError as e:
        return f"cannot mount a tmpfs: {e}"
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# Checkpoints and results


def complete_checkpoints(ckpt_dir):
    """Complete checkpoints (with a manifest), oldest first."""
    try:
        names = sorted(os.listdir(ckpt_dir))
    except OSError:
        return []
    return [ckpt_dir / n for n in names
            if n.startswith("step-") and n[5:].isdigit() and (ckpt_dir / n / "manifest.json").exists()]


def flip_byte(ckpt, rank, rng):
    """Flips one byte of `ckpt`'s rank file; returns a description."""
    path = ckpt / f"rank-{rank:05d}.safetensors"
    size = path.stat().st_size
    off = rng.randrange(size)
    with open(path, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)[0]
        fh.seek(off)
        fh.write(bytes([b ^ (1 << rng.randrange(8))]))
        fh.flush()
        os.fsync(fh.fileno())
    return f"{path.parent.name}/{path.name} byte {off} of {size}"


def safetensors_tensors(path):
    """{name: raw bytes} of a safetensors file (its metadata left out)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    return {k: data[base + v["data_offsets"][0]:base + v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}


def compare_tensors(a, b, skip=()):
    """Names of tensors that differ between two safetensors files (or are in only one),
    leaving out names that start with one of `skip`."""
    ta, tb = safetensors_tensors(a), safetensors_tensors(b)
    return sorted(k for k in set(ta) | set(tb) if ta.get(k) != tb.get(k) and not k.startswith(tuple(skip)))
