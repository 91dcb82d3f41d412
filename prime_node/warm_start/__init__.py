"""Warm starts: processes forked, ready, from a server that imported torch, transformers and libp2p once.

A prime-node process spends most of its start importing (about 5 CPU-seconds for torch and transformers
and 2 for libp2p on a 2-core machine), and the demo starts six of them at once. A warm-start server
(``server.py``, a "zygote") imports those libraries and runs nothing else, so it can fork safely; each
command it is asked for becomes a forked child (``child.py``) that is a session leader with the caller's
argv, environment, working directory and stdio, exactly as a fresh process would have. The owner
(``launcher.py``) gets a Popen-like handle (``process.py``) whose ``pid`` is the real process, so
signals, process groups and ``/proc`` work as with ``subprocess.Popen``; only the parent differs.
``wire.py`` is the request and reply format on the server's Unix socket. ``rank_stub.py`` is what
torchrun starts for a rank when a server is named: it asks for the rank warm and stands in for it.
"""
