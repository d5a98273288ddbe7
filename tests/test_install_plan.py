"""The launcher's decisions with faked probes (installers/install_plan.py): where things go, which Python and
PyTorch build, disk space, and when the stamp says to install again."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launcher_fakes import GB, REPO, SMI, make_project, plan, probes


@pytest.fixture
def project(tmp_path: Path) -> plan.Project:
    return make_project(tmp_path)


# ---- where things go ----


def test_data_dir_follows_each_os_convention(tmp_path: Path):
    home = tmp_path / "home"
    assert plan.data_dir("Linux", {}, home) == home / ".local/share/fmoe-local"
    assert plan.data_dir("Linux", {"XDG_DATA_HOME": "/xdg"}, home) == Path("/xdg/fmoe-local")
    # A relative XDG_DATA_HOME is invalid per the XDG spec and must be ignored.
    assert plan.data_dir("Linux", {"XDG_DATA_HOME": "rel"}, home) == home / ".local/share/fmoe-local"
    assert plan.data_dir("Darwin", {}, home) == home / "Library/Application Support/fmoe-local"
    assert plan.data_dir("Windows", {"LOCALAPPDATA": "C:/Users/u/AppData/Local"}, home) == Path(
        "C:/Users/u/AppData/Local/fmoe-local"
    )


# ---- Python ----


@pytest.mark.parametrize(
    "system, where",
    [
        ("Linux", "sudo apt install python3.11"),
        ("Darwin", "https://www.python.org/downloads/macos/"),
        ("Windows", "https://www.python.org/downloads/windows/"),
    ],
)
def test_python_too_old_says_what_to_install_per_os(system: str, where: str, project: plan.Project, tmp_path: Path):
    with pytest.raises(plan.BootstrapError) as err:
        plan.decide(probes(system=system, machine="arm64", python=(3, 9, 18)), project, None, False, False, tmp_path)
    assert "Python 3.9.18" in str(err.value)
    assert "Install Python 3.11" in str(err.value) and where in str(err.value)
    assert plan.python_problem((3, 10, 0), system) is None


def test_python_without_venv_support_names_the_debian_package(project: plan.Project, tmp_path: Path):
    with pytest.raises(plan.BootstrapError, match="sudo apt install python3.11-venv"):
        plan.decide(probes(has_venv=False), project, None, False, False, tmp_path)


# ---- PyTorch build ----


def test_no_gpu_on_linux_picks_the_cpu_build():
    chosen = plan.choose_torch("Linux", "x86_64", None)
    assert chosen.build == "cpu"
    assert chosen.index_url == "https://download.pytorch.org/whl/cpu"
    assert "No NVIDIA GPU" in chosen.reason


@pytest.mark.parametrize(
    "cuda, build",
    [("13.1", "cu130"), ("13.0", "cu130"), ("12.9", "cu128"), ("12.8", "cu128"), ("12.6", "cu126")],
)
def test_gpu_present_picks_the_newest_cuda_build_the_driver_runs(cuda: str, build: str):
    chosen = plan.choose_torch("Linux", "x86_64", SMI.format(cuda=cuda))
    assert chosen.build == build
    assert chosen.index_url == f"https://download.pytorch.org/whl/{build}"
    assert "NVIDIA H100 80GB HBM3" in chosen.reason and f"CUDA {cuda}" in chosen.reason


def test_gpu_with_an_old_driver_falls_back_to_cpu_and_says_to_update():
    chosen = plan.choose_torch("Windows", "AMD64", SMI.format(cuda="12.2"))
    assert chosen.build == "cpu"
    assert "Update the NVIDIA driver" in chosen.reason and "--repair" in chosen.reason


def test_macos_apple_silicon_takes_the_default_wheel_with_mps():
    chosen = plan.choose_torch("Darwin", "arm64", None)
    assert (chosen.build, chosen.index_url) == ("mps", None)
    assert "runs models on the CPU" in chosen.reason  # the runtime does not use the Apple GPU (yet)


def test_intel_mac_is_refused_with_a_reason():
    with pytest.raises(plan.BootstrapError, match="Apple Silicon"):
        plan.choose_torch("Darwin", "x86_64", None)


def test_torch_pin_goes_through_the_constraints_file(project: plan.Project):
    cpu = plan.choose_torch("Linux", "x86_64", None)
    args = plan.torch_install_args(cpu, project, index_reachable=True)
    assert args == [
        "torch",
        "-c",
        str(project.root / "constraints.txt"),
        "--extra-index-url",
        "https://download.pytorch.org/whl/cpu",
    ]
    # Unreachable index: no extra index, so pip does not spend its retries on it; the pin still holds.
    assert plan.torch_install_args(cpu, project, index_reachable=False) == args[:3]
    assert "--extra-index-url" not in plan.torch_install_args(plan.choose_torch("Darwin", "arm64", None), project, True)


def test_repository_pin_is_read_from_constraints_txt():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the bootstrap itself parses with a regex
    real = plan.read_project(REPO)
    assert real.version == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    pins = [line.strip() for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("torch")]
    assert real.torch_pin == pins[0]


# ---- disk space ----


def test_no_disk_space_stops_a_first_install(project: plan.Project, tmp_path: Path):
    with pytest.raises(plan.BootstrapError) as err:
        plan.decide(probes(free_bytes=2 * GB), project, None, False, False, tmp_path)
    assert "2.0 GB free" in str(err.value) and "about 4 GB" in str(err.value)
    assert "Free some space" in str(err.value)
    # A CUDA install needs more room than a CPU one.
    assert plan.disk_problem(6 * GB, plan.choose_torch("Linux", "x86_64", SMI.format(cuda="12.8")), tmp_path)
    assert plan.disk_problem(6 * GB, plan.choose_torch("Linux", "x86_64", None), tmp_path) is None


def test_no_disk_space_does_not_block_an_installed_copy(project: plan.Project, tmp_path: Path):
    stamp = plan.wanted_stamp(project, plan.choose_torch("Linux", "x86_64", None), (3, 11, 7))
    decision = plan.decide(probes(free_bytes=0), project, stamp, True, False, tmp_path)
    assert not decision.install


# ---- the stamp ----


def test_stamp_up_to_date_skips_the_install(project: plan.Project, tmp_path: Path):
    stamp = plan.wanted_stamp(project, plan.choose_torch("Linux", "x86_64", None), (3, 11, 2))
    decision = plan.decide(probes(), project, stamp, True, False, tmp_path)
    assert not decision.install and "up to date" in decision.why and decision.stamp == stamp


def test_changed_version_or_dependencies_reinstall(project: plan.Project, tmp_path: Path):
    old = plan.wanted_stamp(project, plan.choose_torch("Linux", "x86_64", None), (3, 11, 7))
    (project.root / "constraints.txt").write_text("torch==2.14.0\n")
    (project.root / "pyproject.toml").write_text('[project]\nname = "fmoe-local"\nversion = "0.4.0"\n')
    newer = plan.read_project(project.root)
    assert newer.fingerprint != project.fingerprint and newer.torch_pin == "torch==2.14.0"
    decision = plan.decide(probes(), newer, old, True, False, tmp_path)
    assert decision.install
    assert "project_version: 0.3.1 -> 0.4.0" in decision.why and "fingerprint" in decision.why


def test_a_new_gpu_changes_the_wanted_build(project: plan.Project, tmp_path: Path):
    cpu_stamp = plan.wanted_stamp(project, plan.choose_torch("Linux", "x86_64", None), (3, 11, 7))
    decision = plan.decide(probes(nvidia_smi=SMI.format(cuda="12.8")), project, cpu_stamp, True, False, tmp_path)
    assert decision.install and "torch_build: cpu -> cu128" in decision.why


def test_a_cpu_only_torch_where_cuda_was_planned_is_retried_without_reinstalling(project: plan.Project, tmp_path: Path):
    gpu = probes(nvidia_smi=SMI.format(cuda="12.8"))
    wanted = plan.decide(gpu, project, None, False, False, tmp_path).stamp
    fell_back = plan.decide(gpu, project, dict(wanted, torch_cuda=""), True, False, tmp_path)
    assert not fell_back.install and fell_back.retry_cuda and "GPU is not used yet" in fell_back.why
    got_cuda = plan.decide(gpu, project, dict(wanted, torch_cuda="12.8"), True, False, tmp_path)
    assert not got_cuda.install and not got_cuda.retry_cuda and "up to date" in got_cuda.why
    # A stamp from before the key existed is taken as it is; a CPU machine never retries.
    assert not plan.decide(gpu, project, wanted, True, False, tmp_path).retry_cuda
    cpu = plan.decide(probes(), project, None, False, False, tmp_path).stamp
    assert not plan.decide(probes(), project, dict(cpu, torch_cuda=""), True, False, tmp_path).retry_cuda


def test_first_run_unfinished_install_and_repair_all_install(project: plan.Project, tmp_path: Path):
    stamp = plan.wanted_stamp(project, plan.choose_torch("Linux", "x86_64", None), (3, 11, 7))
    assert "first run" in plan.decide(probes(), project, None, False, False, tmp_path).why
    assert "did not finish" in plan.decide(probes(), project, None, True, False, tmp_path).why
    repaired = plan.decide(probes(), project, stamp, True, True, tmp_path)
    assert repaired.install and "--repair" in repaired.why
