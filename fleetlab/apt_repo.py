"""The lab's signed apt repository: stand-ins for NVIDIA's driver and CUDA packages, served beside the index.

A real fleet installs the GPU driver from NVIDIA's CUDA apt repository (or a mirror of it): a
*flat* repository per distribution (``<mirror>/debian12/x86_64/``, ``ubuntu2204/x86_64/``,
``ubuntu2404/x86_64/``, used as ``deb [signed-by=...] <url> /``), signed with NVIDIA's archive key.
The lab builds the same shape for its Debian 12 hosts, so ``fleet``'s deploy runs the very apt
commands it would run on a real host, signature checking included:

* packages built with ``dpkg-deb --root-owner-group`` from trees written here, one per name and
  driver version, with the names NVIDIA's Debian 12 repository uses (see ``PACKAGES``);
* ``Packages``/``Packages.gz`` from ``dpkg-scanpackages --multiversion``; a ``Release`` with the
  SHA-256 of both, signed with ``gpg`` into ``InRelease`` (clear-signed) and ``Release.gpg``;
* the signing key generated once per lab and kept in the lab's state dir (``apt-key/``, private);
  hosts get only the public key, as a binary keyring file (``archive-keyring.gpg``) that the
  deploy installs under ``/etc/apt/keyrings`` and names in ``Signed-By``.

The repository lives under the package index's root (``<lab>/index/apt/``) so the index's one
detached HTTP server on 127.0.0.1 serves both (``fleetlab.index.ensure_index``).

What the stand-in driver does on a host, the way a real one does (NVIDIA driver README,
"Installing the driver"; Debian's ``nvidia-kernel-dkms`` postinst): installing it puts the
userspace library in place (``libnvidia-ml.so.<version>`` and its ``.so.1`` link, from
``libnvidia-ml1``) but the kernel module is only loaded at the next boot, so until the host
restarts NVML answers ``NVML_ERROR_DRIVER_NOT_LOADED`` and ``/var/run/reboot-required`` says why.
In the lab "loading the module" is a boot-time unit from ``nvidia-kernel-open-dkms``: it copies
the host's hardware description (written by the lab, like the PCI devices a real host has) into
the place the simulated NVML library reads, stamped with this driver's version, and writes
``/proc/driver/nvidia/version``.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path

from fleet.plan.cuda import compat_lib_dir, compat_package, toolkit_dir, toolkit_package
from fleetlab.errors import LabError
from fleetlab.hostfiles import HARDWARE_PROFILE, NVML_PROFILE_PATH, PROC_DRIVER_SOURCE
from fleetlab.index import ensure_index, index_root
from fleetlab.locks import file_lock

#: Driver versions the lab repository offers. 580.95.05 is the driver the lab's GPU profiles
#: describe; 580.82.07 is an older release of the same branch, so pinning is observable (apt
#: alone would take the newest).
DRIVER_VERSIONS: tuple[str, ...] = ("580.82.07", "580.95.05")
#: CUDA toolkits the lab repository offers (``cuda-toolkit-X-Y``: version X.Y.Z), and the CUDA
#: versions it has forward-compatibility packages for (``cuda-compat-X-Y``, versioned, as NVIDIA's
#: are, by the driver its ``libcuda.so.1`` comes from).
CUDA_TOOLKITS: tuple[str, ...] = ("12.9.1", "13.0.2")
CUDA_COMPAT: tuple[tuple[str, str], ...] = (("13.0", "580.95.05"),)
DEB_REVISION = "1"
#: NVIDIA's repository path for the lab's distribution (Debian 12) on this machine's arch.
DIST_PATH = "debian12/" + {"aarch64": "sbsa"}.get(platform.machine(), platform.machine())
#: Bump when the package recipes below change, so an old build is not reused.
RECIPE_VERSION = 2
KEY_UID = "fleet lab archive signing key <apt@fleet-lab.invalid>"

#: Inside a lab host: where the loaded "module" puts the profile the NVML library reads (the
#: package links ``NVML_PROFILE_PATH`` here; /run is empty after every boot).
LOADED_PROFILE = "/run/fleet-lab/driver/nvml-profile"
MODULE_UNIT = "fleet-lab-nvidia-module.service"


def _triplet() -> str:
    return f"{platform.machine()}-linux-gnu"


def _deb_arch() -> str:
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


def branch_of(version: str) -> str:
    """The driver branch (``580`` of ``580.95.05``): NVIDIA's package names carry it."""
    return version.split(".", 1)[0]


@dataclass(frozen=True)
class DebFile:
    """One file in a package: path on the host, content (text or bytes), mode; or a symlink."""

    path: str
    content: str | bytes = ""
    mode: int = 0o644
    link_to: str | None = None


@dataclass(frozen=True)
class DebPackage:
    """One stand-in package: control fields, files and maintainer scripts."""

    name: str
    version: str
    description: str
    real: str  #: what the real package of that name is, for the lab's documentation
    files: tuple[DebFile, ...] = ()
    depends: tuple[str, ...] = ()
    postinst: str | None = None
    prerm: str | None = None
    triggers: str | None = None

    @property
    def deb_version(self) -> str:
        return f"{self.version}-{DEB_REVISION}"

    @property
    def filename(self) -> str:
        return f"{self.name}_{self.deb_version}_{_deb_arch()}.deb"


def _load_script(version: str) -> str:
    """The boot-time "module load": what the driver finds, stamped with its version."""
    nvrm = f"NVRM version: NVIDIA UNIX {platform.machine()} Kernel Module  {version}  (fleet lab stand-in)"
    return textwrap.dedent(
        f"""\
        #!/bin/sh
        # Lab stand-in for loading the NVIDIA {version} kernel module at boot. Written by fleet lab.
        set -eu
        hw={HARDWARE_PROFILE}
        mkdir -p "$(dirname {LOADED_PROFILE})" {PROC_DRIVER_SOURCE}/nvidia
        if [ ! -r "$hw" ]; then
            echo "no NVIDIA GPU found (no $hw)" >&2
            exit 0
        fi
        major=$(sed -n 's/^cuda_driver_version=\\([0-9]*\\)[0-9][0-9][0-9]$/\\1/p' "$hw")
        sed -e 's/^driver_version=.*/driver_version={version}/' \\
            -e "s/^nvml_version=.*/nvml_version=$major.{version}/" "$hw" > {LOADED_PROFILE}.tmp
        mv -f {LOADED_PROFILE}.tmp {LOADED_PROFILE}
        printf '%s\\n' '{nvrm}' > {PROC_DRIVER_SOURCE}/nvidia/version
        """
    )


def _packages(version: str, shim: bytes) -> list[DebPackage]:
    branch = branch_of(version)
    deb_version = f"{version}-{DEB_REVISION}"
    lib_dir = f"/usr/lib/{_triplet()}"
    module_unit = textwrap.dedent(
        f"""\
        [Unit]
        Description=Load the NVIDIA {version} kernel module (fleet lab stand-in)
        DefaultDependencies=no
        After=local-fs.target systemd-tmpfiles-setup.service
        Before=sysinit.target nvidia-fabricmanager.service

        [Service]
        Type=oneshot
        RemainAfterExit=yes
        ExecStart=/usr/lib/fleet-lab/nvidia-module/load

        [Install]
        WantedBy=sysinit.target
        """
    )
    fm_unit = textwrap.dedent(
        """\
        [Unit]
        Description=NVIDIA fabric manager service (fleet lab stand-in)
        After=fleet-lab-nvidia-module.service

        [Service]
        Type=simple
        ExecStart=/usr/bin/nv-fabricmanager

        [Install]
        WantedBy=multi-user.target
        """
    )
    fm_daemon = textwrap.dedent(
        f"""\
        #!/bin/sh
        # Lab stand-in for NVIDIA's fabric manager {version}: like the real one it refuses to run
        # against a kernel module of another version.
        loaded=$(sed -n 's/.*Kernel Module[^0-9]*\\([0-9][0-9.]*\\).*/\\1/p' /proc/driver/nvidia/version 2>/dev/null)
        if [ "$loaded" != "{version}" ]; then
            echo "fabric manager {version}: driver version mismatch (loaded: ${{loaded:-none}})" >&2
            exit 1
        fi
        exec sleep infinity
        """
    )
    reboot_note = textwrap.dedent(
        """\
        #!/bin/sh
        set -e
        if [ "$1" = configure ]; then
            systemctl enable fleet-lab-nvidia-module.service >/dev/null 2>&1 || true
            # The module is loaded at the next boot (Debian's update-notifier convention).
            touch /var/run/reboot-required
            grep -qx "$DPKG_MAINTSCRIPT_PACKAGE" /var/run/reboot-required.pkgs 2>/dev/null \\
                || echo "$DPKG_MAINTSCRIPT_PACKAGE" >> /var/run/reboot-required.pkgs
        fi
        """
    )
    return [
        DebPackage(
            "libnvidia-ml1",
            version,
            f"NVIDIA Management Library (NVML) runtime library, {version} (fleet lab stand-in)",
            "libnvidia-ml1: libnvidia-ml.so.1 of the driver (Ubuntu: in libnvidia-compute-<branch>)",
            files=(
                DebFile(f"{lib_dir}/libnvidia-ml.so.{version}", shim, 0o644),
                DebFile(f"{lib_dir}/libnvidia-ml.so.1", link_to=f"libnvidia-ml.so.{version}"),
            ),
            triggers="activate-noawait ldconfig\n",
        ),
        DebPackage(
            "nvidia-kernel-open-dkms",
            version,
            f"NVIDIA open GPU kernel module {version}, loaded at the next boot (fleet lab stand-in)",
            "nvidia-kernel-open-dkms: the open kernel module built by DKMS (Ubuntu: nvidia-dkms-<branch>-open)",
            files=(
                DebFile("/usr/lib/fleet-lab/nvidia-module/load", _load_script(version), 0o755),
                DebFile(f"/lib/systemd/system/{MODULE_UNIT}", module_unit),
                DebFile(NVML_PROFILE_PATH, link_to=LOADED_PROFILE),
            ),
            postinst=reboot_note,
        ),
        DebPackage(
            "nvidia-driver",
            version,
            f"NVIDIA driver metapackage {version} (fleet lab stand-in)",
            "nvidia-driver: the driver metapackage (Ubuntu: nvidia-driver-<branch>-open)",
            depends=(f"libnvidia-ml1 (= {deb_version})", f"nvidia-kernel-open-dkms (= {deb_version})"),
        ),
        DebPackage(
            f"nvidia-fabricmanager-{branch}",
            version,
            f"NVIDIA fabric manager for NVSwitch systems, {version} (fleet lab stand-in)",
            f"nvidia-fabricmanager-{branch}: the NVSwitch fabric manager daemon, same version as the driver",
            files=(
                DebFile("/usr/bin/nv-fabricmanager", fm_daemon, 0o755),
                DebFile("/lib/systemd/system/nvidia-fabricmanager.service", fm_unit),
            ),
        ),
    ]


#: What every CUDA stand-in package says about itself (``README.fleet-lab`` beside its files).
CUDA_README = """\
fleet lab stand-in for NVIDIA's {name} (version {version}).

This is NOT NVIDIA's package: the fleet lab's apt repository (fleetlab/apt_repo.py) builds it so
that `fleet deploy` runs the apt commands it runs against NVIDIA's CUDA repository, and the files
land where the real package puts them. {what}
"""
#: The first line of a stand-in compat ``libcuda.so.1`` (the lab's vLLM stand-in reads the CUDA
#: version after it, as the real CUDA runtime gets it from ``cuDriverGetVersion`` of that library).
COMPAT_MARKER = "fleet-lab-stand-in libcuda.so.1 CUDA"


def _nvcc(version: str) -> str:
    """A stand-in ``nvcc`` that answers ``--version`` as the real one does."""
    major_minor = ".".join(version.split(".")[:2])
    return textwrap.dedent(
        f"""\
        #!/bin/sh
        # fleet lab stand-in for NVIDIA's nvcc {version}: it compiles nothing.
        case "${{1:-}}" in
        --version|-V)
            echo "nvcc: NVIDIA (R) Cuda compiler driver"
            echo "Copyright (c) 2005-2025 NVIDIA Corporation (fleet lab stand-in)"
            echo "Cuda compilation tools, release {major_minor}, V{version}"
            ;;
        *)
            echo "nvcc {version}: fleet lab stand-in, it compiles nothing" >&2
            exit 1
            ;;
        esac
        """
    )


def cuda_packages() -> list[DebPackage]:
    """The CUDA stand-ins: ``cuda-toolkit-X-Y`` (``/usr/local/cuda-X.Y/bin/nvcc``) and
    ``cuda-compat-X-Y`` (``/usr/local/cuda-X.Y/compat/libcuda.so.1``, a placeholder, not a library)."""
    out = []
    for version in CUDA_TOOLKITS:
        mm = ".".join(version.split(".")[:2])
        name = toolkit_package(mm)
        root = toolkit_dir(mm)
        out.append(
            DebPackage(
                name,
                version,
                f"CUDA Toolkit {version} (fleet lab stand-in: nvcc answers --version, nothing else)",
                f"{name}: the CUDA toolkit metapackage (nvcc, libraries, headers in {root})",
                files=(
                    DebFile(f"{root}/bin/nvcc", _nvcc(version), 0o755),
                    DebFile(f"{root}/version.json", f'{{"cuda": {{"name": "CUDA SDK", "version": "{version}"}}}}\n'),
                    DebFile(
                        f"{root}/README.fleet-lab",
                        CUDA_README.format(name=name, version=version, what=f"{root}/bin/nvcc prints its version."),
                    ),
                ),
            )
        )
    for cuda, driver in CUDA_COMPAT:
        name = compat_package(cuda)
        compat = compat_lib_dir(cuda)
        out.append(
            DebPackage(
                name,
                driver,
                f"CUDA {cuda} forward compatibility libraries from driver {driver} (fleet lab stand-in)",
                f"{name}: libcuda.so.1 and friends of driver {driver}, for older drivers on data-centre GPUs",
                files=(
                    DebFile(f"{compat}/libcuda.so.{driver}", f"{COMPAT_MARKER} {cuda} driver {driver}\n"),
                    DebFile(f"{compat}/libcuda.so.1", link_to=f"libcuda.so.{driver}"),
                    DebFile(f"{compat}/libnvidia-ptxjitcompiler.so.{driver}", f"fleet lab placeholder {driver}\n"),
                    DebFile(f"{compat}/libnvidia-ptxjitcompiler.so.1", link_to=f"libnvidia-ptxjitcompiler.so.{driver}"),
                    DebFile(
                        f"{compat}/README.fleet-lab",
                        CUDA_README.format(
                            name=name,
                            version=driver,
                            what="The libraries are placeholders: the lab's vLLM stand-in reads the CUDA version "
                            "from the first libcuda.so.1 on LD_LIBRARY_PATH, as CUDA would load it.",
                        ),
                    ),
                ),
            )
        )
    return out


def lab_packages(shim: Path) -> list[DebPackage]:
    """Every package of the lab repository (all ``DRIVER_VERSIONS``, the CUDA stand-ins)."""
    data = shim.read_bytes()
    return [p for v in DRIVER_VERSIONS for p in _packages(v, data)] + cuda_packages()


# -- building ----------------------------------------------------------------------------------


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, cwd=cwd)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip().splitlines()[-10:]
        raise LabError(f"{what} failed (exit {result.returncode}): {' '.join(cmd)}\n" + "\n".join(tail))
    return result.stdout


def _control(pkg: DebPackage) -> str:
    lines = [
        f"Package: {pkg.name}",
        f"Version: {pkg.deb_version}",
        f"Architecture: {_deb_arch()}",
        "Maintainer: fleet lab <apt@fleet-lab.invalid>",
        "Section: non-free/libs",
        "Priority: optional",
    ]
    if pkg.depends:
        lines.append("Depends: " + ", ".join(pkg.depends))
    lines.append(f"Description: {pkg.description}")
    lines.append(f" Lab stand-in with the name of NVIDIA's package {pkg.real}.")
    return "\n".join(lines) + "\n"


def build_deb(pkg: DebPackage, out_dir: Path) -> Path:
    """Build one package with ``dpkg-deb`` into ``out_dir``."""
    with tempfile.TemporaryDirectory(prefix="fleet-deb-") as tmp:
        tree = Path(tmp) / "tree"
        (tree / "DEBIAN").mkdir(parents=True)
        (tree / "DEBIAN" / "control").write_text(_control(pkg))
        for name, script in (("postinst", pkg.postinst), ("prerm", pkg.prerm)):
            if script:
                path = tree / "DEBIAN" / name
                path.write_text(script)
                path.chmod(0o755)
        if pkg.triggers:
            (tree / "DEBIAN" / "triggers").write_text(pkg.triggers)
        for f in pkg.files:
            target = tree / f.path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if f.link_to is not None:
                target.symlink_to(f.link_to)
                continue
            if isinstance(f.content, bytes):
                target.write_bytes(f.content)
            else:
                target.write_text(f.content)
            target.chmod(f.mode)
        for d in [tree, *[p for p in tree.rglob("*") if p.is_dir() and not p.is_symlink()]]:
            d.chmod(0o755)
        out = out_dir / pkg.filename
        _run(["dpkg-deb", "--root-owner-group", "-Zxz", "--build", str(tree), str(out)], f"building {pkg.filename}")
    return out


def _gpg(home: Path, *args: str) -> list[str]:
    return ["gpg", "--homedir", str(home), "--batch", "--no-tty", *args]


@contextmanager
def _gpg_home(key_dir: Path) -> Iterator[Path]:
    """A throw-away gpg home with the lab's secret key imported (if it exists yet).

    It lives under /tmp, not in the lab's state dir: gpg-agent's socket path must fit in
    ``sun_path`` (108 bytes), which a deep state dir exceeds. The agent gpg starts for it is
    stopped and the home removed on the way out.
    """
    home = Path(tempfile.mkdtemp(prefix="fleet-gpg-", dir="/tmp"))
    try:
        secret = key_dir / "secret.asc"
        if secret.is_file():
            _run(_gpg(home, "--import", str(secret)), "importing the lab's apt signing key")
        yield home
    finally:
        subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "gpg-agent"], capture_output=True, check=False)
        shutil.rmtree(home, ignore_errors=True)


def ensure_key(key_dir: Path) -> tuple[str, Path]:
    """The lab's signing key (generated once): its fingerprint and the public keyring file.

    ``key_dir`` (0700) keeps the secret key (``secret.asc``, 0600, no passphrase: a lab key that
    signs only the lab's own repository), the fingerprint, and the public key as a binary keyring
    (``archive-keyring.gpg``) for hosts' ``Signed-By``.
    """
    public = key_dir / "archive-keyring.gpg"
    fpr_file = key_dir / "fingerprint"
    if fpr_file.is_file() and public.is_file() and (key_dir / "secret.asc").is_file():
        return fpr_file.read_text().strip(), public
    key_dir.mkdir(parents=True, exist_ok=True)
    key_dir.chmod(0o700)
    (key_dir / "secret.asc").unlink(missing_ok=True)
    with _gpg_home(key_dir) as home:
        _run(
            _gpg(home, "--pinentry-mode", "loopback", "--passphrase", "", "--quick-gen-key", KEY_UID, "ed25519", "sign",
                 "never"),
            "generating the lab's apt signing key",
        )  # fmt: skip
        listing = _run(_gpg(home, "--with-colons", "--list-secret-keys"), "listing the lab's apt signing key")
        fpr = next(line.split(":")[9] for line in listing.splitlines() if line.startswith("fpr:"))
        exported = subprocess.run(_gpg(home, "--export", fpr), capture_output=True, check=True).stdout
        secret = subprocess.run(
            _gpg(home, "--pinentry-mode", "loopback", "--passphrase", "", "--armor", "--export-secret-keys", fpr),
            capture_output=True, check=True,
        ).stdout  # fmt: skip
    fd = os.open(key_dir / "secret.asc", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(secret)
    tmp = public.with_suffix(".tmp")
    tmp.write_bytes(exported)
    tmp.chmod(0o644)
    tmp.replace(public)
    fpr_file.write_text(fpr + "\n")
    return fpr, public


def _release(repo: Path) -> str:
    lines = [
        "Origin: fleet lab",
        "Label: fleet lab NVIDIA stand-ins",
        f"Architectures: {_deb_arch()}",
        f"Date: {formatdate(time.time(), usegmt=True)}",
        "Acquire-By-Hash: no",
        "SHA256:",
    ]
    for name in ("Packages", "Packages.gz"):
        data = (repo / name).read_bytes()
        lines.append(f" {hashlib.sha256(data).hexdigest()} {len(data)} {name}")
    return "\n".join(lines) + "\n"


def sign_release(repo: Path, key_dir: Path, fingerprint: str) -> None:
    """Write ``Release`` and sign it into ``InRelease`` and ``Release.gpg``."""
    (repo / "Release").write_text(_release(repo))
    with _gpg_home(key_dir) as home:
        for extra, out in ((["--clearsign"], "InRelease"), (["--detach-sign"], "Release.gpg")):
            _run(
                _gpg(home, "--yes", "--digest-algo", "SHA256", "--local-user", fingerprint, *extra, "--output",
                     str(repo / out), str(repo / "Release")),
                f"signing {repo / 'Release'}",
            )  # fmt: skip


def write_index(repo: Path) -> None:
    """``Packages`` and ``Packages.gz`` for the ``.deb`` files in ``repo`` (every version)."""
    text = _run(["dpkg-scanpackages", "--multiversion", ".", "/dev/null"], "dpkg-scanpackages", cwd=repo)
    (repo / "Packages").write_text(text)
    (repo / "Packages.gz").write_bytes(gzip.compress(text.encode(), mtime=0))


def _recipe_hash(packages: list[DebPackage]) -> str:
    digest = hashlib.sha256(f"recipe={RECIPE_VERSION}".encode())
    for pkg in packages:
        digest.update(_control(pkg).encode())
        for f in pkg.files:
            body = f.content if isinstance(f.content, bytes) else f.content.encode()
            digest.update(f"{f.path}|{f.mode}|{f.link_to}".encode() + body)
        digest.update(f"{pkg.postinst}|{pkg.prerm}|{pkg.triggers}".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class AptRepo:
    """Where hosts find the lab repository, and the key that signs it."""

    url: str  #: the mirror root, as an inventory's ``nvidia_apt_url`` names it
    dist_path: str  #: NVIDIA's per-distribution path below it (``debian12/x86_64``)
    keyring: Path  #: the public key, a binary keyring file for ``Signed-By``
    fingerprint: str
    directory: Path


def key_dir(lab_dir: Path) -> Path:
    return Path(lab_dir) / "apt-key"


def build_repo(lab_dir: Path, shim: Path) -> tuple[Path, str, Path]:
    """Build (or reuse) the signed repository under the index root; (repo dir, fingerprint, keyring)."""
    top = index_root(lab_dir) / "apt"
    repo = top / DIST_PATH
    keys = key_dir(lab_dir)
    with file_lock(top / ".lock"):
        fingerprint, keyring = ensure_key(keys)
        packages = lab_packages(shim)
        stamp = repo / ".fleet-lab-recipe"
        wanted = f"{_recipe_hash(packages)} {fingerprint}"
        if stamp.is_file() and stamp.read_text().strip() == wanted and (repo / "InRelease").is_file():
            return repo, fingerprint, keyring
        if repo.exists():
            shutil.rmtree(repo)
        building = Path(tempfile.mkdtemp(prefix=".building-", dir=top))
        try:
            for pkg in packages:
                build_deb(pkg, building)
            write_index(building)
            sign_release(building, keys, fingerprint)
            (building / ".fleet-lab-recipe").write_text(wanted + "\n")
            building.chmod(0o755)
            repo.parent.mkdir(parents=True, exist_ok=True)
            os.rename(building, repo)
        finally:
            if building.exists():
                shutil.rmtree(building, ignore_errors=True)
    return repo, fingerprint, keyring


def ensure_apt_repo(lab_dir: Path, shim: Path) -> AptRepo:
    """Build what is missing and make sure the lab's server serves it; see the module docstring."""
    repo, fingerprint, keyring = build_repo(lab_dir, shim)
    index_url = ensure_index(lab_dir)
    base = index_url.removesuffix("simple/") + "apt/"
    return AptRepo(url=base, dist_path=DIST_PATH, keyring=keyring, fingerprint=fingerprint, directory=repo)
