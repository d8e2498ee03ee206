"""`pip install .` and `pip install -e .` both import correctly from outside the repository; the
metadata carries the license (PEP 639) and the build prints no setuptools warnings (e.g. about
``project.license`` as a TOML table, or about presets/, mixtures/ and schemas/ being "absent from the
packages configuration")."""

import importlib.metadata
import importlib.resources
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CHECK = (
    "import crl_bench, crl_bench.envs.sokoban, crl_bench.envs.minihack, crl_bench.trainer.loop, "
    "crl_bench.baselines, crl_bench.cli;"
    "from crl_bench.env_api import list_envs, make_env;"
    "assert {'sokoban', 'alfworld'} <= set(list_envs()), list_envs();"
    "import crl_bench.envs.alfworld; from crl_bench.data import dataset_names, downloader, load_manifest;"
    "assert dataset_names() == ['alfworld', 'swebench', 'webshop'], dataset_names();"
    "assert len(load_manifest('webshop')['files']['items_shuffle_1000.json']['products']) == 1000;"
    "downloader('webshop');"
    "assert len(load_manifest('alfworld')['games']['eval']) == 134;"
    "make_env('sokoban').reset(options={'task': 0});"
    "from crl_bench.results.summary import load_schema; load_schema('summary'); load_schema('submission_metadata');"
    "print(crl_bench.envs.sokoban.__file__)"
)


def _venv(tmp_path: Path) -> Path:
    """A fresh venv that sees this environment's dependencies through a .pth file."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _pip(venv: Path, *args: str) -> None:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", *args], check=True, env=env, cwd=str(REPO))


def _import_from_outside(venv: Path, tmp_path: Path) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", CHECK], capture_output=True, text=True,
                         cwd=str(tmp_path), env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.slow
def test_regular_install(tmp_path):
    venv = _venv(tmp_path)
    _pip(venv, str(REPO))
    where = _import_from_outside(venv, tmp_path)
    assert where.startswith(str(venv)) and where.endswith("crl_bench/envs/sokoban.py")
    # nothing generic lands in site-packages
    site = next((venv / "lib").glob("python*/site-packages"))
    for name in ("envs", "trainer", "baselines"):
        assert not (site / name).exists()


@pytest.mark.slow
def test_editable_install(tmp_path):
    venv = _venv(tmp_path)
    _pip(venv, "-e", str(REPO))
    where = _import_from_outside(venv, tmp_path)
    assert where == str(REPO / "envs" / "sokoban.py")


def test_installed_metadata_names_the_license_and_its_file():
    md = importlib.metadata.metadata("crl-bench")
    assert md["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (md.get_all("License-File") or [])
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert not any(r.split()[0].startswith("rich") for r in importlib.metadata.requires("crl-bench") or [])


def test_typed_marker_and_data_files_are_package_resources():
    pkg = importlib.resources.files("crl_bench")
    assert pkg.joinpath("py.typed").is_file()
    presets = {p.name for p in pkg.joinpath("presets").iterdir()}
    assert {"cpu.yaml", "default.yaml", "paper.yaml", "smoke.yaml"} <= presets
    assert pkg.joinpath("mixtures", "6task.yaml").is_file()
    assert pkg.joinpath("schemas", "summary.schema.json").is_file()


def test_wheel_builds_without_setuptools_warnings(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    for bad in ("deprecated", "absent from the `packages` configuration", "BuildBackendWarning"):
        assert bad not in out, out[-3000:]
    (wheel,) = tmp_path.glob("crl_bench-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"crl_bench/py.typed", "crl_bench/presets/cpu.yaml", "crl_bench/mixtures/6task.yaml",
            "crl_bench/schemas/summary.schema.json", "crl_bench/envs/minihack/__init__.py",
            "crl_bench/envs/minihack/render.py", "crl_bench/bench/__init__.py", "crl_bench/bench/raw.py",
            "crl_bench/bench/env.py"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
