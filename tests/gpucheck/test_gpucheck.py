"""The GPU check's preparation (gpucheck/): what travels, what the device call is, and how it is
reported. The whole pipeline runs in `make gpu-rehearse`; these are its quick parts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpucheck import build, carry, pipeline, plan, report, source, wheels

ROOT = Path(__file__).resolve().parents[2]
LLAMA = source.LLAMA


@pytest.mark.parametrize(
    "path",
    [
        "llama_cpp/llama_cpp.py",
        f"{LLAMA}/CMakeLists.txt",
        f"{LLAMA}/src/llama.cpp",
        f"{LLAMA}/ggml/src/ggml.c",
        f"{LLAMA}/ggml/src/ggml-cuda/mmq.cu",
        f"{LLAMA}/ggml/src/ggml-cuda/template-instances/mmq-instance-q4_k.cu",
        f"{LLAMA}/ggml/src/ggml-cpu/ggml-cpu.c",
        f"{LLAMA}/gguf-py/gguf/gguf_writer.py",
        f"{LLAMA}/vendor/nlohmann/json.hpp",
    ],
)
def test_the_trimmed_tree_keeps_what_the_cpu_and_cuda_builds_need(path: str) -> None:
    assert source._kept(path)


@pytest.mark.parametrize(
    "path",
    [
        f"{LLAMA}/models/ggml-vocab-llama-bpe.gguf",
        f"{LLAMA}/docs/build.md",
        f"{LLAMA}/tools/server/server.cpp",
        f"{LLAMA}/common/common.cpp",
        f"{LLAMA}/ggml/src/ggml-vulkan/ggml-vulkan.cpp",
        f"{LLAMA}/ggml/src/ggml-metal/ggml-metal.m",
        f"{LLAMA}/vendor/cpp-httplib/httplib.h",
        f"{LLAMA}/gguf-py/tests/test_quants.py",
        "llama_cpp/server/app.py",
        "vendor/llama.cpp/ggml/src/ggml-cuda/__pycache__/x.pyc",
    ],
)
def test_the_trimmed_tree_leaves_models_docs_tools_and_other_backends_behind(path: str) -> None:
    assert not source._kept(path)


def _touch(folder: Path, names: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"x")


CORE = "pydantic_core-2.50.5-cp{v}-cp{v}-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"


def test_the_install_takes_the_compiled_wheel_of_the_interpreter_at_hand(tmp_path: Path) -> None:
    _touch(
        tmp_path,
        [
            "pydantic-2.14.4-py3-none-any.whl",
            "structlog-26.1.0-py3-none-any.whl",
            *(CORE.format(v=v) for v in ("311", "312", "313")),
        ],
    )
    picked = [w.name for w in wheels.select(tmp_path, (3, 12))]
    assert picked == sorted(
        [
            "pydantic-2.14.4-py3-none-any.whl",
            "structlog-26.1.0-py3-none-any.whl",
            CORE.format(v="312"),
        ]
    )


def test_a_python_without_its_compiled_wheel_is_refused_before_pip_runs(tmp_path: Path) -> None:
    _touch(tmp_path, ["pydantic-2.14.4-py3-none-any.whl", CORE.format(v="312")])
    with pytest.raises(RuntimeError, match=r"pydantic_core for CPython 3\.14"):
        wheels.select(tmp_path, (3, 14))


def test_the_install_command_is_the_device_tools_offline_one(tmp_path: Path) -> None:
    args = wheels.install_command("python3", [tmp_path / "a.whl"], Path("/tmp/site"))
    assert args[:3] == ["python3", "-m", "pip"]
    for flag in ("--no-index", "--no-deps", "--target"):
        assert flag in args
    assert args[-1] == str(tmp_path / "a.whl")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_travel_size_counts_what_the_device_tool_sends_and_nothing_ignored(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text(".gpu-carry/\n.venv/\n")
    (tmp_path / "tracked.py").write_bytes(b"a" * 1000)
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    (tmp_path / "untracked.txt").write_bytes(b"b" * 300)  # travels: not ignored
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "big").write_bytes(b"c" * 50_000)  # ignored: stays here
    (tmp_path / ".gpu-carry" / "wheels").mkdir(parents=True)
    (tmp_path / ".gpu-carry" / "wheels" / "w.whl").write_bytes(b"d" * 7000)
    size = carry.travel_size(tmp_path, (".gpu-carry",))
    gitignore = len(".gpu-carry/\n.venv/\n")
    assert size["working_tree_bytes"] == 1000 + 300 + gitignore
    assert size["carried_bytes"] == {".gpu-carry": 7000}
    assert size["total_bytes"] == 1300 + gitignore + 7000
    assert size["fits"] is True


def test_travel_size_refuses_a_carry_over_the_limit_less_the_margin(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "big").mkdir()
    with (tmp_path / "big" / "blob").open("wb") as handle:
        handle.truncate(plan.TRAVEL_LIMIT_BYTES - plan.TRAVEL_MARGIN_BYTES + 1)
    assert carry.travel_size(tmp_path, ("big",))["fits"] is False


def test_the_device_call_fits_the_tools_limits() -> None:
    assert len(plan.DEVICE_COMMAND) <= 2000
    assert 1 <= len(plan.DEVICE_CARRY) <= 8
    assert plan.DEVICE_BUDGET_S + 60 <= plan.DEVICE_TIMEOUT_S <= 600
    assert all(not Path(c).is_absolute() for c in plan.DEVICE_CARRY)
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", *plan.DEVICE_CARRY], cwd=ROOT, check=False
    )
    assert ignored.returncode == 0  # carried paths must be ignored ones (else they travel twice)


def test_the_docs_give_the_device_call_as_the_code_makes_it() -> None:
    page = (ROOT / "docs" / "gpu-check.md").read_text()
    assert plan.DEVICE_COMMAND in page
    assert json.dumps(list(plan.DEVICE_CARRY)) in page
    assert f"timeout_s: {plan.DEVICE_TIMEOUT_S}" in page


def test_cuda_build_takes_cublas_from_nvidias_wheel_when_the_toolkit_has_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toolkit = tmp_path / "cuda"
    _touch(toolkit / "bin", ["nvcc"])
    (toolkit / "lib64").mkdir()  # libcudart's folder, without libcublas
    site = tmp_path / "site"
    _touch(site / "nvidia" / "cu13" / "lib", ["libcublas.so.13", "libcublasLt.so.13"])
    _touch(site / "nvidia" / "cu13" / "include", ["cublas_v2.h"])
    monkeypatch.setattr(build.shutil, "which", lambda name: str(toolkit / "bin" / name))
    monkeypatch.setattr(build.site, "getsitepackages", lambda: [str(site)])
    libs = build.find_cuda()
    assert libs.cublas == str(site / "nvidia" / "cu13" / "lib" / "libcublas.so.13")
    args = build.configure_args(tmp_path / "src", tmp_path / "b", libs)
    assert "-DGGML_CUDA=ON" in args and "-DCMAKE_CUDA_ARCHITECTURES=90" in args
    assert f"-DCUDA_cublas_LIBRARY={libs.cublas}" in args
    assert f"-DCMAKE_CUDA_FLAGS=-I{site / 'nvidia' / 'cu13' / 'include'}" in args
    rpath = next(a for a in args if a.startswith("-DCMAKE_INSTALL_RPATH="))
    entries = rpath.removeprefix("-DCMAKE_INSTALL_RPATH=").split(";")
    assert entries[0] == "$ORIGIN"
    assert {str(site / "nvidia" / "cu13" / "lib"), str(toolkit / "lib64")} <= set(entries)


def test_cuda_build_without_any_cublas_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _touch(tmp_path / "cuda" / "bin", ["nvcc"])
    monkeypatch.setattr(build.shutil, "which", lambda name: str(tmp_path / "cuda" / "bin" / name))
    monkeypatch.setattr(build.site, "getsitepackages", lambda: [str(tmp_path)])
    monkeypatch.setattr(build.site, "getusersitepackages", lambda: str(tmp_path))
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    with pytest.raises(RuntimeError, match="no cuBLAS"):
        build.find_cuda()


def test_the_cpu_build_turns_cuda_and_the_unneeded_parts_off(tmp_path: Path) -> None:
    args = build.configure_args(tmp_path / "src", tmp_path / "b", None)
    assert "-DGGML_CUDA=OFF" in args
    for part in ("COMMON", "TESTS", "TOOLS", "EXAMPLES", "SERVER"):
        assert f"-DLLAMA_BUILD_{part}=OFF" in args
    assert "-DGGML_NATIVE=OFF" in args  # scripts/llama-cmake-args: no AMX crash on these VMs


BENCH_CPU = {
    "single_150": {"prompt_tokens": 152, "engine_p50_ms": 40.0},
    "single_600": {"prompt_tokens": 601, "engine_p50_ms": 120.0},
    "single_long": {"prompt_tokens": 3998, "engine_p50_ms": 900.0},
    "shared_8x400": {"prefix_tokens": 410, "grouped_ms": 200.0},
    "shared_8x400_parallel": {"prefix_tokens": 410, "grouped_ms": 190.0},
}
BENCH_GPU = {
    "single_150": {"prompt_tokens": 152, "engine_p50_ms": 8.0},
    "single_600": {"prompt_tokens": 601, "engine_p50_ms": 10.0},
    "single_long": {"prompt_tokens": 3998, "engine_p50_ms": 30.0},
    "shared_8x400": {"prefix_tokens": 410, "grouped_ms": 40.0},
    "shared_8x400_parallel": {"prefix_tokens": 410, "grouped_ms": 20.0},
}


def test_the_table_puts_cpu_and_gpu_side_by_side_with_the_seeds_figures() -> None:
    lines = report.table(BENCH_CPU, BENCH_GPU)
    assert "| single decision, ~150 tokens (152 tokens) | 40.0 | 8.0 | 5.00x |" in lines
    assert "| single decision, long prompt (3998 tokens) | 900.0 | 30.0 | 30.00x |" in lines
    assert any("parallel branches" in line and "9.50x" in line for line in lines)
    assert lines[-1].endswith("p50 4.9x, p95 32.2x |")


def test_a_rehearsal_table_leaves_the_gpu_column_empty() -> None:
    lines = report.table(BENCH_CPU, None)
    assert "| single decision, ~600 tokens (601 tokens) | 120.0 | — | — |" in lines


def test_parallel_branches_count_as_a_win_only_when_clearly_faster() -> None:
    gpu = report.parallel_verdict(BENCH_GPU)
    cpu = report.parallel_verdict(BENCH_CPU)
    assert gpu is not None and gpu["parallel_wins"] and gpu["parallel_speedup"] == 2.0
    assert cpu is not None and not cpu["parallel_wins"]  # 5% is noise on these machines


def _paths(tmp_path: Path) -> pipeline.Paths:
    return pipeline.Paths(
        carry=tmp_path, work=tmp_path, out=tmp_path / "out", python=sys.executable,
        site=tmp_path, llama=tmp_path, gguf_py=tmp_path, model=tmp_path / "m.gguf",
    )  # fmt: skip


def test_stages_after_a_failure_are_skipped_and_every_stage_is_written_out(tmp_path: Path) -> None:
    settings = pipeline.Settings(gpu=False, repeats=1, long_prompt=0, questions=1, budget_s=100)
    stages = pipeline.Stages("rehearsal", _paths(tmp_path), settings)

    def broken() -> str:
        raise RuntimeError("cmake exited 1")

    assert stages.stage("first", lambda: "fine")
    assert not stages.stage("build", broken)
    assert not stages.stage("model", lambda: "never", needs=("build",))
    written = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert [(s["name"], s["status"]) for s in written["stages"]] == [
        ("first", "ok"),
        ("build", "failed"),
        ("model", "skipped"),
    ]
    assert "cmake exited 1" in written["stages"][1]["note"]
    assert "| model | skipped |" in (tmp_path / "out" / "gpu-check.md").read_text()
    assert stages.failed() == ["build", "model"]


def test_a_stage_that_would_start_too_near_the_deadline_is_skipped(tmp_path: Path) -> None:
    settings = pipeline.Settings(gpu=True, repeats=1, long_prompt=0, questions=1, budget_s=30)
    stages = pipeline.Stages("device", _paths(tmp_path), settings)
    started = time.monotonic()
    assert not stages.stage("bench-cpu", lambda: time.sleep(10), min_s=60)
    assert time.monotonic() - started < 5
    assert stages.results["stages"][0]["status"] == "skipped"


def test_results_are_read_from_their_own_json_line_whatever_else_is_printed() -> None:
    stdout = (
        'ggml_cuda_init: found 1 CUDA devices\n{"other": 1}\n{"single_150": {"x": 2}}\n{"r": 3}\n'
    )
    assert pipeline.json_line(stdout, "single_150") == {"single_150": {"x": 2}}
    with pytest.raises(RuntimeError, match="no result"):
        pipeline.json_line("{not json\nplain text\n", "single_150")
