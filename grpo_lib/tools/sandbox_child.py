"""The child side of the Python sandbox (grpo_lib/tools/sandbox.py): run as a script by a fresh `python -I`, it locks
itself in, then runs the model's code read from stdin. It imports nothing of grpo_lib (it runs before any isolation
is up, and `-I` keeps the trainer's paths out of it).

    python -I -B sandbox_child.py '<limits as JSON>' < code.py      # cwd: a fresh temporary directory

The layers, in the order they go up (each is the kernel's, so code that calls the C library itself through ctypes
meets them all the same; none needs root):

    1. rlimits      RLIMIT_CPU (SIGXCPU at cpu_s), RLIMIT_AS (memory_bytes: a larger allocation is a MemoryError),
                    RLIMIT_FSIZE (a file written past file_bytes fails), RLIMIT_NOFILE, RLIMIT_CORE 0; no RLIMIT_NPROC:
                    it counts every process of the user (the trainer's too, and root ignores it), so seccomp refuses
                    fork instead, and RLIMIT_AS bounds threads (each reserves its stack)
    2. namespaces   unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS): a network with only a loopback that is
                    down (no route anywhere, 127.0.0.1 included), no capability left in the trainer's user
                    namespace, and a mount namespace of its own, where the working directory becomes a tmpfs of
                    dir_bytes (what the code writes cannot fill the disk; without it, file_bytes per file only)
    3. Landlock     files: read (and execute) only under read_roots (the Python installation, /usr, /lib*), read and
                    write only under the working directory and /dev/null; TCP bind / connect refused (ABI >= 4);
                    signals to any process outside the sandbox and abstract unix sockets refused (ABI >= 6)
    4. seccomp      a filter that refuses (EPERM) socket(), fork / vfork / clone of a process (threads are allowed),
                    execve, kill / tgkill / sigqueue of any pid but its own, ptrace, process_vm_*, mount, unshare,
                    setns, bpf, io_uring, keyctl, module and reboot calls (x86_64; another architecture has none)

Every layer that could not be set is named in `layers` of the report; the parent refuses to run (isolation "strict")
when Landlock or seccomp is missing. Exit status 97 with a "sandbox:" line: a required layer failed before any code ran.
"""

import ast
import ctypes
import json
import os
import resource
import struct
import sys
import traceback

SANDBOX_FAILED = 97
_libc = ctypes.CDLL(None, use_errno=True)


def _fail(message: str) -> None:
    sys.stdout.write(f"sandbox: {message}\n")
    sys.stdout.flush()
    os._exit(SANDBOX_FAILED)


def set_rlimits(limits: dict) -> None:
    for name, value in (("RLIMIT_CORE", 0), ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_NOFILE", limits["max_open_files"]),
                        ("RLIMIT_AS", limits["memory_bytes"])):
        resource.setrlimit(getattr(resource, name), (value, value))
    # SIGXCPU at the soft limit (a traceback-free kill), SIGKILL one second later if it is caught
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))


def enter_namespaces() -> tuple[str | None, bool]:
    """A new user + network + mount namespace, the user's own uid and gid mapped (files it writes keep them);
    (why it failed or None, whether a mount namespace is ours)."""
    clone_newuser, clone_newnet, clone_newns = 0x10000000, 0x40000000, 0x00020000
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(clone_newuser | clone_newnet | clone_newns) == 0:
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError as error:
            return f"writing the user namespace's id maps: {error}", False
        return None, True
    first = os.strerror(ctypes.get_errno())
    if _libc.unshare(clone_newnet) == 0:  # root where user namespaces are off: the network alone
        return None, False
    return f"unshare(CLONE_NEWUSER|CLONE_NEWNET|CLONE_NEWNS): {first}", False


def mount_workdir(size_bytes: int) -> str | None:
    """A tmpfs of size_bytes over the working directory (in our mount namespace only), so the files the code writes
    cannot fill the disk; the reason it failed, else None."""
    cwd = os.getcwd().encode()
    ms_nosuid, ms_nodev = 2, 4
    if _libc.mount(b"tmpfs", cwd, b"tmpfs", ms_nosuid | ms_nodev, f"size={size_bytes},mode=0700".encode()) != 0:
        return f"mount(tmpfs): {os.strerror(ctypes.get_errno())}"
    os.chdir(cwd)  # onto the new mount
    return None


# -- Landlock (linux/landlock.h) ----------------------------------------------------------------------------------

_LL_CREATE, _LL_ADD, _LL_RESTRICT = 444, 445, 446  # the same numbers on every architecture (new syscall table)
_FS_FILE = 1 | 2 | 4  # EXECUTE, WRITE_FILE, READ_FILE
_FS_READ = 1 | 4 | 8  # EXECUTE, READ_FILE, READ_DIR
_FS_ALL_V1 = (1 << 13) - 1  # EXECUTE .. MAKE_SYM
_FS_EXTRA = {2: 1 << 13, 3: 1 << 14, 5: 1 << 15}  # REFER (ABI 2), TRUNCATE (3), IOCTL_DEV (5)


def apply_landlock(read_roots: list[str], write_roots: list[str]) -> tuple[int, str | None]:
    """(Landlock ABI, why it failed or None). Files outside the roots, TCP, outside signals: refused from here on."""
    abi = _libc.syscall(_LL_CREATE, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return 0, f"Landlock is not available ({os.strerror(ctypes.get_errno())})"
    fs_all = _FS_ALL_V1
    for version, bit in _FS_EXTRA.items():
        fs_all |= bit if abi >= version else 0
    fields = [fs_all] + ([1 | 2] if abi >= 4 else []) + ([1 | 2] if abi >= 6 else [])  # net: BIND|CONNECT; scope: UNIX|SIGNAL
    attr = struct.pack(f"{len(fields)}Q", *fields)
    ruleset = _libc.syscall(_LL_CREATE, attr, len(attr), 0)
    if ruleset < 0:
        return abi, f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}"
    file_all = _FS_FILE | (_FS_EXTRA[3] if abi >= 3 else 0)
    rules = [(p, _FS_READ) for p in read_roots] + [(p, fs_all) for p in write_roots] + [("/dev/null", _FS_FILE & ~1)]
    for path, access in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a root that does not exist here (no /lib64): nothing to allow
        if not os.path.isdir(path):
            access &= file_all  # a file takes file rights only
        rule = struct.pack("=Qi", access, fd)  # struct landlock_path_beneath_attr (packed)
        ok = _libc.syscall(_LL_ADD, ruleset, 1, rule, 0) == 0  # LANDLOCK_RULE_PATH_BENEATH
        os.close(fd)
        if not ok:
            return abi, f"landlock_add_rule({path}): {os.strerror(ctypes.get_errno())}"
    if _libc.syscall(_LL_RESTRICT, ruleset, 0) != 0:
        return abi, f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}"
    os.close(ruleset)
    return abi, None


# -- seccomp ------------------------------------------------------------------------------------------------------

_AUDIT_ARCH_X86_64 = 0xC000003E
_X86_64_REFUSED = {  # syscall numbers (asm/unistd_64.h) refused with EPERM
    "socket": 41, "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "ptrace": 101, "process_vm_readv": 310,
    "process_vm_writev": 311, "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155,
    "chroot": 161, "bpf": 321, "perf_event_open": 298, "keyctl": 250, "add_key": 248, "request_key": 249,
    "init_module": 175, "finit_module": 313, "delete_module": 176, "kexec_load": 246, "reboot": 169, "swapon": 167,
    "swapoff": 168, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "userfaultfd": 323,
    "pidfd_send_signal": 424, "pidfd_getfd": 438,
}
_X86_64_CLONE, _X86_64_CLONE3 = 56, 435
_X86_64_SIGNAL_OWN = {"kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)  # struct sock_filter


def seccomp_program(own_pid: int) -> bytes:
    """The BPF filter: the arch check, then one block per special syscall; everything else is allowed."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38
    arg0 = 16  # offsetof(struct seccomp_data, args[0]), its low 32 bits (little-endian)
    p = [_insn(ld, 4), _insn(jeq, _AUDIT_ARCH_X86_64, 1, 0), _insn(ret, kill), _insn(ld, 0),
         _insn(jge, 0x40000000, 0, 1), _insn(ret, eperm)]  # the x32 ABI's numbers: refused
    for nr in _X86_64_REFUSED.values():
        p += [_insn(jeq, nr, 0, 1), _insn(ret, eperm)]
    # clone: a thread (CLONE_THREAD) yes, a process no; clone3 hides its flags in memory: ENOSYS makes libc use clone
    p += [_insn(jeq, _X86_64_CLONE, 0, 4), _insn(ld, arg0), _insn(jset, 0x10000, 0, 1), _insn(ret, allow), _insn(ret, eperm)]
    p += [_insn(jeq, _X86_64_CLONE3, 0, 1), _insn(ret, enosys)]
    for name, nr in _X86_64_SIGNAL_OWN.items():  # a signal to its own pid (or process group 0 / -pid for kill) only
        own = [own_pid, 0, -own_pid] if name == "kill" else [own_pid]
        p += [_insn(jeq, nr, 0, len(own) + 3), _insn(ld, arg0)]
        p += [_insn(jeq, value, len(own) - i, 0) for i, value in enumerate(own)]
        p += [_insn(ret, eperm), _insn(ret, allow)]
    p.append(_insn(ret, allow))
    return b"".join(p)


def apply_seccomp() -> str | None:
    """Install the filter (needs no_new_privs, set before); the reason it could not be, else None."""
    if os.uname().machine != "x86_64":
        return f"seccomp filter written for x86_64 only, this is {os.uname().machine}"
    program = seccomp_program(os.getpid())
    buffer = ctypes.create_string_buffer(program)
    fprog = struct.pack("=HxxxxxxQ", len(program) // 8, ctypes.addressof(buffer))  # struct sock_fprog
    if _libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        return f"prctl(PR_SET_SECCOMP): {os.strerror(ctypes.get_errno())}"
    return None


def audit_fallback(read_roots: list[str], write_roots: list[str]) -> None:
    """Where Landlock is missing (isolation: best_effort): an audit hook refusing open() outside the roots and the
    process / socket calls. It is NOT a security boundary: ctypes calls the C library around it."""
    readable = tuple(os.path.realpath(p) + os.sep for p in read_roots + write_roots)
    writable = tuple(os.path.realpath(p) + os.sep for p in write_roots)
    refused = {"os.system", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.kill", "os.killpg",
               "subprocess.Popen", "socket.__new__", "socket.connect", "os.putenv"}

    def hook(event, args):
        if event in refused:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and isinstance(args[0], (str, bytes)):
            path = os.path.realpath(os.fsdecode(args[0])) + os.sep
            writing = isinstance(args[1], str) and any(c in args[1] for c in "wax+")
            if not path.startswith(writable if writing else readable) and path != "/dev/null" + os.sep:
                raise PermissionError(f"sandbox: no access to {os.fsdecode(args[0])!r}")

    sys.addaudithook(hook)


def run_code(code: str) -> int:
    """Run `code` as __main__; a last bare expression's value is printed, as a REPL would. Returns the exit status."""
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(code, "<code>")
        tail = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<code>", "exec"), scope)
        if tail is not None:
            value = eval(compile(ast.Expression(tail.value), "<code>", "eval"), scope)
            if value is not None:
                print(repr(value))
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    except BaseException as error:  # the model's code failed: its traceback is the answer, without this file's frames
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == "<code>"]
        lines = code.splitlines()
        for f in frames:
            f._line = lines[f.lineno - 1] if f.lineno and f.lineno <= len(lines) else ""
        sys.stdout.write("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)))
        sys.stdout.write("".join(traceback.format_exception_only(type(error), error)))
        return 1
    return 0


def main() -> None:
    limits = json.loads(sys.argv[1])
    code = sys.stdin.read()
    os.close(0)
    set_rlimits(limits)
    layers = {"rlimits": None}
    layers["namespaces"], own_mounts = enter_namespaces()
    layers["tmpfs"] = mount_workdir(limits["dir_bytes"]) if own_mounts else "no mount namespace of its own"
    if _libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: no setuid binary regains what is taken
        _fail(f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
    abi, layers["landlock"] = apply_landlock(limits["read_roots"], [os.getcwd()])
    if layers["landlock"] is None and abi < 6:
        layers["landlock_signals"] = f"Landlock ABI {abi} < 6 scopes no signals (seccomp refuses them)"
    layers["seccomp"] = apply_seccomp()
    missing = {k: v for k, v in layers.items() if v is not None}
    if limits["report_layers"]:
        print(json.dumps({"landlock_abi": abi, "missing": missing}))
        sys.stdout.flush()
        os._exit(0)
    if limits["strict"] and (missing.get("landlock") or missing.get("seccomp")):
        _fail("; ".join(f"{k}: {v}" for k, v in missing.items()))
    if missing.get("landlock"):
        audit_fallback(limits["read_roots"], [os.getcwd()])
    status = run_code(code)
    sys.stdout.flush()
    os._exit(status if isinstance(status, int) else 1)


if __name__ == "__main__":
    main()
