"""The sandbox's seccomp filter: a second wall behind the namespaces, compiled once to the classic-BPF program
bubblewrap loads (``--seccomp FD``) before it starts the launcher.

Built with libseccomp (the system's ``libseccomp2``, through ``pyseccomp``: its ctypes binding with the API of
libseccomp's own Python module) rather than hand-written BPF: libseccomp resolves syscall numbers per
architecture and adds the architecture check (a syscall made through another ABI, e.g. 32-bit ``int 0x80``
on x86-64, kills the process), the classic mistakes of hand-rolled filters.

Policy: allow by default, refuse with EPERM the syscalls a Python program has no use for and kernel exploits
and escapes are made of (the kernel-facing subset of Docker's default deny list): namespaces and mounts (also
refused by the missing capabilities and ``--disable-userns``: here they fail even if those did not), tracing
and cross-process memory access, keyrings, eBPF, perf events, userfaultfd (a classic exploit primitive),
io_uring (a large recent attack surface), module loading, kexec, clocks, swap, reboot, handles by inode. And
``socket``/``socketpair`` in any address family but AF_UNIX, AF_INET and AF_INET6 (EAFNOSUPPORT): netlink,
packet, AF_ALG, AF_VSOCK and the other families are kernel surface a program has no use for (the network
namespace leaves IP nothing but its own loopback).
"""

from __future__ import annotations

import functools
import os

DENIED = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount",
    "fsconfig", "fspick", "mount_setattr", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "add_key",
    "request_key", "keyctl", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "name_to_handle_at", "open_by_handle_at", "lookup_dcookie", "iopl", "ioperm", "uselib",
    "vhangup", "personality", "sethostname", "setdomainname",
)
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6: the only ones socket() and socketpair() may make
EAFNOSUPPORT = 97


class SeccompUnavailable(RuntimeError):
    """libseccomp (or its binding) cannot be loaded here."""


@functools.lru_cache(maxsize=1)
def program() -> bytes:
    """The compiled filter (classic BPF, the host's architecture)."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError, RuntimeError) as e:  # the binding, or the libseccomp.so.2 it loads
        raise SeccompUnavailable(f"libseccomp cannot be loaded ({e})") from None
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in DENIED:
        try:
            f.add_rule(sc.ERRNO(1), name)  # EPERM
        except (RuntimeError, ValueError, OSError):  # a syscall this architecture does not have
            continue
    for call in ("socket", "socketpair"):  # family (argument 0) not in SOCKET_FAMILIES: one rule per gap
        lo = 0
        for fam in (*SOCKET_FAMILIES, None):
            if fam is None:
                f.add_rule(sc.ERRNO(EAFNOSUPPORT), call, sc.Arg(0, sc.GE, lo))
                break
            for v in range(lo, fam):
                f.add_rule(sc.ERRNO(EAFNOSUPPORT), call, sc.Arg(0, sc.EQ, v))
            lo = fam + 1
    fd = os.memfd_create("seccomp-bpf")
    try:
        with os.fdopen(os.dup(fd), "wb") as out:
            f.export_bpf(out)
        os.lseek(fd, 0, os.SEEK_SET)
        size = os.fstat(fd).st_size
        return os.read(fd, size)
    finally:
        os.close(fd)
