"""Inside the Python sandbox (grpo_lib/tools/sandbox.py): the stage, pid 1 of the sandbox's PID namespace, and the
code child it forks, which locks itself in and runs the model's code. A script run by a fresh `python -I -S -B`; it
imports nothing of grpo_lib (-I keeps the trainer's paths out of it).

    python -I -S -B stage.py '<spec as JSON>' < code.py

The stage (our code: the model's code never runs in it)
    - mounts its working directory /work as a tmpfs bounded in bytes and inodes (it holds CAP_SYS_ADMIN of the
      sandbox's own user namespace for this one mount), then forks the code child;
    - holds the status pipe, the only channel of the sandbox's outcome: a "started" record once the child's layers are
      up, then {"exit": n} or {"signal": n, "cpu_s": t} from wait4. The child closes the pipe before any code runs,
      and cannot reach the stage (no /proc, ptrace and pidfd_getfd refused, not dumpable, signals to pid 1 of a PID
      namespace from inside it are dropped), so no exit code or signal of the code can pass for the sandbox's own.
The code child, before it runs a line of the code (each layer is the kernel's, so ctypes meets them all the same):
    1. identity      uid/gid 65534 (host nobody where the trainer is root), no supplementary group, every capability
                     dropped (effective, permitted, inheritable, ambient, the bounding set), checked with capget
    2. rlimits       CPU (SIGXCPU at cpu_s), AS (memory_bytes: a larger allocation is a MemoryError), FSIZE, NOFILE,
                     CORE 0, NPROC (max_tasks: threads; counted per user namespace, so per call)
    3. Landlock      read (and execute) only under read_roots, write only under /work and /dev/null; TCP bind/connect
                     refused (ABI >= 4); signals and abstract unix sockets outside the sandbox refused (ABI >= 6)
    4. seccomp       refused (EPERM): socket, socketpair, fork / vfork / clone of a process (threads are allowed),
                     execve, ptrace, process_vm_*, every mount call (old and new API), unshare, setns, bpf, io_uring,
                     keyctl, handles (open_by_handle_at), setpriority, ioprio_set; kill / tgkill / sigqueue, prlimit64
                     and sched_set* only on its own pid (x86_64 only: another architecture has no filter)
Where bubblewrap cannot start (isolation: best_effort only) the stage runs on the host instead ("direct"): it unshares
a user + network + mount namespace itself where it can; the layers it lacks are named in the report.
"""

import ast
import ctypes
import json
import os
import resource
import signal
import struct
import sys
import traceback

_libc = ctypes.CDLL(None, use_errno=True)
WORKDIR = "/work"  # the code's directory inside bubblewrap (a fixed name: no host path reaches the model)


def _errno() -> str:
    return os.strerror(ctypes.get_errno())


# -- the stage's set-up ---------------------------------------------------------------------------------------------

def mount_tmpfs(path: str, *, size_bytes: int, inodes: int, uid: int, gid: int) -> str | None:
    """A tmpfs of size_bytes and `inodes` files over `path`, owned by the code's uid; why it failed, else None."""
    ms_nosuid, ms_nodev, ms_noexec = 2, 4, 8
    options = f"size={size_bytes},nr_inodes={inodes},mode=0700,uid={uid},gid={gid}".encode()
    if _libc.mount(b"tmpfs", path.encode(), b"tmpfs", ms_nosuid | ms_nodev | ms_noexec, options) != 0:
        return f"mount(tmpfs): {_errno()}"
    os.chdir(path)  # onto the new mount
    return None


def enter_namespaces() -> tuple[str | None, bool]:
    """best_effort without bubblewrap: a user + network + mount namespace, the user's own ids mapped;
    (why it failed or None, whether the mount namespace is ours)."""
    clone_newuser, clone_newnet, clone_newns = 0x10000000, 0x40000000, 0x00020000
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(clone_newuser | clone_newnet | clone_newns) == 0:
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError as error:
            return f"writing the user namespace's id maps: {error}", False
        return "no PID, IPC or UTS namespace (bubblewrap did not start)", True
    first = _errno()
    if _libc.unshare(clone_newnet) == 0:  # root where user namespaces are off: the network alone
        return "a network namespace only (bubblewrap did not start)", False
    return f"unshare(CLONE_NEWUSER|CLONE_NEWNET|CLONE_NEWNS): {first}", False


# -- the code child's layers ----------------------------------------------------------------------------------------

def drop_identity(uid: int, gid: int, *, switch: bool) -> str | None:
    """Drop every capability and, with `switch`, become uid/gid (from the stage's uid 0); why not, else None."""
    pr_capbset_drop, pr_cap_ambient, ambient_clear_all = 24, 47, 4
    for cap in range(64):  # the bounding set first (needs CAP_SETPCAP, which a uid-0 stage has); EINVAL past the last
        if _libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:
            break
    _libc.prctl(pr_cap_ambient, ambient_clear_all, 0, 0, 0)
    try:
        if switch and os.getuid() == 0:  # the stage is the namespace's root: leave it for the code's ids
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)  # from uid 0 to another: the kernel clears the capabilities
    except OSError as error:
        return f"switching to uid {uid}: {error}"
    header, data = struct.pack("=Ii", 0x20080522, 0), ctypes.create_string_buffer(24)  # _LINUX_CAPABILITY_VERSION_3
    _libc.syscall(126, header, data)  # capset: all zero
    if _libc.syscall(125, header, data) != 0 or any(data.raw):  # capget
        return f"capabilities left after dropping them: {data.raw.hex()}"
    return None


def set_rlimits(limits: dict) -> str | None:
    try:
        for name, value in (("RLIMIT_CORE", 0), ("RLIMIT_FSIZE", limits["file_bytes"]),
                            ("RLIMIT_NOFILE", limits["max_open_files"]), ("RLIMIT_AS", limits["memory_bytes"]),
                            ("RLIMIT_NPROC", limits["max_tasks"])):
            resource.setrlimit(getattr(resource, name), (value, value))
        # SIGXCPU at the soft limit (a traceback-free kill), SIGKILL one second later if it is caught
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    except (OSError, ValueError) as error:
        return f"setrlimit: {error}"
    return None


# Landlock (linux/landlock.h)
_LL_CREATE, _LL_ADD, _LL_RESTRICT = 444, 445, 446  # the same numbers on every architecture (new syscall table)
_FS_FILE = 1 | 2 | 4  # EXECUTE, WRITE_FILE, READ_FILE
_FS_READ = 1 | 4 | 8  # EXECUTE, READ_FILE, READ_DIR
_FS_ALL_V1 = (1 << 13) - 1  # EXECUTE .. MAKE_SYM
_FS_EXTRA = {2: 1 << 13, 3: 1 << 14, 5: 1 << 15}  # REFER (ABI 2), TRUNCATE (3), IOCTL_DEV (5)


def apply_landlock(read_roots: list[str], write_roots: list[str]) -> tuple[int, str | None]:
    """(Landlock ABI, why it failed or None). Files outside the roots, TCP, outside signals: refused from here on."""
    abi = _libc.syscall(_LL_CREATE, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return 0, f"Landlock is not available ({_errno()})"
    fs_all = _FS_ALL_V1
    for version, bit in _FS_EXTRA.items():
        fs_all |= bit if abi >= version else 0
    fields = [fs_all] + ([1 | 2] if abi >= 4 else []) + ([1 | 2] if abi >= 6 else [])  # net: BIND|CONNECT; scope: UNIX|SIGNAL
    attr = struct.pack(f"{len(fields)}Q", *fields)
    ruleset = _libc.syscall(_LL_CREATE, attr, len(attr), 0)
    if ruleset < 0:
        return abi, f"landlock_create_ruleset: {_errno()}"
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
            return abi, f"landlock_add_rule({path}): {_errno()}"
    if _libc.syscall(_LL_RESTRICT, ruleset, 0) != 0:
        return abi, f"landlock_restrict_self: {_errno()}"
    os.close(ruleset)
    return abi, None


# seccomp
_AUDIT_ARCH_X86_64 = 0xC000003E
_X86_64_REFUSED = {  # syscall numbers (asm/unistd_64.h) refused with EPERM
    "socket": 41, "socketpair": 53, "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "ptrace": 101,
    "process_vm_readv": 310, "process_vm_writev": 311, "unshare": 272, "setns": 308, "mount": 165, "umount2": 166,
    "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
    "fsmount": 432, "fspick": 433, "mount_setattr": 442, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "bpf": 321, "perf_event_open": 298, "keyctl": 250, "add_key": 248, "request_key": 249, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "kexec_load": 246, "reboot": 169, "swapon": 167, "swapoff": 168,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "userfaultfd": 323,
    "pidfd_open": 434, "pidfd_send_signal": 424, "pidfd_getfd": 438, "setpriority": 141, "ioprio_set": 251,
}
_X86_64_CLONE, _X86_64_CLONE3 = 56, 435
_X86_64_OWN_PID = {"kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297,
                   "prlimit64": 302, "sched_setparam": 142, "sched_setscheduler": 144, "sched_setaffinity": 203,
                   "sched_setattr": 314}


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
    for name, nr in _X86_64_OWN_PID.items():  # its own pid (0: itself; for kill, process group 0 / -pid) only
        own = [own_pid, 0, -own_pid] if name == "kill" else [own_pid, 0]
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
        return f"prctl(PR_SET_SECCOMP): {_errno()}"
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


def code_child(spec: dict, report_fd: int, code: str, layers: dict) -> None:
    """Lock in, report the layers to the stage, close the report pipe, run the code; never returns."""
    os.dup2(1, 2)  # the code's stderr is its stdout: the one pipe the parent reads
    os.closerange(3, report_fd)  # whatever bubblewrap or the stage left open (its block pipe, the status pipe)
    os.closerange(report_fd + 1, 1 << 16)
    layers["identity"] = drop_identity(spec["uid"], spec["gid"], switch=spec["mode"] == "bwrap") or \
        (f"runs as the trainer's uid {spec['host_uid']} (no bubblewrap)" if spec["mode"] != "bwrap" else None)
    if _libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: no setuid binary regains what is taken
        layers["no_new_privs"] = f"prctl(PR_SET_NO_NEW_PRIVS): {_errno()}"
    layers["rlimits"] = set_rlimits(spec)
    abi, layers["landlock"] = apply_landlock(spec["read_roots"], spec["write_roots"])
    layers["landlock_net"] = None if abi >= 4 else f"Landlock ABI {abi} < 4: no TCP rules (the network namespace has no route)"
    layers["landlock_scope"] = None if abi >= 6 else \
        f"Landlock ABI {abi} < 6: no signal / abstract-socket scoping (the PID and network namespaces hold them)"
    layers["seccomp"] = apply_seccomp()
    missing = {k: v for k, v in layers.items() if v is not None}
    refuse = spec["strict"] and bool(set(missing) & set(spec["required"]))
    os.write(report_fd, json.dumps({"landlock_abi": abi, "missing": missing, "refuse": refuse}).encode())
    os.close(report_fd)
    if spec["report_layers"] or refuse:
        os._exit(0)
    if missing.get("landlock"):
        audit_fallback(spec["read_roots"], spec["write_roots"])
    import site  # -S skipped it: exit() / quit() / help() as a normal interpreter has them, no .pth file run

    site.setquit()
    site.sethelper()
    sys.path.extend(spec["site_dirs"])
    status = run_code(code)
    try:
        sys.stdout.flush()
    except OSError:
        pass  # the code closed its stdout
    os._exit(status if isinstance(status, int) else 1)


def main() -> None:
    spec = json.loads(sys.argv[1])
    status_fd = spec["status_fd"]
    os.set_inheritable(status_fd, False)

    def record(**fields) -> None:
        os.write(status_fd, (json.dumps(fields) + "\n").encode())

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no process of the same uid may trace or read the stage
    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    layers: dict = {}
    if spec["mode"] == "bwrap":
        layers["namespaces"] = None  # user, PID, IPC, UTS, network, mount, cgroup: bubblewrap's --unshare-all
        layers["tmpfs"] = mount_tmpfs(WORKDIR, size_bytes=spec["dir_bytes"], inodes=spec["dir_inodes"],
                                      uid=spec["uid"], gid=spec["gid"])
    else:
        layers["namespaces"], own_mounts = enter_namespaces()
        layers["tmpfs"] = mount_tmpfs(os.getcwd(), size_bytes=spec["dir_bytes"], inodes=spec["dir_inodes"],
                                      uid=os.getuid(), gid=os.getgid()) if own_mounts else "no mount namespace of its own"
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(report_r)
            os.close(status_fd)
            code_child(spec, report_w, code, layers)
        finally:
            os._exit(70)  # only reached if code_child itself failed: no report, so the stage says so
    os.close(report_w)
    report = b""
    while chunk := os.read(report_r, 65536):
        report += chunk
    os.close(report_r)
    try:
        report = json.loads(report)
    except ValueError:
        report = None
    if report is None or report["refuse"] or spec["report_layers"]:
        _, wait_status, _ = os.wait4(pid, 0)
        record(layers=report, error=None if report else f"the code child ended before its report (wait status {wait_status})")
        os._exit(0)
    record(started=True)
    _, wait_status, usage = os.wait4(pid, 0)
    if os.WIFSIGNALED(wait_status):
        record(signal=os.WTERMSIG(wait_status), cpu_s=usage.ru_utime + usage.ru_stime)
    else:
        record(exit=os.WEXITSTATUS(wait_status))
    os._exit(0)


if __name__ == "__main__":
    main()
