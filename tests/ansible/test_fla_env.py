"""The fla_env module builds the ML environment, changes it only when needed, and says what it can run.

Run from the checkout: .venv/bin/pytest tests/ansible/test_fla_env.py
One environment (CPU torch 2.13, transformers 5.23, specops) is built per session, by the real module
run as a host runs it (module_call.py); it takes a few minutes. This machine has no GPU, so the GPU-only
decisions (a CUDA torch without a driver, fla proven on the GPU, fla importable without a GPU) are tested on
specops.envcheck.decide() with injected facts; the GPU itself is exercised by
benchmarks/fla_env_h200.sh.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specops import envcheck
from specops.stage import StageError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from module_call import call_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE = ROOT / ".venv" / "bin" / "ansible"
CONTROL_PYTHON = ROOT / ".venv" / "bin" / "python"
# The CPU torch 2.13.0 wheel on this machine is built for Python 3.11: the interpreter make built the
# checkout's ML environment from (the Makefile's PYTHON_ML), so this test makes no choice of its own.
ML_VENV_PYTHON = ROOT / ".venv-ml" / "bin" / "python"
PYTHON311 = (
    os.path.realpath(ML_VENV_PYTHON) if ML_VENV_PYTHON.exists() else shutil.which("python3.11") or "python3"
)
TORCH = "torch==2.13.0"


def run_module(args: dict, check: bool = False) -> tuple[str, dict]:
    """Run specops.drafter.fla_env as a host runs it (module_call); (status as ansible prints it, result)."""
    result = call_module("fla_env", args, check=check, timeout=1200, python=str(CONTROL_PYTHON))
    return ("FAILED" if result["failed"] else "CHANGED" if result.get("changed") else "SUCCESS"), result


def run_ansible(args: dict, check: bool = False) -> subprocess.CompletedProcess:
    """Run specops.drafter.fla_env on localhost through ansible, for what the controller prints of its
    result (warnings are on stderr)."""
    cmd = [
        str(ANSIBLE),
        "localhost",
        "-i",
        "localhost,",
        "-c",
        "local",
        "-e",
        f"ansible_python_interpreter={CONTROL_PYTHON}",
        "-m",
        "specops.drafter.fla_env",
        "-a",
        json.dumps(args),
    ]
    if check:
        cmd.append("--check")
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_CALLBACK_RESULT_FORMAT="json",
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
    )
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


def module_result(proc: subprocess.CompletedProcess) -> tuple[str, dict]:
    match = re.search(r"^localhost \| (\S+) => (\{.*)", proc.stdout, re.MULTILINE | re.DOTALL)
    assert match, f"no result from ansible (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return match.group(1).rstrip("!"), json.loads(match.group(2))


def snapshot_sources(dest: Path) -> Path:
    """What the module installs from a checkout, copied so edits elsewhere do not move the fingerprint."""
    dest.mkdir(parents=True)
    shutil.copytree(ROOT / "src", dest / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="session")
def source(tmp_path_factory) -> Path:
    return snapshot_sources(tmp_path_factory.mktemp("fla_env_source") / "checkout")


@pytest.fixture(scope="session")
def session_venv(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fla_env") / "venv"


def base_args(venv: Path, source: Path, **overrides) -> dict:
    args = {"venv": str(venv), "python": PYTHON311, "torch": TORCH, "specops_source": str(source)}
    args.update(overrides)
    return args


@pytest.fixture(scope="session")
def first_run(session_venv, source) -> dict:
    status, result = run_module(base_args(session_venv, source))
    assert status == "CHANGED", result
    return result


# -- building the environment ---------------------------------------------------------------------


def test_first_run_creates_the_environment_and_reports_versions(first_run, session_venv):
    assert first_run["changed"] is True
    assert first_run["created"] is True
    assert first_run["python"] == str(session_venv / "bin" / "python")
    assert (session_venv / "bin" / "python").exists()
    assert first_run["versions"]["torch"].startswith("2.13.0")
    assert first_run["versions"]["transformers"] == "5.23.0"
    assert first_run["versions"]["specops"] == "0.1.0"
    assert TORCH in first_run["installed"] and "specops (source)" in first_run["installed"]


def test_second_run_changes_nothing(first_run, session_venv, source):
    status, result = run_module(base_args(session_venv, source))
    assert status == "SUCCESS", result
    assert result["changed"] is False
    assert result["installed"] == [] and result["removed"] == []
    assert result["versions"] == first_run["versions"]
    # The default requirement (any) passes on a CPU host, as the other requirements without fla do.
    assert result["backend"] == "torch-cpu" and result["verification"]["require_backend"] == "any"


def test_cpu_host_reports_torch_cpu_and_says_fla_is_not_usable(first_run):
    report = first_run["verification"]
    assert first_run["backend"] == "torch-cpu" == report["backend"]
    assert report["cuda_available"] is False and report["devices"] == []
    assert any("fla is not usable here" in note for note in report["notes"])
    assert report["gdr"]["ran"] is False and report["gdr_max_abs_error"] is None
    assert report["transformers_gdr_impl"] == "torch"


def test_fla_auto_without_gpu_leaves_fla_out(first_run):
    assert first_run["gpu_visible"]["visible"] is False
    assert not any(
        req.startswith(("fla-core", "flash-linear-attention")) for req in first_run["requirements"]
    )
    assert first_run["versions"]["fla-core"] is None


def test_require_fla_on_a_cpu_host_fails_with_the_reason(first_run, session_venv, source):
    status, result = run_module(base_args(session_venv, source, require_backend="fla"))
    assert status == "FAILED"
    assert "require_backend is fla but this environment's backend is torch-cpu" in result["msg"]
    assert "no CUDA GPU is visible" in result["msg"]


# The default, any, is test_second_run_changes_nothing's.
@pytest.mark.parametrize(("require", "checked"), [("auto", "any"), ("torch", "torch")])
def test_requirements_that_do_not_need_fla_pass_on_a_cpu_host(
    first_run, session_venv, source, require, checked
):
    status, result = run_module(base_args(session_venv, source, require_backend=require))
    assert status == "SUCCESS", result
    assert result["backend"] == "torch-cpu"
    assert result["verification"]["require_backend"] == checked


def test_require_fla_cuda_is_the_deprecated_name_of_fla(first_run, session_venv, source):
    proc = run_ansible(base_args(session_venv, source, require_backend="fla-cuda"))
    status, result = module_result(proc)
    assert status == "FAILED"
    assert "require_backend is fla but this environment's backend is torch-cpu" in result["msg"]
    warnings = " ".join(proc.stderr.split())
    assert "[DEPRECATION WARNING]: require_backend fla-cuda is deprecated: use fla" in warnings
    assert "removed from collection 'specops.drafter' version 1.0.0" in warnings


def test_fla_found_in_the_environment_without_gpu_is_removed(first_run, session_venv, source):
    site = Path(next((session_venv / "lib").glob("python3*/site-packages")))
    fake_dist(site, "fla_core", "0.6.0", package="fla")
    status, result = run_module(base_args(session_venv, source, verify=False))
    assert status == "CHANGED", result
    assert result["removed"] == ["fla-core"]
    assert not (site / "fla").exists()
    assert result["versions"]["fla-core"] is None


def fake_dist(site: Path, dist: str, version: str, package: str) -> None:
    """A minimal installed distribution pip can uninstall, without network or triton."""
    (site / package).mkdir()
    (site / package / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n"
    )
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text(
        "".join(
            f"{name},,\n"
            for name in (
                f"{package}/__init__.py",
                f"{info.name}/METADATA",
                f"{info.name}/INSTALLER",
                f"{info.name}/RECORD",
            )
        )
    )


def test_specops_is_reinstalled_only_when_its_sources_change(first_run, session_venv, source, tmp_path):
    copy = tmp_path / "checkout"
    shutil.copytree(source, copy)

    status, same = run_module(base_args(session_venv, source, specops_source=str(copy), verify=False))
    assert status == "SUCCESS" and same["installed"] == [], same

    marker = "# changed by the fingerprint test\n"
    with open(copy / "src" / "specops" / "__init__.py", "a") as handle:
        handle.write(marker)
    status, edited = run_module(base_args(session_venv, source, specops_source=str(copy), verify=False))
    assert status == "CHANGED" and edited["installed"] == ["specops (source)"], edited
    installed = next((session_venv / "lib").glob("python3*/site-packages/specops/__init__.py"))
    assert installed.read_text().endswith(marker)

    # Leave the session environment as the other tests expect it.
    status, restored = run_module(base_args(session_venv, source, verify=False))
    assert status == "CHANGED" and not installed.read_text().endswith(marker)


def build_wheel(checkout: Path, dest: Path) -> Path:
    """The specops wheel of a checkout, as tools/build_collection.py builds the one the collection ships."""
    subprocess.run(
        [
            str(CONTROL_PYTHON),
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(dest),
            str(checkout),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = dest.glob("specops-*.whl")
    return wheel


def test_specops_installs_from_a_wheel_and_again_only_when_the_wheel_changes(
    first_run, session_venv, source, tmp_path
):
    copy = tmp_path / "checkout"
    shutil.copytree(source, copy)
    wheel = build_wheel(copy, tmp_path / "first")
    status, installed = run_module(base_args(session_venv, source, specops_source=str(wheel), verify=False))
    assert status == "CHANGED" and installed["installed"] == ["specops (source)"], installed
    dist_info = next((session_venv / "lib").glob("python3*/site-packages/specops-*.dist-info"))
    assert json.loads((dist_info / "direct_url.json").read_text())["url"] == f"file://{wheel}"

    status, same = run_module(base_args(session_venv, source, specops_source=str(wheel), verify=False))
    assert status == "SUCCESS" and same["installed"] == [], same

    marker = "# changed by the wheel test\n"
    with open(copy / "src" / "specops" / "__init__.py", "a") as handle:
        handle.write(marker)
    rebuilt = build_wheel(copy, tmp_path / "second")
    status, replaced = run_module(base_args(session_venv, source, specops_source=str(rebuilt), verify=False))
    assert status == "CHANGED" and replaced["installed"] == ["specops (source)"], replaced
    module = next((session_venv / "lib").glob("python3*/site-packages/specops/__init__.py"))
    assert module.read_text().endswith(marker)

    status, restored = run_module(base_args(session_venv, source, verify=False))
    assert status == "CHANGED" and not module.read_text().endswith(marker)


def test_a_file_that_is_no_distribution_is_refused_naming_what_it_takes(session_venv, source, tmp_path):
    stray = tmp_path / "specops.zip"
    stray.write_bytes(b"not a wheel")
    status, result = run_module(
        base_args(session_venv, source, specops_source=str(stray), verify=False), check=True
    )
    assert status == "FAILED"
    assert "not a wheel (.whl) or sdist (.tar.gz)" in result["msg"]


# -- check mode -----------------------------------------------------------------------------------


def test_environment_made_from_a_venv_interpreter_sees_that_venvs_torch(
    first_run, session_venv, source, tmp_path
):
    """An image whose torch lives in its own venv: the new environment uses that torch, installs none."""
    inner = tmp_path / "inner"
    args = base_args(
        inner,
        source,
        python=str(session_venv / "bin" / "python"),
        system_site_packages=True,
        torch="torch",
        verify=False,
    )
    status, result = run_module(args)
    assert status == "CHANGED", result
    assert "torch" not in result["installed"]
    assert result["base_environment"] and result["base_environment"][0].startswith(str(session_venv))
    assert result["versions"]["torch"] == first_run["versions"]["torch"]
    status, again = run_module(args)
    assert status == "SUCCESS" and again["changed"] is False, again


@pytest.fixture(scope="module")
def verify_cache(first_run, session_venv, source, tmp_path_factory) -> dict:
    """The module's arguments with a verification cache directory, and the verification it kept there."""
    args = base_args(session_venv, source, verify_cache_dir=str(tmp_path_factory.mktemp("envcheck")))
    status, first = run_module(args)
    assert status == "SUCCESS" and first["verification_cached"] is False, first
    return {"args": args, "first": first}


def test_verification_is_reused_for_the_same_environment_and_gpu(verify_cache):
    first = verify_cache["first"]
    status, second = run_module(verify_cache["args"])
    assert second["verification_cached"] is True
    assert second["backend"] == first["backend"] and second["verification"] == first["verification"]


def test_verification_cache_misses_when_the_verification_options_change(verify_cache):
    args = verify_cache["args"]
    # The same options still find the kept verification: only the changed option makes it miss.
    status, same = run_module(args)
    assert status == "SUCCESS" and same["verification_cached"] is True, same
    sizes = [{"batch": 1, "seq_len": 64, "dtype": "float32"}]
    status, result = run_module({**args, "gdr_sizes": sizes})
    assert status == "SUCCESS" and result["verification_cached"] is False, result


def test_check_mode_on_a_fresh_path_installs_nothing(tmp_path, source):
    venv = tmp_path / "not-yet"
    status, result = run_module(base_args(venv, source), check=True)
    assert status == "CHANGED"
    assert result["created"] is True
    assert "does not exist yet" in result["msg"]
    assert TORCH in result["installed"]
    assert result["verification"] is None
    assert not venv.exists()


def test_check_mode_on_the_built_environment_reports_nothing_to_do(first_run, session_venv, source):
    status, result = run_module(base_args(session_venv, source), check=True)
    assert status == "SUCCESS", result
    assert result["changed"] is False
    assert result["verification"]["backend_expected"] == "torch-cpu"
    assert result["verification"]["gdr"]["ran"] is False


# -- errors ---------------------------------------------------------------------------------------


def test_missing_python_fails_naming_the_interpreter(tmp_path, source):
    status, result = run_module(base_args(tmp_path / "venv", source, python="python3.99-nowhere"))
    assert status == "FAILED"
    assert "'python3.99-nowhere' not found" in result["msg"]
    assert not (tmp_path / "venv").exists()


def test_requirement_no_source_provides_fails_naming_it_and_the_sources(tmp_path, source):
    wheelhouse = tmp_path / "empty-wheelhouse"
    wheelhouse.mkdir()
    # pip_isolated: this host's own pip configuration would otherwise add its wheel directory.
    args = base_args(
        tmp_path / "venv",
        source,
        index_url="file:///nonexistent",
        find_links=[str(wheelhouse)],
        no_index=True,
        pip_isolated=True,
    )
    status, result = run_module(args)
    assert status == "FAILED"
    assert f"pip cannot provide {TORCH}" in result["msg"]
    assert str(wheelhouse) in result["msg"] and "no index" in result["msg"]


# -- decisions that need a GPU host, on injected facts ---------------------------------------------


def facts(**overrides) -> dict:
    base = {
        "versions": {"torch": "2.13.0+cpu", "torch_cuda": None},
        "cuda_available": False,
        "driver": {"present": False, "version": None},
        "fla_importable": False,
        "fla_import_error": "ModuleNotFoundError: No module named 'fla'",
        "triton_importable": False,
        "transformers_gdr_impl": "torch",
    }
    base.update(overrides)
    return base


GPU = {
    "cuda_available": True,
    "driver": {"present": True, "version": "580"},
    "versions": {"torch": "2.11.0+cu130", "torch_cuda": "13.0"},
}


def test_cuda_torch_on_a_host_without_driver_is_an_error():
    verdict = envcheck.decide(facts(versions={"torch": "2.11.0+cu130", "torch_cuda": "13.0"}), None)
    assert "CUDA 13.0 build" in verdict["error"] and "no NVIDIA driver" in verdict["error"]
    assert "install a CPU build of torch" in verdict["error"]


def test_cuda_torch_with_a_driver_it_cannot_use_is_a_warning():
    verdict = envcheck.decide(
        facts(
            versions={"torch": "2.11.0+cu130", "torch_cuda": "13.0"},
            driver={"present": True, "version": "470"},
        ),
        None,
    )
    assert verdict["error"] is None and verdict["backend"] == "torch-cpu"
    assert any("cannot use it" in w for w in verdict["warnings"])


def test_fla_and_triton_importable_without_gpu_warn_of_the_crash():
    verdict = envcheck.decide(
        facts(
            fla_importable=True,
            triton_importable=True,
            transformers_gdr_impl="fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule",
        ),
        None,
    )
    assert verdict["backend"] == "torch-cpu"
    assert envcheck.FLA_CRASH_WARNING in verdict["warnings"]


def test_cpu_host_without_fla_has_no_crash_warning():
    verdict = envcheck.decide(facts(), None)
    assert verdict["backend"] == "torch-cpu" and verdict["warnings"] == []
    assert envcheck.FLA_NOT_USABLE_NOTE in verdict["notes"]


def test_fla_cuda_only_when_the_kernel_matched_the_reference():
    gpu_fla = facts(**GPU, fla_importable=True, triton_importable=True)
    assert (
        envcheck.decide(gpu_fla, {"ran": True, "ok": True, "error": None, "rel_error": 1e-3})["backend"]
        == "fla-cuda"
    )
    mismatch = envcheck.decide(gpu_fla, {"ran": True, "ok": False, "error": None, "rel_error": 0.4})
    assert (
        mismatch["backend"] == "torch-cuda" and "differs from the torch reference" in mismatch["warnings"][0]
    )
    crashed = envcheck.decide(
        gpu_fla, {"ran": True, "ok": False, "error": "CompilationError: x", "checks": []}
    )
    assert crashed["backend"] == "torch-cuda" and "failed on the GPU" in crashed["warnings"][0]


def test_gpu_without_fla_is_torch_cuda_and_fails_a_fla_requirement():
    verdict = envcheck.decide(facts(**GPU), None, require_backend="fla")
    assert verdict["backend"] == "torch-cuda"
    assert verdict["error"].startswith(
        "require_backend is fla but this environment's backend is torch-cuda, not fla-cuda"
    )


def test_check_mode_on_a_gpu_with_fla_expects_fla_cuda_without_claiming_it():
    verdict = envcheck.decide(facts(**GPU, fla_importable=True), None, require_backend="fla", planning=True)
    assert verdict["backend"] is None and verdict["backend_expected"] == "fla-cuda"
    assert verdict["error"] is None


PROVEN = {"ran": True, "ok": True, "error": None, "rel_error": 1e-3}
MISMATCH = {"ran": True, "ok": False, "error": None, "rel_error": 0.4}


# Each value means what it means for the extraction: auto is fla where torch sees a CUDA GPU, else any.
@pytest.mark.parametrize(
    ("host", "gdr", "require", "checked", "fails"),
    [
        ("cpu", None, "auto", "any", False),
        ("cpu", None, "fla", "fla", True),
        ("cpu", None, "torch", "torch", False),
        ("cpu", None, "any", "any", False),
        ("gpu with fla proven", PROVEN, "auto", "fla", False),
        ("gpu with fla proven", PROVEN, "fla", "fla", False),
        ("gpu with fla proven", PROVEN, "torch", "torch", False),
        ("gpu with fla proven", PROVEN, "any", "any", False),
        ("gpu with a wrong fla", MISMATCH, "auto", "fla", True),
        ("gpu with a wrong fla", MISMATCH, "fla", "fla", True),
        ("gpu with a wrong fla", MISMATCH, "torch", "torch", False),
        ("gpu with a wrong fla", MISMATCH, "any", "any", False),
        ("gpu without fla", None, "auto", "fla", True),
        ("gpu without fla", None, "fla", "fla", True),
        ("gpu without fla", None, "torch", "torch", False),
        ("gpu without fla", None, "any", "any", False),
    ],
)
def test_each_require_backend_value_on_each_kind_of_host(host, gdr, require, checked, fails):
    host_facts = {
        "cpu": facts(),
        "gpu with fla proven": facts(**GPU, fla_importable=True, triton_importable=True),
        "gpu with a wrong fla": facts(**GPU, fla_importable=True, triton_importable=True),
        "gpu without fla": facts(**GPU),
    }[host]
    verdict = envcheck.decide(host_facts, gdr, require_backend=require)
    assert verdict["require_backend"] == checked
    assert (verdict["error"] is not None) is fails, verdict
    if fails:
        assert f"require_backend is {require}" in verdict["error"] and "not fla-cuda" in verdict["error"]


def test_auto_on_a_gpu_says_it_required_fla_because_of_the_gpu():
    verdict = envcheck.decide(facts(**GPU), None, require_backend="auto")
    assert verdict["error"].startswith(
        "require_backend is auto (fla where torch sees a CUDA GPU) "
        "but this environment's backend is torch-cuda"
    )


def test_the_envcheck_stage_takes_the_extractions_values_and_names_fla_for_fla_cuda():
    for require in ("auto", "fla", "torch", "any"):
        assert envcheck.parse_request({"require_backend": require})[0] == require
    assert envcheck.parse_request({})[0] == "any"
    with pytest.raises(StageError, match=r"'fla-cuda' is not one of auto, fla, torch, any: fla requires"):
        envcheck.parse_request({"require_backend": "fla-cuda"})


def test_gdr_sizes_are_validated_with_the_fix_in_the_message():
    with pytest.raises(StageError, match="v_heads 5 must be a multiple of k_heads 2"):
        envcheck.normalize_sizes([{"k_heads": 2, "v_heads": 5}])
    with pytest.raises(StageError, match="dtype 'float16' is not one of"):
        envcheck.normalize_sizes([{"dtype": "float16"}])
    assert envcheck.normalize_sizes([{"seq_len": 77}])[0]["seq_len"] == 77


# -- the comparison harness, on the CPU with transformers' torch implementations -------------------

HARNESS = textwrap.dedent("""
    import inspect, json
    from specops import envcheck
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling
    reference, _ = envcheck.torch_reference()
    recurrent = inspect.unwrap(modeling.torch_recurrent_gated_delta_rule)
    def without_l2norm(q, k, v, **kw):
        return reference(q, k, v, **{**kw, "use_qk_l2norm_in_kernel": False})
    size = envcheck.normalize_sizes([{"batch": 1, "seq_len": 130, "k_heads": 2, "v_heads": 4,
                                      "head_k_dim": 32, "head_v_dim": 32}])[0]
    print(json.dumps({"recurrent": envcheck.compare_gdr(recurrent, reference, size, "cpu"),
                      "wrong": envcheck.compare_gdr(without_l2norm, reference, size, "cpu")}))
""")


def test_comparison_harness_accepts_an_equivalent_kernel_and_rejects_a_wrong_one(first_run, session_venv):
    proc = subprocess.run(
        [str(session_venv / "bin" / "python"), "-c", HARNESS], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    checks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert checks["recurrent"]["ok"] is True and checks["recurrent"]["output_rel_error"] < 1e-4
    assert checks["wrong"]["ok"] is False and checks["wrong"]["output_rel_error"] > 0.1


# -- locked environments --------------------------------------------------------------------------


def test_a_lock_pins_every_package_and_freeze_names_specops_by_version(first_run, session_venv, source):
    lock = ROOT / "requirements" / "ml.lock"
    status, locked = run_module(base_args(session_venv, source, requirements_lock=str(lock), verify=False))
    assert status in ("CHANGED", "SUCCESS"), locked
    freeze = subprocess.run(
        [str(session_venv / "bin" / "python"), "-m", "pip", "freeze"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert "specops==0.1.0" in freeze, "pip freeze names the temporary copy specops was built from"
    done = subprocess.run(
        [
            str(session_venv / "bin" / "python"),
            str(ROOT / "requirements" / "check_lock.py"),
            str(lock),
            "--also",
            TORCH,
            "--also",
            "specops==0.1.0",
        ],
        capture_output=True,
        text=True,
    )
    # Packages other tests added are allowed; every locked one must be at its locked version.
    mismatched = [line for line in done.stdout.splitlines() if ": locked " in line]
    assert mismatched == [], done.stdout

    status, again = run_module(base_args(session_venv, source, requirements_lock=str(lock), verify=False))
    assert status == "SUCCESS" and again["installed"] == [], again
