"""The sandbox's in-interpreter guard, as source code run before the model's program.

Why:
1. The spawned bootstrap (``sandbox.py``) and the fork server's children (``forkserver.py``) must
   refuse exactly the same things, so both run this one source: ``_install_guard(root)`` installs
   an audit hook for a program whose working directory is ``root``.
2. What it refuses and what it lets through is listed in ``sandbox.py``'s point 7 and tried, escape
   by escape, in ``tests/envs/test_sandbox_escape_on_cpu.py``.
3. The hook's state (the root, the allowed folders) lives in a closure, so user code that rebinds
   module globals cannot loosen it, and the gc walks that would reach the closure are refused.
4. It is source, not a function, because the sandboxed interpreter runs with ``-I -S`` and cannot
   import this package.
"""

GUARD_SOURCE = r"""
def _install_guard(root):
    import os, sys
    denied = frozenset({
        "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
        "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo",
        "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
        "os.forkpty", "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata",
        "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    })
    no_import = frozenset({"_posixsubprocess"})  # fork_exec raises no audit event of its own
    changes = frozenset({"os.mkdir", "os.rmdir", "os.remove", "os.rename", "os.symlink", "os.link",
                         "os.chmod", "os.chown", "os.truncate", "os.utime", "os.setxattr",
                         "os.removexattr", "os.chflags", "os.lchflags", "os.lchmod"})
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    realpath, fsdecode, own = os.path.realpath, os.fsdecode, os.getpid()
    root = realpath(root)
    readable = tuple({root, "/proc/%d" % own, "/usr/share/zoneinfo"}
                     | {realpath(p) for p in sys.path if p and os.path.isdir(p)})
    read_files = frozenset({"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/etc/localtime"})

    def under(path, bases):
        if path is None or isinstance(path, int):
            return True  # an open file descriptor: its path was checked when it was opened
        try:
            full = realpath(fsdecode(path))
        except (TypeError, ValueError, OSError):
            return False
        return any(full == b or full.startswith(b + "/") for b in bases)

    def deny(what):
        raise PermissionError("sandbox: " + what + " is denied (no network, no new processes, "
                              "writes only inside the working directory)")

    def guard(event, args):
        if event in denied or (event == "socket.__new__" and args[1] != 1):  # 1 == AF_UNIX
            deny(event)
        elif event == "open":
            if args[2] & write_flags:
                if not under(args[0], (root,)):
                    deny("writing " + str(args[0]))
            elif not (args[0] in read_files or under(args[0], readable)):
                deny("reading " + str(args[0]))
        elif event in changes:
            for arg in args:
                if isinstance(arg, (str, bytes)) and not under(arg, (root,)):
                    deny(event + " on " + str(arg))
        elif event in ("os.listdir", "os.scandir"):
            if args and not under(args[0], readable):
                deny("listing " + str(args[0]))
        elif event in ("os.kill", "os.killpg"):
            if args[0] not in (0, own):
                deny("signalling process " + str(args[0]))
        elif event == "import" and args[0] in no_import:
            deny("importing " + args[0])

    sys.addaudithook(guard)
"""
