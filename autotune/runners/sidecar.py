"""The vLLM server of a server-mode trial: start it in its own session, wait for its health
endpoint, stop it and what it started (see :mod:`autotune.runners.trl`, which re-exports these)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil

from autotune import configs as lc
from autotune.trial.launch import LaunchSpec
from autotune.trial.layout import TrialFiles
from autotune.trial.processes import PID_FILE, TRIAL_ENV, kill_group, kill_marked, process_tree

__all__ = ["listens", "port_in_use", "start_sidecar", "stop_sidecar", "vllm_health_url", "wait_health"]

log = logging.getLogger(__name__)


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something already listens on ``port`` (it answers, or the port cannot be bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        if probe.connect_ex((host, port)) == 0:
            return True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return True
    return False


def vllm_health_url(port: int = lc.DEFAULT_VLLM_SERVER_PORT, host: str = "127.0.0.1") -> str:
    """Where ``trl vllm-serve`` answers when ready (TRL's client polls the same path)."""
    return f"http://{host}:{port}/health/"


def start_sidecar(spec: LaunchSpec) -> subprocess.Popen:
    """Start a sidecar in its own session, output to its folder's stdout.log / stderr.log.

    Its own process group lets :func:`stop_sidecar` end it and the engine processes it starts; its
    pid file (``<folder>/pid``) and the ``AUTOTUNE_TRIAL_DIR`` marker let a resume find it after a
    crash. Raises RuntimeError when its port is already taken (a stale or foreign server would
    answer for it).
    """
    if spec.port is not None and port_in_use(spec.port):
        raise RuntimeError(f"port {spec.port} for the vLLM server is already in use by another process")
    spec.trial_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **spec.env}
    env.setdefault(TRIAL_ENV, str(spec.trial_dir))
    files = TrialFiles(spec.trial_dir)
    with open(files.stdout, "ab") as out, open(files.stderr, "ab") as err:
        proc = subprocess.Popen(
            spec.argv,
            env=env,
            cwd=spec.cwd or spec.trial_dir,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    try:
        (spec.trial_dir / PID_FILE).write_text(f"{proc.pid}\n")
    except OSError as exc:
        log.warning("cannot write the sidecar's pid file: %s", exc)
    return proc


def listens(proc: subprocess.Popen, port: int) -> bool:
    """Whether ``proc`` or one of its descendants listens on TCP ``port``."""
    for member in process_tree(proc.pid):
        try:
            conns = member.net_connections(kind="tcp")
        except psutil.Error:  # gone, AccessDenied
            continue
        if any(c.status == "LISTEN" and c.laddr and c.laddr.port == port for c in conns):
            return True
    return False


def wait_health(
    url: str, timeout_s: float, proc: subprocess.Popen | None = None, interval_s: float = 1.0
) -> float:
    """Poll ``GET url`` until it answers 200; return the seconds it took.

    With ``proc``, an answer counts only while ``proc`` runs and listens on the URL's port itself:
    another server on that port (a stale one, someone else's) is not ours. Raises RuntimeError when
    ``proc`` exits first (a vLLM startup failure: read its stderr.log) and TimeoutError after
    ``timeout_s``.
    """
    start = time.monotonic()
    port = urllib.parse.urlsplit(url).port or 80
    foreign_noted = False
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with status {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=min(5.0, interval_s * 5)) as response:
                answered = response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            answered = False
        if answered and (proc is None or (proc.poll() is None and listens(proc, port))):
            return time.monotonic() - start
        if answered and not foreign_noted:
            log.warning("%s answered, but not from our vLLM server: ignored", url)
            foreign_noted = True
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"the vLLM server did not answer {url} within {timeout_s:.0f} s")
        time.sleep(interval_s)


def stop_sidecar(
    proc: subprocess.Popen, grace_s: float = 10.0, *, pid_dir: Path | None = None, marker: Path | None = None
) -> None:
    """End a sidecar and its process group (SIGTERM, then SIGKILL), then what carries ``marker``
    (``AUTOTUNE_TRIAL_DIR``) outside it; remove ``pid_dir``'s pid file."""
    if proc.poll() is None:
        kill_group(proc.pid, grace_s=grace_s, leader=proc)
    proc.wait()
    if marker is not None:
        kill_marked(marker, grace_s=min(grace_s, 2.0))
    if pid_dir is not None:
        (pid_dir / PID_FILE).unlink(missing_ok=True)
