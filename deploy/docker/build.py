"""Build the service images here (`make images`): python deploy/docker/build.py [IMAGE ...].

    llmserve/gateway:VERSION  llmserve/router:VERSION  llmserve/conversations:VERSION
    llmserve/worker:VERSION-cpu   (worker-cpu.Dockerfile; the CUDA worker.Dockerfile is for clusters)

VERSION is pyproject.toml's. No image registry is reachable from these machines, so the images
start from a Debian base made here (debootstrap of the machine's own suite and mirror, with its
python3, then `docker import`) passed as the Dockerfiles' PYTHON_IMAGE; elsewhere the defaults
(python:3.11-slim-bookworm) apply. pip installs from PyPI; the wheels in PIP_FIND_LINKS (the torch
CPU build) are served to the builds over loopback, so they never enter the build context or a layer.

The Docker engine: the one `docker info` reaches (DOCKER_HOST or the default socket), else a private
dockerd started for the run (as root; data in LLMSERVE_DOCKER_ROOT, default /var/lib/llmserve-docker,
so the layer cache outlives the run) and stopped, by its pid, at the end.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = REPO / "deploy" / "docker"
DOCKER_ROOT = Path(os.environ.get("LLMSERVE_DOCKER_ROOT", "/var/lib/llmserve-docker"))
# Short: the daemon's sockets live under it, and a unix socket path has at most 107 bytes.
DOCKER_RUN = Path(os.environ.get("LLMSERVE_DOCKER_RUN", "/run/llmserve-docker"))
# The local base: Debian's python3 (bookworm: 3.11) and venv, nothing else.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
# The wheel server's port: a fixed one, since PIP_FIND_LINKS (its URL) is part of the cache key of
# every pip layer.
WHEELS_PORT = int(os.environ.get("LLMSERVE_WHEELS_PORT", "47999"))
BASE_TRIM = ("usr/share/doc/*", "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*",
             "var/cache/apt/*", "var/lib/apt/lists/*", "var/log/*")


class EngineError(RuntimeError):
    """No Docker engine, or no way to start one, or a tool for the base image missing."""


def version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


@dataclass(frozen=True)
class Image:
    name: str          # deploy/docker/<name>.Dockerfile
    service: str       # python -m services.<service>
    tag_suffix: str = ""

    @property
    def dockerfile(self) -> Path:
        return DOCKERFILES / f"{self.name}.Dockerfile"

    @property
    def ref(self) -> str:
        return f"llmserve/{self.service}:{version()}{self.tag_suffix}"


IMAGES = (Image("gateway", "gateway"), Image("router", "router"), Image("conversations", "conversations"),
          Image("worker-cpu", "worker", "-cpu"))


@dataclass
class Engine:
    """A Docker engine to talk to; `started` is the dockerd this run started (None: one was running)."""
    env: dict[str, str]
    started: subprocess.Popen | None = None

    def docker(self, *args: str, check: bool = True, capture: bool = True, timeout: float | None = None,
               stdin=None) -> subprocess.CompletedProcess:
        result = subprocess.run(["docker", *args], env=self.env, text=True, timeout=timeout, stdin=stdin,
                                capture_output=capture)
        if check and result.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:3])} ... failed ({result.returncode}):\n"
                               f"{result.stderr if capture else ''}")
        return result

    def has_image(self, ref: str) -> bool:
        return self.docker("image", "inspect", ref, check=False).returncode == 0


def _answers(env: dict[str, str]) -> bool:
    return subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30).returncode == 0


@contextmanager
def engine() -> Iterator[Engine]:
    """The running engine if `docker info` reaches one, else a private dockerd for the duration."""
    if shutil.which("docker") is None:
        raise EngineError("no docker client: apt-get install docker.io")
    # The classic builder: BuildKit wants the buildx plugin with newer clients; the Dockerfiles use
    # nothing only BuildKit has, and build the same under it.
    env = {"DOCKER_BUILDKIT": "0", **os.environ}
    if _answers(env):
        yield Engine(env)
        return
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        raise EngineError("no Docker engine answers and none can be started here "
                         "(dockerd runs as root: apt-get install docker.io, run as root)")
    DOCKER_RUN.mkdir(parents=True, exist_ok=True)
    DOCKER_ROOT.mkdir(parents=True, exist_ok=True)
    env["DOCKER_HOST"] = f"unix://{DOCKER_RUN / 'docker.sock'}"
    log = open(DOCKER_RUN / "dockerd.log", "ab")
    # No bridge and no iptables rules on a shared machine: builds and containers use --network host.
    daemon = subprocess.Popen(
        ["dockerd", "--iptables=false", "--ip6tables=false", "--bridge=none",
         "--data-root", str(DOCKER_ROOT), "--exec-root", str(DOCKER_RUN / "exec"),
         "--pidfile", str(DOCKER_RUN / "dockerd.pid"), "--host", env["DOCKER_HOST"]],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    try:
        deadline = time.monotonic() + 60
        while not _answers(env):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise EngineError(f"dockerd did not start; its log: {DOCKER_RUN / 'dockerd.log'}")
            time.sleep(0.5)
        yield Engine(env, daemon)
    finally:
        daemon.terminate()   # dockerd stops its containers and its own containerd
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        _unmount_under(DOCKER_RUN)


def _unmount_under(folder: Path) -> None:
    """What a stopped dockerd leaves mounted in its exec root (the host's netns handle)."""
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if Path(m).is_relative_to(folder)), reverse=True):
        subprocess.run(["umount", mount], check=False)


def _os_release() -> dict[str, str]:
    lines = Path("/etc/os-release").read_text().splitlines()
    return {k: v.strip('"') for k, _, v in (line.partition("=") for line in lines) if k}


def base_ref() -> str:
    return f"llmserve-local/debian-python:{_os_release().get('VERSION_CODENAME', 'bookworm')}"


def ensure_base(docker: Engine) -> str:
    """The local base image, made once: a minimal Debian root of this machine's suite with python3."""
    ref = base_ref()
    if docker.has_image(ref):
        return ref
    if shutil.which("debootstrap") is None:
        raise EngineError("no debootstrap: apt-get install debootstrap")
    suite = ref.rsplit(":", 1)[1]
    mirror = os.environ.get("LLMSERVE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    with tempfile.TemporaryDirectory(prefix="llmserve-base-", dir=DOCKER_ROOT.parent) as scratch:
        root = Path(scratch) / "root"
        print(f"making {ref}: debootstrap {suite} from {mirror}", flush=True)
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                        suite, str(root), mirror], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(f"cd {root} && rm -rf {' '.join(BASE_TRIM)}", shell=True, check=True)
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        docker.docker("import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                      "--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["python3"]',
                      "-m", f"debootstrap --variant=minbase {suite} + {' '.join(BASE_PACKAGES)}",
                      "-", ref, stdin=tar.stdout)
        tar.stdout.close()
        if tar.wait() != 0:
            raise RuntimeError("tar of the Debian root failed")
    python = docker.docker("run", "--rm", "--network", "none", ref, "python3", "--version").stdout.strip()
    print(f"{ref}: {python}", flush=True)
    return ref


@contextmanager
def served_wheels() -> Iterator[str]:
    """PIP_FIND_LINKS's directories served on a loopback port for the builds (--network host):
    the value to pass as the builds' PIP_FIND_LINKS, or "" when there is none."""
    folders = [Path(p) for p in os.environ.get("PIP_FIND_LINKS", "").split() if Path(p).is_dir()]
    if not folders:
        yield ""
        return
    handler = functools.partial(_QuietHandler, directory=str(folders[0]))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), handler)
    except OSError:   # taken: any port serves, but the address is part of the layers' cache keys
        print(f"port {WHEELS_PORT} is taken: the wheels on another port rebuild the pip layers", flush=True)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="wheels", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def _git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else ""


def local_ca_certificates() -> str:
    """The CA certificates this machine's admin added (Debian: /usr/local/share/ca-certificates),
    e.g. a TLS-inspecting egress proxy's, which pip in the builds must trust too."""
    folder = Path(os.environ.get("LLMSERVE_EXTRA_CA_DIR", "/usr/local/share/ca-certificates"))
    return "\n".join(p.read_text().strip() for p in sorted(folder.glob("**/*.crt")))


def build(docker: Engine, images: tuple[Image, ...] = IMAGES, base: str = "") -> dict[str, float]:
    """Builds each image (the layer cache makes an unchanged one a no-op); returns seconds each took."""
    base = base or ensure_base(docker)
    build_args = {"VERSION": version(),
              "SOURCE": _git("config", "--get", "remote.origin.url") or f"file://{REPO}",
              "REVISION": _git("rev-parse", "HEAD"), "EXTRA_CA_CERTS": local_ca_certificates()}
    took = {}
    with served_wheels() as find_links:
        for image in images:
            args = ["build", "--network", "host", "-f", str(image.dockerfile), "-t", image.ref,
                    "--build-arg", f"PYTHON_IMAGE={base}"]
            args += [a for k, v in build_args.items() for a in ("--build-arg", f"{k}={v}")]
            if find_links:
                args += ["--build-arg", f"PIP_FIND_LINKS={find_links}"]
            print(f"building {image.ref} from {image.dockerfile.relative_to(REPO)}", flush=True)
            started = time.monotonic()
            docker.docker(*args, str(REPO), capture=False)
            took[image.ref] = time.monotonic() - started
    return took


def size_mb(docker: Engine, ref: str) -> float:
    return int(docker.docker("image", "inspect", "-f", "{{.Size}}", ref).stdout) / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images", nargs="*", help=f"which to build: {', '.join(i.name for i in IMAGES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = set(args.images) - {i.name for i in IMAGES}
    if unknown:
        parser.error(f"unknown images {sorted(unknown)}")
    chosen = tuple(i for i in IMAGES if not args.images or i.name in args.images)
    try:
        with engine() as docker:
            took = build(docker, chosen)
            sizes = {image.ref: size_mb(docker, image.ref) for image in chosen}
    except EngineError as e:
        print(f"make images: {e}", file=sys.stderr)
        return 1
    print("\nimage                               size      build")
    for image in chosen:
        print(f"{image.ref:<35} {sizes[image.ref]:>6.0f} MB  {took[image.ref]:>5.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
