"""Apptainer recipes and the image build, checked statically.

Apptainer (and Singularity) cannot be installed on these machines: they are not in Debian's archive and nothing
else can be downloaded. So the recipes are checked without building them: parsed with spython, every shell
section run through shellcheck, pinned by golden files, and `containers/` compared with what the command renders.
`hpctrain container build` is tested against a fake `apptainer` script on PATH, the one process boundary that
cannot exist here.

Regenerate the golden files and `containers/` after an intended change with:
    HPCTRAIN_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_containers.py
(or `hpctrain container recipe --write-defaults containers` for `containers/` alone), then review the diff.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hpctrain.tools import containers, containers_build
from hpctrain.cli.main import app
from hpctrain.tools.containers import ContainerConfig, render_recipe
from hpctrain.base.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
REGEN = os.environ.get("HPCTRAIN_REGEN_GOLDEN") == "1"
REGEN_HINT = "HPCTRAIN_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_containers.py"

needs_hpccm = pytest.mark.skipif(importlib.util.find_spec("hpccm") is None,
                                 reason="hpccm is not installed: pip install 'hpccm==26.5.0' (make test installs it)")

runner = CliRunner()

# Golden variants beyond the defaults in containers/: every option that changes the text.
VARIANTS: dict[str, dict[str, str]] = {
    "recipe-hybrid-pinned.def": dict(
        cuda="12.8.1", openmpi="5.0.8", ucx="1.19.1", pmix="5.0.7", gdrcopy="2.4.4", mpi4py="4.1.1",
        torch="2.12.0", devel_digest="sha256:" + "a" * 64, runtime_digest="sha256:" + "b" * 64,
    ),
    "recipe-bind-openmpi41.def": dict(mode="bind", openmpi="4.1.8", torch_index="https://mirror.example/whl/cu129"),
}


def _check_text(name: str, expected_path: Path, actual: str) -> None:
    """Compare with a checked-in file; print a diff and how to regenerate when they differ."""
    if REGEN:
        expected_path.parent.mkdir(parents=True, exist_ok=True)
        expected_path.write_text(actual)
    expected = expected_path.read_text() if expected_path.exists() else ""
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                            str(expected_path.relative_to(ROOT)), f"rendered {name}"))
        pytest.fail(f"{expected_path.relative_to(ROOT)} differs from what hpctrain renders now:\n{diff}\n"
                    f"If the change is intended, regenerate with: {REGEN_HINT}", pytrace=False)


def all_recipes() -> dict[str, str]:
    out = dict(containers.default_recipes())
    out.update({name: render_recipe(ContainerConfig(**opts)) for name, opts in VARIANTS.items()})
    return out


@pytest.fixture(scope="module")
def recipes() -> dict[str, str]:
    if importlib.util.find_spec("hpccm") is None:
        pytest.skip("hpccm is not installed: pip install 'hpccm==26.5.0' (make test installs it)")
    return all_recipes()


# -- pinned text ----------------------------------------------------------------------------------------------


@needs_hpccm
@pytest.mark.parametrize("name", list(containers.DEFAULT_RECIPES))
def test_containers_dir_matches_the_renderer(name: str) -> None:
    _check_text(name, ROOT / "containers" / name, containers.default_recipes()[name])


@needs_hpccm
@pytest.mark.parametrize("name", list(containers.DEFAULT_RECIPES))
def test_containers_dir_matches_the_command(name: str, tmp_path: Path) -> None:
    """`hpctrain container recipe` with the recipe's options writes exactly the checked-in file."""
    args = []
    for key, value in containers.DEFAULT_RECIPES[name].items():
        args += [f"--{key.replace('_', '-')}", value]
    out = tmp_path / name
    result = runner.invoke(app, ["container", "recipe", *args, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output
    assert out.read_text() == (ROOT / "containers" / name).read_text(), (
        f"containers/{name} is stale: regenerate with {REGEN_HINT}")


@needs_hpccm
def test_write_defaults_renders_what_containers_dir_holds(tmp_path: Path) -> None:
    """`hpctrain container recipe --write-defaults DIR` re-renders every checked-in recipe, and only those."""
    result = runner.invoke(app, ["container", "recipe", "--write-defaults", str(tmp_path / "defs")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "defs").iterdir()) == sorted(containers.DEFAULT_RECIPES)
    for name in containers.DEFAULT_RECIPES:
        assert f"wrote {tmp_path / 'defs' / name}" in result.output
        assert (tmp_path / "defs" / name).read_text() == (ROOT / "containers" / name).read_text(), (
            f"containers/{name} is stale: regenerate with {REGEN_HINT}")


@pytest.mark.parametrize("extra", [["-o", "x.def"], ["--mode", "bind"]])
def test_write_defaults_refuses_other_options(extra: list[str], tmp_path: Path) -> None:
    result = runner.invoke(app, ["container", "recipe", "--write-defaults", str(tmp_path / "defs"), *extra])
    assert result.exit_code == 2
    assert "--write-defaults renders the default recipes with their own options" in result.output
    assert not (tmp_path / "defs").exists()


def test_no_stray_files_in_containers_dir() -> None:
    assert sorted(p.name for p in (ROOT / "containers").glob("*.def")) == sorted(containers.DEFAULT_RECIPES)


@needs_hpccm
@pytest.mark.parametrize("name", list(VARIANTS))
def test_golden_variants(name: str) -> None:
    _check_text(name, GOLDEN / name, render_recipe(ContainerConfig(**VARIANTS[name])))


@needs_hpccm
def test_recipe_prints_to_stdout_and_the_header_says_how_it_was_made() -> None:
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "container", "recipe", "--mode", "bind",
                           "--mpi-abi", "mpich"], capture_output=True, text=True, check=True)
    assert proc.stdout == (ROOT / "containers" / "hpctrain-bind-mpich.def").read_text()
    assert "# Generated by `hpctrain container recipe --mode bind --mpi-abi mpich`" in proc.stdout


@needs_hpccm
def test_rendering_is_pure() -> None:
    import hpccm

    before = (hpccm.config.g_ctype, hpccm.config.g_linux_distro, hpccm.config.g_singularity_version)
    cfg = ContainerConfig()
    assert render_recipe(cfg) == render_recipe(cfg)
    assert (hpccm.config.g_ctype, hpccm.config.g_linux_distro, hpccm.config.g_singularity_version) == before


# -- what the recipes say -------------------------------------------------------------------------------------


def test_hybrid_builds_a_cuda_aware_stack_and_mpi4py_against_it(recipes: dict[str, str]) -> None:
    text = recipes["hpctrain-hybrid.def"]
    cfg = ContainerConfig()
    assert f"From: nvidia/cuda:{cfg.cuda}-devel-ubuntu22.04\nStage: devel" in text
    assert f"From: nvidia/cuda:{cfg.cuda}-base-ubuntu22.04\nStage: runtime" in text
    ucx = next(line for line in text.splitlines() if "ucx" in line and "./configure" in line)
    for flag in ("--with-cuda=/usr/local/cuda", "--with-gdrcopy=/usr/local/gdrcopy", "--enable-mt", "--with-verbs"):
        assert flag in ucx
    ompi = next(line for line in text.splitlines() if "openmpi" in line and "./configure" in line)
    for flag in ("--with-cuda=/usr/local/cuda", "--with-cuda-libdir=/usr/local/cuda/lib64/stubs",
                 "--with-ucx=/usr/local/ucx", "--with-pmix=/usr/local/pmix", "--with-libevent=external",
                 "--with-hwloc=external", "--enable-prte-prefix-by-default"):
        assert flag in ompi
    assert f"openmpi-{cfg.openmpi}.tar.bz2" in text and f"pmix-{cfg.pmix}.tar" in text
    assert (f"MPI4PY_BUILD_MPICC=/usr/local/openmpi/bin/mpicc /opt/venv/bin/python -m pip install --no-cache-dir "
            f"--no-binary mpi4py mpi4py=={cfg.mpi4py}") in text
    assert f"torch=={cfg.torch} --index-url https://download.pytorch.org/whl/cu129" in text
    assert "pip install --no-cache-dir /opt/hpctrain/src" in text
    for key, value in {"OMPI_MCA_pml": "ucx", "PMIX_MCA_gds": "hash", "PMIX_MCA_psec": "native",
                       "UCX_MEMTYPE_CACHE": "n", "PYTHONNOUSERSITE": "1"}.items():
        assert f"export {key}={value}\n" in text
    assert "mpi_built_with_cuda_support:value:true" in text
    assert "hpctrain doctor --strict" in text


def test_bind_mode_leaves_mpi_to_the_host(recipes: dict[str, str]) -> None:
    for name in ("hpctrain-bind.def", "hpctrain-bind-mpich.def"):
        text = recipes[name]
        assert "ucx" not in text.lower().replace("hpctrain", "")
        assert "--with-cuda" not in text
        assert "export LD_LIBRARY_PATH=/opt/host-mpi/lib:/opt/host-mpi/deps${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}\n" in text
        assert "mkdir -p /opt/host-mpi/lib /opt/host-mpi/deps" in text
        assert "MPI4PY_BUILD_MPICC=/opt/mpi/bin/mpicc" in text
    assert "openmpi-5.0.10.tar.bz2" in recipes["hpctrain-bind.def"]
    assert "mpich-4.3.2.tar.gz" in recipes["hpctrain-bind-mpich.def"]
    assert "--enable-orterun-prefix-by-default" in recipes["recipe-bind-openmpi41.def"]
    assert "--index-url https://mirror.example/whl/cu129" in recipes["recipe-bind-openmpi41.def"]


def test_digests_pin_the_base_images(recipes: dict[str, str]) -> None:
    text = recipes["recipe-hybrid-pinned.def"]
    assert f"From: nvidia/cuda:12.8.1-devel-ubuntu22.04@sha256:{'a' * 64}" in text
    assert f"From: nvidia/cuda:12.8.1-base-ubuntu22.04@sha256:{'b' * 64}" in text
    assert "https://download.pytorch.org/whl/cu128" in text


# -- spython --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(containers.DEFAULT_RECIPES) + list(VARIANTS))
def test_spython_parses_every_recipe(name: str, recipes: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("spython", reason="spython is not installed: pip install 'spython==0.3.14'")
    from spython.main.parse.parsers import SingularityParser

    path = tmp_path / name
    path.write_text(recipes[name])
    parsed = SingularityParser(str(path)).recipe
    assert list(parsed) == ["devel", "runtime"]
    devel, runtime = parsed["devel"], parsed["runtime"]
    assert devel.fromHeader.startswith("nvidia/cuda:") and "-devel-ubuntu22.04" in devel.fromHeader
    assert "-base-ubuntu22.04" in runtime.fromHeader
    sources = [f.split()[0] for f in devel.files if not f.startswith("#")]
    assert sources == sorted(containers.HOST_FILES)
    copied = [f.split()[0] for f in runtime.layer_files["devel"]]
    assert "/opt/venv" in copied and "/opt/hpctrain" in copied
    labels = dict(line.split(None, 1) for line in runtime.labels)
    cfg = ContainerConfig(**{**containers.DEFAULT_RECIPES, **VARIANTS}[name])
    assert labels == {f"org.hpctrain.{k}": v for k, v in cfg.versions().items()}
    environ = dict(e.split("=", 1) for e in runtime.environ)
    assert environ["PATH"].startswith("/opt/venv/bin:")
    assert runtime.cmd == 'exec hpctrain "$@"'
    assert runtime.test  # %test is there
    assert any("pip install" in line and "mpi4py" in line for line in devel.install)


# -- shellcheck -----------------------------------------------------------------------------------------------

# Idioms of hpccm's building blocks, accepted on purpose:
#   SC1090 `. /.singularity.d/env/10-docker*.sh`: Apptainer provides that file; shellcheck cannot follow a glob.
#   SC2164 `cd DIR` without `|| exit`: Apptainer runs %post with `sh -e`, so a failed cd stops the build.
#   SC2046 `make -j$(nproc)`: nproc prints one word.
SHELLCHECK_EXCLUDE = "SC1090,SC2164,SC2046"


def shell_sections(text: str) -> list[tuple[str, str, str]]:
    """(stage, section, script) for every %post, %test, %runscript and %environment section."""
    out: list[tuple[str, str, list[str]]] = []
    stage, current = "?", None
    for line in text.splitlines():
        if line.startswith("Stage:"):
            stage = line.split(":", 1)[1].strip()
        if line.startswith("%"):
            name = line.split()[0][1:]
            current = (stage, name, []) if name in ("post", "test", "runscript", "environment") else None
            if current:
                out.append(current)
        elif re.match(r"^(BootStrap|Bootstrap|From|Stage):", line) or (line.startswith("#") and current is None):
            current = None
        elif current is not None:
            current[2].append(line[4:] if line.startswith("    ") else line)
    return [(s, n, "\n".join(body).strip() + "\n") for s, n, body in out]


@pytest.mark.parametrize("name", list(containers.DEFAULT_RECIPES) + list(VARIANTS))
def test_shellcheck_every_shell_section(name: str, recipes: dict[str, str]) -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed: apt-get install shellcheck (make test installs it)")
    sections = shell_sections(recipes[name])
    assert sum(1 for _, n, _ in sections if n == "post") >= 8
    failures = []
    for i, (stage, section, script) in enumerate(sections):
        proc = subprocess.run([shellcheck, "--shell=sh", "--severity=warning", f"--exclude={SHELLCHECK_EXCLUDE}",
                               "-"], input=script, capture_output=True, text=True)
        if proc.returncode != 0:
            failures.append(f"--- {stage} %{section} (section {i}):\n{script}\n{proc.stdout}")
    assert not failures, "\n".join(failures)


def test_shell_sections_hpctrain_writes_pass_shellcheck_at_every_severity(recipes: dict[str, str]) -> None:
    """The sections hpctrain writes itself (not hpccm's building blocks) are clean even at style level."""
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed: apt-get install shellcheck (make test installs it)")
    own = [(s, n, body) for s, n, body in shell_sections(recipes["hpctrain-hybrid.def"])
           if n in ("test", "runscript") or "/opt/venv" in body and n == "post" or "hpctrain.conf" in body]
    assert len(own) == 4
    for stage, section, script in own:
        proc = subprocess.run([shellcheck, "--shell=sh", "-"], input=script, capture_output=True, text=True)
        assert proc.returncode == 0, f"{stage} %{section}:\n{script}\n{proc.stdout}"


# -- config validation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"mode": "docker"}, "unknown --mode 'docker': choose one of hybrid, bind"),
        ({"mpi_abi": "intel"}, "choose one of openmpi, mpich"),
        ({"mpi_abi": "mpich"}, "needs --mode bind"),
        ({"cuda": "12.9"}, "--cuda '12.9'"),
        ({"cuda": "11.8.0"}, "CUDA 12 or newer"),
        ({"openmpi": "latest"}, "--openmpi 'latest' is not a release version"),
        ({"openmpi": "4.1.8"}, "hybrid image needs Open MPI 5.0"),
        ({"mode": "bind", "openmpi": "4.0.7"}, "use 4.1 or newer"),
        ({"pmix": "3.2.5"}, "PMIx 4.2 or newer"),
        ({"ucx": "1.9.0"}, "--ucx 1.9.0 is too old"),
        ({"torch": "2.13"}, None),
        ({"torch": "v2"}, "--torch 'v2'"),
        ({"devel_digest": "sha256:abc"}, "--devel-digest 'sha256:abc' must look like sha256:<64 hex digits>"),
        ({"runtime_digest": "latest"}, "--runtime-digest 'latest'"),
        ({"torch_index": "pypi"}, "--torch-index 'pypi' must be a URL"),
    ],
)
def test_config_errors_name_the_value_and_the_fix(options: dict, needle: str | None) -> None:
    if needle is None:
        ContainerConfig(**options)
        return
    with pytest.raises(ConfigError) as info:
        ContainerConfig(**options)
    assert needle in str(info.value)
    assert info.value.exit_code == 2


def test_bad_option_is_one_line_and_exit_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "container", "recipe", "--cuda", "12"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: --cuda '12'")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("cmd", [["container"], ["container", "recipe"], ["container", "build"], ["doctor"]])
def test_help_has_an_example(cmd: list[str]) -> None:
    result = runner.invoke(app, [*cmd, "--help"])
    assert result.exit_code == 0
    assert "Example:" in result.output


def test_cli_import_does_not_pull_hpccm_or_torch() -> None:
    code = "import sys, hpctrain.cli.main; print(sorted(m for m in ('hpccm', 'torch', 'spython') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_only_containers_imports_hpccm() -> None:
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "hpctrain").rglob("*.py")
                 if p.name != "containers.py" and re.search(r"^\s*(import|from)\s+hpccm", p.read_text(), re.M)]
    assert offenders == []


# -- container build (a fake apptainer: the real one cannot be installed here) ---------------------------------

FAKE_BUILDER = textwrap.dedent("""\
    #!/bin/sh
    # Stands in for apptainer/singularity, which cannot be installed on this machine: records its argv,
    # prints progress lines like the real one, and writes the image (the argument before the definition).
    printf '%s\\n' "$0" "$@" > "$FAKE_ARGV"
    echo "INFO:    Starting build..."
    echo "INFO:    Running post scriptlet"
    echo "+ apt-get update -y"
    echo "INFO:    Running testscript"
    if [ -n "$FAKE_FAIL" ]; then echo "FATAL:   While performing build: %test failed" >&2; exit 255; fi
    image=""; prev=""
    for arg in "$@"; do image="$prev"; prev="$arg"; done
    echo "fake sif" > "$image"
    echo "INFO:    Build complete: $image"
    """)


def _fake_bin(tmp_path: Path, *names: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        script = bin_dir / name
        script.write_text(FAKE_BUILDER)
        script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir


@pytest.fixture()
def source_tree(tmp_path: Path) -> Path:
    """A build directory holding what the recipes copy, and the checked-in hybrid definition."""
    tree = tmp_path / "src"
    (tree / "hpctrain").mkdir(parents=True)
    (tree / "pyproject.toml").write_text("[project]\nname = 'hpctrain'\n")
    (tree / "README.md").write_text("# hpctrain\n")
    shutil.copy(ROOT / "containers" / "hpctrain-hybrid.def", tree / "hpctrain.def")
    return tree


def _build(args: list[str], cwd: Path, path: str, **env: str) -> subprocess.CompletedProcess:
    """Run the installed `hpctrain` console script in `cwd` (`python -m` would import the tree's own hpctrain/)."""
    environ = {**os.environ, "PATH": path, "FAKE_ARGV": str(cwd / "argv.txt"), **env}
    script = Path(sys.executable).with_name("hpctrain")
    if not script.exists():
        pytest.skip(f"the hpctrain console script is not installed next to {sys.executable}: pip install -e .")
    return subprocess.run([str(script), "container", "build", *args], cwd=cwd,
                          capture_output=True, text=True, env=environ, timeout=60)


def test_build_runs_apptainer_with_the_right_argv_and_shows_progress(source_tree: Path, tmp_path: Path) -> None:
    bin_dir = _fake_bin(tmp_path, "apptainer", "singularity")
    proc = _build(["hpctrain.def", "-o", "out.sif", "--fakeroot", "--nv"], source_tree,
                  f"{bin_dir}:{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = (source_tree / "argv.txt").read_text().splitlines()
    assert argv == [str(bin_dir / "apptainer"), "build", "--fakeroot", "--nv", "out.sif", "hpctrain.def"]
    assert (source_tree / "out.sif").read_text() == "fake sif\n"
    lines = proc.stdout.splitlines()
    assert re.match(r"^\[00:00\] building out\.sif from hpctrain\.def with apptainer", lines[0])
    assert any(re.match(r"^\[\d\d:\d\d\] INFO:    Running post scriptlet$", line) for line in lines)
    assert any(re.match(r"^\[\d\d:\d\d\] \+ apt-get update -y$", line) for line in lines)
    assert re.match(r"^\[\d\d:\d\d\] built out\.sif; sign it with `apptainer sign out\.sif`$", lines[-1])


def test_build_falls_back_to_singularity_and_names_the_image_after_the_definition(
        source_tree: Path, tmp_path: Path) -> None:
    bin_dir = _fake_bin(tmp_path, "singularity")
    proc = _build(["hpctrain.def"], source_tree, str(bin_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = (source_tree / "argv.txt").read_text().splitlines()
    assert argv == [str(bin_dir / "singularity"), "build", "hpctrain.sif", "hpctrain.def"]
    assert (source_tree / "hpctrain.sif").exists()


def test_build_without_apptainer_exits_2_and_says_how_to_get_it(source_tree: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _build(["hpctrain.def"], source_tree, str(empty))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "neither `apptainer` nor `singularity` is on PATH" in proc.stderr
    assert "module load apptainer" in proc.stderr and "apptainer.org/docs/admin" in proc.stderr


def test_build_failure_exits_1_after_showing_the_log(source_tree: Path, tmp_path: Path) -> None:
    bin_dir = _fake_bin(tmp_path, "apptainer")
    proc = _build(["hpctrain.def", "--force"], source_tree, str(bin_dir), FAKE_FAIL="1")
    assert proc.returncode == 1
    assert "FATAL:   While performing build: %test failed" in proc.stdout
    assert "apptainer build exited 255" in proc.stderr
    assert "--force" in (source_tree / "argv.txt").read_text()


def test_build_checks_inputs_before_starting_a_long_build(source_tree: Path, tmp_path: Path) -> None:
    bin_dir = _fake_bin(tmp_path, "apptainer")
    path = str(bin_dir)
    (source_tree / "hpctrain.sif").write_text("old")
    proc = _build(["hpctrain.def"], source_tree, path)
    assert proc.returncode == 2 and "'hpctrain.sif' already exists: pass --force" in proc.stderr
    proc = _build(["hpctrain.def", "-o", "image.img"], source_tree, path)
    assert proc.returncode == 2 and "must name a .sif file" in proc.stderr
    proc = _build(["missing.def"], source_tree, path)
    assert proc.returncode == 2 and "'missing.def' does not exist" in proc.stderr
    (source_tree / "README.md").unlink()
    proc = _build(["hpctrain.def", "-o", "x.sif"], source_tree, path)
    assert proc.returncode == 2
    assert "copies 'README.md' from the build directory" in proc.stderr and "source tree" in proc.stderr
    assert not (source_tree / "argv.txt").exists()


def test_host_files_reads_only_plain_files_sections() -> None:
    text = (ROOT / "containers" / "hpctrain-hybrid.def").read_text()
    assert containers_build.host_files(text) == sorted(containers.HOST_FILES)
