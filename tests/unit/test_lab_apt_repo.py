"""The lab's apt repository, built for real (dpkg-deb, dpkg-scanpackages, gpg) and checked the way
apt checks it: gpgv against the lab's public keyring, the Release hashes, the package contents."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from fleetlab import apt_repo
from fleetlab.nvml import build_shim

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("dpkg-deb", "dpkg-scanpackages", "gpg", "gpgv", "gcc")),
    reason="needs dpkg-dev, gnupg, gpgv and gcc (scripts/install.sh installs them)",
)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, Path]:
    root = tmp_path_factory.mktemp("apt")
    shim = build_shim(root / "nvml")
    return apt_repo.build_repo(root / "lab", shim)


def _gpgv(keyring: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["gpgv", "--keyring", str(keyring), *args], capture_output=True, text=True, check=False)


def test_inrelease_and_release_gpg_verify_with_the_lab_keyring(repo: tuple[Path, str, Path]) -> None:
    directory, fingerprint, keyring = repo
    assert _gpgv(keyring, str(directory / "InRelease")).returncode == 0
    assert _gpgv(keyring, str(directory / "Release.gpg"), str(directory / "Release")).returncode == 0
    assert len(fingerprint) == 40


def test_another_key_or_a_changed_release_does_not_verify(repo: tuple[Path, str, Path], tmp_path: Path) -> None:
    directory, _fpr, _keyring = repo
    _other, other_keyring = apt_repo.ensure_key(tmp_path / "other")
    assert _gpgv(other_keyring, str(directory / "InRelease")).returncode != 0
    tampered = tmp_path / "Release"
    tampered.write_text((directory / "Release").read_text().replace("fleet lab", "evil lab"))
    assert _gpgv(_keyring, str(directory / "Release.gpg"), str(tampered)).returncode != 0


def test_release_hashes_match_the_indexes(repo: tuple[Path, str, Path]) -> None:
    directory, _fpr, _keyring = repo
    release = (directory / "Release").read_text()
    for name in ("Packages", "Packages.gz"):
        data = (directory / name).read_bytes()
        assert f" {hashlib.sha256(data).hexdigest()} {len(data)} {name}\n" in release


def test_every_package_at_every_driver_version_is_indexed(repo: tuple[Path, str, Path]) -> None:
    directory, _fpr, _keyring = repo
    stanzas = (directory / "Packages").read_text().strip().split("\n\n")
    found = {(s.split("Package: ")[1].split("\n")[0], s.split("Version: ")[1].split("\n")[0]) for s in stanzas}
    names = ("nvidia-driver", "libnvidia-ml1", "nvidia-kernel-open-dkms", "nvidia-fabricmanager-580")
    cuda = {("cuda-toolkit-12-9", "12.9.1-1"), ("cuda-toolkit-13-0", "13.0.2-1"), ("cuda-compat-13-0", "580.95.05-1")}
    assert found == {(n, f"{v}-1") for n in names for v in apt_repo.DRIVER_VERSIONS} | cuda
    driver = next(s for s in stanzas if "Package: nvidia-driver\n" in s and "580.95.05-1" in s)
    assert "Depends: libnvidia-ml1 (= 580.95.05-1), nvidia-kernel-open-dkms (= 580.95.05-1)" in driver


def test_the_driver_library_is_the_nvml_shim_with_the_real_layout(repo: tuple[Path, str, Path], tmp_path: Path) -> None:
    directory, _fpr, _keyring = repo
    deb = next(directory.glob("libnvidia-ml1_580.95.05-1_*.deb"))
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp_path)], check=True)
    lib = next(tmp_path.glob("usr/lib/*/libnvidia-ml.so.1"))
    assert lib.is_symlink() and lib.readlink() == Path("libnvidia-ml.so.580.95.05")
    assert (lib.parent / "libnvidia-ml.so.580.95.05").read_bytes()[:4] == b"\x7fELF"
    subprocess.run(["dpkg-deb", "-e", str(deb), str(tmp_path / "DEBIAN")], check=True)
    assert (tmp_path / "DEBIAN" / "triggers").read_text() == "activate-noawait ldconfig\n"


def test_cuda_stand_ins_put_their_files_where_nvidia_s_do(repo: tuple[Path, str, Path], tmp_path: Path) -> None:
    directory, _fpr, _keyring = repo
    for deb in (*directory.glob("cuda-compat-13-0_*.deb"), *directory.glob("cuda-toolkit-12-9_*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp_path)], check=True)
    compat = tmp_path / "usr/local/cuda-13.0/compat"
    assert (compat / "libcuda.so.1").readlink() == Path("libcuda.so.580.95.05")
    assert (compat / "libcuda.so.580.95.05").read_text().startswith(apt_repo.COMPAT_MARKER + " 13.0 ")
    assert "NOT NVIDIA's package" in (compat / "README.fleet-lab").read_text()
    nvcc = subprocess.run([str(tmp_path / "usr/local/cuda-12.9/bin/nvcc"), "--version"], capture_output=True, text=True)
    assert nvcc.returncode == 0 and "Cuda compilation tools, release 12.9, V12.9.1" in nvcc.stdout
    assert "stand-in" in (tmp_path / "usr/local/cuda-12.9/README.fleet-lab").read_text()


def test_a_second_build_reuses_the_first(repo: tuple[Path, str, Path]) -> None:
    directory, fingerprint, _keyring = repo
    before = (directory / "InRelease").stat().st_mtime_ns
    lab_dir = directory.parents[3]
    again = apt_repo.build_repo(lab_dir, build_shim(lab_dir.parent / "nvml"))
    assert again[1] == fingerprint and (directory / "InRelease").stat().st_mtime_ns == before


def test_the_vllm_stand_in_reads_the_compat_library_the_repository_ships() -> None:
    """The stand-in is its own package (it cannot import fleetlab): both spell the marker alike."""
    source = Path(__file__).resolve().parents[2] / "lab" / "vllm-standin" / "src" / "vllm" / "standin" / "gpus.py"
    assert f'COMPAT_MARKER = "{apt_repo.COMPAT_MARKER}"' in source.read_text()
